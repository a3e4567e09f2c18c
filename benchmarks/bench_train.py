"""Training throughput against data-loader throughput on the tiny target, as a ratio measured in one run.

    .venv/bin/python benchmarks/bench_train.py [hydra overrides...]

Extracts (or reuses) the tiny experiment's shards, then times (a) the loader alone: reading and collating
batches exactly as the trainer does, and (b) full training steps (forward, TTT unroll, backward, AdamW).
A loader/train ratio well above 1 means the loader is not the bottleneck.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from orchestrator import conf_dir
from orchestrator.config import load
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.stages import train as T
from orchestrator.states import manifest as state_manifest
from orchestrator.states import shards, source


def main(overrides: list[str]) -> None:
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = load(
            compose("config", overrides=["+experiment=tiny_eagle3", "stages=[extract]", "cluster=debug", *overrides])
        )
    run_dir = Path(tempfile.mkdtemp(prefix="bench_train_"))
    run_pipeline(cfg, run_dir)
    plan = make_plan(cfg, run_dir)
    manifest = state_manifest.load_manifest_checked(plan.dir("extract"), cfg)
    tc = cfg.train

    started = time.perf_counter()
    seqs = shards.load_split(plan.dir("extract"), manifest, "train")
    read_s = time.perf_counter() - started
    steps = 20
    started = time.perf_counter()
    loader_tokens = 0
    for step in range(steps):
        batch = T.collate([seqs[i] for i in source.step_indices(len(seqs), tc.batch_size, tc.seed, step)])
        loader_tokens += int(batch.lengths.sum())
    loader_tps = loader_tokens / (time.perf_counter() - started)

    draft, head = T.build_draft(cfg, Path(plan.target_dir), plan.dir("extract"), manifest)
    kept = draft.to_target_ids(torch.arange(draft.shape.draft_vocab_size))
    weights = [tc.step_weight_decay**k for k in range(tc.ttt_steps)]
    optim = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=tc.lr)
    train_tokens = 0
    started = time.perf_counter()
    for step in range(steps):
        batch = T.collate([seqs[i] for i in source.step_indices(len(seqs), tc.batch_size, tc.seed, step)])
        loss, _ = T.ttt_forward(draft, head, batch, tc.ttt_steps, kept, weights)
        optim.zero_grad()
        loss.backward()
        optim.step()
        train_tokens += int(batch.lengths.sum())
    train_tps = train_tokens / (time.perf_counter() - started)
    print(f"shards read and checksummed once: {read_s:.2f} s for {len(seqs)} sequences")
    print(f"loader:   {loader_tps:12,.0f} tokens/s")
    print(
        f"training: {train_tps:12,.0f} tokens/s  (ttt_steps={tc.ttt_steps}, batch {tc.batch_size}, "
        f"{torch.get_num_threads()} threads)"
    )
    print(f"loader/training ratio: {loader_tps / train_tps:.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
