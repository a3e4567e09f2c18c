"""Data-parallel extraction and distributed training on CPUs: real gloo process groups started through
submitit's task model (cluster=local, two tasks), against the same stages in one process."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, copy_cache
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from orchestrator.compute import cpu
from orchestrator.config import ConfigError
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.runner import StageFailed
from orchestrator.stages.train import rank_share

WRITE_AUDIT = Path(__file__).resolve().parent / "write_audit"
FAULTS = Path(__file__).resolve().parent / "faults"
# One CPU per rank, and the one-process run also on one: the same float reductions in both.
ONE_CPU = ["extract.resources.cpus_per_task=1", "train.resources.cpus_per_task=1"]


def _overrides(ranks: int) -> list[str]:
    return [
        "cluster=local",
        "stages=[extract,train]",
        *ONE_CPU,
        f"extract.resources.tasks_per_node={ranks}",
        f"train.resources.tasks_per_node={ranks}",
    ]


@pytest.fixture(scope="module")
def runs(fast_cache, tmp_path_factory):
    """{ranks: (config, summary)} of `stages=[extract,train]` with 1 and with 2 processes per stage, each in its
    own outputs folder, so that neither reuses the other's stages: one process's are the session's FAST stages
    (`fast_cache`, one process each: resources do not key them), two processes' are computed here from a copy of
    the shared tiny target."""
    shared = fast_cache("extract", "train")
    out = {}
    for ranks in (1, 2):
        root = tmp_path_factory.mktemp(f"ranks{ranks}")
        copy_cache(shared, root, ("targets", "extract", "train") if ranks == 1 else ("targets",))
        cfg = compose_config(root, *_overrides(ranks))
        audit = {}
        if ranks == 2:  # every task records its writes under the training cache (tests/write_audit)
            (root / "writes").mkdir()
            audit = {
                "PYTHONPATH": os.pathsep.join([str(WRITE_AUDIT), *filter(None, [os.environ.get("PYTHONPATH")])]),
                "WRITE_AUDIT_ROOT": str(root / "cache" / "train"),
                "WRITE_AUDIT_LOG": str(root / "writes"),
            }
        saved = {k: os.environ.get(k) for k in audit}
        os.environ.update(audit)
        try:
            out[ranks] = (cfg, run_pipeline(cfg, root / "runs" / "r"))
        finally:
            for k, v in saved.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return out


def _shards(cfg) -> dict[str, dict[str, torch.Tensor]]:
    folder = make_plan(cfg, cfg.outputs / "runs" / "r").dir("extract")
    return {str(p.relative_to(folder)): load_file(str(p)) for p in sorted(folder.glob("*/shard_*.safetensors"))}


def test_extraction_holds_the_same_sequences_and_states_with_two_ranks(runs):
    (cfg1, summary1), (cfg2, summary2) = runs[1], runs[2]
    one, two = _shards(cfg1), _shards(cfg2)
    assert len(one) >= 3 and one.keys() == two.keys()  # several shards, so both ranks wrote some
    for name in one:
        for key in ("input_ids", "loss_mask", "seq_lens", "aux_hidden_states", "teacher_hidden_state"):
            assert torch.equal(one[name][key], two[name][key]), f"{name}: {key} differs between 1 and 2 ranks"
    assert summary1["stages"]["extract"]["compute"]["world_size"] == 1
    assert summary2["stages"]["extract"]["compute"] | {} == {
        "device": "cpu",
        "devices": ["cpu"],
        "dtype": "float32",
        "world_size": 2,
        "backend": "gloo",
        "subnormals": "flushed",  # every CPU thread of the job (pipeline.run_stage)
    }
    assert summary2["stages"]["extract"]["tokens"] == summary1["stages"]["extract"]["tokens"]
    # rank 1 extracted its shards in its own process (its own submitit task log)
    logs = list(Path(summary2["run_dir"], "jobs").glob("*_1_log.err"))
    assert any("extract (rank 1/2)" in p.read_text(errors="replace") for p in logs)


def test_two_rank_training_reaches_the_one_rank_weights(runs):
    (_, summary1), (_, summary2) = runs[1], runs[2]
    w1 = load_file(str(Path(summary1["stages"]["train"]["draft_dir"]) / "model.safetensors"))
    w2 = load_file(str(Path(summary2["stages"]["train"]["draft_dir"]) / "model.safetensors"))
    assert w1.keys() == w2.keys()
    moved = 0
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
        moved += int(not torch.equal(w1[name], w2[name]))
    # the two ranks computed their own draft (their gradients summed in another order), not the one-rank one again
    assert moved > 0, "the two-rank draft is bit for bit the one-rank draft: it was not trained by two ranks"
    t1, t2 = summary1["stages"]["train"], summary2["stages"]["train"]
    assert t2["val_loss"] == pytest.approx(t1["val_loss"], rel=1e-4)
    for k in range(3):
        assert t2[f"val_acc_{k}"] == pytest.approx(t1[f"val_acc_{k}"], abs=0.01)
    assert t2["compute"]["world_size"] == 2 and t2["compute"]["backend"] == "gloo"
    # MLflow records how each stage ran
    params = MlflowClient(summary2["tracking_uri"]).get_run(summary2["mlflow_run_id"]).data.params
    assert params["train.world_size"] == "2" and params["extract.world_size"] == "2"
    assert params["train.device"] == "cpu" and params["train.dtype"] == "float32"
    assert params["train.subnormals"] == "flushed" and params["extract.subnormals"] == "flushed"


def test_two_rank_training_killed_mid_run_resumes_to_the_same_weights(runs, tmp_path):
    """The 2-task training job is killed with its driver after a checkpoint; the same command again resumes both
    ranks from rank 0's checkpoint and reaches the uninterrupted 2-rank weights. Rank 1 stops for good at its 7th
    step (tests/faults), so the kill lands after the step-4 checkpoint and before the end however slow the machine
    is: the test does not race the training."""
    cfg2, summary2 = runs[2]
    root = tmp_path / "outputs"
    for part in ("targets", "extract"):  # the same target and extraction: only training runs
        shutil.copytree(
            cfg2.outputs / "cache" / part, root / "cache" / part, ignore=shutil.ignore_patterns("*.lock", ".job.json")
        )
    command = [
        sys.executable,
        "-m",
        "orchestrator",
        "+experiment=tiny_eagle3",
        f"outputs_dir={root}",
        *FAST,
        *_overrides(2),
    ]
    assert cfg2.train.checkpoint_every == 4 and cfg2.train.max_steps > 7
    hang = {
        "PYTHONPATH": os.pathsep.join([str(FAULTS), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "FAULT_TARGET": "orchestrator.stages.train:optimizer_step",
        "FAULT_RANK": "1",
        "FAULT_CALL": "7",
        "FAULT_KIND": "hang",
    }
    first = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=os.environ | hang,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        found = []
        while not found and first.poll() is None and time.monotonic() < deadline:
            found = list((root / "cache" / "train").glob("*/checkpoints/latest.pt"))
            time.sleep(0.1)
        assert found, "no checkpoint before the driver ended"
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # the driver and its local jobs, both ranks
        first.wait()
    killed_at = torch.load(found[0], weights_only=False)["step"]
    assert killed_at == 4, "the kill must land after the first checkpoint, before rank 1's hang"
    assert not (found[0].parent.parent / "manifest.json").exists()

    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    train_dir = found[0].parent.parent
    logs = "".join(p.read_text(errors="replace") for p in root.rglob("jobs/*_log.*"))
    assert logs.count(f"at step {killed_at}/{cfg2.train.max_steps}") == 2, logs[-3000:]  # each rank resumed there
    resumed = load_file(str(train_dir / "draft" / "model.safetensors"))
    uninterrupted = load_file(str(Path(summary2["stages"]["train"]["draft_dir"]) / "model.safetensors"))
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        torch.testing.assert_close(
            resumed[name], uninterrupted[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}"
        )


def test_only_rank_zero_writes(runs):
    """Two training ranks: rank 0 writes the checkpoints, the draft and the manifest; rank 1 writes nothing under
    the training folder (every write of both tasks recorded by their audit hook, tests/write_audit)."""
    cfg2, summary2 = runs[2]
    train_dir = Path(summary2["stages"]["train"]["draft_dir"]).parent
    written = sorted(str(p.relative_to(train_dir)) for p in train_dir.rglob("*") if p.is_file())
    assert not [p for p in written if ".tmp" in p]
    assert "checkpoints/latest.pt" in written and "manifest.json" in written
    # the training job: the one whose rank-1 task log shows rank 1's training (the extract job's tasks log too)
    train_jobs = {
        p.name.split("_")[0]
        for p in Path(summary2["run_dir"], "jobs").glob("*_1_log.err")
        if "train (rank 1/2)" in p.read_text(errors="replace")
    }
    assert len(train_jobs) == 1, f"one two-task training job: {train_jobs}"
    (job,) = train_jobs
    logs = {rank: sorted((cfg2.outputs / "writes").glob(f"rank{rank}.{job}.*.txt")) for rank in (0, 1)}
    assert logs[0] and logs[1], f"both tasks of training job {job} ran with the audit hook: {logs}"
    by_rank = {
        rank: [line.split("\t") for p in files for line in p.read_text().splitlines()] for rank, files in logs.items()
    }
    renamed = {
        Path(path).relative_to(train_dir).as_posix()
        for event, path in by_rank[0]
        if event == "os.rename" and Path(path).is_relative_to(train_dir)
    }
    assert {"checkpoints/latest.pt", "manifest.json", "draft/model.safetensors", "draft/config.json"} <= renamed
    assert by_rank[1] == [], f"rank 1 wrote under {train_dir}: {by_rank[1][:10]}"


def test_a_short_last_batch_leaves_a_rank_a_sequence_that_counts_nothing():
    two = [type(cpu())(devices=cpu().devices, dtype=torch.float32, rank=r, world_size=2) for r in (0, 1)]
    assert rank_share([5, 1, 7, 3], two[0]) == ([5, 7], True)
    assert rank_share([5, 1, 7, 3], two[1]) == ([1, 3], True)
    assert rank_share([5], two[1]) == ([5], False)


def test_a_global_batch_that_does_not_split_between_ranks_is_refused(tiny_config):
    with pytest.raises(ConfigError, match="train.batch_size=8 over 3 ranks"):
        tiny_config("train.resources.tasks_per_node=3")


def test_ranks_the_cluster_cannot_run_are_refused_before_any_job(tiny_config):
    with pytest.raises(ConfigError, match="cluster=debug, which runs each stage in this process"):
        tiny_config("cluster=debug", "train.resources.tasks_per_node=2")
    with pytest.raises(ConfigError, match="only a Slurm cluster has several nodes"):
        tiny_config("cluster=local", "extract.resources.nodes=2")
    with pytest.raises(ConfigError, match="eval runs as one process"):
        tiny_config("eval.resources.tasks_per_node=2")
    with pytest.raises(ConfigError, match="train.precision='fp8'"):
        tiny_config("train.precision=fp8")


def test_an_extraction_rank_that_fails_or_is_killed_is_named_and_the_rerun_matches(runs, tmp_path, monkeypatch):
    """Rank 1 of a two-task extraction fails at its first shard; rank 0 finishes its own, sees rank 1's failure
    record and fails naming it (no collective left waiting). Then rank 1 is killed with SIGKILL instead (no
    exception, no failure record: kill -9, the OOM killer): its heartbeat stops, and rank 0, with nothing left to
    extract, fails once rank 1 is silent for extract.collective_timeout_min (0.25 here), naming it, instead of
    waiting forever. The same command a third time extracts what is missing, and every shard equals the
    uninterrupted two-rank run's, bit for bit."""
    cfg2, _ = runs[2]
    root = tmp_path / "outputs"
    targets = cfg2.outputs / "cache" / "targets"
    shutil.copytree(targets, root / "cache" / "targets", ignore=shutil.ignore_patterns("*.lock"))
    cfg = compose_config(root, *_overrides(2), "stages=[extract]", "extract.collective_timeout_min=0.25")
    faults = Path(__file__).resolve().parent / "faults"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(faults), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key, value in {"FAULT_TARGET": "orchestrator.engines.hf:extract_chunk", "FAULT_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(StageFailed) as failed:
        run_pipeline(cfg, tmp_path / "first")
    assert "rank 1 failed first: RuntimeError: injected fault" in str(failed.value)
    assert "extraction rank 1 failed" in str(failed.value)  # rank 0's own error names it

    monkeypatch.setenv("FAULT_KIND", "kill")
    started = time.monotonic()
    with pytest.raises(StageFailed) as failed:
        run_pipeline(cfg, tmp_path / "killed")
    assert "extraction rank 1 stopped without a word: no heartbeat" in str(failed.value), str(failed.value)[-3000:]
    assert time.monotonic() - started < 300

    monkeypatch.delenv("FAULT_TARGET")
    summary = run_pipeline(cfg, tmp_path / "again")
    assert 0 < summary["stages"]["extract"]["tokens_extracted_now"] < summary["stages"]["extract"]["tokens"]
    resumed, uninterrupted = _shards(cfg), _shards(cfg2)
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        for key, tensor in resumed[name].items():
            assert torch.equal(tensor, uninterrupted[name][key]), f"{name}: {key} differs from the uninterrupted run"
