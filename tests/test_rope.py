"""The draft's rope (orchestrator/draft/rope.py): computed as Hugging Face computes it, read in both spellings,
written so that SGLang 0.5.23 reads the target's rope, and checked by the export validator.

The `sglang` tests (end of file) check it against SGLang 0.5.23's own code: tests/sglang_rope_probe.py runs under
SGLANG_PYTHON (scripts/make_sglang_env.sh), reads an exported draft config.json with sglang's get_config, builds
the EAGLE-3 draft's decoder layer and applies its rotary embedding; without SGLANG_PYTHON they skip."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import SMALL_DRAFT_SHAPE
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from orchestrator import conf_dir
from orchestrator.draft import export as E
from orchestrator.draft import rope
from orchestrator.draft.model import DraftShape, Eagle3Draft, Rope

HEAD_DIM = 64
# Kimi-K2.5's text model (DeepSeek-V3): YaRN, factor 64 over 4096 positions
KIMI = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 64.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": KIMI,
    "yarn_mscale_ratio": KIMI | {"mscale_all_dim": 0.707},
    "yarn_plain": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 2048,
    },
}


def hf_rotary(params: dict):
    """Hugging Face's (inv_freq, attention factor) and rotary module for these rope parameters."""
    if params["rope_type"] == "yarn":
        config = DeepseekV3Config(
            hidden_size=256,
            num_attention_heads=4,
            qk_rope_head_dim=HEAD_DIM,
            max_position_embeddings=262144,
            rope_parameters=dict(params),
        )
        module = DeepseekV3RotaryEmbedding(config)
    else:
        config = LlamaConfig(
            hidden_size=256,
            num_attention_heads=4,
            head_dim=HEAD_DIM,
            max_position_embeddings=131072,
            rope_parameters=dict(params),
        )
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
    assert scale == pytest.approx(
        (0.1 * 1.0 * torch.log(torch.tensor(64.0)).item() + 1)
        / (0.1 * 0.707 * torch.log(torch.tensor(64.0)).item() + 1)
    )
    _, plain = rope.rotary(
        rope.read({"rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}}),
        HEAD_DIM,
    )
    assert plain == pytest.approx(0.1 * torch.log(torch.tensor(64.0)).item() + 1)


def test_yarn_mscale_zero_follows_sglang_not_transformers():
    """With mscale 0 and mscale_all_dim set, SGLang 0.5.23 (`YaRNScalingRotaryEmbedding`: both `is not None`) takes the
    ratio get_mscale(f, 0) / get_mscale(f, mscale_all_dim); transformers (both truthy) takes get_mscale(f). The draft
    is served by SGLang, so it follows SGLang (checked against SGLang's code in test_draft_rope_equals_sglangs)."""
    params = KIMI | {"mscale": 0.0, "mscale_all_dim": 1.0}
    _, scale = rope.rotary(rope.read({"rope_parameters": params}), HEAD_DIM)
    log64 = torch.log(torch.tensor(64.0)).item()
    assert scale == pytest.approx(1.0 / (0.1 * log64 + 1))
    _, hf_scale, _ = hf_rotary(params)
    assert hf_scale == pytest.approx(0.1 * log64 + 1)


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_both_spellings_read_the_same(kind):
    params = ROPES[kind]
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    legacy = {"rope_theta": params["rope_theta"]} | (
        {"rope_scaling": scaling} if params["rope_type"] != "default" else {}
    )
    assert rope.read({"rope_parameters": params}) == rope.read(legacy)
    old_key = {
        "rope_theta": params["rope_theta"],
        "rope_scaling": {"type": params["rope_type"]} | {k: v for k, v in scaling.items() if k != "rope_type"},
    }
    assert rope.read(old_key) == rope.read(legacy)


def test_absent_rope_is_theta_10000():
    assert rope.read({}) == rope.RopeSpec(10000.0, "default", {})


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type='dynamic'"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope_parameters.rope_type='longrope'"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "original_max_position_embeddings",
        ),
        (
            {
                "rope_scaling": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 4096,
                    "attention_factor": 1.2,
                }
            },
            "attention_factor",
        ),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "default"},
                }
            },
            "per-layer-type",
        ),
    ],
)
def test_unsupported_rope_is_refused_naming_the_key(config, fragment):
    with pytest.raises(rope.RopeError, match="config.json") as err:
        rope.read(config, "config.json")
    assert fragment in str(err.value)


# ------------------------------------------------------------------------------------ the exported draft


def sglang_reads(conf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict) as SGLang 0.5.23 reads a draft config: a mirror, written independently of rope.py,
    of `LlamaDecoderLayer.__init__` in sglang/srt/models/llama.py (reused by LlamaForCausalLMEagle3 in
    sglang/srt/models/llama_eagle3.py), as docs/rope.md describes it: `rope_parameters` first, its `rope_theta`
    and scaling keys; else `rope_theta` (default 10000) and `rope_scaling`."""
    parameters = conf.get("rope_parameters")
    if parameters:
        scaling = {k: v for k, v in parameters.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        return parameters.get("rope_theta", conf.get("rope_theta", 10000)), (None if kind == "default" else scaling)
    return conf.get("rope_theta", 10000), conf.get("rope_scaling")


SHAPE = SMALL_DRAFT_SHAPE
# what transformers 5 writes for a Llama-3 style target: no top-level rope_theta
LLAMA3_TARGET = {
    "hidden_size": 32,
    "vocab_size": 50,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"},
}


def export_for(tmp_path, target: dict, provenance: dict | None = None):
    spec = rope.read(target)
    keys = rope.config_keys(spec)
    shape = DraftShape(
        **(SHAPE.as_dict() | {"rope_theta": keys["rope_theta"], "rope_scaling": keys.get("rope_scaling")})
    )
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
    target = {
        "hidden_size": 32,
        "vocab_size": 50,
        "max_position_embeddings": 64,
        "rope_theta": 50000.0,
        "rope_scaling": {k: v for k, v in KIMI.items() if k not in ("rope_type", "rope_theta")} | {"type": "yarn"},
    }
    folder, draft = export_for(tmp_path, target)
    conf = json.loads((folder / "config.json").read_text())
    theta, scaling = sglang_reads(conf)
    assert theta == 50000.0 and scaling["rope_type"] == "yarn" and scaling["factor"] == 64.0
    assert draft.midlayer.self_attn.rope.scale == pytest.approx(1.0)  # mscale == mscale_all_dim
    assert E.validate_draft_dir(folder, target) == []


def test_validator_refuses_a_rope_other_than_the_trained_one(tmp_path):
    folder, _ = export_for(tmp_path, LLAMA3_TARGET)
    edit_config(
        folder,
        lambda c: c["rope_parameters"].update(rope_theta=10000.0, rope_type="default") or c.update(rope_theta=10000.0),
    )
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


# ------------------------------------------------------------------- against sglang's own rotary embedding

PROBE = Path(__file__).with_name("sglang_rope_probe.py")
# below, at and beyond YaRN's original 4096 (and llama3's 8192), up to Kimi's 262144; each case takes those below
# its max_position_embeddings (SGLang's cos/sin cache ends there)
SGLANG_POSITIONS = [
    0,
    1,
    7,
    100,
    1000,
    2047,
    2048,
    4095,
    4096,
    4097,
    5000,
    8191,
    8192,
    20000,
    32767,
    65536,
    131071,
    262143,
]
KIMI_HEAD_DIM = 128  # Kimi's draft (docs/kimi_k25.md#the-draft-shape)


def kimi_target(name: str = "kimi_k25") -> dict:
    """The target config.json fields the draft export reads, with the rope values of conf/target/NAME.yaml."""
    t = OmegaConf.load(conf_dir() / "target" / f"{name}.yaml")
    return {
        "hidden_size": 32,
        "vocab_size": 50,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_theta": t.rope_theta,
        "rope_scaling": OmegaConf.to_container(t.rope_scaling),
    }


# YaRN keys that only SGLang reads (transformers has no extrapolation_factor, and its attention_factor replaces the
# computed scale where SGLang's attn_factor multiplies it) or reads differently (SGLang takes the mscale ratio when
# both keys are set, 0 included; transformers when both are non-zero): checked against SGLang only.
SGLANG_ONLY = {
    "yarn_sglang_keys": KIMI | {"beta_fast": 32.0, "attn_factor": 1.25, "extrapolation_factor": 0.5, "truncate": False},
    "yarn_mscale_zero": KIMI | {"beta_fast": 32.0, "mscale": 0.0, "mscale_all_dim": 1.0},
}


def sglang_cases() -> dict[str, tuple[dict, int]]:
    """name -> (target config, head_dim): Kimi-K2.5's YaRN as configured, and the other types the draft supports."""
    cases = {"kimi_k25": (kimi_target(), KIMI_HEAD_DIM)}
    for kind, params in (ROPES | SGLANG_ONLY).items():
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        # YaRN's context is factor x original, as in Kimi's config (transformers warns otherwise)
        context = (
            int(params["factor"] * params["original_max_position_embeddings"]) if kind.startswith("yarn") else 131072
        )
        target = {
            "hidden_size": 32,
            "vocab_size": 50,
            "max_position_embeddings": context,
            "rope_theta": params["rope_theta"],
        }
        cases[kind] = (target | ({"rope_scaling": scaling} if kind != "default" else {}), HEAD_DIM)
    return cases


def draft_folder(root: Path, name: str, target: dict, head_dim: int, legacy_only: bool = False) -> Path:
    """A draft directory's config.json as `draft_config` exports it for this target. The widths are small (sglang
    builds the layer's weights too); the rope depends only on head_dim, the rope keys and max_position_embeddings."""
    shape = DraftShape(**(SHAPE.as_dict() | {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim}))
    conf = E.draft_config(shape, [0, 2, 4], "bfloat16", target, target["max_position_embeddings"])
    if legacy_only:  # a config with only rope_theta/rope_scaling (older exports, most targets): transformers folds them
        del conf["rope_parameters"]
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    return folder


@pytest.fixture(scope="module")
def sglang_rope(sglang_python, tmp_path_factory):
    """name -> (draft config, inputs, sglang's outputs, sglang's description of its rotary module)."""
    root = tmp_path_factory.mktemp("sglang_rope")
    folders, confs, inputs = {}, {}, {}
    generator = torch.Generator().manual_seed(0)
    cases = sglang_cases()
    for name, (target, head_dim) in cases.items():
        folders[name] = draft_folder(root, name, target, head_dim)
    folders["kimi_k25_legacy_keys"] = draft_folder(root, "kimi_k25_legacy_keys", *cases["kimi_k25"], legacy_only=True)
    for name, folder in folders.items():
        confs[name] = json.loads((folder / "config.json").read_text())
        width = confs[name]["head_dim"]
        positions = [p for p in SGLANG_POSITIONS if p < confs[name]["max_position_embeddings"]]
        inputs[f"positions.{name}"] = torch.tensor(positions, dtype=torch.int64)
        inputs[f"q.{name}"] = torch.randn(
            len(positions), confs[name]["num_attention_heads"] * width, generator=generator
        )
        inputs[f"k.{name}"] = torch.randn(
            len(positions), confs[name]["num_key_value_heads"] * width, generator=generator
        )
    save_file(inputs, str(root / "in.safetensors"))
    request = {
        "cases": {n: str(f) for n, f in folders.items()},
        "inputs": str(root / "in.safetensors"),
        "output": str(root / "out.safetensors"),
    }
    (root / "request.json").write_text(json.dumps(request))
    done = subprocess.run(
        [sglang_python, str(PROBE), str(root / "request.json")], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        pytest.fail(
            f"{PROBE.name} failed under {sglang_python} (an environment built before the rope check lacks "
            f"packages: rebuild it with scripts/make_sglang_env.sh):\n{done.stderr[-3000:]}"
        )
    with safe_open(str(root / "out.safetensors"), "pt") as f:
        meta = {n: json.loads(v) for n, v in f.metadata().items()}
    outputs = load_file(str(root / "out.safetensors"))
    return {n: (confs[n], inputs, outputs, meta[n]) for n in folders}


SGLANG_CLASSES = {
    "default": "RotaryEmbedding",
    "linear": "LinearScalingRotaryEmbedding",
    "llama3": "Llama3RotaryEmbedding",
    "yarn": "YaRNScalingRotaryEmbedding",
}


@pytest.mark.sglang
@pytest.mark.parametrize("name", ["kimi_k25", "kimi_k25_legacy_keys", *sorted(ROPES), *sorted(SGLANG_ONLY)])
def test_draft_rope_equals_sglangs(name, sglang_rope):
    """The rope the draft trains with (read back from the exported config.json, as a reloaded draft does) applied
    to the same q/k at the same positions as SGLang 0.5.23's own rotary embedding, built by its EAGLE-3 draft layer
    from that config.json (tests/sglang_rope_probe.py)."""
    conf, inputs, outputs, meta = sglang_rope[name]
    spec = E.shape_from_config(conf).rope
    assert spec == rope.read(conf)
    assert meta["class"] == SGLANG_CLASSES[spec.type], meta
    assert meta["base"] == spec.theta and meta["rotary_dim"] == meta["head_size"] == conf["head_dim"]
    if spec.type == "yarn":
        assert meta["scaling_factor"] == spec.param("factor")
        assert meta["max_position_embeddings"] == spec.param("original_max_position_embeddings")
    module = Rope(conf["head_dim"], spec)
    if meta["mscale"] is not None:
        assert module.scale == pytest.approx(meta["mscale"], abs=1e-7)

    positions = inputs[f"positions.{name}"]
    assert positions.max() >= 2 * (
        spec.param("original_max_position_embeddings") or 4096
    )  # well beyond the original context
    half = conf["head_dim"] // 2
    cos, sin = module.cos_sin(positions)
    cache = outputs[f"cache.{name}"]  # sglang's [cos * mscale | sin * mscale] rows
    torch.testing.assert_close(cos[:, :half], cache[:, :half], rtol=0, atol=1e-5)
    torch.testing.assert_close(sin[:, :half], cache[:, half:], rtol=0, atol=1e-5)
    for x in ("q", "k"):
        flat = inputs[f"{x}.{name}"]
        heads = flat.view(len(positions), -1, conf["head_dim"]).transpose(0, 1)[None]  # [1, heads, T, D]
        ours = module(heads, positions[None])[0].transpose(0, 1).reshape(flat.shape)
        torch.testing.assert_close(ours, outputs[f"{x}.{name}"], rtol=0, atol=1e-5)


@pytest.mark.sglang
def test_sglang_reads_kimis_exported_rope(sglang_rope):
    """SGLang 0.5.23 reads the Kimi draft's config.json (both spellings, or the legacy keys alone) as Kimi's YaRN."""
    kimi = kimi_target()
    for name in ("kimi_k25", "kimi_k25_legacy_keys"):
        conf, _, _, meta = sglang_rope[name]
        assert meta["class"] == "YaRNScalingRotaryEmbedding" and meta["base"] == kimi["rope_theta"] == 50000.0
        assert meta["scaling_factor"] == kimi["rope_scaling"]["factor"] == 64.0
        assert meta["max_position_embeddings"] == kimi["rope_scaling"]["original_max_position_embeddings"] == 4096
        assert meta["cache_rows"] >= conf["max_position_embeddings"] == 262144
        assert meta["cache_dtype"] == "torch.float32"
        parameters = meta["rope_parameters"]
        for key, value in kimi["rope_scaling"].items():
            assert parameters[key] == value, (key, parameters)
