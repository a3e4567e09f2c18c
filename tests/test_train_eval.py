"""Training resumes after a kill to the same weights; stages refuse upstream artifacts that disagree; the
standalone eval flags a draft whose config ids capture other layers than it was trained on."""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from orchestrator import tracking
from orchestrator.artifacts import ArtifactError
from orchestrator.pipeline import make_plan, run_pipeline, run_stage


@pytest.fixture(scope="module")
def trained(tiny_config, tmp_path_factory):
    """A tiny config whose extract and train stages have run (cached in the session's outputs folder)."""
    cfg = tiny_config("stages=[extract,train]", "cluster=debug")
    run_dir = tmp_path_factory.mktemp("trained")
    run_pipeline(cfg, run_dir)
    return cfg, make_plan(cfg, run_dir)


def _tracker(plan, name):
    return tracking.start_pipeline_run(plan.tracking_uri, "tests", name, {}, [], Path(plan.run_dir))


def _with_train_dir(plan, folder: Path):
    return dataclasses.replace(plan, stage_dirs={**plan.stage_dirs, "train": str(folder)})


def test_killed_training_resumes_to_the_uninterrupted_weights(trained, tmp_path):
    cfg, plan = trained
    reference = plan.dir("train") / "draft" / "model.safetensors"

    interrupted = _with_train_dir(plan, tmp_path / "train")
    tracker = _tracker(plan, "resume-test")
    args = tmp_path / "args.pkl"
    args.write_bytes(pickle.dumps(("train", cfg, interrupted, tracker.run_id)))
    script = "import pickle, sys; from orchestrator.pipeline import run_stage; run_stage(*pickle.load(open(sys.argv[1], 'rb')))"
    proc = subprocess.Popen([sys.executable, "-c", script, str(args)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    checkpoint = tmp_path / "train" / "checkpoints" / "latest.pt"
    deadline = time.monotonic() + 300
    while not checkpoint.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert checkpoint.exists(), "no checkpoint was written"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = torch.load(checkpoint, weights_only=False)["step"]
    assert 0 < killed_at < cfg.train.max_steps, "the kill must land mid-run"
    assert not (tmp_path / "train" / "draft").exists()

    result = run_stage("train", cfg, interrupted, tracker.run_id)
    resumed = load_file(result["draft_dir"] + "/model.safetensors")
    uninterrupted = load_file(str(reference))
    assert resumed.keys() == uninterrupted.keys()
    for name in resumed:
        torch.testing.assert_close(resumed[name], uninterrupted[name], rtol=1e-3, atol=1e-3, msg=name)


def test_train_refuses_extraction_with_other_layers(trained, tiny_config, tmp_path):
    cfg, plan = trained
    other = tiny_config("aux_layers=[0,3,6]", "cluster=debug")
    mixed = dataclasses.replace(make_plan(other, tmp_path / "run"), stage_dirs={**plan.stage_dirs, "train": str(tmp_path / "t")})
    with pytest.raises(ArtifactError, match=r"aux_layers is \[1, 4, 6\] but this run's config says \[0, 3, 6\]"):
        run_stage("train", other, mixed, _tracker(plan, "refuse").run_id)


def test_eval_flags_draft_ids_changed_to_other_layers(trained, tmp_path):
    cfg, plan = trained
    altered = tmp_path / "train"
    shutil.copytree(plan.dir("train"), altered)
    conf_path = altered / "draft" / "config.json"
    conf = json.loads(conf_path.read_text())
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]
    conf_path.write_text(json.dumps(conf))
    eval_plan = dataclasses.replace(_with_train_dir(plan, altered), stage_dirs={**_with_train_dir(plan, altered).stage_dirs, "eval": str(tmp_path / "eval")})
    tracker = _tracker(plan, "eval-mismatch")
    result = run_stage("eval", cfg, eval_plan, tracker.run_id)
    assert result["mismatch"] is True
    assert result["served_layers"] == [0, 2, 5] and result["trained_layers"] == [1, 4, 6]
    assert any("trained on aux_layers=[1, 4, 6]" in f for f in result["mismatch_flags"]), result["mismatch_flags"]
    run = tracker.client.get_run(tracker.run_id)
    assert run.data.tags["eval.mismatch"] == "true" and run.data.metrics["eval/mismatch"] == 1.0


def test_accuracy_gap_must_exceed_tolerance_and_sampling_noise():
    from orchestrator.stages.eval import significant_gaps

    few = {"acc_0": 0.5, "positions_0": 16, "acc_1": 0.5, "positions_1": 16}
    gaps, noise = significant_gaps({0: 0.125, 1: 0.4}, few, 0.03)
    assert noise[0] == pytest.approx(0.25)  # 2 * sqrt(0.25 / 16)
    assert gaps == {1: 0.4}, "a 0.125 gap over 16 positions is noise; 0.4 is not"
    many = {"acc_0": 0.5, "positions_0": 40000}
    assert significant_gaps({0: 0.02}, many, 0.03)[0] == {}, "below the tolerance"
    assert significant_gaps({0: 0.05}, many, 0.03)[0] == {0: 0.05}
