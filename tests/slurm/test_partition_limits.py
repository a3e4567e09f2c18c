"""The partition's longest job as the Slurm cluster says it (`sinfo`), where cluster.max_time_min is not set: the
test cluster (tests/infra/slurm_cluster.sh) has `debug` (the default, MaxTime=INFINITE) and `short` (MaxTime=60)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from orchestrator.pipeline import run_pipeline
from orchestrator.preflight import PreflightError, partition_max_time, time_limit_findings

pytestmark = pytest.mark.slurm

if not os.environ.get("SLURM_CONF") or shutil.which("sinfo") is None:
    pytest.skip("no Slurm cluster (start one with tests/infra/slurm_cluster.sh start)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def test_the_dry_run_reads_the_partitions_limit_from_sinfo_splits_a_training_and_refuses_a_longer_eval(
    tiny_config, tmp_path
):
    """On `short` (MaxTime=60, read from sinfo), a 120-minute training is planned as 2 allocations of 60 minutes,
    each requeued at its limit; a 120-minute eval, which starts over when requeued, is refused before any job."""
    assert partition_max_time("short") == (60, "sinfo's MaxTime of partition short")
    assert partition_max_time(None) == (None, "sinfo's MaxTime of partition debug")  # the default: no limit
    assert partition_max_time("no-such-partition") is None
    source = "sinfo's MaxTime of partition short; cluster.max_time_min sets it"
    cfg = tiny_config("cluster=slurm", "cluster.partition=short", "train.resources.timeout_min=120")
    (train,) = [f for f in time_limit_findings(cfg) if f.message.startswith("train")]
    assert train.ok and f"train asks 120 min; the partition allows 60 ({source}): 2 allocations of 60 min" in (
        train.message
    )
    cfg = tiny_config("cluster=slurm", "cluster.partition=short", "eval.resources.timeout_min=120", "dry_run=true")
    with pytest.raises(PreflightError) as refused:
        run_pipeline(cfg, tmp_path / "run")
    assert not (tmp_path / "run" / "jobs").exists()
    assert f"[time limits] eval asks 120 min; the partition allows 60 ({source})" in str(refused.value)
    # the same job on the default partition, and the key set by hand, which wins over sinfo
    assert all(f.ok for f in time_limit_findings(tiny_config("cluster=slurm", "eval.resources.timeout_min=120")))
    mine = tiny_config("cluster=slurm", "cluster.partition=short", "cluster.max_time_min=240",
                       "eval.resources.timeout_min=120")  # fmt: skip
    assert all(f.ok and "allocations" not in f.message for f in time_limit_findings(mine))
