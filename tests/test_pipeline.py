"""The local end-to-end pipeline on the tiny target: four stages as submitit jobs, one MLflow run."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient

from orchestrator.pipeline import make_plan, run_pipeline


def test_extract_then_reuse(tiny_config, tmp_path):
    cfg = tiny_config("stages=[extract]", "cluster=local")
    summary = run_pipeline(cfg, tmp_path / "first")
    extract = summary["stages"]["extract"]
    assert extract["tokens"] > 0 and extract["tokens_per_s"] > 0
    manifest = json.loads((Path(extract["output"]) / "manifest.json").read_text())
    assert manifest["aux_layers"] == [1, 4, 6]
    assert manifest["hf_capture_points"] == ["layers.1", "layers.4", "layers.6"]
    assert manifest["teacher"] == {"kind": "post_norm", "capture_point": "norm"}
    assert all(len(s["sha256"]) == 64 for s in manifest["splits"]["train"]["shards"])
    run = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.metrics["extract/tokens_per_s"] > 0 and run.data.metrics["extract/bytes_per_token"] > 0
    assert run.data.tags["aux_layers"] == "[1, 4, 6]"
    assert run.data.params["aux_layers"] == "[1, 4, 6]"

    again = make_plan(cfg, tmp_path / "second")
    assert again.stages[0]["cached"], "a second run reuses the shards"
    summary2 = run_pipeline(cfg, tmp_path / "second")
    assert summary2["stages"]["extract"]["cached"] is True


def test_full_pipeline(tiny_config, tmp_path):
    cfg = tiny_config("cluster=local")
    summary = run_pipeline(cfg, tmp_path / "run")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mlflow_run_id"] == summary["mlflow_run_id"]
    train, ev, serve = (summary["stages"][s] for s in ("train", "eval", "serve"))
    assert 0.0 <= train["val_acc_0"] <= 1.0
    assert abs(ev["acc_0"] - train["val_acc_0"]) <= 0.03, (ev["acc_0"], train["val_acc_0"])
    assert serve["greedy_outputs_identical"] is True
    assert serve["accept_length"] >= 1.0
    assert abs(serve["accept_length"] - ev["expected_accept_length"]) / ev["expected_accept_length"] <= 0.10
    assert summary["mismatch_flags"] == []
    metrics = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.metrics
    for key in ("train/val_acc_0", "eval/acc_0", "eval/expected_accept_length", "serve/baseline_tok_s", "serve/spec_tok_s", "serve/speedup", "serve/accept_length"):
        assert key in metrics, key
