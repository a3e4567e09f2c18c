"""The states on disk, as extraction writes them and training and eval read them.

An extraction folder (content-addressed by the plan's cache key):
    {train,val}/shard_NNNNN.safetensors   input_ids int32[T], loss_mask uint8[T], seq_lens int32[n],
                                          aux_hidden_states [T, K*H], teacher_hidden_state [T, H]
    {train,val}/shard_NNNNN.json          size, sha256 and counts of the shard, written after it (its completion mark)
    token_freq.safetensors                counts int64[V] of loss-masked train tokens (for the draft vocabulary)
    manifest.json                         written last (`orchestrator.stages.extract`)

With `train.states=stream` the train split's shards hold the token ids alone (`input_ids`, `loss_mask`, `seq_lens`;
`pack_tokens`): the states are computed by a capture service as training asks for them
(orchestrator/states/stream.py), and the manifest's train split says `"states": false`.

Positions are stored unshifted (position t holds the states computed at token t); the trainer applies the EAGLE
shift (`CONVENTIONS`, which the manifest records).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from orchestrator.artifacts import ArtifactError, atomic_path, file_sha256, read_json, write_json
from orchestrator.compute import Compute

# The train stage's record that the shards' checksums were verified (`verify_shards`).
VERIFIED = ".verified.json"
CONVENTIONS = {
    "shift": "none: position t holds the states computed at token t; training pairs states at t with token t+1 "
    "and the teacher at t+1",
    "loss_mask": "1 on assistant tokens (the chat template's generation block, incl. its end token)",
}
REEXTRACT = "Delete the extraction ({folder}), or run with extract.force=true, to extract it again"


@dataclass
class SequenceStates:
    """One sequence's states: its tokens, its loss mask, the aux states side by side and the teacher state."""

    input_ids: torch.Tensor  # [L] int64
    loss_mask: torch.Tensor  # [L] bool
    aux: torch.Tensor  # [L, K*H]
    teacher: torch.Tensor  # [L, H]


def pack(sequences: list[SequenceStates]) -> dict[str, torch.Tensor]:
    """A shard's tensors: the sequences end to end, with their lengths."""
    return {
        "input_ids": torch.cat([s.input_ids for s in sequences]).to(torch.int32),
        "loss_mask": torch.cat([s.loss_mask for s in sequences]).to(torch.uint8),
        "seq_lens": torch.tensor([len(s.input_ids) for s in sequences], dtype=torch.int32),
        "aux_hidden_states": torch.cat([s.aux for s in sequences]).contiguous(),
        "teacher_hidden_state": torch.cat([s.teacher for s in sequences]).contiguous(),
    }


def pack_tokens(sequences) -> dict[str, torch.Tensor]:
    """A token-only shard's tensors (a streamed split's): the rendered sequences' ids and loss masks, end to end."""
    return {
        "input_ids": torch.tensor([t for s in sequences for t in s.input_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for s in sequences for m in s.loss_mask], dtype=torch.uint8),
        "seq_lens": torch.tensor([len(s.input_ids) for s in sequences], dtype=torch.int32),
    }


def shard_path(folder: Path, split: str, index: int) -> Path:
    return Path(folder) / split / f"shard_{index:05d}.safetensors"


def shard_done(folder: Path, split: str, index: int) -> bool:
    """A shard with its record is whole: the record is written after the shard, which is written atomically."""
    path = shard_path(folder, split, index)
    return path.exists() and path.with_suffix(".json").exists()


def write_shard(folder: Path, split: str, index: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The shard, atomically, then its record (size, sha256 and counts), which marks it done. Returns the record."""
    path = shard_path(folder, split, index)
    needs = sum(t.numel() * t.element_size() for t in tensors.values())  # the shard's data, without its header
    with atomic_path(path, needs_bytes=needs) as tmp:
        save_file(tensors, str(tmp))
    record = {
        "file": f"{split}/{path.name}",
        "bytes": path.stat().st_size,
        "sha256": file_sha256(path),
        "num_tokens": int(tensors["input_ids"].numel()),
        "num_sequences": int(tensors["seq_lens"].numel()),
        "num_loss_tokens": int(tensors["loss_mask"].sum()),
    }
    write_json(path.with_suffix(".json"), record)
    return record


def read_record(folder: Path, split: str, index: int) -> dict[str, Any]:
    return read_json(shard_path(folder, split, index).with_suffix(".json"), "shard record")


def token_counts(folder: Path, records: list[dict[str, Any]], vocab_size: int) -> torch.Tensor:
    """Occurrences of each token among the loss-masked tokens of the shards `records` name."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for record in records:
        with safe_open(str(Path(folder) / record["file"]), framework="pt") as f:
            ids = f.get_tensor("input_ids").long()[f.get_tensor("loss_mask").bool()]
        counts.index_add_(0, ids, torch.ones_like(ids))
    return counts


def verify_shards(folder: Path, manifest: dict[str, Any], compute: Compute) -> ShardVerification:
    """Every shard's sha256 against the extraction manifest, checked beside training rather than before it
    (`ShardVerification`): no rank waits on another's reading of terabytes in a barrier."""
    return ShardVerification(Path(folder), manifest, compute)


class ShardVerification:
    """The shards' sha256 against the extraction manifest, once per extraction, beside training. Each rank hashes its
    share (every world_size-th shard from its rank) in a thread of its own, while training runs on sizes checked at
    load (`load_split(verify=False)`). `check()`, at the steps every rank reaches together, shares one flag
    (an all-reduce of one number) and raises on every rank once any rank found a bad shard, the finder naming it.
    `finish()`, when training is done and before the draft is exported, waits for the rank's share, checks, and
    rank 0 writes the stamp (`.verified.json`: each shard's size and modification time then). While the shards keep
    them, later trainings trust the stamp and hash nothing but the manifest. The longest any collective waits on
    one rank's hashing is at `finish`, after the last step, for what is left of its share."""

    def __init__(self, folder: Path, manifest: dict[str, Any], compute: Compute):
        self.folder, self.compute, self.error = folder, compute, None
        records = [r for split in ("train", "val") for r in manifest["splits"][split]["shards"]]
        seen = {}
        for r in records:
            st = (folder / r["file"]).stat() if (folder / r["file"]).exists() else None
            seen[r["file"]] = [st.st_size, st.st_mtime_ns] if st else None
        self.stamp = {"manifest_sha256": file_sha256(folder / "manifest.json"), "shards": seen}
        try:
            self.trusted = read_json(folder / VERIFIED, "verification stamp") == self.stamp
        except ArtifactError:
            self.trusted = False
        self.thread = None
        if not self.trusted:
            share = records[compute.rank :: compute.world_size]
            self.thread = threading.Thread(target=self._hash, args=(share,), name="verify-shards", daemon=True)
            self.thread.start()

    def _hash(self, records: list[dict[str, Any]]) -> None:
        for r in records:
            path = self.folder / r["file"]
            try:
                if file_sha256(path) != r["sha256"]:
                    raise ArtifactError(
                        f"{path}: its sha256 differs from the extraction manifest's: the shard is corrupt. "
                        + REEXTRACT.format(folder=self.folder)
                    )
            except (OSError, ArtifactError) as exc:
                self.error = exc if isinstance(exc, ArtifactError) else ArtifactError(f"{path}: {exc}")
                return

    def check(self) -> None:
        """Every rank at once: raises once any rank's share has a bad shard (the rank that found it names it)."""
        found = self.compute.all_reduce_max(torch.tensor([1.0 if self.error is not None else 0.0]))
        if float(found[0]) > 0:
            if self.error is not None:
                raise self.error
            raise ArtifactError(
                f"{self.folder}: another rank found a corrupt shard (its log names it). "
                + REEXTRACT.format(folder=self.folder)
            )

    def finish(self) -> None:
        """The rank's share hashed, every rank's verdict shared, and the stamp written by rank 0."""
        if self.thread is not None:
            self.thread.join()
        self.check()
        if not self.trusted and self.compute.is_main:
            write_json(self.folder / VERIFIED, self.stamp)
            self.trusted = True


def load_split(
    folder: Path,
    manifest: dict[str, Any],
    split: str,
    layers: list[int] | None = None,
    verify: bool = True,
    tokens_only: bool = False,
) -> ShardedSplit:
    """Sequences of one split, each shard checked against the manifest's size and checksum; with `layers`,
    only those aux states (a subset of what was extracted), in that order. Read lazily: see `ShardedSplit`. A
    streamed split (token ids only) is read with `tokens_only` (`ShardedSplit.tokens`), by the capture service."""
    if manifest["splits"][split].get("states") is False and not tokens_only:
        raise ArtifactError(
            f"{folder}/manifest.json: the {split} split's states were not stored (train.states=stream): its "
            "shards hold token ids only, and its states come from the capture service (orchestrator/states/stream.py)"
        )
    columns = layer_columns(manifest, layers)
    paths, seq_lens = [], []
    for record in manifest["splits"][split]["shards"]:
        path = Path(folder) / record["file"]
        if not path.exists() or path.stat().st_size != record["bytes"]:
            size = f"{path.stat().st_size} bytes" if path.exists() else "missing"
            raise ArtifactError(
                f"{path}: {size}, but the extraction manifest says {record['bytes']} bytes: the shard is truncated "
                f"or was replaced. {REEXTRACT.format(folder=folder)}"
            )
        if verify and file_sha256(path) != record["sha256"]:
            raise ArtifactError(
                f"{path}: its sha256 differs from the extraction manifest's: the shard is corrupt. "
                + REEXTRACT.format(folder=folder)
            )
        with safe_open(str(path), framework="pt") as f:
            seq_lens.append(f.get_tensor("seq_lens").long())
        paths.append(path)
    return ShardedSplit(paths, seq_lens, columns)


def layer_columns(manifest: dict[str, Any], layers: list[int] | None) -> torch.Tensor | None:
    """The columns of the stored aux states that hold `layers` (a subset of the extracted ones, in that order);
    None where they are all of them, in order."""
    if layers is None or list(layers) == manifest["aux_layers"]:
        return None
    hidden = manifest["hidden_size"]
    return torch.cat([torch.arange(hidden) + manifest["aux_layers"].index(k) * hidden for k in layers])


class ShardedSplit:
    """A split's sequences, each read from its shard when asked for (safetensors slices): RAM holds the sequences'
    offsets and at most `open_shards` open shard files, whatever the data set's size. Indexing by an int gives a
    `SequenceStates`, by a slice a list of them. The offline `StateSource` (orchestrator/states/source.py)."""

    def __init__(
        self, paths: list[Path], seq_lens: list[torch.Tensor], columns: torch.Tensor | None, open_shards: int = 4
    ):
        self.paths, self.columns, self.open_shards = paths, columns, open_shards
        none = torch.zeros(0, dtype=torch.long)
        self.shard = torch.repeat_interleave(
            torch.arange(len(seq_lens)), torch.tensor([len(n) for n in seq_lens], dtype=torch.long)
        )
        self.end = torch.cat([*(n.cumsum(0) for n in seq_lens), none])
        self.start = self.end - torch.cat([*seq_lens, none])
        self._handles: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self.shard)

    def __getitem__(self, index: int | slice) -> SequenceStates | list[SequenceStates]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} of a split of {len(self)}")
        index %= len(self)
        f = self._handle(int(self.shard[index]))
        a, b = int(self.start[index]), int(self.end[index])
        aux = f.get_slice("aux_hidden_states")[a:b]
        if self.columns is not None:
            aux = aux[:, self.columns]
        return SequenceStates(
            f.get_slice("input_ids")[a:b].long(),
            f.get_slice("loss_mask")[a:b].bool(),
            aux,
            f.get_slice("teacher_hidden_state")[a:b],
        )

    def __iter__(self) -> Iterator[SequenceStates]:
        return (self[i] for i in range(len(self)))

    def tokens(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's token ids and loss mask alone (all a streamed split's shards hold)."""
        f = self._handle(int(self.shard[index]))
        a, b = int(self.start[index]), int(self.end[index])
        return f.get_slice("input_ids")[a:b].long(), f.get_slice("loss_mask")[a:b].bool()

    def take(self, indices) -> list[SequenceStates]:
        """The sequences `indices`, in that order (`StateSource.take`)."""
        return [self[i] for i in indices]

    def close(self) -> None:
        self._handles.clear()

    def _handle(self, shard: int):
        if shard in self._handles:
            self._handles.move_to_end(shard)
        else:
            self._handles[shard] = safe_open(str(self.paths[shard]), framework="pt")
            while len(self._handles) > self.open_shards:
                self._handles.popitem(last=False)
        return self._handles[shard]
