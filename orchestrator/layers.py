"""The layer contract: what an `aux_layers` entry means, and every engine's way of writing it.

Canonical meaning, used by the config and every manifest:
    k >= 0  the output of decoder layer k (0-based), before any final norm;
    k == -1 the embedding output (the state entering decoder layer 0).

Every engine has its own id convention. This module is the only place that converts between them; nothing
else in the project adds or subtracts one from a layer id. Each conversion is expressed as "which state does
engine id i capture" (a decode function, table-driven below) and the encoder searches for ids whose decoding is
exactly the canonical list, so an encoding that cannot express the request raises instead of silently
capturing something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

EMBEDDING = -1

# Teacher kinds: which tensor the extraction stores as the teacher's final state.
#   post_norm: output of the final norm (HF's last `hidden_states` entry); teacher logits = lm_head(state).
#   pre_norm:  raw output of the last decoder layer; teacher logits = lm_head(norm(state)).
TEACHER_KINDS = ("post_norm", "pre_norm")


class LayerContractError(ValueError):
    """A layer list that an engine cannot express, or that is not a valid canonical list."""


def validate_canonical(layers: Sequence[int], num_layers: int, key: str = "aux_layers") -> tuple[int, ...]:
    """Checks a canonical layer list against a target with `num_layers` decoder layers."""
    layers = tuple(int(k) for k in layers)
    if not layers:
        raise LayerContractError(f"{key}: empty list; expected decoder-layer indices in [-1, {num_layers - 1}]")
    bad = [k for k in layers if not EMBEDDING <= k <= num_layers - 1]
    if bad:
        raise LayerContractError(
            f"{key}={list(layers)}: {bad} out of range for a target with {num_layers} decoder layers; "
            f"allowed: -1 (embedding output) .. {num_layers - 1} (output of the last decoder layer)"
        )
    if len(set(layers)) != len(layers):
        raise LayerContractError(f"{key}={list(layers)}: duplicate entries; each layer may appear once")
    if list(layers) != sorted(layers):
        raise LayerContractError(
            f"{key}={list(layers)}: must be ascending, e.g. {sorted(layers)}; serving engines concatenate the "
            f"captured states in ascending layer order whatever order the list has, so training must too"
        )
    return layers


def describe(k: int) -> str:
    return "embedding output" if k == EMBEDDING else f"output of decoder layer {k}"


# ---------------------------------------------------------------------------------------------- HF transformers


def hf_hidden_states_index(k: int, num_layers: int) -> int:
    """Index into HF `output_hidden_states` holding canonical state k.

    `hidden_states[0]` is the embedding output and `hidden_states[i]` the output of layer i-1, except the last
    entry, which HF takes after the final norm. The raw output of the last layer is therefore not in
    `hidden_states` at all; capture it with a hook on the layer (see `hf_capture_point`).
    """
    validate_canonical([k], num_layers)
    if k == num_layers - 1:
        raise LayerContractError(
            f"layer {k} is the last decoder layer: HF's hidden_states[{num_layers}] is the final norm's output, "
            f"not the layer's raw output; capture it with a forward hook on model.layers.{k} instead"
        )
    return k + 1


def hf_capture_point(k: int, num_layers: int) -> str:
    """Name of the base-model submodule whose forward output is canonical state k."""
    validate_canonical([k], num_layers)
    return "embed_tokens" if k == EMBEDDING else f"layers.{k}"


def hf_teacher_capture_point(teacher: str, num_layers: int) -> str:
    if teacher == "post_norm":
        return "norm"
    if teacher == "pre_norm":
        return f"layers.{num_layers - 1}"
    raise LayerContractError(f"teacher kind {teacher!r} unknown; expected one of {TEACHER_KINDS}")


# ------------------------------------------------------------------------------------------- engine id tables


@dataclass(frozen=True)
class IdRule:
    """How an engine reads a list of aux-layer ids.

    `decode(ids, num_layers)` returns the canonical state each id captures (None: captured nowhere). The
    engine's capture loop is over the states *entering* decoder layers 0..N-1 (plus, where `final_capturable`,
    the state after the last layer), so "entering layer j" is canonical j-1.
    """

    name: str
    decode: Callable[[Sequence[int], int], list[int | None]]
    source: str


def _entering(j: int, num_layers: int, final_capturable: bool) -> int | None:
    """Canonical state entering layer j (j == num_layers: after the last layer, if the engine captures it)."""
    if 0 <= j < num_layers or (final_capturable and j == num_layers):
        return j - 1
    return None


def _decode_shift(ids: Sequence[int], n: int) -> list[int | None]:
    # layers_to_capture = [i + 1 for i in ids]; captured before layer j runs, for j in range(N).
    return [_entering(i + 1, n, final_capturable=False) for i in ids]


def _decode_first_id(ids: Sequence[int], n: int) -> list[int | None]:
    # Shift only when the first id is 1; otherwise ids name the layer whose input is captured.
    if ids and ids[0] == 1:
        return _decode_shift(ids, n)
    return [_entering(i, n, final_capturable=False) for i in ids]


def _decode_entering_with_final(ids: Sequence[int], n: int) -> list[int | None]:
    # id i = state entering layer i; i == N is the final pre-norm state.
    return [_entering(i, n, final_capturable=True) for i in ids]


SGLANG_SHIFT = IdRule(
    "sglang-shift",
    _decode_shift,
    "sglang 0.5.23 python/sglang/srt/models/llama.py LlamaForCausalLM.set_eagle3_layers_to_capture: "
    "layers_to_capture = [val + 1 for val in layer_ids], captured before layer j runs (LlamaModel.forward); "
    "every family before PR #25454 (0.5.12's deepseek_v2.py too)",
)
SGLANG_FIRST_ID = IdRule(
    "sglang-first-id",
    _decode_first_id,
    "sglang 0.5.23 python/sglang/srt/models/deepseek_v2.py DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
    "(PR #25454, first in 0.5.13): [val + 1 ...] only when layer_ids[0] == 1, else list(layer_ids); "
    "DeepseekV3ForCausalLM inherits it, and kimi_k25.py's KimiK25ForConditionalGeneration passes the ids to its "
    "DeepseekV3ForCausalLM language_model",
)


def _decode_entering_no_embedding(ids: Sequence[int], n: int) -> list[int | None]:
    # id i = state entering layer i for 1 <= i < N, id N the final pre-norm state; id 0 (the embedding, whose
    # residual is still None there) captures nothing.
    return [i - 1 if 1 <= i <= n else None for i in ids]


VLLM_ENTERING = IdRule(
    "vllm-entering",
    _decode_entering_with_final,
    "vllm vllm/model_executor/models/llama.py LlamaModel.forward: EagleModelMixin._maybe_add_hidden_state records "
    "the embedding as id start_layer (0) and the state after layer idx as id idx + 1, so id k = state entering "
    "layer k and id N the final pre-norm state (checked in vllm 0.32.0; speculators writes the same ids)",
)
VLLM_DEEPSEEK = IdRule(
    "vllm-deepseek-entering",
    _decode_entering_no_embedding,
    "vllm vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward: `if idx in aux_hidden_state_layers` "
    "records hidden_states + residual before layer idx runs (residual is None before layer 0, so id 0 fails), and "
    "`if self.end_layer in aux_hidden_state_layers` the state after the last layer; Kimi-K2.5's language model is "
    "this model (checked in vllm 0.32.0)",
)
# The vLLM versions whose capture loops were read for the rules above; another version has no recorded rule.
VLLM_CHECKED = (0, 32)

# SGLang versions that include PR #25454 (the first-id rule for the DeepSeek/Kimi family): absent from the
# 0.5.12 and 0.5.12.post1 wheels' deepseek_v2.py, present in 0.5.13's.
SGLANG_FIRST_ID_SINCE = (0, 5, 13)
# The newest SGLang whose model code was read for the rules above; a newer one has no recorded rule. (Families
# the project does not accept have other rules there: gpt_oss.py keeps ids as they are when the largest is N,
# since 0.5.17; a family with no rule here is refused.)
SGLANG_CHECKED_UNTIL = (0, 5, 23)


def parse_version(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in version.split("+")[0].split("."))
    except ValueError as exc:
        raise LayerContractError(f"version {version!r} is not of the form X.Y.Z") from exc


def captured_layers(rule: IdRule, ids: Sequence[int], num_layers: int) -> list[int]:
    """Canonical states an engine captures for `ids`, in the order it concatenates them (ascending)."""
    return sorted({k for k in rule.decode(list(ids), num_layers) if k is not None})


def encode(rule: IdRule, layers: Sequence[int], num_layers: int) -> list[int]:
    """Engine ids that make `rule` capture exactly the canonical `layers`, or a LayerContractError saying why not."""
    layers = list(validate_canonical(layers, num_layers))
    candidates = [[k + d for k in layers] for d in (0, 1)]
    for ids in candidates:
        if rule.decode(ids, num_layers) == layers:
            return ids
    raise LayerContractError(_why_not(rule, layers, num_layers, candidates))


def _why_not(rule: IdRule, layers: list[int], num_layers: int, candidates: list[list[int]]) -> str:
    def captured(ids: list[int]) -> str:
        return ", ".join(describe(k) if k is not None else "nothing" for k in rule.decode(ids, num_layers))

    tried = "; ".join(f"ids {ids} would capture [{captured(ids)}]" for ids in candidates)
    hint = ""
    if num_layers - 1 in layers and rule not in (VLLM_ENTERING, VLLM_DEEPSEEK):
        hint = (
            f" The last decoder layer ({num_layers - 1}) is never captured by this engine; "
            f"use {num_layers - 2} or lower."
        )
    elif rule is VLLM_DEEPSEEK and EMBEDDING in layers:
        hint = " vLLM captures no embedding output for this family (id 0 fails there); start with layer 0 or above."
    elif rule is SGLANG_FIRST_ID and layers and layers[0] == 0:
        hint = " With this rule the output of layer 0 cannot be the first aux layer; start with -1 (embedding) or 1."
    return (
        f"{rule.name} cannot capture {layers} ({', '.join(describe(k) for k in layers)}) on a {num_layers}-layer "
        f"target: {tried}.{hint} (rule: {rule.source})"
    )
