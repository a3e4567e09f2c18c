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
    project = [r for r in line["bench"]["results"] if r["implementation"] == "project"]
    assert project and all(r["status"] == "measured" for r in project), "the project's step ran in the benchmark"
    assert line["serve_hardware"] == hardware(gpus=False)  # on a GPU, the processor then nvidia-smi's GPU names
    # the engine that served, named; SpecForge's rows skipped on the CPU, saying why, and not a failure there
    assert (line["engine"], line["engine_fallback"]) == ("reference", None)
    assert line["specforge_measured"] == 0 and any("device is cpu" in r for r in line["specforge_missing"])
    assert "served by reference" in proc.stderr


def _check_line(
    tmp_path: Path, mode: str, specforge: list[dict], fallback: str | None = None, bench: dict | None = None
):
    """scripts/gpu_check_line.py on a constructed run: every stage on `mode`, the reference engine serving in place
    of vLLM where `fallback` says so, the benchmark's rows as given."""
    out = tmp_path / mode
    (out / "run").mkdir(parents=True)
    compute = {"device": mode, "dtype": "bfloat16"}
    serve = {"compute": compute, "accept_length": 2.5, "speedup": 1.3, "engine": "reference", "engine_version": None,
             "engine_fallback": fallback, "measured_by": {"baseline": [{"hardware": "a GPU"}]}}  # fmt: skip
    stages = {s: {"compute": compute} for s in ("extract", "train", "eval")} | {"serve": serve}
    (out / "run" / "summary.json").write_text(json.dumps({"stages": stages, "mismatch_flags": []}))
    project = {"implementation": "project", "seq": 2048, "status": "measured"}
    (out / "bench.json").write_text(json.dumps({"results": [project, *specforge], **(bench or {})}))
    proc = subprocess.run(["python3", "scripts/gpu_check_line.py", str(out), mode, "60"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return proc, json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_gpu_checks_line_names_the_engine_and_fails_without_specforges_rows_on_a_gpu(tmp_path):
    """On a GPU machine the demo may be served by the reference engine (no CUDA vLLM there): the line says so. The
    check's comparison with SpecForge is its point there: missing rows fail it, as a stage off the device does."""
    measured = [
        {"implementation": f"specforge:{backend}", "seq": 2048, "status": "measured"}
        for backend in ("flex_attention", "sdpa")
    ]
    proc, line = _check_line(tmp_path / "ok", "cuda", measured, fallback="no CUDA vLLM in serve.python")
    assert proc.returncode == 0, proc.stderr
    assert (line["engine"], line["engine_fallback"]) == ("reference", "no CUDA vLLM in serve.python")
    assert "in place of the engine asked for: no CUDA vLLM" in proc.stderr and line["specforge_measured"] == 2
    missing = [{"implementation": "specforge:flex_attention", "seq": 2048, "status": "skipped",
                "reason": "cannot import specforge (ModuleNotFoundError)"}]  # fmt: skip
    proc, line = _check_line(tmp_path / "missing", "cuda", missing)
    assert proc.returncode == 1 and "cannot import specforge" in line["failed"]
    proc, line = _check_line(tmp_path / "none", "cuda", [])
    assert proc.returncode == 1 and "none ran" in line["failed"]
    proc, line = _check_line(tmp_path / "cpu", "cpu", missing)  # the CPU has no triton: skipped, not failed
    assert proc.returncode == 0 and "failed" not in line
    # rows measured, but SpecForge's loss on the project's draft is not the project's: the timing compares unlike
    # work, and the check fails
    differ = {"targets": {"same_loss": {"target": "SpecForge's TTT loss ...", "status": "FAIL"}},
              "agreement": {"ce_sum_rel_diff": 6e-4}}  # fmt: skip
    proc, line = _check_line(tmp_path / "differ", "cuda", measured, bench=differ)
    assert proc.returncode == 1 and "FAIL" in line["failed"] and line["specforge_loss_rel_diff"] == 6e-4
    assert "SpecForge's loss on the project's draft: FAIL" in proc.stderr


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
