"""Multimodal checkpoints whose text model is the target: how their config.json and weights are laid out, and
how the text model is loaded out of them.

Kimi-K2.5 (docs/kimi_k25.md#the-target) is `KimiK25ForConditionalGeneration`: its config.json has
`model_type: kimi_k25`, the DeepSeek-V3 text model's config under `text_config` (next to `vision_config`), and
its weights name the text model `language_model.*` (`language_model.model.layers.N...`,
`language_model.model.embed_tokens.weight`, `language_model.lm_head.weight`), beside `vision_tower.*` and
`mm_projector.*`. Its routed experts are stored one tensor per expert and projection
(`language_model.model.layers.N.mlp.experts.<e>.{gate,up,down}_proj...`), as DeepSeek-V3's are; transformers 5
holds them fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`) and converts between the two
on load and save (its conversion mapping for deepseek_v3). EAGLE-3 drafts only ever see text, so a wrapper
target is loaded as its text model, built from `text_config` with transformers' own class for that architecture,
its weights read from the `language_model.` prefix (the vision tower's are left unread), and held under the
wrapper's attribute name, so capture finds the decoder where it finds it in the real remote-code model
(`model.language_model.model`).

The tiny Kimi target (`target=tiny_kimi_k25`, orchestrator/tiny/kimi_k25.py) is written in this layout by the
tiny builder, with Kimi's router keys, MLA dims and a small stand-in vision tower, so that both this code and
vLLM's `KimiK25ForConditionalGeneration` load it. What a real Kimi-K2.5 checkpoint needs beyond it, none of which
the tiny one exercises:
  * its tokenizer is remote code (tiktoken): `target.trust_remote_code: true` (conf/target/kimi_k25.yaml);
    the text model itself needs no remote code, transformers has DeepSeek-V3;
  * its routed experts are INT4 (`quantization_config`, compressed-tensors): HF cannot load them into
    `DeepseekV3ForCausalLM` as plain weights, so `load_text_model` refuses a quantized wrapper rather than leave
    those experts randomly initialised; dequantise the checkpoint first, or capture through vLLM
    (`extract.engine=vllm`, which loads the checkpoint as shipped);
  * its size: ~2 TB dequantised to bf16, more than one 8-GPU node holds (8 x 141 GB on H200s), while
    `targets.load_target` spreads a target only over one task's GPUs (device_map). The dry run refuses such a
    layout with the numbers (`preflight.memory_findings`); `+experiment=kimi_eagle3_vllm` captures it INT4 in
    vLLM instead (docs/kimi_k25.md#capturing-the-states-in-vllm-experimentkimi_eagle3_vllm).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Wrapper:
    """A multimodal architecture that wraps a causal text model."""

    architecture: str  # config.json `architectures[0]`
    model_type: str  # config.json `model_type`
    text_attribute: str  # the wrapper's attribute holding the text causal LM; also its weights' name prefix
    text_architecture: str  # the transformers class of the text model

    @property
    def prefix(self) -> str:
        return f"{self.text_attribute}."


KIMI_K25 = Wrapper("KimiK25ForConditionalGeneration", "kimi_k25", "language_model", "DeepseekV3ForCausalLM")
WRAPPERS = {w.architecture: w for w in (KIMI_K25,)}


class WrapperError(ValueError):
    """A wrapper checkpoint this project cannot load as its text model."""


def wrapper_of(config: dict[str, Any]) -> Wrapper | None:
    """The wrapper a config.json dict describes (known architecture and a `text_config`), else None."""
    architectures = config.get("architectures") or []
    if not architectures or architectures[0] not in WRAPPERS or "text_config" not in config:
        return None
    return WRAPPERS[architectures[0]]


def read_config(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "config.json").read_text())


def wrapper_config(wrapper: Wrapper, text_config: dict[str, Any], **top_level: Any) -> dict[str, Any]:
    """The wrapper's config.json for a text model config: architecture, model type, `top_level` (the vision
    tower's `vision_config`, token ids, ...) and `text_config`."""
    text = {**text_config, "architectures": [wrapper.text_architecture]}
    return {"architectures": [wrapper.architecture], "model_type": wrapper.model_type, **top_level, "text_config": text}


def wrapped_state_dict(wrapper: Wrapper, text_model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a text model built from its config under the names the wrapper checkpoint gives them: as
    transformers' own `save_pretrained` names them (its load-time conversion reversed: one tensor per routed
    expert and projection), under the wrapper's prefix. (A model `load_text_model` loaded reverses to these names
    by itself: its conversions include the prefix it was loaded from.)"""
    from transformers.core_model_loading import revert_weight_conversion

    state = revert_weight_conversion(text_model, text_model.state_dict())
    return {wrapper.prefix + name: tensor.contiguous() for name, tensor in state.items()}


class TextOnly(nn.Module):
    """A wrapper checkpoint's text model, held under the wrapper's attribute name (`language_model`), with the
    causal-LM surface the stages use (forward, generate, the output embeddings) passed through to it."""

    def __init__(self, wrapper: Wrapper, text_model: nn.Module, config: dict[str, Any]):
        super().__init__()
        self.wrapper = wrapper
        self.wrapper_config = config
        setattr(self, wrapper.text_attribute, text_model)

    @property
    def text_model(self) -> nn.Module:
        return getattr(self, self.wrapper.text_attribute)

    def forward(self, *args, **kwargs):
        return self.text_model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.text_model.generate(*args, **kwargs)

    def get_input_embeddings(self) -> nn.Module:
        return self.text_model.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.text_model.get_output_embeddings()


def load_text_model(path: Path, config: dict[str, Any], wrapper: Wrapper, placement: dict[str, Any]) -> TextOnly:
    """The wrapper checkpoint's text model, every text weight read from the checkpoint; `placement` holds
    `from_pretrained`'s dtype and device arguments (`targets.load_target`)."""
    import transformers

    where = f"{path}/config.json"
    quantized = config.get("quantization_config") or config["text_config"].get("quantization_config")
    if quantized:
        raise WrapperError(
            f"{where}: quantization_config {quantized.get('quant_method', quantized)!r}: the quantized weights cannot "
            f"load into transformers' {wrapper.text_architecture} as plain tensors (they would stay random); "
            "dequantise the checkpoint to bf16 first, or capture hidden states through the serving engine"
        )
    text_class = getattr(transformers, wrapper.text_architecture)
    # The real text_config may name a remote-code model_type (kimi_k2) and auto_map; the fields are DeepSeek-V3's.
    text_fields = {
        k: v for k, v in config["text_config"].items() if k not in ("model_type", "architectures", "auto_map")
    }
    text_config = text_class.config_class.from_dict(text_fields)
    model, info = text_class.from_pretrained(
        path,
        config=text_config,
        key_mapping={rf"^{wrapper.prefix}": ""},
        output_loading_info=True,
        **placement,
    )
    if info["missing_keys"]:
        raise WrapperError(
            f"{path}: weights {sorted(info['missing_keys'])[:5]} (of {len(info['missing_keys'])}) missing under "
            f"'{wrapper.prefix}'; a {wrapper.architecture} checkpoint names its text model's weights "
            f"'{wrapper.prefix}model.layers.N...' and '{wrapper.prefix}lm_head.weight'"
        )
    model.eval()
    return TextOnly(wrapper, model, config).eval()
