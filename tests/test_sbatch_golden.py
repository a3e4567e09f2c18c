"""Golden sbatch files for the Kimi experiment's four stages: resources, dependencies, setup lines.

`EAGLE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch_golden.py` rewrites them; review the diff
before committing."""

from __future__ import annotations

from pathlib import Path

import pytest
from golden import assert_matches_golden

from orchestrator.config import tasks_per_node
from orchestrator.runner import render_sbatch

STAGES = ("extract", "train", "eval", "serve")


@pytest.mark.parametrize("index, stage", list(enumerate(STAGES)))
def test_kimi_sbatch(tiny_config, index, stage):
    cfg = tiny_config("cluster=example_site", experiment="kimi_eagle3", fast=False)
    dependency = [str(1000 + index)] if index else None  # job id of the previous stage
    text = render_sbatch(
        cfg.cluster,
        Path("/shared/runs/kimi_eagle3/jobs"),
        f"kimi_eagle3-{stage}",
        getattr(cfg, stage).resources,
        tasks_per_node(cfg, stage),
        dependency,
    )
    assert_matches_golden(f"sbatch_kimi_{stage}.sh", text)
    assert f"--job-name=kimi_eagle3-{stage}" in text and "--gpus-per-node=8" in text
    assert ("--dependency=afterok:" in text) == (index > 0)
    assert "source /shared/envs/eagle-orchestrator/bin/activate" in text
    # training runs a rank per GPU; the 1T-parameter target is spread over a node's GPUs by one process
    assert f"--ntasks-per-node={8 if stage == 'train' else 1}" in text


def test_a_missing_golden_file_fails_and_is_not_created(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE_UPDATE_GOLDEN", raising=False)
    with pytest.raises(
        pytest.fail.Exception, match="EAGLE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/test_sbatch_golden.py"
    ):
        assert_matches_golden("sbatch_new_stage.sh", "#!/bin/bash\n", golden_dir=tmp_path)
    assert not (tmp_path / "sbatch_new_stage.sh").exists()


def test_a_changed_output_fails_with_a_diff_and_only_the_flag_rewrites_it(tmp_path, monkeypatch):
    golden = tmp_path / "sbatch_train.sh"
    golden.write_text("#SBATCH --nodes=1\n#SBATCH --time=60\n")
    monkeypatch.delenv("EAGLE_UPDATE_GOLDEN", raising=False)
    with pytest.raises(pytest.fail.Exception) as failure:
        assert_matches_golden(golden.name, "#SBATCH --nodes=2\n#SBATCH --time=60\n", golden_dir=tmp_path)
    assert "\n-#SBATCH --nodes=1\n+#SBATCH --nodes=2\n" in str(failure.value)

    monkeypatch.setenv("EAGLE_UPDATE_GOLDEN", "1")
    assert_matches_golden(golden.name, "#SBATCH --nodes=2\n#SBATCH --time=60\n", golden_dir=tmp_path)
    assert golden.read_text() == "#SBATCH --nodes=2\n#SBATCH --time=60\n"
