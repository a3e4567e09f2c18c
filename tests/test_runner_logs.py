"""While a run waits on a local job, the job's log streams to the console, and a stage job outlives a late
pre-emption signal (orchestrator/runner.py): real submitit jobs in a temporary folder, each a few lines, a progress
bar and short sleeps."""

from __future__ import annotations

import atexit
import io
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import submitit

from orchestrator import runner

LINES = [f"step {i} of 3" for i in range(1, 4)]
PROGRESS = ["\rtrain:  33%|###       | 1/3", "\rtrain:  67%|######    | 2/3", "\rtrain: 100%|##########| 3/3\n"]


def chatty_stage() -> str:
    for line, progress in zip(LINES, PROGRESS):
        print(line, flush=True)
        print(progress, end="", file=sys.stderr, flush=True)  # tqdm writes to stderr, redrawing with \r
        time.sleep(0.3)
    return "done"


def failing_stage() -> None:
    print("loading shard 7", file=sys.stderr, flush=True)
    raise ValueError("shard 7 is truncated")


def stage_preempted_as_it_exits(stage, cfg, plan, run_id, finalize) -> str:
    """A stage (as `runner.StageJob` calls one) whose work is done when the pre-emption signal arrives: its process
    is exiting, submitit has written the result, and an exit hook sends the signal to the process itself."""

    def late_signal():
        print(f"at exit: {signal.getsignal(signal.SIGUSR2)!r}", flush=True)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.5)
        print("alive after the signal", flush=True)

    atexit.register(late_signal)
    return "done"


def stage_with_garbage_at_exit(stage, cfg, plan, run_id, finalize) -> str:
    """A stage that leaves objects behind, and an exit hook that says how many the collector still walks."""
    import gc

    kept = [{"i": i} for i in range(10_000)]  # noqa: F841 (the stage's objects, alive until the process exits)
    atexit.register(lambda: print(f"at exit: {gc.get_freeze_count()} frozen, {len(gc.get_objects())} tracked",
                                  flush=True))  # fmt: skip
    return "done"


@pytest.fixture
def local_executor(tmp_path, monkeypatch):
    # The job's own python unpickles the stage function by name: it imports this module from tests/.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    executor = submitit.LocalExecutor(folder=tmp_path / "jobs")
    executor.update_parameters(timeout_min=2)
    return executor


class WhileRunning(io.StringIO):
    """A stream that notes whether anything was written to it while the job was still running."""

    def __init__(self, job):
        super().__init__()
        self.job = job
        self.written_while_running = False

    def write(self, text: str) -> int:
        self.written_while_running |= bool(text) and not self.job.done()
        return super().write(text)


def assert_in_order(text: str, parts: list[str]) -> None:
    position = 0
    for part in parts:
        found = text.find(part, position)
        assert found >= 0, f"{part!r} missing after position {position} of:\n{text!r}"
        position = found + len(part)


def test_wait_prints_the_log_path_and_streams_the_log(local_executor, capsys):
    job = local_executor.submit(chatty_stage)

    assert runner.wait(job, "train") == "done"

    captured = capsys.readouterr()
    assert f"[train] job {job.job_id} log: {job.paths.stdout} (stderr: {job.paths.stderr})" in captured.out
    assert Path(job.paths.stdout).is_file()
    assert_in_order(captured.out, LINES)
    assert_in_order(captured.err, PROGRESS)


def test_follow_logs_copies_each_file_to_its_stream_while_the_job_runs(local_executor):
    job = local_executor.submit(chatty_stage)
    out, err = WhileRunning(job), io.StringIO()

    runner.follow_logs(job, out, err, poll_s=0.05)

    assert job.done()
    assert out.getvalue() == Path(job.paths.stdout).read_bytes().decode()  # all of it, \r kept
    assert err.getvalue() == Path(job.paths.stderr).read_bytes().decode()
    assert_in_order(out.getvalue(), LINES)
    assert "".join(PROGRESS) in err.getvalue()
    assert out.written_while_running, "the log arrived only after the job ended, not as it was written"


def test_a_failing_job_raises_stage_failed_with_the_log_tail(local_executor, capsys):
    job = local_executor.submit(failing_stage)

    with pytest.raises(runner.StageFailed) as failure:
        runner.wait(job, "extract")

    message = str(failure.value)
    assert f"stage extract (job {job.job_id}) failed" in message
    assert_in_order(message, ["--- job log tail ---", "loading shard 7", "ValueError: shard 7 is truncated"])
    assert "shard 7 is truncated" in capsys.readouterr().err  # streamed as it happened, too


def test_a_preemption_signal_after_the_stage_is_done_is_ignored(local_executor):
    """Slurm's pre-emption signal (SIGUSR2) to a stage job whose work is done: ignored, so the job ends as it
    would have. Seen on the Slurm cluster before the fix: a 2-task training job signalled as it exited was killed
    by the signal (Python restores its default action when the interpreter exits) and recorded FAILED, its work
    complete, which cancels the jobs queued after it."""
    job = local_executor.submit(runner.StageJob(), stage_preempted_as_it_exits, "train", None, None, "run", False)

    assert runner.wait(job, "train", follow_log=False) == "done"

    out = Path(job.paths.stdout).read_text()
    assert "at exit: <Handlers.SIG_IGN: 1>" in out, out
    assert "alive after the signal" in out, out
    assert job.state == "FINISHED", job.state


def test_a_finished_stage_job_exits_without_collecting_its_objects(local_executor):
    """Once the stage returned, its job's objects are frozen out of the collector (runner.exiting): at exit the
    collector walks none of them (a job that imported torch and MLflow spent about a second there). Seen failing
    with the call taken out: every object still tracked, none frozen."""
    job = local_executor.submit(runner.StageJob(), stage_with_garbage_at_exit, "train", None, None, "run", False)

    assert runner.wait(job, "train", follow_log=False) == "done"

    out = Path(job.paths.stdout).read_text()
    frozen, tracked = map(int, re.search(r"at exit: (\d+) frozen, (\d+) tracked", out).groups())
    assert frozen >= 10_000 and tracked < 1_000, out
