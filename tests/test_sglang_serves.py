"""serve=sglang on this CPU: SGLang 0.5.23 itself (scripts/make_sglang_env.sh; scripts/test.sh builds it), started
through orchestrator/engines/sglang/cpu_kernels/launch.py with the project's PyTorch stand-in for sgl_kernel, serves
the FAST draft, captures the target's states, and counts the seed's collapse in its own counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import copy_cache
from transformers import AutoModelForCausalLM

from orchestrator import engines
from orchestrator.engines import client
from orchestrator.engines.sglang import cli as sglang
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.preflight import PreflightError

pytestmark = pytest.mark.sglang


def _fast_outputs(fast_cache, tmp_path: Path) -> Path:
    return copy_cache(
        fast_cache("extract", "train", "eval"), tmp_path / "outputs", ("targets", "extract", "train", "eval")
    )


@pytest.fixture(scope="module")
def served_outputs(fast_cache, tmp_path_factory) -> Path:
    """One outputs folder for the two serving tests: the second finds the baseline server's measurement the first
    made (the serve stage caches it by what decides it), so SGLang starts three times, not four (40-55 s each here)."""
    return _fast_outputs(fast_cache, tmp_path_factory.mktemp("sglang_served"))


def test_sglang_serves_the_draft_on_this_cpu_and_its_counts_agree_with_eval(sglang_python, served_outputs, tiny_config,
                                                                           tmp_path, monkeypatch):  # fmt: skip
    """The FAST draft served by SGLang (baseline and EAGLE-3 servers, its /generate API) on the CPU: the accept length
    SGLang counts (`spec_verify_ct` per response) within 10% of eval's expectation on the same prompts, greedy
    outputs identical token for token in float32, the installed version read and recorded, the draft's ids
    SGLang's."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("SGLANG_PYTHON", sglang_python)
    outputs = served_outputs
    cfg = tiny_config(
        "cluster=debug", "serve=sglang", "serve.fallback=null", f"outputs_dir={outputs}", "serve.repeats=1"
    )
    summary = run_pipeline(cfg, tmp_path / "run")
    serve = summary["stages"]["serve"]
    assert serve["engine"] == "sglang" and serve["engine_version"] == "0.5.23" and "engine_fallback" not in serve
    assert serve["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]  # SGLang's Llama ids are the canonical ones
    expected = summary["stages"]["eval"]["expected_accept_length"]
    assert serve["accept_length"] > 1.0 and abs(serve["accept_length"] - expected) / expected <= 0.10, (
        serve["accept_length"],
        expected,
    )
    assert serve["greedy_outputs_identical"] is True and serve["greedy_differing_token_rate"] == 0.0
    assert serve["mismatch_flags"] == []
    # the same prompts one at a time: SGLang's per-request counts add up to the pass's
    assert serve["accept_length_requests"] >= 1
    low, high = serve["accept_length_ci95"]
    assert low <= serve["accept_length_counted"] <= high
    servers = json.loads((Path(summary["run_dir"]) / "serve" / "serve.json").read_text())["servers"]
    for name in ("baseline", "speculative"):
        command = servers[name]["command"]
        assert command[1] == str(sglang.CPU_LAUNCHER) and "--device" in command, command
    assert "--speculative-draft-model-path" in servers["speculative"]["command"]
    metrics = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.metrics
    assert metrics["serve/accept_length"] == pytest.approx(serve["accept_length"])
    # the server ran SGLang's CPU engine on the project's sgl_kernel, not another backend
    log = (Path(summary["run_dir"]) / "serve" / "speculative_server.log").read_text(errors="replace")
    assert "fallback to torch_native" not in log


def test_sglangs_captured_states_equal_hfs(sglang_python, fast_cache, tiny_config, tmp_path):
    """SGLang's capture mode (no draft, `--return-aux-hidden-state-layer-ids 1 4 6`) on the tiny Llama: the states it
    returns for a prompt and its greedy answer are HF's `output_hidden_states` at the canonical layers the project's
    SGLang rule names, within float32 rounding."""
    outputs = _fast_outputs(fast_cache, tmp_path)
    cfg = tiny_config("cluster=local", "serve=sglang", f"serve.python={sglang_python}", f"outputs_dir={outputs}")
    target = Path(make_plan(cfg, tmp_path / "run").target_dir)
    ids, port = [1, 4, 6], client.free_port()
    command = sglang.capture_command(cfg, str(target), ids, port)
    prompt = [1, 20, 30, 40, 50, 60, 70]
    with client.ServerProcess(command, port, tmp_path / "capture.log", 600, sglang.server_env(cfg)) as server:
        payload = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "return_hidden_states": True,
        }
        answer = client.post_json(server, "/generate", payload, 300)
    states = answer["meta_info"]["hidden_states"]
    captured = torch.cat([torch.tensor(states[0])] + [torch.tensor(s)[None] for s in states[1:]])
    layers = engines.from_engine_ids("sglang", ids, cfg.target.num_hidden_layers, "llama", cfg.serve.sglang_version)
    assert layers == [1, 4, 6]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    sequence = prompt + answer["output_ids"]
    with torch.no_grad():
        out = model(torch.tensor([sequence]), output_hidden_states=True)
    # canonical i is the output of decoder layer i: HF's hidden_states[i + 1]
    expected = torch.cat([out.hidden_states[i + 1][0] for i in layers], dim=-1)[: captured.shape[0]]
    assert captured.shape == (len(prompt) + len(answer["output_ids"]) - 1, len(ids) * cfg.target.hidden_size)
    assert answer["output_ids"] == out.logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    torch.testing.assert_close(captured, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    # and another layer's states are not within that rounding: the comparison can tell layers apart
    other = torch.cat([out.hidden_states[i + 2][0] for i in layers], dim=-1)[: captured.shape[0]]
    assert not torch.allclose(captured, other, rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_the_seeds_mismatch_collapses_in_sglangs_own_counts_and_the_guard_refuses_it(
    sglang_python, served_outputs, tiny_config, tmp_path, monkeypatch
):
    """The FAST draft (trained on [1, 4, 6]) handed to SGLang with a config naming [-1, 1, 4] (every slot another
    layer's state, the seed's shift run backwards; SGLang's id -1 is the embedding): with the guard off SGLang serves
    it and its own counters show the accept length collapse against the draft's on the states it was trained on;
    with the guard on the run is refused before any job."""
    monkeypatch.setenv("SGLANG_PYTHON", sglang_python)
    outputs = served_outputs
    common = ("cluster=debug", "serve=sglang", "serve.fallback=null", f"outputs_dir={outputs}", "serve.repeats=1")
    with pytest.raises(PreflightError, match=r"aux_layers|serve\.layers"):
        run_pipeline(tiny_config(*common, "serve.layers=[-1,1,4]"), tmp_path / "guarded")
    assert not (tmp_path / "guarded" / "serve").exists()
    summary = run_pipeline(tiny_config(*common, "serve.layers=[-1,1,4]", "serve.guard=false"), tmp_path / "off")
    serve = summary["stages"]["serve"]
    assert serve["engine"] == "sglang" and serve["eagle_aux_hidden_state_layer_ids"] == [-1, 1, 4]
    # SGLang's own count collapses against what the draft does on the states it was trained on (train's figure on
    # the validation set), and agrees with eval's prediction for the states SGLang feeds it
    # eval saw it first: the states SGLang feeds are far from the trained ones (float32 rounding is below 0.02)
    assert summary["stages"]["eval"]["served_states_rel_diff"] > 0.05
    trained = summary["stages"]["train"]["val_expected_accept_length"]
    predicted = summary["stages"]["eval"]["expected_accept_length"]
    assert serve["accept_length"] < 0.8 * trained, (serve["accept_length"], trained)
    assert abs(serve["accept_length"] - predicted) / predicted <= 0.10, (serve["accept_length"], predicted)
    assert serve["greedy_outputs_identical"] is True  # speculation never changes greedy output, only its speed
    assert summary["mismatch_flags"], "the run with the guard off says what it served"
