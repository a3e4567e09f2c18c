"""The SGLang draft directory: vocabulary maps, export, loading, and the validator every export runs.

Format (sglang 0.5.23, `LlamaForCausalLMEagle3`; docs/engines.md#sglang-draft-format): `config.json` +
`model.safetensors` with the names below. SGLang drops unknown keys silently (random weights, accept length ~1),
so the validator refuses them. Provenance (trained layers, target identity) goes to `orchestrator.json` beside
them, never into SGLang's config.
Rope (`draft/rope.py`): the draft config carries the rope the draft was trained with, which is the target's; the
validator compares the rope SGLang will build from the draft config with the trained one, absent keys meaning
SGLang's default (theta 10000), never "unknown".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from orchestrator import engines
from orchestrator.artifacts import ArtifactError, atomic_path, read_json, write_json
from orchestrator.compute import DTYPES
from orchestrator.draft import rope as rope_lib
from orchestrator.draft.model import DraftShape, Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"
PROVENANCE = "orchestrator.json"


class DraftFormatError(ArtifactError):
    """A draft directory SGLang would reject or, worse, load wrongly."""


def build_vocab_map(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) keeping the `draft_vocab_size` most frequent loss-masked tokens, sorted by id.

    d2t holds offsets (target_id = draft_id + d2t[draft_id]), as SGLang reads it; ties and unseen tokens are
    broken by lower id so the map is deterministic.
    """
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size}: expected 1..{vocab}")
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    kept = torch.tensor(sorted(order[:draft_vocab_size]), dtype=torch.int64)
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def expected_weight_shapes(s: DraftShape) -> dict[str, tuple[int, ...]]:
    h, hd = s.hidden_size, s.head_dim
    shapes = {
        "fc.weight": (h, s.num_aux_layers * s.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (s.num_attention_heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": (s.num_key_value_heads * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": (s.num_key_value_heads * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, s.num_attention_heads * hd),
        "midlayer.mlp.gate_proj.weight": (s.intermediate_size, h),
        "midlayer.mlp.up_proj.weight": (s.intermediate_size, h),
        "midlayer.mlp.down_proj.weight": (h, s.intermediate_size),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (s.draft_vocab_size, h),
        "d2t": (s.draft_vocab_size,),
        "t2d": (s.vocab_size,),
    }
    return shapes


OPTIONAL_WEIGHTS = {"embed_tokens.weight"}


def draft_config(
    s: DraftShape,
    layer_ids: list[int],
    torch_dtype: str,
    target_config: dict[str, Any],
    max_position_embeddings: int,
    convention: str = "sglang",
) -> dict[str, Any]:
    """SGLang's draft config.json, with the target's rope (read in either spelling, written in both), and the layer
    ids under every key the runners of `convention`'s engine read (`write_layer_ids`)."""
    conf = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": s.rms_norm_eps,
        "vocab_size": s.vocab_size,
        "draft_vocab_size": s.draft_vocab_size,
        "target_hidden_size": s.target_hidden_size,
        "max_position_embeddings": max_position_embeddings,
        "torch_dtype": torch_dtype,
        "tie_word_embeddings": False,
        "eagle_config": {"use_aux_hidden_state": True},
    }
    write_layer_ids(conf, layer_ids, convention)
    conf |= rope_lib.config_keys(rope_lib.read(target_config, "the target's config.json"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key in target_config:
            conf[key] = target_config[key]
    return conf


# Where each engine's runners read a draft config's layer ids, first key first
# (docs/engines.md#where-each-engine-and-runner-reads-a-drafts-ids):
#   SGLang 0.5.23: eagle_config.eagle_aux_hidden_state_layer_ids only.
#   vLLM 0.32, V1 runner (v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`): the top-level key,
#     else eagle_config.eagle_aux_hidden_state_layer_ids.
#   vLLM 0.32, Model Runner V2, the GPU default (v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
#     `get_eagle3_aux_layers_from_config`): the top-level key (then DFlash/DSpark keys and eagle_config.layer_ids);
#     never eagle_config.eagle_aux_hidden_state_layer_ids. With no ids it feeds the target's defaults.
TOP_LEVEL_IDS = "eagle_aux_hidden_state_layer_ids"


def write_layer_ids(conf: dict[str, Any], ids: list[int], convention: str) -> dict[str, Any]:
    """Writes `ids` where the runners of `convention`'s engine read them, all equal: the nested key (SGLang, vLLM's
    V1) always, and for vLLM the top-level key as well (its Model Runner V2 reads no other). An SGLang draft carries
    no top-level key, which vLLM would read before the nested one."""
    rest = {k: v for k, v in (conf.get("eagle_config") or {}).items() if k != "eagle_aux_hidden_state_layer_ids"}
    conf["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids), **rest}
    if convention == "vllm":
        conf[TOP_LEVEL_IDS] = list(ids)
    else:
        conf.pop(TOP_LEVEL_IDS, None)
    return conf


def nested_ids(conf: dict[str, Any]) -> list[int] | None:
    """The ids SGLang reads: eagle_config.eagle_aux_hidden_state_layer_ids (None where absent)."""
    ids = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return list(ids) if ids else None


def export(
    model: Eagle3Draft, folder: Path, config: dict[str, Any], provenance: dict[str, Any], target_config: dict[str, Any]
) -> None:
    """Writes the draft directory (weights, then config, then provenance) and validates it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dtype = DTYPES[config["torch_dtype"]]
    state = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu()
        state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    state = {k: v.contiguous() for k, v in state.items()}
    with atomic_path(folder / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": "pt"})
    write_json(folder / "config.json", config)
    write_json(folder / PROVENANCE, provenance)
    problems = validate_draft_dir(folder, target_config)
    if problems:
        raise DraftFormatError(f"exported draft {folder} fails SGLang's rules:\n  - " + "\n  - ".join(problems))


def shape_from_config(conf: dict[str, Any]) -> DraftShape:
    ids = conf.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0]
    rope = rope_lib.config_keys(rope_lib.read(conf, "draft config.json"))
    return DraftShape(
        hidden_size=conf["hidden_size"],
        target_hidden_size=conf.get("target_hidden_size", conf["hidden_size"]),
        num_aux_layers=len(ids),
        num_attention_heads=conf["num_attention_heads"],
        num_key_value_heads=conf.get("num_key_value_heads", conf["num_attention_heads"]),
        head_dim=conf.get("head_dim", conf["hidden_size"] // conf["num_attention_heads"]),
        intermediate_size=conf["intermediate_size"],
        vocab_size=conf["vocab_size"],
        draft_vocab_size=conf.get("draft_vocab_size", conf["vocab_size"]),
        rms_norm_eps=conf.get("rms_norm_eps", 1e-6),
        rope_theta=rope["rope_theta"],
        max_position_embeddings=conf.get("max_position_embeddings", 2048),
        rope_scaling=rope.get("rope_scaling"),
    )


def validate_draft_dir(folder: Path, target_config: dict[str, Any] | None = None) -> list[str]:
    """Every way the directory breaks SGLang's loading rules; empty when it is servable."""
    folder = Path(folder)
    problems: list[str] = []
    config_path = folder / "config.json"
    if not config_path.exists():
        return [f"{config_path}: missing"]
    conf = json.loads(config_path.read_text())

    def need(cond: bool, msg: str) -> None:
        if not cond:
            problems.append(f"config.json: {msg}")

    need(
        conf.get("architectures") == [ARCHITECTURE],
        f"architectures={conf.get('architectures')}, expected [{ARCHITECTURE!r}] "
        f"(EAGLE-3 weights are only remapped for it)",
    )
    need(conf.get("num_hidden_layers") == 1, f"num_hidden_layers={conf.get('num_hidden_layers')}, expected 1")
    for key in (
        "hidden_size",
        "vocab_size",
        "draft_vocab_size",
        "target_hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "max_position_embeddings",
    ):
        need(
            isinstance(conf.get(key), int),
            f"{key} missing or not an integer (draft_vocab_size missing raises AttributeError in SGLang)",
        )
    need(
        conf.get("torch_dtype") in ("bfloat16", "float16", "float32"),
        f"torch_dtype={conf.get('torch_dtype')!r}; missing loads the draft as fp16",
    )
    need(
        conf.get("tie_word_embeddings") is False,
        "tie_word_embeddings must be false (lm_head is over the draft vocabulary)",
    )
    eagle = conf.get("eagle_config")
    need(isinstance(eagle, dict), "eagle_config missing: SGLang then captures its default layers, not the trained ones")
    if isinstance(eagle, dict):
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        need(
            isinstance(ids, list) and all(isinstance(i, int) for i in ids) and ids,
            "eagle_config.eagle_aux_hidden_state_layer_ids must be a non-empty list of ints",
        )
        need(eagle.get("use_aux_hidden_state", True) is True, "eagle_config.use_aux_hidden_state must be true")
    problems += [f"config.json: {p}" for p in rope_problems(folder, conf, target_config)]
    if target_config:
        target_ctx = target_config.get("max_position_embeddings")
        if isinstance(target_ctx, int) and isinstance(conf.get("max_position_embeddings"), int):
            need(
                conf["max_position_embeddings"] >= target_ctx,
                f"max_position_embeddings={conf['max_position_embeddings']} < the target's {target_ctx} "
                f"(SGLang refuses to start)",
            )
        need(
            conf.get("target_hidden_size") == target_config.get("hidden_size"),
            f"target_hidden_size={conf.get('target_hidden_size')} "
            f"but the target's hidden_size is {target_config.get('hidden_size')}",
        )
        need(
            conf.get("vocab_size") == target_config.get("vocab_size"),
            f"vocab_size={conf.get('vocab_size')} but the target's is {target_config.get('vocab_size')}",
        )
    if problems:
        return problems

    weights_path = folder / "model.safetensors"
    if not weights_path.exists():
        return [f"{weights_path}: missing"]
    weights = load_file(str(weights_path))
    s = shape_from_config(conf)
    expected = expected_weight_shapes(s)
    for name, shape in expected.items():
        if name not in weights:
            problems.append(f"model.safetensors: {name} missing")
        elif tuple(weights[name].shape) != shape:
            problems.append(f"model.safetensors: {name} has shape {tuple(weights[name].shape)}, expected {shape}")
    unknown = sorted(set(weights) - set(expected) - OPTIONAL_WEIGHTS)
    if unknown:
        problems.append(
            f"model.safetensors: unknown keys {unknown} (SGLang drops them silently; use the midlayer.* names)"
        )
    if "embed_tokens.weight" in weights and tuple(weights["embed_tokens.weight"].shape) != (
        s.vocab_size,
        s.hidden_size,
    ):
        problems.append(
            f"model.safetensors: embed_tokens.weight has shape {tuple(weights['embed_tokens.weight'].shape)}"
        )
    if "d2t" in weights and tuple(weights["d2t"].shape) == (s.draft_vocab_size,):
        problems += check_vocab_map(weights["d2t"], weights.get("t2d"), s.vocab_size)
    return problems


def rope_problems(folder: Path, conf: dict[str, Any], target_config: dict[str, Any] | None) -> list[str]:
    """The rope SGLang builds from the draft config against the one the draft was trained with: provenance's
    "rope" when recorded, else the target config's rope (the draft uses the target's)."""
    legacy_keys = {k: conf[k] for k in ("rope_theta", "rope_scaling") if k in conf}
    try:
        served = rope_lib.read(conf, "draft config.json")
        legacy = rope_lib.read(legacy_keys, "draft config.json")
    except rope_lib.RopeError as err:
        return [str(err)]
    if conf.get("rope_parameters") and legacy_keys:
        # SGLang reads rope_parameters first, transformers may fold rope_theta/rope_scaling into it: both must agree
        if legacy != served:
            return [
                f"rope_theta/rope_scaling ({legacy.describe()}) disagree with rope_parameters ({served.describe()}); "
                "which one is served depends on the SGLang/transformers version. Re-export the draft"
            ]
    record = read_json(folder / PROVENANCE, "draft provenance").get("rope") if (folder / PROVENANCE).exists() else None
    if record is not None:
        trained, source = (
            rope_lib.read({"rope_parameters": record}, f"{folder / PROVENANCE} rope"),
            "the draft was trained with",
        )
    elif target_config:
        try:
            trained, source = rope_lib.read(target_config, "the target's config.json"), "the target's config.json gives"
        except rope_lib.RopeError as err:
            return [str(err)]
    else:
        return []
    if served != trained:
        return [
            f"rope: SGLang would serve a {served.describe()} (rope_theta={served.theta:g}, rope_parameters="
            f"{served.as_dict()}), but {source} a {trained.describe()}; re-export the draft with the target's rope"
        ]
    return []


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int) -> list[str]:
    problems = []
    if d2t.dtype != torch.int64:
        problems.append(f"d2t dtype {d2t.dtype}, expected int64")
    target_ids = d2t.to(torch.int64) + torch.arange(d2t.numel())
    if target_ids.min() < 0 or target_ids.max() >= vocab:
        problems.append(
            f"d2t maps draft ids outside the target vocabulary [0, {vocab}): d2t must hold offsets "
            f"(target_id = draft_id + d2t[draft_id]), not target ids"
        )
    elif target_ids.unique().numel() != target_ids.numel():
        problems.append("d2t maps two draft ids to the same target id")
    elif t2d is not None and (t2d.sum() != d2t.numel() or not bool(t2d[target_ids].all())):
        problems.append("t2d does not mark exactly the target ids that d2t maps to")
    return problems


def load_draft(folder: Path) -> tuple[Eagle3Draft, dict[str, Any]]:
    """The draft as a serving engine loads it: from the directory alone, in the config's `torch_dtype` (the
    dtype SGLang serves it in), so that whatever runs it computes what serving computes."""
    folder = Path(folder)
    conf = read_json(folder / "config.json", "draft config")
    dtype = DTYPES[conf["torch_dtype"]]
    model = Eagle3Draft(shape_from_config(conf))
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=False)
    missing = [m for m in missing if m != "embed_tokens.weight"]
    if missing or unexpected:
        raise DraftFormatError(f"{folder}: missing {missing}, unexpected {unexpected}")
    model.to(dtype).eval()
    return model, conf


def serving_record(serve, family: str, ids: list[int]) -> dict[str, Any]:
    """The provenance's `serving` entry: the engine (and the version of its id rule) the config's ids are written
    for. The guard refuses the folder on an engine of another convention (orchestrator.engines.sglang.cli)."""
    return {
        "engine": serve.engine,
        "family": family,
        "sglang_version": serve.sglang_version,
        # the version of the engine's id rule, under its convention's name (vllm_version, sglang_version)
        f"{engines.get(serve.engine).convention}_version": engines.engine_version(serve),
        "id_rules": engines.id_rules(serve),
        "eagle_aux_hidden_state_layer_ids": list(ids),
    }


def provenance(folder: Path) -> dict[str, Any]:
    return read_json(Path(folder) / PROVENANCE, "draft provenance")
