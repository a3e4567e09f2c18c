"""Smoke test against a real (single-node) Slurm cluster.

Start one with::

    bash tests/infra/slurm_cluster.sh install
    eval "$(bash tests/infra/slurm_cluster.sh start)"   # exports SLURM_CONF
    .venv/bin/python -m pytest -m slurm tests/slurm

Skipped unless ``SLURM_CONF`` is set and ``sinfo`` answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

submitit = pytest.importorskip("submitit")
cloudpickle = pytest.importorskip("cloudpickle")


def _slurm_available() -> tuple[bool, str]:
    if not os.environ.get("SLURM_CONF"):
        return False, "SLURM_CONF is not set (start a cluster with tests/infra/slurm_cluster.sh start)"
    if shutil.which("sinfo") is None:
        return False, "sinfo is not on PATH"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%P %a"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"sinfo failed: {exc}"
    if proc.returncode != 0 or not proc.stdout.strip():
        return False, f"sinfo failed (rc={proc.returncode}): {proc.stderr.strip()}"
    return True, ""


_AVAILABLE, _REASON = _slurm_available()

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not _AVAILABLE, reason=_REASON),
]

# Generous bound so a broken cluster fails the test instead of hanging CI
# (submitit's result() polls sacct forever for a job that never starts).
_JOB_TIMEOUT_S = 120


def _report_gpus() -> dict:
    """Runs on the Slurm node."""
    import os as _os
    import time as _time

    _time.sleep(1.0)  # make the ordering check with the dependent job meaningful
    return {
        "cuda_visible_devices": _os.environ.get("CUDA_VISIBLE_DEVICES"),
        "slurm_job_id": _os.environ.get("SLURM_JOB_ID"),
        "end": _time.time(),
    }


def _report_start() -> dict:
    """Runs on the Slurm node after the first job (afterok dependency)."""
    import os as _os
    import time as _time

    return {"slurm_job_id": _os.environ.get("SLURM_JOB_ID"), "start": _time.time()}


@pytest.fixture
def pickle_this_module_by_value():
    # The worker imports nothing from the tests tree: whether this module is
    # importable as `tests.slurm...` or `slurm...` depends on pytest's rootdir
    # and import mode, so ship the job functions' code inside the pickle.
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)
    try:
        yield
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def _wait(job, timeout_s: float = _JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while not job.done():
        if time.monotonic() > deadline:
            job.cancel(check=False)
            pytest.fail(f"Slurm job {job.job_id} not done after {timeout_s}s (state {job.state})")
        time.sleep(0.5)
    return job.result()


def _final_state(job, timeout_s: float = 30) -> str:
    # The result pickle appears before the job ends in Slurm (srun and the batch
    # step still have to exit, then slurmctld reports to slurmdbd), so poll sacct.
    deadline = time.monotonic() + timeout_s
    while True:
        state = job.get_info(mode="force").get("State", "UNKNOWN")
        if state not in {"PENDING", "RUNNING", "COMPLETING", "REQUEUED", "UNKNOWN"}:
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(0.5)


def test_gpu_job_and_dependency(tmp_path, pickle_this_module_by_value):
    # A fresh folder per run: job ids restart at 1 on a fresh cluster state dir,
    # and a reused submitit folder would return stale results.
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(
        timeout_min=5,
        gpus_per_node=1,
        cpus_per_task=1,
        mem_gb=1,
        slurm_partition="debug",
        name="smoke-gpu",
    )
    first = executor.submit(_report_gpus)

    executor.update_parameters(
        name="smoke-after",
        slurm_additional_parameters={"dependency": f"afterok:{first.job_id}"},
    )
    second = executor.submit(_report_start)
    assert second.job_id != first.job_id

    out1 = _wait(first)
    out2 = _wait(second)

    cvd = out1["cuda_visible_devices"]
    assert cvd, f"CUDA_VISIBLE_DEVICES not set in the job (got {cvd!r})"
    assert cvd in {"0", "1"}, f"expected one fake GPU index, got {cvd!r}"
    assert out1["slurm_job_id"] == str(first.job_id)
    assert out2["slurm_job_id"] == str(second.job_id)

    assert _final_state(first) == "COMPLETED"
    assert _final_state(second) == "COMPLETED"
    # afterok: the second job starts only after the first one finished
    assert out2["start"] >= out1["end"] - 0.5, (out1, out2)
