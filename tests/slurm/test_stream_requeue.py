"""A streamed training outlives its Slurm allocations (train.states=stream on the real single-node cluster of
tests/infra/slurm_cluster.sh): the train job at its time limit, the capture service's job requeued, and a trainer
cancelled for good. Each side asks Slurm about the other where it falls silent: a job requeued or pending is waited
for, one that ended is not. The requeued runs' drafts equal an uninterrupted run's bit for bit (float32, HF's
capture, one CPU a job in both).

Skipped unless SLURM_CONF points at a running cluster (scripts/test.sh starts one)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.slurm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import copy_cache  # noqa: E402

from slurm.test_pipeline_slurm import (  # noqa: E402
    SLURM_FAST,
    cli,
    job_logs,
    run_jobs,
    sacct_states,
    started_until_checkpoint,
    wait_terminal,
)

# 20 epochs of the FAST split's 12 steps: a training that outlasts the signal of a one-minute limit, sent 25 s before
# it (at slurmctld's next periodic look at time limits, not on the second). 120 steps, a 28 s job here once the tests'
# targets were kept rather than built beside it, ended before the signal: no requeue was seen.
STEPS = 240
STREAM = [
    "+experiment=tiny_eagle3",
    *SLURM_FAST,
    "stages=[extract,train]",  # the extraction is in the outputs' cache: its job finds it there
    "train.states=stream",
    f"train.max_steps={STEPS}",
    "train.checkpoint_every=4",
    f"train.val_every={STEPS}",
    "train.log_every=20",
    "train.stream.buffer_bytes=300000",
    # the first epoch's states kept in the spool and replayed (the FAST split's is about 16 MB): the service captures
    # once, and the trainer, not the capture, sets the pace on CI's two busy cores
    "train.stream.replay_bytes=100000000",
    "train.stream.stall_timeout_s=5",  # a side silent this long is asked after through Slurm, not dropped
    "cluster.wait=true",
]


def _outputs(fast_cache, folder: Path) -> Path:
    """A fresh outputs folder with the FAST target and extraction cached: only the stream and the training run."""
    return copy_cache(fast_cache("extract"), folder)


def _draft(outputs: Path) -> dict:
    summary = json.loads(max(outputs.rglob("summary.json"), key=lambda p: p.stat().st_mtime).read_text())
    return load_file(str(Path(summary["stages"]["train"]["draft_dir"]) / "model.safetensors"))


def _attempts(job_id: str) -> list[str]:
    """Every attempt of a job as Slurm's accounting keeps them (sacct -D), oldest first."""
    out = subprocess.run(["sacct", "-n", "-X", "-D", "-P", "-o", "JobID,State", "-j", job_id], capture_output=True,
                         text=True).stdout  # fmt: skip
    return [line.split("|")[1].split()[0] for line in out.splitlines() if "|" in line]


def _logs(run_dir: Path, job_id: str) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted((run_dir / "jobs").glob(f"{job_id}_0_log.*")))


@pytest.fixture(scope="module")
def uninterrupted(fast_cache, tmp_path_factory) -> dict:
    """The streamed training as Slurm jobs with nothing in its way: the draft every requeued run must equal."""
    outputs = _outputs(fast_cache, tmp_path_factory.mktemp("uninterrupted") / "outputs")
    proc = cli(outputs, *STREAM, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return _draft(outputs)


def _assert_same_draft(outputs: Path, reference: dict) -> None:
    draft = _draft(outputs)
    assert sorted(draft) == sorted(reference)
    differ = [name for name in draft if not draft[name].equal(reference[name])]
    assert not differ, f"not bit for bit: {differ}"


def test_a_streamed_training_at_its_time_limit_is_requeued_resumes_and_trains_the_same_draft(
    fast_cache, tmp_path, uninterrupted
):
    """The train job's limit is one minute; Slurm signals it 25 s before (cluster.signal_delay_s), submitit's
    handler requeues it, and its consumer keeps its place with the capture service: the service, seeing the
    trainer silent, asks Slurm, finds its job pending or starting again, and waits (its log says so) instead of
    stopping. Each start resumes from the last checkpoint and declares its step; the service starts over there."""
    outputs = _outputs(fast_cache, tmp_path / "outputs")
    limited = ["train.resources.timeout_min=1", "train.collective_timeout_min=0.5", "cluster.signal_delay_s=25",
               "cluster.spare_requeues=12"]  # fmt: skip
    proc = cli(outputs, *STREAM, *limited, timeout=1200)
    (run_dir,) = (outputs / "runs").glob("*/*")
    jobs = run_jobs(run_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + job_logs(run_dir / "jobs", jobs["train"])
    wait_terminal([jobs["train"]], timeout=120)  # its result is read as the job exits: Slurm says so a moment later
    attempts = _attempts(jobs["train"])
    assert attempts[-1] == "COMPLETED" and len(attempts) >= 2, attempts  # requeued at least once, then done
    train_log = _logs(run_dir, jobs["train"])
    resumed = [int(s) for s in re.findall(rf"resumed from \S+ at step (\d+)/{STEPS}", train_log)]
    # each start resumed from the last checkpoint; one after the last (the signal while exporting) reads nothing
    assert any(0 < s < STEPS for s in resumed) and all(0 < s <= STEPS for s in resumed), train_log[-3000:]
    assert "timed-out" in train_log, train_log[-3000:]  # Slurm's own signal at the limit, not a pre-emption
    service_log = _logs(run_dir, jobs["stream"])
    assert re.search(rf"waiting for {run_dir.name} \(job {jobs['train']} (PENDING|REQUEUED|RUNNING)", service_log), (
        service_log[-3000:]
    )
    last = max(s for s in resumed if s < STEPS)
    assert f"declared steps [{last}, {STEPS}]: starting over" in service_log, service_log[-3000:]
    assert "dropped" not in service_log, service_log[-3000:]
    _assert_same_draft(outputs, uninterrupted)


def test_the_capture_service_requeued_mid_epoch_goes_on_where_its_trainer_is(fast_cache, tmp_path, uninterrupted):
    """`scontrol requeue` on the capture service's job mid-training (its node taken, as pre-emption does): the
    trainer, finding the service silent, asks Slurm, sees its job requeued and waits; the service starts again under
    the same job id, reads its consumer's floor, and captures from the step the trainer reads, skipping what it has
    read; the training finishes with the draft an uninterrupted run trains."""
    outputs = _outputs(fast_cache, tmp_path / "outputs")
    run, run_dir, jobs = started_until_checkpoint(outputs, STREAM, "the requeue")
    subprocess.run(["scontrol", "requeue", jobs["stream"]], check=True)
    out, _ = run.communicate(timeout=900)
    assert run.returncode == 0, out[-3000:] + job_logs(run_dir / "jobs", jobs["stream"])
    wait_terminal([jobs["stream"]], timeout=120)
    assert len(_attempts(jobs["stream"])) >= 2, _attempts(jobs["stream"])
    train_log = _logs(run_dir, jobs["train"])
    assert f"waiting for the capture service's job {jobs['stream']}" in train_log, train_log[-3000:]
    assert "resumed from" not in train_log, train_log[-3000:]  # the trainer itself was never stopped
    service_log = _logs(run_dir, jobs["stream"])
    floor = re.search(r"the consumers read from step (\d+) on", service_log)
    assert floor and 0 < int(floor.group(1)) < STEPS, service_log[-3000:]
    assert service_log.count("[stream] capturing") == 2, service_log[-3000:]  # once a start
    _assert_same_draft(outputs, uninterrupted)


def test_a_trainer_cancelled_for_good_stops_the_service_within_minutes_naming_it(fast_cache, tmp_path):
    """`scancel` on the train job: it never comes back. The service, finding its consumer silent, asks Slurm, finds
    the job CANCELLED, drops it naming the job and its state, and ends: its nodes are not held for
    train.stream.requeue_wait_min."""
    outputs = _outputs(fast_cache, tmp_path / "outputs")
    run, run_dir, jobs = started_until_checkpoint(outputs, STREAM, "the cancel")
    subprocess.run(["scancel", "--full", jobs["train"]], check=True)
    cancelled = time.monotonic()
    states = wait_terminal([jobs["stream"]], timeout=180)
    assert time.monotonic() - cancelled < 120, (states, sacct_states([jobs["stream"]]))
    run.communicate(timeout=120)
    service_log = _logs(run_dir, jobs["stream"])
    assert f"consumer {run_dir.name}: its job {jobs['train']} is CANCELLED: dropped" in service_log, service_log[-3000:]
    assert "every trainer has ended: stopping" in service_log, service_log[-3000:]
