"""Golden sbatch files for the Kimi experiment's four stages: resources, dependencies, setup lines.

UPDATE_GOLDEN=1 rewrites them; review the diff before committing."""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from orchestrator.runner import render_sbatch

GOLDEN = Path(__file__).parent / "golden"
STAGES = ("extract", "train", "eval", "serve")


@pytest.mark.parametrize("index, stage", list(enumerate(STAGES)))
def test_kimi_sbatch(tiny_config, index, stage):
    cfg = tiny_config("cluster=example_site", experiment="kimi_eagle3", fast=False)
    dependency = [str(1000 + index)] if index else None  # job id of the previous stage
    text = render_sbatch(cfg.cluster, Path("/shared/runs/kimi_eagle3/jobs"), f"kimi_eagle3-{stage}", getattr(cfg, stage).resources, dependency)
    path = GOLDEN / f"sbatch_kimi_{stage}.sh"
    if os.environ.get("UPDATE_GOLDEN") == "1" or not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    expected = path.read_text()
    diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True), str(path), "rendered"))
    assert text == expected, f"sbatch for {stage} changed (UPDATE_GOLDEN=1 to accept):\n{diff}"
    assert f"--job-name=kimi_eagle3-{stage}" in text and "--gpus-per-node=8" in text
    assert ("--dependency=afterok:" in text) == (index > 0)
    assert "source /shared/envs/eagle-orchestrator/bin/activate" in text
