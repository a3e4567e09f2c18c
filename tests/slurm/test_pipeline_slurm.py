"""The pipeline on a real single-node Slurm cluster (tests/infra/slurm_cluster.sh): dependent stage jobs, sweeps
that fan out under one MLflow parent run, caching across runs, failure isolation, and requeue on SIGUSR2.

Skipped unless SLURM_CONF points at a running cluster (scripts/test.sh starts one)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

pytestmark = pytest.mark.slurm

if not os.environ.get("SLURM_CONF") or shutil.which("sbatch") is None:
    pytest.skip("no Slurm cluster (start one with tests/infra/slurm_cluster.sh start)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import FAST, copy_cache  # noqa: E402

TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}
SLURM_FAST = [o for o in FAST if not o.startswith("train.max_steps")] + [
    "cluster=slurm",
    "extract.resources.cpus_per_task=1",
    "train.resources.cpus_per_task=1",
    "eval.resources.cpus_per_task=1",
    "serve.resources.cpus_per_task=1",
    "extract.resources.mem_gb=2",
    "train.resources.mem_gb=2",
    "eval.resources.mem_gb=2",
    "serve.resources.mem_gb=2",
]


def sacct_states(job_ids: list[str]) -> dict[str, str]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", ",".join(job_ids)], capture_output=True, text=True
    ).stdout
    states = {}
    for line in out.splitlines():
        job, _, state = line.partition("|")
        states[job.strip()] = state.split()[0] if state else ""
    return states


def wait_terminal(job_ids: list[str], timeout: float = 900) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = sacct_states(job_ids)
        if len(states) >= len(job_ids) and all(states.get(j) in TERMINAL for j in job_ids):
            return states
        time.sleep(2)
    raise AssertionError(f"jobs not finished after {timeout} s: {sacct_states(job_ids)}")


def job_logs(folder: Path, job_id: str, lines: int = 40) -> str:
    """Every attempt of a job as Slurm's accounting has it, and the end of each task's stderr (progress bars
    dropped): what a failed assertion on a job's state shows."""
    attempts = subprocess.run(
        ["sacct", "-n", "-X", "-D", "-P", "-o", "JobID,State,ExitCode,Start,End", "-j", job_id],
        capture_output=True,
        text=True,
    ).stdout
    tails = [attempts]
    for log in sorted(folder.glob(f"{job_id}_*_log.err")):
        kept = [
            line
            for line in log.read_text(errors="replace").replace("\r", "\n").splitlines()
            if "it/s" not in line and "step/s" not in line
        ]
        tails.append(f"--- {log.name} ---\n" + "\n".join(kept[-lines:]))
    return "\n".join(tails)


def cli(outputs: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(outputs)}
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.fixture
def slurm_outputs(fast_cache, tmp_path):
    """A fresh outputs folder holding a copy of the shared tiny target (built once for the session, on both CPUs,
    not again in a 1-CPU job) and of the target's regenerated answers (`outputs/cache/regenerated`), so every stage
    runs as a job, and an extraction job captures without answering the prompts again."""
    return copy_cache(fast_cache("extract"), tmp_path / "outputs", ("targets", "regenerated"))


@pytest.fixture
def slurm_extracted(slurm_outputs, fast_cache):
    """`slurm_outputs` with the FAST tiny extraction already in its cache (the Slurm runs' extraction key is the
    same: resources do not key it), for the tests about training jobs: only those run as jobs."""
    return copy_cache(fast_cache("extract"), slurm_outputs)


def test_pipeline_runs_as_four_dependent_jobs(slurm_outputs, fast_cache, tiny_config, tmp_path):
    from orchestrator.pipeline import run_pipeline

    fast_steps = next(o for o in FAST if o.startswith("train.max_steps"))  # every key the local FAST run's
    proc = cli(slurm_outputs, "+experiment=tiny_eagle3", *SLURM_FAST, fast_steps, "cluster.wait=true", timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary_path = next(slurm_outputs.rglob("summary.json"))
    summary = json.loads(summary_path.read_text())
    assert set(summary["stages"]) == {"extract", "train", "eval", "serve"}
    assert summary["stages"]["serve"]["greedy_outputs_identical"] is True
    run = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    submitted = [line for line in proc.stdout.splitlines() if "submitted job" in line]
    assert len(submitted) == 4, proc.stdout

    # The same experiment run locally, in the session's shared outputs folder (its own stages, not the Slurm jobs':
    # the session's FAST extraction, draft and eval, computed once for every test, and a serve stage of its own),
    # gives the same summary (extraction's determinism across processes and ranks: tests/test_distributed.py).
    fast_cache("extract", "train", "eval")
    local = run_pipeline(tiny_config("cluster=local"), tmp_path / "local_run")
    assert_same_summary(summary, local)


def assert_same_summary(slurm: dict, local: dict) -> None:
    """Equal where the pipeline is deterministic; timings (tok/s) only present. The Slurm jobs run with 1 CPU
    and the local ones with 2, so float sums may differ in their last bits: accuracies within 0.01."""
    assert slurm["aux_layers"] == local["aux_layers"] and slurm["mismatch_flags"] == local["mismatch_flags"] == []
    a, b = slurm["stages"], local["stages"]
    assert a["extract"]["tokens"] == b["extract"]["tokens"]
    assert a["extract"]["bytes_per_token"] == b["extract"]["bytes_per_token"]
    assert a["train"]["eagle_aux_hidden_state_layer_ids"] == b["train"]["eagle_aux_hidden_state_layer_ids"]
    close = {
        "train": ["val_acc_0", "val_acc_1", "val_acc_2", "val_expected_accept_length"],
        "eval": ["acc_0", "acc_1", "acc_2", "expected_accept_length"],
        "serve": ["accept_length", "eval_expected_accept_length"],
    }
    for stage, keys in close.items():
        for key in keys:
            assert abs(a[stage][key] - b[stage][key]) <= 0.01 * max(1.0, abs(b[stage][key])), (
                stage,
                key,
                a[stage][key],
                b[stage][key],
            )
    assert a["train"]["val_loss"] == pytest.approx(b["train"]["val_loss"], rel=1e-3)
    assert a["eval"]["served_layers"] == b["eval"]["served_layers"]
    assert a["serve"]["greedy_outputs_identical"] is b["serve"]["greedy_outputs_identical"] is True
    for key in ("baseline_tok_s", "spec_tok_s", "speedup"):
        assert a["serve"][key] > 0 and b["serve"][key] > 0
    print("slurm vs local:", {s: a[s].get("headline") for s in a}, {s: b[s].get("headline") for s in b})


def test_sweep_fans_out_then_is_cached_and_a_failing_point_is_isolated(slurm_outputs):
    sweep = [
        "-m",
        "+experiment=tiny_eagle3",
        *SLURM_FAST,
        "train.max_steps=12",
        "stages=[extract,train]",
        "aux_layers=[1,4,6],[0,3,6]",
    ]
    started = time.monotonic()
    proc = cli(slurm_outputs, *sweep)
    submit_seconds = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(p.read_text()) for p in slurm_outputs.rglob("jobs.json")]
    assert len(records) == 2
    job_ids = [j for r in records for j in r.values()]
    assert len(job_ids) == 4
    # Pending jobs reach sacct only once slurmdbd records them; squeue lists every queued job at once.
    in_queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    queued = set(in_queue) | set(sacct_states(job_ids))
    assert set(job_ids) <= queued, "every job of every point is queued when the command returns"
    print(f"2-point sweep: {len(job_ids)} jobs queued in {submit_seconds:.1f} s")
    states = wait_terminal(job_ids)
    assert set(states.values()) == {"COMPLETED"}, states

    uri = f"sqlite:///{slurm_outputs / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("tiny_eagle3")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) == 2
    assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
    assert sorted(c.data.tags["aux_layers"] for c in children) == ["[0, 3, 6]", "[1, 4, 6]"]
    assert all(c.info.status == "FINISHED" and "train/val_acc_0" in c.data.metrics for c in children)

    again = cli(slurm_outputs, *sweep)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "submitted job" not in again.stdout
    assert again.stdout.count("cached:") == 4, again.stdout

    # One point fails at run time (its weights file is cut short after its header: the dry run's checks read the
    # checkpoint's config.json, tokenizer and safetensors headers and pass it; loading it fails in the job); the
    # others are untouched.
    built = next(p for p in (slurm_outputs / "cache" / "targets").iterdir() if p.is_dir())
    broken = slurm_outputs.parent / "broken_target"
    shutil.copytree(built, broken, ignore=shutil.ignore_patterns("*.lock"))
    weights = (broken / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(weights[:8], "little")
    (broken / "model.safetensors").write_bytes(weights[: header + 1000])
    failing = cli(
        slurm_outputs,
        "-m",
        "+experiment=tiny_eagle3",
        *SLURM_FAST,
        "train.max_steps=12",
        "aux_layers=[1,4,6]",
        f"target.path={broken},null",
        "stages=[extract,train,eval]",
    )
    assert failing.returncode == 0, failing.stderr[-3000:]
    newest = [
        json.loads(p.read_text())
        for p in sorted(slurm_outputs.rglob("jobs.json"), key=lambda p: p.stat().st_mtime)[-2:]
    ]
    chain = next(r for r in newest if "extract" in r)
    healthy = next(r for r in newest if "extract" not in r)  # extract and train cached from the first sweep
    assert set(healthy) == {"eval"}
    states = wait_terminal(list(chain.values()) + list(healthy.values()))
    assert states[chain["extract"]] == "FAILED"
    assert states[chain["train"]] == states[chain["eval"]] == "CANCELLED", states
    assert states[healthy["eval"]] == "COMPLETED", states
    failed_runs = [r for r in client.search_runs([exp.experiment_id]) if r.info.status == "FAILED"]
    assert failed_runs and "incomplete metadata" in failed_runs[0].data.tags.get("error", "")


def requeued_training(slurm_outputs: Path, *extra: str) -> tuple[str, Path, Path]:
    """A 30-step training job sent Slurm's pre-emption signal (SIGUSR2) once it has a checkpoint,
    waited for until it completes: (job id, its jobs.json, the checkpoint)."""
    common = ["+experiment=tiny_eagle3", *SLURM_FAST]  # the extraction is in the cache already (slurm_extracted)
    long_train = [
        "stages=[extract,train]",
        "train.max_steps=30",
        "train.checkpoint_every=5",
        "train.resources.timeout_min=60",
    ]
    proc = cli(slurm_outputs, *common, *long_train, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = sorted(slurm_outputs.rglob("jobs.json"), key=lambda p: p.stat().st_mtime)[-1]
    job_id = json.loads(record.read_text())["train"]
    checkpoint = next((slurm_outputs / "cache" / "train").iterdir()) / "checkpoints" / "latest.pt"
    deadline = time.monotonic() + 600
    while not checkpoint.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert checkpoint.exists()
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    states = wait_terminal([job_id], timeout=900)
    assert states[job_id] == "COMPLETED", (states, job_logs(record.parent / "jobs", job_id))
    assert (checkpoint.parent.parent / "manifest.json").exists()
    return job_id, record, checkpoint


def test_training_as_a_two_task_job_reaches_the_one_task_weights(slurm_extracted):
    """DDP over two Slurm tasks of one job (gloo on CPUs): each task takes its rank from submitit's task model,
    and the draft equals a one-task job's on the same extraction."""
    import torch
    from safetensors.torch import load_file

    common = [
        "+experiment=tiny_eagle3",
        *SLURM_FAST,
        "cluster.wait=true",
        "stages=[extract,train]",
        "train.max_steps=8",
    ]
    proc = cli(slurm_extracted, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the same extraction and target in a second outputs folder: resources do not key the cache, a new folder does
    two = slurm_extracted.parent / "two"
    for part in ("targets", "extract"):
        shutil.copytree(
            slurm_extracted / "cache" / part, two / "cache" / part, ignore=shutil.ignore_patterns("*.lock", ".job.json")
        )
    proc = cli(two, *common, "train.resources.tasks_per_node=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = {}
    for name, root in (("one", slurm_extracted), ("two", two)):
        summaries[name] = json.loads(max(root.rglob("summary.json"), key=lambda p: p.stat().st_mtime).read_text())
    t1, t2 = summaries["one"]["stages"]["train"], summaries["two"]["stages"]["train"]
    assert t1["compute"]["world_size"] == 1 and t2["compute"] | {} == {
        "device": "cpu",
        "devices": ["cpu"],
        "dtype": "float32",
        "world_size": 2,
        "backend": "gloo",
        "subnormals": "flushed",  # in a Slurm task too (pipeline.run_stage)
    }
    assert summaries["two"]["stages"]["extract"]["cached"] is True
    w1, w2 = (load_file(str(Path(t["draft_dir"]) / "model.safetensors")) for t in (t1, t2))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")
    second_task = list(Path(summaries["two"]["run_dir"], "jobs").glob("*_1_log.out"))  # the train job's task 1
    assert second_task and "global_rank=1(2)" in second_task[0].read_text(errors="replace")


def sacct_times(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-o", "JobID,Start,End", "-j", ",".join(job_ids)], capture_output=True, text=True
    ).stdout
    return {
        job: (start, end) for job, start, end in (line.split("|") for line in out.splitlines() if line.count("|") == 2)
    }


@pytest.mark.slow  # outside the default suite, for its time (pyproject.toml's marker)
def test_layer_search_runs_trials_as_parallel_slurm_jobs(slurm_outputs):
    """`search.n_jobs=2` on Slurm: the union is extracted once, then two trials' chains (train, eval) are jobs at the
    same time, side by side on the node's two CPUs; both trials complete, in Optuna and as MLflow child runs."""
    import optuna

    name = "slurm-search"
    proc = cli(
        slurm_outputs,
        "+experiment=tiny_eagle3",
        "+search=tiny_llama",
        *SLURM_FAST,
        "train.max_steps=12",
        "stages=[extract,train,eval]",
        f"search.study_name={name}",
        "search.n_trials=2",
        "search.n_jobs=2",
        "search/pruner=none",
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folder = slurm_outputs / "search" / name
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{folder / 'optuna.db'}")
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    # a point proposed while another trial runs it is asked again: such a trial is failed, uncounted, and ran nothing
    asked_again = [t for t in study.trials if t.state != optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 2 and all("in_flight_of" in t.user_attrs for t in asked_again), study.trials
    points = [t.user_attrs["aux_layers"] for t in complete]
    assert points[0] == [1, 4, 6] and points[1] != [1, 4, 6], points
    assert sorted(p.name for p in (folder / "trials").iterdir()) == [f"{t.number:04d}" for t in complete]

    def job_ids(run_dir: Path) -> list[str]:  # the driver waited for them: submitit's files name them
        return sorted({p.name.split("_")[0] for p in (run_dir / "jobs").glob("*_submitted.pkl")})

    union = job_ids(folder / "extract")
    trials = [job_ids(folder / "trials" / f"{t.number:04d}") for t in complete]
    assert len(union) == 1 and [len(t) for t in trials] == [2, 2], (
        union,
        trials,
    )  # extract once; train, eval per trial
    jobs = union + trials[0] + trials[1]
    assert set(wait_terminal(jobs).values()) == {"COMPLETED"}
    from datetime import datetime, timedelta

    times = {j: tuple(datetime.fromisoformat(t) for t in span) for j, span in sacct_times(jobs).items()}
    # trial 1's chain started before trial 0's ended, and both after the union (sacct's end includes the job's
    # epilog and is in whole seconds: the driver's next submission can start a second or two before it)
    first = (min(times[j][0] for j in trials[0]), max(times[j][1] for j in trials[0]))
    second = (min(times[j][0] for j in trials[1]), max(times[j][1] for j in trials[1]))
    assert min(first[0], second[0]) >= times[union[0]][1] - timedelta(seconds=3), (times, union, trials)
    assert first[0] < second[1] and second[0] < first[1], f"the trials ran one after the other: {times}"
    summary = json.loads((folder / "search.json").read_text())
    client = MlflowClient(summary["tracking_uri"])
    children = client.search_runs(
        [client.get_run(summary["mlflow_parent_run_id"]).info.experiment_id],
        f"tags.`mlflow.parentRunId` = '{summary['mlflow_parent_run_id']}'",
    )
    states = sorted(r.data.tags.get("search.trial_state", "") for r in children if "search.trial" in r.data.tags)
    assert states == ["complete", "complete"], [(r.info.run_name, r.data.tags) for r in children]


def test_two_task_training_requeued_on_sigusr2_resumes_on_both_ranks(slurm_extracted):
    """Slurm's pre-emption signal to a 2-task DDP training job: submitit requeues it, both tasks start again under
    the same job id, both resume from rank 0's checkpoint, and the job completes."""
    job_id, record, _ = requeued_training(slurm_extracted, "train.resources.tasks_per_node=2")
    logs = {p.name: p.read_text(errors="replace") for p in record.parent.glob(f"jobs/{job_id}_*_log.out")}
    assert sorted(logs) == [f"{job_id}_0_log.out", f"{job_id}_1_log.out"], sorted(logs)
    assert all("resumed from" in text for text in logs.values()), {k: v[-2000:] for k, v in logs.items()}


def test_a_chain_rejected_partway_cancels_the_jobs_it_queued(slurm_outputs):
    """sbatch rejects the train job (1000 GB on a node of about 21: "Requested node configuration is not
    available"; this Slurm queues an excess of CPUs instead) after the extract job was queued: the run cancels the
    extract job, says so, and exits with an error instead of leaving it queued for nothing."""
    proc = cli(
        slurm_outputs, "+experiment=tiny_eagle3", *SLURM_FAST, "stages=[extract,train]",
        "train.resources.mem_gb=1000", timeout=300,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "submitted job" in line]
    queued = [line.split("submitted job ")[1].split()[0] for line in lines]
    assert len(queued) == 1, proc.stdout
    assert f"cancelled this run's jobs queued before it: extract (job {queued[0]})" in proc.stderr
    assert "submitting stage train failed" in proc.stderr
    assert wait_terminal(queued, timeout=120)[queued[0]] == "CANCELLED"


def test_a_rank_that_hangs_ends_the_slurm_job_within_the_collective_timeout(slurm_extracted, monkeypatch):
    """Rank 1 of a two-task training job never returns from its third step. Rank 0's all-reduce times out after
    train.collective_timeout_min (0.25 here, against the job's 120-minute limit) and fails; srun then ends the
    hung task (--kill-on-bad-exit), so the job is over in about a minute, not at its time limit."""
    faults = Path(__file__).resolve().parents[1] / "faults"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(faults), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for key, value in {"FAULT_TARGET": "orchestrator.stages.train:optimizer_step", "FAULT_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAULT_CALL", "3")
    monkeypatch.setenv("FAULT_KIND", "hang")
    started = time.monotonic()
    proc = cli(
        slurm_extracted, "+experiment=tiny_eagle3", *SLURM_FAST, "stages=[extract,train]", "train.max_steps=12",
        "train.resources.tasks_per_node=2", "train.collective_timeout_min=0.25", "cluster.wait=true", timeout=900,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout[-3000:]
    output = proc.stdout + proc.stderr
    assert "stage train" in output and "rank 0 failed first" in output, output[-4000:]
    assert "timed out" in output.lower() or "timeout" in output.lower(), output[-4000:]
    assert time.monotonic() - started < 600, "the job ran on past its collective timeout"


@pytest.mark.slow  # outside the default suite, for its time (pyproject.toml's marker)
def test_a_task_killed_mid_extraction_ends_the_job_and_the_rerun_matches_an_uninterrupted_one(
    slurm_outputs, fast_cache, monkeypatch
):
    """kill -9 of one Slurm task of a two-task extraction, rank 1, as it starts its shard: no exception and no
    failure record, as with the OOM killer or a lost node. srun ends rank 0 at once (--kill-on-bad-exit), so the
    job fails in seconds, not after rank 0 has waited out the killed task's heartbeat (10 minutes here), and the
    run fails with srun's word for it. The same command again extracts only what is missing, leaves the shards
    already done as they are, and every shard equals the uninterrupted local extraction's, bit for bit."""
    faults = Path(__file__).resolve().parents[1] / "faults"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(faults), *filter(None, [os.environ.get("PYTHONPATH")])]))
    faulty = {"FAULT_TARGET": "orchestrator.engines.hf:extract_chunk", "FAULT_RANK": "1", "FAULT_KIND": "kill"}
    for key, value in faulty.items():
        monkeypatch.setenv(key, value)
    args = (
        "+experiment=tiny_eagle3", *SLURM_FAST, "stages=[extract]", "extract.resources.tasks_per_node=2",
        "extract.collective_timeout_min=10", "cluster.wait=true",
    )  # fmt: skip
    started = time.monotonic()
    proc = cli(slurm_outputs, *args, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    assert "stage extract" in output and "task 1: Killed" in output, output[-4000:]
    assert time.monotonic() - started < 300, "rank 0 waited for the killed task's heartbeat instead of ending"
    folder = next((slurm_outputs / "cache" / "extract").iterdir())
    assert not (folder / "manifest.json").exists()  # the extraction is not whole
    kept = {p: p.stat().st_mtime_ns for p in folder.glob("*/shard_*.safetensors")}

    for key in faulty:
        monkeypatch.delenv(key)
    proc = cli(slurm_outputs, *args, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(max(slurm_outputs.rglob("summary.json"), key=lambda p: p.stat().st_mtime).read_text())
    extract = summary["stages"]["extract"]
    assert 0 < extract["tokens_extracted_now"] <= extract["tokens"], extract
    assert (extract["tokens_extracted_now"] < extract["tokens"]) == bool(kept), (extract, kept)  # only what was missing
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items()), "a shard already done was written again"
    # one key: resources and engine placement do not key an extraction (the shared folder may hold others)
    reference = fast_cache("extract") / "cache" / "extract" / folder.name
    assert (reference / "manifest.json").exists(), sorted(p.name for p in reference.parent.iterdir())
    shards = sorted(p.relative_to(reference) for p in reference.glob("*/shard_*.safetensors"))
    assert shards == sorted(p.relative_to(folder) for p in folder.glob("*/shard_*.safetensors"))
    for name in shards:
        resumed, uninterrupted = load_file(str(folder / name)), load_file(str(reference / name))
        assert resumed.keys() == uninterrupted.keys()
        for key, tensor in resumed.items():
            assert torch.equal(tensor, uninterrupted[key]), f"{name}: {key} differs from the uninterrupted run"


def run_jobs(run_dir: Path) -> dict[str, str]:
    """The jobs a run submitted, by the last word of their Slurm job name (extract, stream, train, ...)."""
    ids = sorted({p.name.split("_")[0] for p in (run_dir / "jobs").glob("*_submitted.pkl")})
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,JobName", "-j", ",".join(ids)], capture_output=True,
                         text=True).stdout  # fmt: skip
    return {name.rsplit("-", 1)[-1]: job for job, name in (line.split("|") for line in out.splitlines() if "|" in line)}


def started_until_checkpoint(outputs: Path, args: list[str], before: str) -> tuple[subprocess.Popen, Path, dict]:
    """The command with `args` started in the background on `outputs`, once its training has written a checkpoint:
    (the process, its run folder, its jobs by name). `before`: what the checkpoint must come before, for the error."""
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(outputs)}
    run = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    deadline = time.monotonic() + 600
    while not list(outputs.glob("cache/train/*/checkpoints/latest.pt")):
        assert time.monotonic() < deadline and run.poll() is None, f"no checkpoint before {before}"
        time.sleep(0.5)
    (run_dir,) = (outputs / "runs").glob("*/*")
    return run, run_dir, run_jobs(run_dir)


def test_a_capture_service_job_of_its_own_killed_fails_the_training_naming_its_log_and_the_rerun_resumes(
    slurm_outputs,
):
    """train.states=stream on Slurm: the capture service is a job of its own (`<run>-stream`, the extraction's
    resources) after the extraction, and the train job starts once it has started (--dependency=after:). Killed
    mid-training (SIGKILL through scancel), the run fails within 2 minutes, naming the service's job log, and the
    train job fails on its own within train.stream.stall_timeout_s. The same command with eval then resumes the
    training from its checkpoint with a new service job, which captures from that step on, then answers the eval
    job's requests for its live target (the target loaded once for both), and every job completes."""
    steps = 60  # the trainer reads for seconds after its first checkpoint: the kill lands before it has all its states
    args = ["+experiment=tiny_eagle3", *SLURM_FAST, f"train.max_steps={steps}", "train.checkpoint_every=2",
            "stages=[extract,train]", "train.states=stream", "train.stream.buffer_bytes=300000",
            "train.stream.stall_timeout_s=15", "cluster.wait=true"]  # fmt: skip
    run, run_dir, jobs = started_until_checkpoint(slurm_outputs, args, "the kill")
    service, trainer = jobs["stream"], jobs["train"]
    killed = time.monotonic()
    subprocess.run(["scancel", "--signal=KILL", "--full", service], check=True)
    out, _ = run.communicate(timeout=300)
    assert run.returncode != 0 and time.monotonic() - killed < 120, out[-3000:]
    assert f"stage stream (job {service}) failed" in out and f"{service}_0_log" in out, out[-3000:]
    assert wait_terminal([trainer], timeout=120)[trainer] == "FAILED"
    train_log = next((run_dir / "jobs").glob(f"{trainer}_0_log.err")).read_text()
    assert "StreamError" in train_log and f"{service}_0_log.out" in train_log, train_log[-2000:]

    with_eval = [a.replace("stages=[extract,train]", "stages=[extract,train,eval]") for a in args]
    rerun = cli(slurm_outputs, *with_eval, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "capture service: a Slurm job of its own after extract, with extract.resources" in rerun.stdout
    (again,) = [d for d in (slurm_outputs / "runs").glob("*/*") if d != run_dir]
    jobs = run_jobs(again)
    assert set(jobs) == {"stream", "train", "eval"}
    assert set(wait_terminal(list(jobs.values())).values()) == {"COMPLETED"}
    from datetime import datetime

    times = {j: tuple(datetime.fromisoformat(t) for t in span) for j, span in sacct_times(list(jobs.values())).items()}
    assert times[jobs["train"]][0] >= times[jobs["stream"]][0], times
    logs = [p.read_text() for p in (again / "jobs").glob("*_0_log.out")]
    service_log = next(log for log in logs if "[stream] capturing" in log)
    first = int(re.search(rf"capturing \d+ sequences' states, steps (\d+)\.\.{steps}", service_log).group(1))
    assert first > 0, service_log  # from the checkpoint's step, not from the start
    report = json.loads((again / "summary.json").read_text())["stages"]["train"]["stream"]
    assert report["captured_sequences"] == (steps - first) * 8 and 0 < report["peak_spool_bytes"] <= 300_000, report
    assert "service ended with code 0" in service_log, service_log[-2000:]
    evaluated = json.loads((again / "summary.json").read_text())["stages"]["eval"]
    asked = evaluated["sequences"] + 4  # one request a validation sequence and a serving prompt (serve.prompts=4)
    assert f"answered {asked} eval requests on the target loaded here" in service_log, service_log[-2000:]
    eval_log = next((again / "jobs").glob(f"{jobs['eval']}_0_log.out")).read_text()
    assert "[eval] the live target is the capture service's" in eval_log, eval_log[-2000:]


@pytest.mark.slow
def test_a_streamed_layer_search_on_slurm_shares_one_capture_service_job(slurm_outputs):
    """train.states=stream with search.n_jobs=2 on Slurm: the group's capture service is a Slurm job of its own (the
    union's layers), each trial's train job starts after it and joins it. With room on the cluster for the service
    and both train jobs (3 CPUs or more), both trials read one capture pass; with 2 CPUs (the suite's cluster) the
    second train job waits in the queue, the service starts without it train.stream.declare_timeout_s after the
    first declared, and that trial fails saying so while the other completes. Slow (minutes): `-m slow`."""
    import optuna

    cpus = int(subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True).stdout.split()[0])
    name = "slurm-stream-search"
    proc = cli(
        slurm_outputs, "+experiment=tiny_eagle3", "+search=tiny_llama", *SLURM_FAST, "train.max_steps=12",
        "stages=[extract,train,eval]", "train.states=stream", "train.stream.declare_timeout_s=20",
        f"search.study_name={name}", "search.n_trials=2", "search.n_jobs=2", "search/pruner=none", timeout=1500,
    )  # fmt: skip
    folder = slurm_outputs / "search" / name
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{folder / 'optuna.db'}")
    # a point proposed while another trial runs it is asked again: such a trial is failed, uncounted, and ran nothing
    trials = {t.number: t for t in study.trials if "in_flight_of" not in t.user_attrs}
    (service,) = sorted({p.name.split("_")[0] for p in (folder / "jobs").glob("*_submitted.pkl")})
    log = next((folder / "jobs").glob(f"{service}_0_log.out")).read_text()
    assert wait_terminal([service])[service] == "COMPLETED", log[-3000:]
    assert log.count("[stream] capturing") == 1, log[-3000:]  # one capture pass for the group
    states = sorted(t.state.name for t in trials.values())
    if cpus >= 3:
        assert proc.returncode == 0 and states == ["COMPLETE", "COMPLETE"], proc.stdout[-3000:] + log[-2000:]
        assert "starting without it" not in log, log[-3000:]
    else:
        assert states == ["COMPLETE", "FAIL"], proc.stdout[-3000:] + log[-2000:]
        (left_out,) = [n for n, t in trials.items() if t.state.name == "FAIL"]
        assert f"consumer {left_out:04d} had not declared its steps 20 s after the first did" in log, log[-3000:]
        train_log = "".join(p.read_text() for p in (folder / "trials" / f"{left_out:04d}" / "jobs").glob("*_log.err"))
        assert f"started without consumer '{left_out:04d}'" in train_log, train_log[-3000:]
        assert "train.stream.declare_timeout_s" in train_log and "search.n_jobs" in train_log, train_log[-3000:]
    for t in trials.values():  # each trial's train job started once the service's had (sacct's start times)
        jobs = run_jobs(folder / "trials" / f"{t.number:04d}")
        times = sacct_times([service, jobs["train"]])
        assert times[jobs["train"]][0] >= times[service][0], times
