"""Extraction: the target's hidden states at `aux_layers` plus the teacher state, for every conversation.

Output folder (content-addressed by the plan's cache key):
    {train,val}/shard_NNNNN.safetensors   input_ids int32[T], loss_mask uint8[T], seq_lens int32[n],
                                          aux_hidden_states [T, K*H], teacher_hidden_state [T, H]
    {train,val}/shard_NNNNN.json          size and sha256 of the shard, written after it (its completion mark)
    token_freq.safetensors                counts int64[V] of loss-masked train tokens (for the draft vocabulary)
    manifest.json                         written last

Positions are stored unshifted (position t holds the states computed at token t); the trainer applies the
EAGLE shift. Resumable at shard granularity: a shard with its .json is done and is skipped on restart.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from orchestrator import layers as layer_contract
from orchestrator.artifacts import atomic_path, file_sha256, read_json, write_json, write_manifest
from orchestrator.capture import HiddenStateCapture
from orchestrator.config import RootConfig, captured_layers
from orchestrator.data import Rendered, conversations
from orchestrator.regenerate import sequences
from orchestrator.targets import ensure_target, identity, load_target

# Regenerated responses shorter than this on average (tokens) get a warning: a target that stops at once.
MIN_RESPONSE_TOKENS = 4
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONVENTIONS = {
    "shift": "none: position t holds the states computed at token t; training pairs states at t with token t+1 "
    "and the teacher at t+1",
    "loss_mask": "1 on assistant tokens (the chat template's generation block, incl. its end token)",
}


def run(cfg: RootConfig, plan, tracker) -> dict[str, Any]:
    out = plan.dir("extract")
    out.mkdir(parents=True, exist_ok=True)
    target_path = ensure_target(cfg)
    target = identity(cfg, target_path)
    model, tokenizer = load_target(target_path, cfg.target.trust_remote_code)
    train_convs, val_convs = conversations(cfg.data, cfg.seed)
    n = target.num_hidden_layers
    layers = list(layer_contract.validate_canonical(captured_layers(cfg), n))

    started = time.time()
    splits, tokens_done, bytes_done, all_rendered, regenerate_s = {}, 0, 0, {}, 0.0
    for split, convs in (("train", train_convs), ("val", val_convs)):
        begin = time.time()
        rendered = all_rendered[split] = _sequences(model, tokenizer, convs, split, out, cfg)
        regenerate_s += time.time() - begin if cfg.data.regenerate.enabled else 0.0
        shards = []
        size = cfg.extract.shard_conversations
        chunks = [rendered[i : i + size] for i in range(0, len(rendered), size)]
        for index, chunk in enumerate(tqdm(chunks, desc=f"extract {split}", unit="shard")):
            shard = out / split / f"shard_{index:05d}.safetensors"
            record_path = shard.with_suffix(".json")
            if record_path.exists() and shard.exists():
                record = read_json(record_path, "shard record")
            else:
                tensors = _extract_chunk(model, tokenizer, chunk, layers, cfg)
                with atomic_path(shard) as tmp:
                    save_file(tensors, str(tmp))
                record = {
                    "file": f"{split}/{shard.name}",
                    "bytes": shard.stat().st_size,
                    "sha256": file_sha256(shard),
                    "num_tokens": int(tensors["input_ids"].numel()),
                    "num_sequences": int(tensors["seq_lens"].numel()),
                }
                write_json(record_path, record)
                tokens_done += record["num_tokens"]
                bytes_done += record["bytes"]
            shards.append(record)
        loss_tokens = sum(sum(r.loss_mask) for r in rendered)
        splits[split] = {
            "shards": shards,
            "num_tokens": sum(s["num_tokens"] for s in shards),
            "num_sequences": sum(s["num_sequences"] for s in shards),
            "num_loss_tokens": loss_tokens,
            "loss_tokens_per_sequence": loss_tokens / max(len(rendered), 1),
        }

    counts = torch.zeros(target.vocab_size, dtype=torch.int64)
    for r in all_rendered["train"]:
        ids = torch.tensor(r.input_ids)
        counts.index_add_(0, ids[torch.tensor(r.loss_mask, dtype=torch.bool)], torch.ones(int(sum(r.loss_mask)), dtype=torch.int64))
    with atomic_path(out / "token_freq.safetensors") as tmp:
        save_file({"counts": counts}, str(tmp))

    per_seq = splits["train"]["loss_tokens_per_sequence"]
    if cfg.data.regenerate.enabled and per_seq < MIN_RESPONSE_TOKENS:
        print(
            f"[extract] WARNING: the target's regenerated responses average {per_seq:.1f} tokens (under "
            f"{MIN_RESPONSE_TOKENS}): it ends its answers at once, so the draft has little to learn from. Check the target "
            "and its chat template, or train on the data set's responses (data.regenerate.enabled=false)."
        )
    seconds = time.time() - started
    total_tokens = splits["train"]["num_tokens"] + splits["val"]["num_tokens"]
    total_bytes = sum(s["bytes"] for sp in splits.values() for s in sp["shards"])
    result = {
        "tokens": total_tokens,
        "tokens_extracted_now": tokens_done,
        # hidden-state extraction alone; the target's own responses took `regenerate_s` before it
        "tokens_per_s": tokens_done / max(seconds - regenerate_s, 1e-9) if tokens_done else 0.0,
        "regenerate_s": regenerate_s,
        "bytes_per_token": total_bytes / max(total_tokens, 1),
        "loss_tokens_per_sequence": per_seq,
        "output": str(out),
    }
    result["headline"] = {k: result[k] for k in ("tokens", "tokens_per_s", "bytes_per_token")}
    write_manifest(
        out,
        {
            "stage": "extract",
            "key": plan.stage_keys["extract"],
            "target": target.as_dict(),
            "tokenizer_hash": target.tokenizer_hash,
            "aux_layers": layers,
            "hf_capture_points": [layer_contract.hf_capture_point(k, n) for k in layers],
            "teacher": {"kind": cfg.extract.teacher, "capture_point": layer_contract.hf_teacher_capture_point(cfg.extract.teacher, n)},
            "hidden_size": target.hidden_size,
            "dtype": cfg.extract.dtype,
            "conventions": CONVENTIONS,
            "data": {"name": cfg.data.name, "max_seq_len": cfg.data.max_seq_len, "seed": cfg.seed,
                     "files": {f: file_sha256(Path(f)) for f in [*cfg.data.train_files, *cfg.data.val_files]},
                     "responses": "regenerated by the target" if cfg.data.regenerate.enabled else "the data set's",
                     "regenerate": asdict(cfg.data.regenerate)},
            "splits": splits,
            "token_freq": "token_freq.safetensors",
            "result": result,
        },
    )
    tracker.stage_result("extract", result)
    return result


def _sequences(model, tokenizer, convs, split: str, out: Path, cfg: RootConfig) -> list[Rendered]:
    """The split's token sequences (see `regenerate.sequences`). Regenerated ones are kept in
    `<split>/regenerated.safetensors` (input_ids int32[T], seq_lens and response_lens int32[n]), so a restarted
    extraction does not generate them again."""
    if not cfg.data.regenerate.enabled:
        return sequences(convs, split, cfg, tokenizer)
    path = out / split / "regenerated.safetensors"
    if path.exists():
        kept = load_file(str(path))
        offsets = [0] + torch.cumsum(kept["seq_lens"].long(), 0).tolist()
        rendered = []
        for a, b, n in zip(offsets[:-1], offsets[1:], kept["response_lens"].tolist()):
            ids = kept["input_ids"][a:b].tolist()
            rendered.append(Rendered(ids, [0] * (len(ids) - n) + [1] * n))
        return rendered
    rendered = sequences(convs, split, cfg, tokenizer, model=model, log_dir=out / split)
    tensors = {
        "input_ids": torch.tensor([t for r in rendered for t in r.input_ids], dtype=torch.int32),
        "seq_lens": torch.tensor([len(r.input_ids) for r in rendered], dtype=torch.int32),
        "response_lens": torch.tensor([sum(r.loss_mask) for r in rendered], dtype=torch.int32),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return rendered


@torch.no_grad()
def _extract_chunk(model, tokenizer, chunk, layers: list[int], cfg: RootConfig) -> dict[str, torch.Tensor]:
    dtype = DTYPES[cfg.extract.dtype]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids_out, mask_out, aux_out, teacher_out, lens = [], [], [], [], []
    with HiddenStateCapture(model, layers, cfg.extract.teacher) as capture:
        for i in range(0, len(chunk), cfg.extract.batch_size):
            batch = chunk[i : i + cfg.extract.batch_size]
            width = max(len(r.input_ids) for r in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attn = torch.zeros((len(batch), width), dtype=torch.long)
            for row, r in enumerate(batch):
                ids[row, : len(r.input_ids)] = torch.tensor(r.input_ids)
                attn[row, : len(r.input_ids)] = 1
            model(input_ids=ids, attention_mask=attn, use_cache=False)
            aux, teacher = capture.aux(), capture.teacher()
            for row, r in enumerate(batch):
                length = len(r.input_ids)
                ids_out.append(ids[row, :length])
                mask_out.append(torch.tensor(r.loss_mask, dtype=torch.uint8))
                aux_out.append(aux[row, :length].to(dtype))
                teacher_out.append(teacher[row, :length].to(dtype))
                lens.append(length)
            capture.clear()
    return {
        "input_ids": torch.cat(ids_out).to(torch.int32),
        "loss_mask": torch.cat(mask_out),
        "seq_lens": torch.tensor(lens, dtype=torch.int32),
        "aux_hidden_states": torch.cat(aux_out).contiguous(),
        "teacher_hidden_state": torch.cat(teacher_out).contiguous(),
    }


def load_manifest_checked(folder: Path, cfg: RootConfig) -> dict[str, Any]:
    """The extraction manifest, refused when it disagrees with this run's config."""
    from orchestrator.artifacts import ArtifactError, read_manifest, require_equal

    manifest = read_manifest(folder, "extract")
    path = Path(folder) / "manifest.json"
    missing = [k for k in cfg.train.layers if k not in manifest["aux_layers"]]
    if missing:
        raise ArtifactError(
            f"{path}: aux_layers is {manifest['aux_layers']} but this run's config says {list(cfg.train.layers)} "
            f"({missing} not extracted). Re-extract with this aux_layers (the cache key differs, so a normal run does) "
            "or train with the extracted layers."
        )
    require_equal(path, "teacher.kind", manifest["teacher"]["kind"], cfg.extract.teacher,
                  "The teacher state kind (pre/post final norm) must match how training computes teacher logits.")
    require_equal(path, "target.name", manifest["target"]["name"], cfg.target.name, "Extract from the configured target.")
    require_equal(path, "target.hidden_size", manifest["hidden_size"], cfg.target.hidden_size, "Extract from the configured target.")
    return manifest
