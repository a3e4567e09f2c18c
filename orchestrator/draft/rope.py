"""The draft's rotary embedding, as SGLang 0.5.23 builds it from the draft's config.json.

One place reads a rope from an HF config (target or draft), computes it, and writes it back, so that what the
draft is trained with and what SGLang serves it with cannot disagree (docs/rope.md).

Reading mirrors SGLang 0.5.23's `LlamaDecoderLayer` (`sglang/srt/models/llama.py`, which the EAGLE-3 draft
`LlamaForCausalLMEagle3` reuses): a `rope_parameters` dict (transformers 5 spelling) is read first, its
`rope_theta` and its scaling keys; else `rope_theta` (default 10000) and `rope_scaling`. The type is
`rope_type`, else `type`, else "default". Absent rope keys therefore mean theta 10000, never "unknown".

Computing mirrors `get_rope` (`sglang/srt/layers/rotary_embedding/factory.py`, `yarn.py`) for the types below;
any other type, a per-layer-type rope, or a key SGLang would ignore is refused, naming the key, rather than
trained one way and served another.

Writing (`config_keys`): the draft config carries the rope in both spellings, always: `rope_theta` +
`rope_scaling` (omitted for "default") and a matching `rope_parameters`. SGLang reads `rope_parameters` first and
transformers 5 folds the legacy keys into it, so whichever path a given SGLang/transformers pair takes, it reads
the same values. Only the keys the target's config gave are written (no defaults filled in), so the draft
config says what the target's says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_THETA = 10000.0

# type -> (required keys, optional keys with SGLang's defaults), all in the rope dict's own spelling
TYPES: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "default": ((), {}),
    "linear": (("factor",), {}),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), {}),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        {
            "extrapolation_factor": 1.0,
            "attn_factor": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": None,
            "mscale_all_dim": None,
            "truncate": True,
        },
    ),
}
INT_KEYS = {"original_max_position_embeddings"}
BOOL_KEYS = {"truncate"}
# keys that name the rope, not parameterise it
NAME_KEYS = {"rope_type", "type", "rope_theta"}


class RopeError(ValueError):
    """A rope the draft cannot be trained with exactly as SGLang would serve it."""


@dataclass
class RopeSpec:
    """A rope, normalised: theta, type, and the type's parameters as the config gave them."""

    theta: float = DEFAULT_THETA
    type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The `rope_parameters` spelling (also the provenance record)."""
        return {"rope_theta": self.theta, "rope_type": self.type, **self.params}

    def param(self, key: str) -> Any:
        return self.params.get(key, TYPES[self.type][1].get(key))

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in sorted(self.params.items()))
        return f"{self.type} rope, theta {self.theta:g}" + (f" ({extra})" if extra else "")


def read(config: dict[str, Any], where: str = "config.json") -> RopeSpec:
    """The rope SGLang 0.5.23 builds from this HF config dict (see the module docstring for the order)."""
    parameters = config.get("rope_parameters")
    if parameters:
        if not isinstance(parameters, dict) or any(isinstance(v, dict) for v in parameters.values()):
            raise RopeError(
                f"{where}: rope_parameters={parameters!r}: only one global rope dict is supported, "
                f"not a per-layer-type one"
            )
        scaling, key = parameters, "rope_parameters"
        theta = parameters.get("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    else:
        scaling, key = config.get("rope_scaling") or {}, "rope_scaling"
        theta = config.get("rope_theta", DEFAULT_THETA)
    if not isinstance(scaling, dict):
        raise RopeError(f"{where}: {key}={scaling!r}, expected a dict or null")
    if theta is None:
        theta = DEFAULT_THETA
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in TYPES:
        raise RopeError(
            f"{where}: {key}.rope_type={kind!r} is not supported by the draft's rope (supported: {sorted(TYPES)}); "
            "training with another rope than SGLang serves would silently lower acceptance"
        )
    partial = config.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise RopeError(f"{where}: partial_rotary_factor={partial}: the draft rotates the whole head (expected 1.0)")
    required, optional = TYPES[kind]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise RopeError(f"{where}: {key} of type {kind!r} lacks {missing}")
    unknown = sorted(set(scaling) - NAME_KEYS - set(required) - set(optional) - {"partial_rotary_factor"})
    if unknown:
        raise RopeError(
            f"{where}: {key} keys {unknown} are not read by SGLang 0.5.23's {kind!r} rope "
            f"(it reads {sorted([*required, *optional])}); remove them or convert them "
            f"(HF's attention_factor is SGLang's attn_factor)"
        )
    params = {k: _normalise(k, scaling[k]) for k in (*required, *optional) if scaling.get(k) is not None}
    return RopeSpec(float(theta), kind, params)


def _normalise(key: str, value: Any) -> Any:
    if key in BOOL_KEYS:
        return bool(value)
    if key in INT_KEYS:
        return int(value)
    return float(value)


def config_keys(spec: RopeSpec) -> dict[str, Any]:
    """The draft config.json's rope keys, in both spellings (module docstring)."""
    keys: dict[str, Any] = {"rope_theta": spec.theta}
    if spec.type != "default":
        keys["rope_scaling"] = {"rope_type": spec.type, **spec.params}
    keys["rope_parameters"] = spec.as_dict()
    return keys


# ------------------------------------------------------------------------------------------------ computing


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def _llama3(spec: RopeSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    # sglang Llama3RotaryEmbedding._compute_inv_freq
    factor, low, high = spec.param("factor"), spec.param("low_freq_factor"), spec.param("high_freq_factor")
    old_context = spec.param("original_max_position_embeddings")
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context / wavelen - low) / (high - low) if low != high else torch.zeros_like(inv_freq)
    return torch.where(
        wavelen < high_freq_wavelen,
        inv_freq,
        torch.where(
            wavelen > low_freq_wavelen, inv_freq / factor, (1 - smooth) * inv_freq / factor + smooth * inv_freq
        ),
    )


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    # sglang YaRNScalingRotaryEmbedding._compute_inv_freq / _yarn_find_correction_range / _yarn_linear_ramp_mask
    factor, theta = spec.param("factor"), spec.theta
    original = spec.param("original_max_position_embeddings")

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(spec.param("beta_fast")), correction_dim(spec.param("beta_slow"))
    if spec.param("truncate"):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_mask = (1 - ramp) * spec.param("extrapolation_factor")
    inv_freq = interpolation * (1 - extrapolation_mask) + extrapolation * extrapolation_mask
    mscale, mscale_all_dim = spec.param("mscale"), spec.param("mscale_all_dim")
    # SGLang's test: both set, 0 included (transformers takes the ratio only when both are non-zero, so with a 0 the
    # two differ: mscale 0 gives 1/(0.1 ln factor + 1) here and in SGLang, 0.1 ln factor + 1 in transformers)
    if mscale is not None and mscale_all_dim is not None:
        scale = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
    else:
        scale = yarn_get_mscale(factor)
    return inv_freq, float(scale * spec.param("attn_factor"))


def rotary(spec: RopeSpec, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, cos/sin scale) of the rope; the angle at position p is p * inv_freq."""
    if spec.type == "yarn":
        return _yarn(spec, head_dim)
    inv_freq = _base_inv_freq(spec.theta, head_dim)
    if spec.type == "linear":
        # sglang LinearScalingRotaryEmbedding divides positions by the factor; the same angles
        return inv_freq / spec.param("factor"), 1.0
    if spec.type == "llama3":
        return _llama3(spec, inv_freq), 1.0
    return inv_freq, 1.0
