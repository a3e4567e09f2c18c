"""The draft's rope (orchestrator/draft/rope.py): computed as Hugging Face computes it, read in both spellings,
written so that SGLang 0.5.23 reads the target's rope, and checked by the export validator."""

import json

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from orchestrator.draft import export as E
from orchestrator.draft import rope
from orchestrator.draft.model import DraftShape, Eagle3Draft, Rope

HEAD_DIM = 64
# Kimi-K2.5's text model (DeepSeek-V3): YaRN, factor 64 over 4096 positions
KIMI = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "yarn": KIMI,
    "yarn_mscale_ratio": KIMI | {"mscale_all_dim": 0.707},
    "yarn_plain": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 2048},
}


def hf_rotary(params: dict):
    """Hugging Face's (inv_freq, attention factor) and rotary module for these rope parameters."""
    if params["rope_type"] == "yarn":
        config = DeepseekV3Config(hidden_size=256, num_attention_heads=4, qk_rope_head_dim=HEAD_DIM,
                                  max_position_embeddings=262144, rope_parameters=dict(params))
        module = DeepseekV3RotaryEmbedding(config)
    else:
        config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM,
                             max_position_embeddings=131072, rope_parameters=dict(params))
        module = LlamaRotaryEmbedding(config)
    if params["rope_type"] == "default":
        inv_freq, factor = LlamaRotaryEmbedding.compute_default_rope_parameters(config, device="cpu")
    else:
        inv_freq, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, device="cpu")
    return inv_freq, factor, module


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_draft_rope_equals_transformers(kind):
    spec = rope.read({"rope_parameters": ROPES[kind]})
    assert spec.type == ROPES[kind]["rope_type"]
    inv_freq, scale = rope.rotary(spec, HEAD_DIM)
    hf_inv_freq, hf_scale, hf_module = hf_rotary(ROPES[kind])
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), rtol=1e-6, atol=1e-6)
    assert scale == pytest.approx(hf_scale, abs=1e-6)

    # the draft's own cos/sin, against HF's rotary module, at positions below and beyond the original context
    positions = torch.tensor([[0, 1, 7, 100, 1000, 5000]])
    cos, sin = Rope(HEAD_DIM, spec).cos_sin(positions)
    hf_cos, hf_sin = hf_module(torch.zeros(1, 1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)


def test_plain_rope_is_unchanged():
    """The default rope is bit-for-bit the draft's former plain Llama rope."""
    theta = 10000.0
    expected = 1.0 / (theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
    module = Rope(HEAD_DIM, rope.read({"rope_theta": theta}))
    assert torch.equal(module.inv_freq, expected) and module.scale == 1.0


def test_kimi_yarn_scales_cos_sin_by_the_mscale_ratio():
    spec = rope.read({"rope_parameters": KIMI | {"mscale_all_dim": 0.707}})
    _, scale = rope.rotary(spec, HEAD_DIM)
    assert scale == pytest.approx((0.1 * 1.0 * torch.log(torch.tensor(64.0)).item() + 1) / (0.1 * 0.707 * torch.log(torch.tensor(64.0)).item() + 1))
    _, plain = rope.rotary(rope.read({"rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}}), HEAD_DIM)
    assert plain == pytest.approx(0.1 * torch.log(torch.tensor(64.0)).item() + 1)


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_both_spellings_read_the_same(kind):
    params = ROPES[kind]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    legacy = {"rope_theta": params["rope_theta"]} | ({"rope_scaling": scaling} if params["rope_type"] != "default" else {})
    assert rope.read({"rope_parameters": params}) == rope.read(legacy)
    old_key = {"rope_theta": params["rope_theta"], "rope_scaling": {"type": params["rope_type"]} | {k: v for k, v in scaling.items() if k != "rope_type"}}
    assert rope.read(old_key) == rope.read(legacy)


def test_absent_rope_is_theta_10000():
    assert rope.read({}) == rope.RopeSpec(10000.0, "default", {})


@pytest.mark.parametrize("config, fragment", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type='longrope'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "attention_factor": 1.2}}, "attention_factor"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}}, "per-layer-type"),
])
def test_unsupported_rope_is_refused_naming_the_key(config, fragment):
    with pytest.raises(rope.RopeError, match="config.json") as err:
        rope.read(config, "config.json")
    assert fragment in str(err.value)


# ------------------------------------------------------------------------------------ the exported draft


def sglang_reads(conf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict) as SGLang 0.5.23 reads a draft config: a mirror, written independently of rope.py,
    of `LlamaDecoderLayer.__init__` in sglang/srt/models/llama.py (reused by LlamaForCausalLMEagle3 in
    sglang/srt/models/llama_eagle3.py), as recorded in DOMAIN.md §8: `rope_parameters` first, its `rope_theta`
    and scaling keys; else `rope_theta` (default 10000) and `rope_scaling`."""
    parameters = conf.get("rope_parameters")
    if parameters:
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return parameters.get("rope_theta", conf.get("rope_theta", 10000)), (None if kind == "default" else scaling)
    return conf.get("rope_theta", 10000), conf.get("rope_scaling")


SHAPE = DraftShape(hidden_size=32, target_hidden_size=32, num_aux_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, intermediate_size=48, vocab_size=50, draft_vocab_size=20)
# what transformers 5 writes for a Llama-3 style target: no top-level rope_theta
LLAMA3_TARGET = {"hidden_size": 32, "vocab_size": 50, "max_position_embeddings": 64,
                 "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}


def export_for(tmp_path, target: dict, provenance: dict | None = None):
    spec = rope.read(target)
    keys = rope.config_keys(spec)
    shape = DraftShape(**(SHAPE.as_dict() | {"rope_theta": keys["rope_theta"], "rope_scaling": keys.get("rope_scaling")}))
    torch.manual_seed(0)
    draft = Eagle3Draft(shape)
    draft.set_vocab_map(*E.build_vocab_map(torch.arange(50), 20))
    folder = tmp_path / "draft"
    conf = E.draft_config(shape, [0, 2, 4], "bfloat16", target, 64)
    E.export(draft, folder, conf, provenance if provenance is not None else {"rope": shape.rope.as_dict()}, target)
    return folder, draft


def edit_config(folder, edit) -> None:
    conf = json.loads((folder / "config.json").read_text())
    edit(conf)
    (folder / "config.json").write_text(json.dumps(conf))


def test_draft_for_a_rope_parameters_only_target_is_served_with_its_theta(tmp_path):
    folder, draft = export_for(tmp_path, LLAMA3_TARGET)
    conf = json.loads((folder / "config.json").read_text())
    assert sglang_reads(conf) == (500000.0, None)
    assert sglang_reads({k: v for k, v in conf.items() if k != "rope_parameters"}) == (500000.0, None)  # older readers
    assert E.validate_draft_dir(folder, LLAMA3_TARGET) == []
    assert E.provenance(folder)["rope"] == {"rope_theta": 500000.0, "rope_type": "default"}
    # the draft trained (and reloaded) computes the rope it is served with
    assert torch.equal(draft.midlayer.self_attn.rope.inv_freq, Rope(8, rope.read(conf)).inv_freq)
    assert E.shape_from_config(conf).rope == draft.shape.rope


def test_kimi_draft_carries_the_target_yarn(tmp_path):
    target = {"hidden_size": 32, "vocab_size": 50, "max_position_embeddings": 64, "rope_theta": 50000.0,
              "rope_scaling": {k: v for k, v in KIMI.items() if k not in ("rope_type", "rope_theta")} | {"type": "yarn"}}
    folder, draft = export_for(tmp_path, target)
    conf = json.loads((folder / "config.json").read_text())
    theta, scaling = sglang_reads(conf)
    assert theta == 50000.0 and scaling["rope_type"] == "yarn" and scaling["factor"] == 64.0
    assert draft.midlayer.self_attn.rope.scale == pytest.approx(1.0)  # mscale == mscale_all_dim
    assert E.validate_draft_dir(folder, target) == []


def test_validator_refuses_a_rope_other_than_the_trained_one(tmp_path):
    folder, _ = export_for(tmp_path, LLAMA3_TARGET)
    edit_config(folder, lambda c: c["rope_parameters"].update(rope_theta=10000.0, rope_type="default") or c.update(rope_theta=10000.0))
    problems = E.validate_draft_dir(folder, LLAMA3_TARGET)
    assert any("rope" in p and "500000" in p and "trained" in p for p in problems), problems


def test_validator_refuses_a_draft_config_without_rope_for_a_non_default_theta(tmp_path):
    """No rope keys means SGLang's theta 10000, never None == None."""
    folder, _ = export_for(tmp_path, LLAMA3_TARGET, provenance={"aux_layers": [0, 2, 4]})
    edit_config(folder, lambda c: [c.pop(k, None) for k in ("rope_theta", "rope_scaling", "rope_parameters")])
    problems = E.validate_draft_dir(folder, LLAMA3_TARGET)
    assert any("theta 10000" in p and "theta 500000" in p for p in problems), problems


def test_validator_refuses_disagreeing_spellings(tmp_path):
    folder, _ = export_for(tmp_path, LLAMA3_TARGET)
    edit_config(folder, lambda c: c.update(rope_theta=10000.0))
    problems = E.validate_draft_dir(folder, LLAMA3_TARGET)
    assert any("disagree with rope_parameters" in p for p in problems), problems
