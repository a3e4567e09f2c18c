"""Extraction: the target's hidden states at `aux_layers` plus the teacher state, for every conversation, in the
shards of orchestrator/states/shards.py, and the manifest that describes them, written last.

Resumable at shard granularity: a shard with its .json is done and is skipped on restart.
Data-parallel: each rank of the job writes its own shards (see `run`); the manifest is written once, after all
of them.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from tqdm import tqdm

from orchestrator import engines
from orchestrator import layers as layer_contract
from orchestrator.artifacts import ArtifactError, atomic_path, read_json, write_json, write_manifest
from orchestrator.compute import Compute
from orchestrator.config import RootConfig, captured_layers
from orchestrator.data import Rendered, conversations, data_identity
from orchestrator.engines import CaptureJob
from orchestrator.regenerate import (
    Endpoint,
    keep_regenerated,
    read_regenerated,
    regenerate,
    regenerated_path,
    sequences,
)
from orchestrator.results import ExtractResult
from orchestrator.states.shards import (
    CONVENTIONS,
    VERIFIED,
    pack_tokens,
    read_record,
    shard_done,
    token_counts,
    write_shard,
)
from orchestrator.targets import ensure_target, identity, load_tokenizer, template_source

# Regenerated responses shorter than this on average (tokens) get a warning: a target that stops at once.
MIN_RESPONSE_TOKENS = 4


def run(cfg: RootConfig, plan, tracker, compute: Compute) -> ExtractResult | None:
    """Extracts every conversation's states, data-parallel over the job's ranks.

    The shards are fixed by the data alone: shard i of a split holds conversations [i*S, (i+1)*S) with
    S = `extract.shard_conversations`. Rank r of N extracts the shards i with i % N == r, so what every shard
    holds does not depend on N. Rank 0 writes the token counts and the manifest once every rank is done."""
    out = plan.dir("extract")
    out.mkdir(parents=True, exist_ok=True)
    heartbeat = _Heartbeat(out, compute, cfg.extract.collective_timeout_min * 60) if compute.distributed else None
    target_path = ensure_target(cfg)  # a tiny target is built under a file lock: ranks wait for one build
    target = identity(cfg, target_path)
    layers = list(layer_contract.validate_canonical(captured_layers(cfg), target.num_hidden_layers))
    shards = _shards(cfg)
    mine = [(split, i) for split in shards for i in range(len(shards[split])) if i % compute.world_size == compute.rank]
    started = time.time()
    todo = _todo(cfg, out, compute, mine)
    _reuse_regenerated(plan, out, compute, todo)
    regenerate_s = _regenerate_through_server(cfg, out, compute, target_path, shards, todo)
    tokens, regenerate_s = _extract_shards(cfg, out, compute, (target_path, layers), shards, todo, regenerate_s)
    if not todo:
        print(f"[extract] rank {compute.rank}: all {len(mine)} of its shards are done; the target is not loaded")
    # Every rank's shards are complete before rank 0 reads them: the slowest rank's time is the stage's.
    mine_done = {"tokens": tokens, "seconds": time.time() - started, "regenerate_s": regenerate_s}
    done = _join_ranks(out, compute, mine_done, heartbeat)
    if not compute.is_main:
        return None
    splits = {split: _split_record(out, split, len(chunks), streamed(cfg, split)) for split, chunks in shards.items()}
    with atomic_path(out / "token_freq.safetensors") as tmp:
        save_file({"counts": token_counts(out, splits["train"]["shards"], target.vocab_size)}, str(tmp))
    _warn_if_short(cfg, splits["train"]["loss_tokens_per_sequence"])
    result = _result(out, compute, splits, done)
    write_manifest(out, _manifest(cfg, plan, target, layers, compute, splits, result))
    _share_regenerated(plan, out)
    tracker.stage_result("extract", result)
    return result


def _reuse_regenerated(plan, out: Path, compute: Compute, todo: list[tuple[str, int]]) -> None:
    """The target's answers for `todo`'s shards that another extraction of the same data by the same target has
    generated (`plan.dir("regenerated")`: keyed by all that decides them, `pipeline.stage_keys`), linked into this
    extraction's folder, where each shard reads its answers before generating them (`_sequences`, one pass's
    capture). At Kimi-K2.5's scale a regeneration takes hours of the whole node: a layer search's extraction of the
    union of its layers, or a streamed run's, would otherwise pay for it again."""
    shared = plan.stage_dirs.get("regenerated")
    if shared is None:
        return
    reused = 0
    for split, index in todo:
        mine, theirs = regenerated_path(out, split, index), regenerated_path(Path(shared), split, index)
        if not mine.exists() and theirs.exists():
            _link(theirs, mine)
            reused += 1
    if reused:
        print(f"[extract] rank {compute.rank}: the target's answers for {reused} of its {len(todo)} shards reused "
              f"from {shared}, generated by an extraction of the same data and target")  # fmt: skip


def _share_regenerated(plan, out: Path) -> None:
    """A finished extraction's answers, linked where the next extraction of the same data looks for them."""
    shared = plan.stage_dirs.get("regenerated")
    if shared is None:
        return
    for path in sorted(out.glob("*/regenerated_*.safetensors")):
        dest = Path(shared) / path.relative_to(out)
        if not dest.exists():
            _link(path, dest)


def _link(source: Path, dest: Path) -> None:
    """`dest` as a hard link to `source` (a copy across file systems), in place at once or not at all."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        tmp.unlink()
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)


def _shards(cfg: RootConfig) -> dict[str, list[list]]:
    """Each split's conversations, cut into shards of extract.shard_conversations."""
    train_convs, val_convs = conversations(cfg.data, cfg.seed)
    size = cfg.extract.shard_conversations
    return {
        split: [convs[i : i + size] for i in range(0, len(convs), size)]
        for split, convs in (("train", train_convs), ("val", val_convs))
    }


def _todo(cfg: RootConfig, out: Path, compute: Compute, mine: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """This rank's shards not done yet; with extract.force all of them, the old manifest removed first, so nothing
    reads the folder as whole meanwhile."""
    if not cfg.extract.force:
        return [(split, i) for split, i in mine if not shard_done(out, split, i)]
    if compute.is_main:
        for stale in (out / "manifest.json", out / VERIFIED):
            stale.unlink(missing_ok=True)
    return list(mine)


def _regenerate_through_server(cfg: RootConfig, out: Path, compute: Compute, target_path: Path, shards, todo) -> float:
    """With data.regenerate.engine=server, the serving engine answers every prompt of `todo` first, on the job's
    GPUs, and is stopped before the target loads onto them. Its seconds (0 otherwise)."""
    r = cfg.data.regenerate
    if not (r.enabled and r.engine == "server" and todo):
        return 0.0
    started = time.time()
    tokenizer = load_tokenizer(target_path, cfg.target.trust_remote_code, cfg.data.chat_template)
    with Endpoint(cfg, out / "logs" / f"rank{compute.rank}") as endpoint:
        for split, index in todo:
            _sequences(None, tokenizer, shards[split][index], split, index, out, cfg, endpoint)
    return time.time() - started


def _extract_shards(
    cfg: RootConfig, out: Path, compute: Compute, what: tuple[Path, list[int]], shards, todo, regenerate_s: float
) -> tuple[int, float]:
    """Each shard of `todo` through the capture engine, written as it is done: the tokens extracted, and the
    regeneration's seconds with those of the regenerations done here. A rank with nothing to do never loads the
    target (a restarted extraction with every shard done)."""
    if not todo:
        return 0, regenerate_s
    target_path, layers = what

    def rendered(tokenizer, split: str, index: int) -> list[Rendered]:  # a shard's sequences, no model here
        return _sequences(None, tokenizer, shards[split][index], split, index, out, cfg)

    captured = [(split, i) for split, i in todo if not streamed(cfg, split)]  # a streamed split keeps its token ids
    job = CaptureJob(
        shards=shards, todo=captured, layers=layers, out=out, compute=compute, target_path=target_path,
        sequences=rendered,
    )  # fmt: skip
    # HF loads the target here; vLLM starts its engine, which is sent one request per shard
    capture = engines.get(cfg.extract.engine, engines.CAPTURE).open_capture(cfg, job)
    tokens = 0
    desc = f"extract (rank {compute.rank}/{compute.world_size})" if compute.distributed else "extract"
    try:
        for split, index in tqdm(todo, desc=desc, unit="shard"):
            if not streamed(cfg, split):
                capture.start(split, index)  # vLLM: the shard's states captured (one pass: its sequences kept)
            begin = time.time()
            sequences = _sequences(capture.model, capture.tokenizer, shards[split][index], split, index, out, cfg)
            regenerate_s += time.time() - begin if cfg.data.regenerate.enabled else 0.0
            check_loss_fraction(sequences, cfg, f"{split} shard {index}", target_path)
            if streamed(cfg, split):  # the token ids alone: the capture service computes the states as training asks
                write_shard(out, split, index, pack_tokens(sequences))
                continue
            tokens += write_shard(out, split, index, capture.shard(split, index, sequences))["num_tokens"]
    finally:
        capture.close()
    return tokens, regenerate_s


def streamed(cfg: RootConfig, split: str) -> bool:
    """Whether the split's states are streamed to training (train.states=stream: the train split) rather than
    stored."""
    return cfg.train.states == "stream" and split == "train"


def _split_record(out: Path, split: str, shards: int, tokens_only: bool) -> dict[str, Any]:
    """A split's shard records (every rank's) and its counts, for the manifest; `states: false` where the shards
    hold token ids only (a streamed split)."""
    records = [read_record(out, split, i) for i in range(shards)]
    loss_tokens = sum(r["num_loss_tokens"] for r in records)
    sequences = sum(r["num_sequences"] for r in records)
    return {
        "shards": records,
        "num_tokens": sum(r["num_tokens"] for r in records),
        "num_sequences": sequences,
        "num_loss_tokens": loss_tokens,
        "loss_tokens_per_sequence": loss_tokens / max(sequences, 1),
    } | ({"states": False} if tokens_only else {})


def _warn_if_short(cfg: RootConfig, per_seq: float) -> None:
    if cfg.data.regenerate.enabled and per_seq < MIN_RESPONSE_TOKENS:
        print(
            f"[extract] WARNING: the target's regenerated responses average {per_seq:.1f} tokens (under "
            f"{MIN_RESPONSE_TOKENS}): it ends its answers at once, so the draft has little to learn from. "
            "Check the target and its chat template, or train on the data set's responses "
            "(data.regenerate.enabled=false)."
        )


def _result(out: Path, compute: Compute, splits: dict[str, Any], done: list[dict[str, float]]) -> ExtractResult:
    """The stage's figures over all ranks: tokens, the extraction's own speed (the slowest rank's seconds less its
    regeneration's), bytes per token."""
    extracted_now = sum(d["tokens"] for d in done)
    seconds, regenerate_s = max(d["seconds"] for d in done), max(d["regenerate_s"] for d in done)
    total_tokens = splits["train"]["num_tokens"] + splits["val"]["num_tokens"]
    stored = [sp for sp in splits.values() if sp.get("states", True)]  # a streamed split's shards hold token ids
    total_bytes = sum(s["bytes"] for sp in stored for s in sp["shards"])
    result = ExtractResult(
        tokens=total_tokens,
        tokens_extracted_now=extracted_now,
        # hidden-state extraction alone, over all ranks; the target's own responses took `regenerate_s` before it
        tokens_per_s=extracted_now / max(float(seconds - regenerate_s), 1e-9) if extracted_now else 0.0,
        regenerate_s=float(regenerate_s),
        bytes_per_token=total_bytes / max(sum(sp["num_tokens"] for sp in stored), 1),
        loss_tokens_per_sequence=splits["train"]["loss_tokens_per_sequence"],
        output=str(out),
        compute=compute.describe(),
    )
    result.headline = result.make_headline()
    return result


def _manifest(cfg: RootConfig, plan, target, layers: list[int], compute: Compute, splits, result) -> dict[str, Any]:
    """What the extraction holds and how it was made, checked by every stage that reads it
    (`orchestrator.states.manifest`)."""
    n = target.num_hidden_layers
    return {
        "stage": "extract",
        "key": plan.stage_keys["extract"],
        "target": target.as_dict(),
        "tokenizer_hash": target.tokenizer_hash,
        "aux_layers": layers,
        "hf_capture_points": [layer_contract.hf_capture_point(k, n) for k in layers],
        # what computed the states: hf (transformers) or vLLM's extractor, at its ids for the layers and id N
        "capture_engine": engines.get(cfg.extract.engine).capture_record(cfg, layers),
        "teacher": {
            "kind": cfg.extract.teacher,
            "capture_point": layer_contract.hf_teacher_capture_point(cfg.extract.teacher, n),
        },
        "hidden_size": target.hidden_size,
        "dtype": cfg.extract.dtype,
        "compute": compute.describe(),
        "conventions": CONVENTIONS,
        "data": {
            "name": cfg.data.name,
            "max_seq_len": cfg.data.max_seq_len,
            "seed": cfg.seed,
            "files": data_identity(cfg.data).get("file_sha256", {}),
            **(
                {"hf": {"path": cfg.data.path, "subset": cfg.data.subset, "revision": cfg.data.revision}}
                if cfg.data.name == "hf"
                else {}
            ),  # fmt: skip
            "responses": "regenerated by the target" if cfg.data.regenerate.enabled else "the data set's",
            "regenerate": asdict(cfg.data.regenerate),
        },
        "splits": splits,
        "token_freq": "token_freq.safetensors",
        "result": result.to_dict(),
    }


class _Heartbeat:
    """A rank's sign of life while it extracts: a thread touches `ranks/<attempt>.rank<r>.alive` every `limit_s / 4`
    seconds (30 at most) until the rank has written its record. A rank that is killed outright (kill -9, the
    kernel's OOM killer, a lost node) writes no failure record; its heartbeat stops instead, and rank 0 fails once
    it is older than `limit_s` (`extract.collective_timeout_min`)."""

    def __init__(self, out: Path, compute: Compute, limit_s: float):
        from orchestrator import runner

        self.limit_s = limit_s
        self.folder = out / "ranks"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.attempt = runner.attempt_id()
        self.stopped = threading.Event()
        self.path(compute.rank).touch()
        if not compute.is_main:  # rank 0 is the one that waits
            threading.Thread(target=self._beat, args=(self.path(compute.rank),), daemon=True).start()

    def path(self, rank: int) -> Path:
        return self.folder / f"{self.attempt}.rank{rank}.alive"

    def _beat(self, path: Path) -> None:
        while not self.stopped.wait(min(30.0, self.limit_s / 4)):
            path.touch()

    def silent_for(self, rank: int, since: float) -> float:
        """Seconds since rank's last beat (or since `since`, when it has not beaten yet: still starting)."""
        try:
            last = self.path(rank).stat().st_mtime
        except FileNotFoundError:
            last = since
        return time.time() - last


def _join_ranks(
    out: Path, compute: Compute, mine: dict[str, float], heartbeat: _Heartbeat | None = None, poll_s: float = 2.0
) -> list[dict[str, float]]:
    """Each rank's figures, gathered by rank 0 once every rank has finished its shards. Ranks finish far apart
    (a restart leaves one rank all its shards and another none; regeneration takes what it takes), longer than
    a collective may wait (`extract.collective_timeout_min`), so they meet through files, not a collective: each
    writes `ranks/<attempt>.rank<r>.json`, and rank 0 waits for all of them. A peer that fails says so in its job's
    failure record, and rank 0 fails at once naming it; a peer killed outright stops its heartbeat (`_Heartbeat`),
    and rank 0 fails once it is silent for longer than the collective timeout (on Slurm, srun --kill-on-bad-exit
    ends the job sooner)."""
    from orchestrator import runner

    if not compute.distributed:
        return [mine]
    attempt = runner.attempt_id()
    folder = out / "ranks"
    write_json(folder / f"{attempt}.rank{compute.rank}.json", mine)
    if heartbeat is not None:
        heartbeat.stopped.set()
    if not compute.is_main:
        return []
    waiting_since = time.time()
    while True:
        paths = [folder / f"{attempt}.rank{r}.json" for r in range(compute.world_size)]
        if all(p.exists() for p in paths):
            return [read_json(p, "rank record") for p in paths]
        failed = runner.peer_failures()
        if failed:
            raise ArtifactError(
                f"extraction rank {failed[0]['rank']} failed ({failed[0]['error']}); its shards are not done. The "
                "finished shards are kept: the same command resumes"
            )
        silent = {
            rank: heartbeat.silent_for(rank, waiting_since)
            for rank, path in enumerate(paths)
            if heartbeat is not None and not path.exists()
        }
        for rank, seconds in silent.items():
            if seconds > heartbeat.limit_s:
                raise ArtifactError(
                    f"extraction rank {rank} stopped without a word: no heartbeat ({heartbeat.path(rank).name}) for "
                    f"{seconds:.0f} s, more than extract.collective_timeout_min allows (killed, OOM-killed, or its "
                    "node lost). The finished shards are kept: the same command resumes"
                )
        time.sleep(poll_s)


def check_loss_fraction(rendered: list[Rendered], cfg: RootConfig, where: str, target_path: Path) -> None:
    """A shard whose loss tokens fall below data.min_loss_fraction is refused before its states are extracted:
    a draft trained on it would learn from (next to) nothing."""
    tokens = sum(len(r.loss_mask) for r in rendered)
    loss = sum(sum(r.loss_mask) for r in rendered)
    if tokens and loss / tokens < cfg.data.min_loss_fraction:
        how = (
            "the target's regenerated responses"
            if cfg.data.regenerate.enabled
            else template_source(target_path, cfg.data.chat_template)
        )
        raise ArtifactError(
            f"{where}: {loss} of {tokens} tokens ({loss / tokens:.2%}) are loss (assistant) tokens, below "
            f"data.min_loss_fraction={cfg.data.min_loss_fraction}, rendered by {how}. Check the mask with "
            "dry_run=true (it prints one sample's masked text); give a template with data.chat_template=<file>, "
            "or train on the target's own answers with data.regenerate.enabled=true"
        )


def _sequences(
    model, tokenizer, convs, split: str, index: int, out: Path, cfg: RootConfig, endpoint: Endpoint | None = None
) -> list[Rendered]:
    """One shard's token sequences: rendered, or regenerated (`orchestrator.regenerate`, by the target in this
    process or through `endpoint`). Regenerated ones are kept in `<split>/regenerated_NNNNN.safetensors`
    (input_ids int32[T], seq_lens and response_lens int32[n]), so a restarted extraction does not generate them
    again. Sampling (temperature > 0) is seeded per shard, so a shard's responses do not depend on the ranks."""
    if not cfg.data.regenerate.enabled:
        return sequences(convs, split, cfg, tokenizer)
    path = regenerated_path(out, split, index)
    if path.exists():
        return read_regenerated(path)
    rendered = regenerate(
        convs,
        cfg,
        tokenizer,
        cfg.seed * 100_003 + index + (0 if split == "train" else 50_000),
        model=model,
        log_dir=out / "logs",
        endpoint=endpoint,
        desc=f"regenerate {split} shard {index}",
    )
    keep_regenerated(path, rendered)
    return rendered
