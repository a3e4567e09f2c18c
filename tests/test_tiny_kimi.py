"""The tiny Kimi-K2.5-shaped target: saved as the real wrapper checkpoint is, loaded through the code path the
real one takes, and the whole pipeline (`+experiment=tiny_kimi_eagle3`) on it. (vLLM loads the same checkpoint and
captures its states in test_vllm.py.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers.core_model_loading import revert_weight_conversion

from orchestrator import engines, wrappers
from orchestrator import layers as layer_contract
from orchestrator.artifacts import ArtifactError
from orchestrator.capture import HiddenStateCapture, base_model, teacher_logits
from orchestrator.draft import rope as draft_rope
from orchestrator.draft.export import validate_draft_dir
from orchestrator.pipeline import run_pipeline
from orchestrator.targets import (
    identity,
    load_head_tensors,
    load_target,
    load_tokenizer,
    target_config_json,
    target_dir,
)

EXPERIMENT = "tiny_kimi_eagle3"
# The pipeline's tiny Kimi: a MoE step is slow on a CPU, so fewer, shorter steps than FAST's; at a gentler lr
# than the full build's, so that 40 steps already answer with text rather than <|end|> (what serving measures).
PIPELINE = [
    "target.tiny.train.steps=40",
    "target.tiny.train.seq_len=128",
    "target.tiny.train.batch_size=4",
    "target.tiny.train.lr=3e-3",
    "target.tiny.train.warmup_steps=10",
]
# Kimi-K2.5's YaRN, as its checkpoint's config.json gives it (tests/data/targets), less its original context (the
# tiny one's is 32 positions)
KIMI_YARN = {
    k: v
    for k, v in json.loads(
        (Path(__file__).parent / "data" / "targets" / "moonshotai__Kimi-K2.5" / "config.json").read_text()
    )["text_config"]["rope_parameters"].items()
    if k not in ("rope_theta", "rope_type", "type", "original_max_position_embeddings")
}
# Kimi-K2.5's text_config router keys (docs/kimi_k25.md#the-tiny-target).
KIMI_ROUTER = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.827,
               "norm_topk_prob": True, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0}  # fmt: skip
# Every kind of tensor Kimi-K2.5's checkpoint holds, indices written N (docs/kimi_k25.md#the-tiny-target names the
# sources). The published checkpoint stores the routed experts INT4 (`...experts.N.gate_proj.weight_packed`,
# `weight_scale`, `weight_shape`); the tiny one stores them as the unquantised checkpoints do, `.weight`.
KIMI_K25_TENSORS = {
    "language_model.model.embed_tokens.weight",
    "language_model.model.norm.weight",
    "language_model.lm_head.weight",
    *(f"language_model.model.layers.N.{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")),
    *(f"language_model.model.layers.N.self_attn.{name}.weight"
      for name in ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj",
                   "o_proj")),
    *(f"language_model.model.layers.N.mlp.{proj}.weight" for proj in ("gate_proj", "up_proj", "down_proj")),
    "language_model.model.layers.N.mlp.gate.weight",
    "language_model.model.layers.N.mlp.gate.e_score_correction_bias",
    *(f"language_model.model.layers.N.mlp.{experts}.{proj}.weight"
      for experts in ("shared_experts", "experts.N") for proj in ("gate_proj", "up_proj", "down_proj")),
    *(f"vision_tower.patch_embed.{name}" for name in ("proj.weight", "proj.bias", "pos_emb.weight")),
    *(f"vision_tower.encoder.blocks.N.{module}.{p}"
      for module in ("norm0", "norm1", "wqkv", "wo", "mlp.fc0", "mlp.fc1") for p in ("weight", "bias")),
    *(f"{module}.{p}" for module in ("vision_tower.encoder.final_layernorm", "mm_projector.pre_norm",
                                     "mm_projector.proj.0", "mm_projector.proj.2") for p in ("weight", "bias")),
}  # fmt: skip


def test_saved_as_the_kimi_wrapper_checkpoint(tiny_kimi_dir):
    """The layout of Kimi-K2.5's checkpoint, which vLLM's loader takes: every kind of tensor it holds and no other
    (one tensor per routed expert, not transformers' fused ones), Kimi's MLA latent shapes, its router keys and a
    learned-looking router bias, and what the wrapper holds beside the text model (vision tower, projector, media
    tokens, image processor settings)."""
    from orchestrator.tiny import kimi_k25

    conf = json.loads((tiny_kimi_dir / "config.json").read_text())
    assert conf["architectures"] == ["KimiK25ForConditionalGeneration"] and conf["model_type"] == "kimi_k25"
    text = conf["text_config"]
    assert text["model_type"] == "deepseek_v3" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert text["num_hidden_layers"] == 6 and text["first_k_dense_replace"] == 1 and text["n_routed_experts"] == 4
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"]) == (512, 64), "Kimi's MLA latent (vLLM's CPU MLA: 576)"
    assert {k: text[k] for k in KIMI_ROUTER} == KIMI_ROUTER
    assert wrappers.wrapper_of(conf) is wrappers.KIMI_K25
    with safe_open(str(tiny_kimi_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        kv_a = f.get_slice("language_model.model.layers.1.self_attn.kv_a_proj_with_mqa.weight").get_shape()
        kv_b = f.get_slice("language_model.model.layers.1.self_attn.kv_b_proj.weight").get_shape()
        bias = f.get_tensor("language_model.model.layers.1.mlp.gate.e_score_correction_bias")
    assert {re.sub(r"\.(layers|experts|blocks)\.\d+\.", r".\1.N.", n) for n in names} == KIMI_K25_TENSORS
    assert {n for n in names if ".experts." in n and ".layers.1." in n} == {
        f"language_model.model.layers.1.mlp.experts.{e}.{proj}.weight"
        for e in range(4) for proj in ("gate_proj", "up_proj", "down_proj")
    }  # fmt: skip
    assert not any(".layers.0.mlp.experts." in n or ".layers.0.mlp.gate." in n for n in names), "layer 0 is dense"
    assert (kv_a, kv_b) == ([512 + 64, 64], [4 * (32 + 32), 512]), (kv_a, kv_b)
    assert bias.dtype == torch.float32 and bias.abs().min() > 0, bias
    # beside the text model: the media tokens, the image token in config.json, the image processor's settings
    tok = load_tokenizer(tiny_kimi_dir)
    for token in kimi_k25.MEDIA_TOKENS:
        assert len(tok(token, add_special_tokens=False)["input_ids"]) == 1, token
    assert conf["image_token_id"] == tok.convert_tokens_to_ids("<|media_pad|>")
    assert conf["vision_config"] == kimi_k25.VISION_CONFIG
    processor = json.loads((tiny_kimi_dir / "preprocessor_config.json").read_text())
    assert processor == {"media_proc_cfg": kimi_k25.MEDIA_PROC_CFG}
    # the rope the draft is exported with: Kimi's YaRN, read from text_config
    rope = draft_rope.read(target_config_json(tiny_kimi_dir))
    assert (rope.type, rope.theta) == ("yarn", 50000.0)
    assert rope.params == {**KIMI_YARN, "original_max_position_embeddings": 32}
    assert text["max_position_embeddings"] == 64 * 32, "Kimi's ratio: factor x original context"


def test_a_built_tiny_kimi_is_found_in_its_cache(tiny_kimi_dir, tiny_config):
    """Asked again for the same spec, the builder returns the cached folder untouched. (transformers rewrites a
    rope_scaling dict in place: the spec a build records must be the one it was asked for, not that rewrite.)"""
    from conftest import TINY_KIMI_MODEL, TINY_KIMI_TRAIN

    from orchestrator.tiny import build_tiny_target

    tiny = tiny_config(experiment=EXPERIMENT, fast=False).target.tiny
    report = tiny_kimi_dir / "build_report.json"
    written = report.stat().st_mtime_ns
    model, train = {**tiny.model, **TINY_KIMI_MODEL}, {**tiny.train, **TINY_KIMI_TRAIN}
    assert build_tiny_target(tiny_kimi_dir, tiny.arch, model, train, progress=False) == tiny_kimi_dir
    assert report.stat().st_mtime_ns == written


@torch.no_grad()
def test_loads_and_captures_through_the_wrapper(tiny_kimi_dir, tiny_config):
    model, tokenizer = load_target(tiny_kimi_dir)
    assert isinstance(model, wrappers.TextOnly)
    text = model.language_model
    assert type(text).__name__ == "DeepseekV3ForCausalLM"
    assert base_model(model) is text.model
    assert text.config.rope_parameters["rope_type"] == "yarn"
    # every text weight came from the checkpoint (a missing one is refused, see below): the loaded model, named as
    # transformers would save it (its load-time conversions reversed: the wrapper's prefix, one tensor per routed
    # expert), is the checkpoint's text part, tensor for tensor
    loaded = revert_weight_conversion(text, text.state_dict())
    with safe_open(str(tiny_kimi_dir / "model.safetensors"), framework="pt") as f:
        assert loaded.keys() == {n for n in f.keys() if n.startswith("language_model.")}
        for name, tensor in loaded.items():
            assert torch.equal(tensor, f.get_tensor(name)), name
    heads = load_head_tensors(tiny_kimi_dir)
    assert torch.equal(heads["lm_head"], text.lm_head.weight) and torch.equal(heads["norm"], text.model.norm.weight)

    ids = torch.tensor([tokenizer("def main():\n    return 1")["input_ids"]])
    with HiddenStateCapture(model, [-1, 2, 3], "post_norm") as capture:
        out = model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states
    assert torch.equal(capture.aux(), torch.cat([hidden[0], hidden[3], hidden[4]], dim=-1))
    assert torch.allclose(teacher_logits(model, capture.teacher(), "post_norm"), out.logits, atol=1e-5)
    generated = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    assert generated.shape[1] == ids.shape[1] + 3

    cfg = tiny_config(
        "target.hidden_size=64", "target.vocab_size=512", "draft.draft_vocab_size=256", experiment=EXPERIMENT
    )
    assert identity(cfg, tiny_kimi_dir).num_hidden_layers == 6, "the text model's shape, read from text_config"


@torch.no_grad()
def test_a_kimi_checkpoint_round_trips_through_hf_with_every_weight(tiny_kimi_dir, tmp_path):
    """The builder's save (transformers' fused experts split per expert, under the wrapper's prefix) and the HF
    load (transformers' conversion fusing them back): a freshly initialised text model, its router bias drawn
    anew, comes back with every parameter and buffer it had, and the same logits bit for bit; none of them is
    the trained model's, so no weight can have come from anywhere but the checkpoint."""
    from transformers import AutoModelForCausalLM

    from orchestrator.tiny import kimi_k25
    from orchestrator.tiny.build import save_target

    trained, tokenizer = load_target(tiny_kimi_dir)
    torch.manual_seed(1)
    fresh = AutoModelForCausalLM.from_config(trained.language_model.config, dtype=torch.float32).eval()
    kimi_k25.set_router_bias(fresh, seed=1)
    (tmp_path / "fresh").mkdir()
    save_target(fresh, tokenizer, "kimi_k25", tmp_path / "fresh", seed=1)
    loaded, _ = load_target(tmp_path / "fresh")
    before, after = fresh.state_dict(), loaded.language_model.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(tensor, after[name]), name
    ids = torch.tensor([tokenizer("def main():\n    return 1")["input_ids"]])
    logits = fresh(input_ids=ids).logits
    assert torch.equal(loaded(input_ids=ids).logits, logits)
    assert not torch.allclose(trained(input_ids=ids).logits, logits), "the trained model's logits: not a test"


def test_a_wrapper_without_its_text_weights_is_refused(tiny_kimi_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_kimi_dir.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    # a layer's experts left out (as an INT4 checkpoint's `weight_packed` names would be): never random weights
    kept = {
        k: v
        for k, v in load_file(str(tiny_kimi_dir / "model.safetensors")).items()
        if ".layers.1.mlp.experts." not in k
    }
    save_file(kept, str(broken / "model.safetensors"))
    with pytest.raises(ArtifactError, match=r"missing under 'language_model\.'"):
        load_target(broken)
    conf = json.loads((tiny_kimi_dir / "config.json").read_text())
    (broken / "config.json").write_text(
        json.dumps({**conf, "quantization_config": {"quant_method": "compressed-tensors"}})
    )
    with pytest.raises(ArtifactError, match="compressed-tensors.*dequantise"):
        load_target(broken)


def test_tiny_kimi_pipeline_all_four_stages(tiny_config, tmp_path):
    # every stage in this process (cluster=debug): four stages without a job's start-up each; the reference engine's
    # server is still a process of its own
    cfg = tiny_config("cluster=debug", *PIPELINE, experiment=EXPERIMENT)
    summary = run_pipeline(cfg, tmp_path / "run")
    assert set(summary["stages"]) == {"extract", "train", "eval", "serve"}
    assert summary["mismatch_flags"] == []

    draft = Path(summary["stages"]["train"]["draft_dir"])
    assert validate_draft_dir(draft, target_config_json(target_dir(cfg))) == []
    conf = json.loads((draft / "config.json").read_text())
    assert conf["rope_parameters"] == {
        "rope_theta": 50000.0,
        "rope_type": "yarn",
        **KIMI_YARN,
        "original_max_position_embeddings": 32,
    }
    # Kimi's pattern [-1, 2, 3] written for SGLang 0.5.23's DeepSeek/Kimi rule (PR #25454): first id != 1, no shift
    ids = conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert cfg.aux_layers == [-1, 2, 3] and ids == [0, 3, 4]
    assert ids == engines.to_engine_ids("sglang", cfg.aux_layers, 6, "kimi_k25", cfg.serve.sglang_version)
    assert layer_contract.captured_layers(layer_contract.SGLANG_FIRST_ID, ids, 6) == [-1, 2, 3]
    serve = summary["stages"]["serve"]
    assert serve["greedy_outputs_identical"] is True and serve["accept_length"] >= 1.0


def test_the_tiny_kimi_speaks_kimis_published_template(tiny_kimi_dir):
    """Kimi-K2's published chat template (orchestrator/tiny/templates, from ggml-org/llama.cpp) with its markers as
    special tokens, `<|im_end|>` the end of a turn and eos: the Kimi experiment's CPU run renders, masks and stops
    as a real Kimi does. The mask is found without `{% generation %}` markers, which the template has none of."""
    from transformers import AutoTokenizer

    from orchestrator.data import assistant_spans, render
    from orchestrator.tiny.build import TEMPLATES_DIR

    tok = AutoTokenizer.from_pretrained(str(tiny_kimi_dir))
    published = (TEMPLATES_DIR / "moonshotai-Kimi-K2.jinja").read_text()
    assert tok.chat_template == published and "{% generation %}" not in published
    assert published == (Path(__file__).parent / "data" / "chat_templates" / "moonshotai-Kimi-K2.jinja").read_text()
    assert tok.eos_token == "<|im_end|>" and json.loads((tiny_kimi_dir / "config.json").read_text())["text_config"][
        "eos_token_id"
    ] == tok.convert_tokens_to_ids("<|im_end|>")
    for marker in ("<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"):
        assert len(tok(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    conversation = [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]
    full, spans = assistant_spans(tok, conversation)
    assert full.startswith("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>")
    assert [full[a:b] for a, b in spans] == ["Seven.<|im_end|>"]
    rendered = render(tok, conversation, 1 << 20)
    assert tok.decode([i for i, m in zip(rendered.input_ids, rendered.loss_mask) if m]) == "Seven.<|im_end|>"


def test_the_model_load_guard_fires_on_every_loader_the_project_uses(tiny_kimi_dir, monkeypatch):
    """`conftest.forbid_model_loads`, which the "HF never loads the tiny Kimi" test runs under: a wrapper checkpoint
    loads through its text class (`DeepseekV3ForCausalLM.from_pretrained`, orchestrator/wrappers.py), past a guard
    on the Auto classes alone (shown here loading); under this guard it fails, as an Auto class load and the
    project's own entry point do."""
    import torch
    import transformers
    from conftest import forbid_model_loads

    from orchestrator import targets, wrappers
    from orchestrator.tiny.build import SHIPPED

    config = wrappers.read_config(tiny_kimi_dir)
    wrapper = wrappers.wrapper_of(config)

    def load_wrapper():
        return wrappers.load_text_model(tiny_kimi_dir, config, wrapper, {"dtype": torch.float32})

    with monkeypatch.context() as auto_only:  # the guard as it was: the Auto classes patched
        auto_only.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: 1 / 0)
        auto_only.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: 1 / 0)
        assert load_wrapper() is not None, "the wrapper's text class loads past a guard on the Auto classes"
    forbid_model_loads(monkeypatch)
    with pytest.raises(AssertionError, match=r"DeepseekV3ForCausalLM.from_pretrained"):
        load_wrapper()
    with pytest.raises(AssertionError, match=r"LlamaForCausalLM.from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(SHIPPED / "tiny_llama")
    with pytest.raises(AssertionError, match=r"targets.load_target"):
        targets.load_target(tiny_kimi_dir)
