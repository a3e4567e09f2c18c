"""scripts/gpu_check.sh, reduced to the CPU (`--cpu`): the same script the GPU machine runs, so it cannot rot.
It runs the tiny demo through every stage and the training benchmark, and prints one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from orchestrator.compute import hardware

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_reduced_on_the_cpu(fast_cache, tmp_path):
    from conftest import copy_cache

    # The shared tiny target, extraction and draft: on the CPU the script's demo has the test suite's keys, so it
    # runs eval and serve (its own steps) on them and builds nothing again. On a GPU every stage runs.
    cached = copy_cache(fast_cache("extract", "train"), tmp_path / "outputs", ("targets", "extract", "train"))
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "check"), "GPU_CHECK_OUTPUTS": str(cached)}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["mode"] == "cpu" and line["all_on_device"]
    assert line["stage_devices"] == {s: "cpu" for s in ("extract", "train", "eval", "serve")}
    assert line["stage_dtypes"]["train"] == "float32"
    assert line["speedup"] > 0 and line["served_accept_length"] >= 1.0
    assert line["greedy_differing_token_rate"] == 0.0  # float32 on the CPU: exact
    # HF's states in float32 in eval, and stored in bfloat16 by the extraction (extract.dtype): each value rounded by
    # at most 2^-9 of itself
    assert 0 < line["eval_served_states_rel_diff"] < 2**-9
    assert line["bench"], "the benchmark's results are part of the line"
    assert line["serve_hardware"] == hardware(gpus=False)  # on a GPU, the processor then nvidia-smi's GPU names


def test_gpu_check_cuda_arguments_parse_without_a_gpu(tmp_path):
    """`--dry-run`: the GPU run's own demo overrides and benchmark arguments go through the real parsers (Hydra
    and the pipeline's plan; the benchmark's argparse and shapes), so the CUDA branch cannot rot either."""
    env = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "check"), "GPU_CHECK_OUTPUTS": str(tmp_path / "outputs")}
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    stages = ("extract", "train", "eval", "serve")
    assert line["stage_gpus"] == {s: 1 for s in stages} and line["stage_precisions"] == {s: "bfloat16" for s in stages}
    bench = line["bench"]
    assert (bench["device"], bench["shape"], bench["seqs"]) == ("cuda", "kimi", [2048, 8192])
    assert bench["specforge_backends"] == ["flex_attention", "sdpa"] and bench["estimate_memory"] is True
    assert bench["steps"] > 0 and all(f > 0 for f in bench["flops_per_token"].values())
    assert not (tmp_path / "outputs" / "cache").exists(), "a dry run builds and runs nothing"
