"""The tiny Kimi-K2.5-shaped target: saved as the real wrapper checkpoint is, loaded through the code path the
real one takes, and the whole pipeline (`+experiment=tiny_kimi_eagle3`) on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from orchestrator import layers as layer_contract
from orchestrator import wrappers
from orchestrator.artifacts import ArtifactError
from orchestrator.capture import HiddenStateCapture, base_model, teacher_logits
from orchestrator.draft import rope as draft_rope
from orchestrator.draft.export import validate_draft_dir
from orchestrator.pipeline import run_pipeline
from orchestrator.targets import identity, load_head_tensors, load_target, target_config_json, target_dir
from orchestrator.tiny import build_tiny_target

EXPERIMENT = "tiny_kimi_eagle3"
# The experiment's target, shrunk to build in seconds (the text model keeps MLA, MoE and the YaRN rope).
SMALL_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "vocab_size": 512,
}
SMALL_TRAIN = {
    "steps": 5,
    "seq_len": 64,
    "batch_size": 2,
    "warmup_steps": 2,
    "max_files": 16,
    "tokenizer_vocab_size": 384,
    "tokenizer_max_texts": 2000,
    "eval_sequences": 4,
}
# The pipeline's tiny Kimi: a MoE step is slow on a CPU, so fewer, shorter steps than FAST's; at a gentler lr
# than the full build's, so that 40 steps already answer with text rather than <|end|> (what serving measures).
PIPELINE = [
    "target.tiny.train.steps=40",
    "target.tiny.train.seq_len=128",
    "target.tiny.train.batch_size=4",
    "target.tiny.train.lr=3e-3",
    "target.tiny.train.warmup_steps=10",
]
KIMI_YARN = {"factor": 64.0, "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="module")
def kimi_dir(tiny_config, tmp_path_factory) -> Path:
    tiny = tiny_config(experiment=EXPERIMENT, fast=False).target.tiny
    assert tiny.arch == "kimi_k25"
    out = tmp_path_factory.mktemp("kimi") / "target"
    return build_tiny_target(
        out, tiny.arch, {**tiny.model, **SMALL_MODEL}, {**tiny.train, **SMALL_TRAIN}, progress=False
    )


def test_saved_as_the_kimi_wrapper_checkpoint(kimi_dir):
    conf = json.loads((kimi_dir / "config.json").read_text())
    assert conf["architectures"] == ["KimiK25ForConditionalGeneration"] and conf["model_type"] == "kimi_k25"
    text = conf["text_config"]
    assert text["model_type"] == "deepseek_v3" and text["architectures"] == ["DeepseekV3ForCausalLM"]
    assert text["num_hidden_layers"] == 6 and text["first_k_dense_replace"] == 1 and text["n_routed_experts"] == 4
    assert text["q_lora_rank"] and text["kv_lora_rank"], "MLA attention"
    assert wrappers.wrapper_of(conf) is wrappers.KIMI_K25
    with safe_open(str(kimi_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert all(n.startswith("language_model.") for n in names)
    for name in (
        "language_model.model.embed_tokens.weight",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "language_model.model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
        "language_model.model.layers.1.mlp.experts.gate_up_proj",
        "language_model.model.layers.1.mlp.gate.weight",
    ):
        assert name in names, (name, sorted(names)[:20])
    # the rope the draft is exported with: Kimi's YaRN, read from text_config
    rope = draft_rope.read(target_config_json(kimi_dir))
    assert (rope.type, rope.theta) == ("yarn", 50000.0)
    assert rope.params == {**KIMI_YARN, "original_max_position_embeddings": 32}
    assert text["max_position_embeddings"] == 64 * 32, "Kimi's ratio: factor x original context"


@torch.no_grad()
def test_loads_and_captures_through_the_wrapper(kimi_dir, tiny_config):
    model, tokenizer = load_target(kimi_dir)
    assert isinstance(model, wrappers.TextOnly)
    text = model.language_model
    assert type(text).__name__ == "DeepseekV3ForCausalLM"
    assert base_model(model) is text.model
    assert text.config.rope_parameters["rope_type"] == "yarn"
    # every text weight came from the checkpoint (a missing one is refused, see below), under its wrapper name
    with safe_open(str(kimi_dir / "model.safetensors"), framework="pt") as f:
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, f.get_tensor(name)), name
    heads = load_head_tensors(kimi_dir)
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
    assert identity(cfg, kimi_dir).num_hidden_layers == 6, "the text model's shape, read from text_config"


def test_a_wrapper_without_its_text_weights_is_refused(kimi_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in kimi_dir.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    from safetensors.torch import load_file, save_file

    # a layer's experts left out (as an INT4 checkpoint's `weight_packed` names would be): never random weights
    kept = {
        k: v for k, v in load_file(str(kimi_dir / "model.safetensors")).items() if ".layers.1.mlp.experts." not in k
    }
    save_file(kept, str(broken / "model.safetensors"))
    with pytest.raises(ArtifactError, match=r"missing under 'language_model\.'"):
        load_target(broken)
    conf = json.loads((kimi_dir / "config.json").read_text())
    (broken / "config.json").write_text(
        json.dumps({**conf, "quantization_config": {"quant_method": "compressed-tensors"}})
    )
    with pytest.raises(ArtifactError, match="compressed-tensors.*dequantise"):
        load_target(broken)


def test_tiny_kimi_pipeline_all_four_stages(tiny_config, tmp_path):
    cfg = tiny_config("cluster=local", *PIPELINE, experiment=EXPERIMENT)
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
    assert ids == layer_contract.to_engine_ids("sglang", cfg.aux_layers, 6, "kimi_k25", cfg.serve.sglang_version)
    assert layer_contract.captured_layers(layer_contract.SGLANG_FIRST_ID, ids, 6) == [-1, 2, 3]
    serve = summary["stages"]["serve"]
    assert serve["greedy_outputs_identical"] is True and serve["accept_length"] >= 1.0


def test_the_tiny_kimi_speaks_kimis_published_template(kimi_dir):
    """Kimi-K2's published chat template (orchestrator/tiny/templates, from ggml-org/llama.cpp) with its markers as
    special tokens, `<|im_end|>` the end of a turn and eos: the Kimi experiment's CPU run renders, masks and stops
    as a real Kimi does. The mask is found without `{% generation %}` markers, which the template has none of."""
    from transformers import AutoTokenizer

    from orchestrator.data import assistant_spans, render
    from orchestrator.tiny.build import TEMPLATES_DIR

    tok = AutoTokenizer.from_pretrained(str(kimi_dir))
    published = (TEMPLATES_DIR / "moonshotai-Kimi-K2.jinja").read_text()
    assert tok.chat_template == published and "{% generation %}" not in published
    assert published == (Path(__file__).parent / "data" / "chat_templates" / "moonshotai-Kimi-K2.jinja").read_text()
    assert tok.eos_token == "<|im_end|>" and json.loads((kimi_dir / "config.json").read_text())["text_config"][
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
