"""Captures target hidden states with forward hooks, at the points the layer contract names.

Used by extraction (what training sees), by standalone eval and by the reference engine (what serving sees),
so all three read states through the same code; only the layer list they are given differs.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from orchestrator import layers as layer_contract


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (`embed_tokens`, `layers`, `norm`) of an HF causal LM, or of the causal LM a multimodal
    wrapper holds as `language_model` (Kimi-K2.5: `model.language_model.model`; `orchestrator/wrappers.py`)."""
    for attribute in ("model", "base_model"):
        base = getattr(model, attribute, None)
        if base is not None and hasattr(base, "layers"):
            return base
    text_model = getattr(model, "language_model", None)
    if isinstance(text_model, nn.Module):
        return text_model if hasattr(text_model, "layers") else base_model(text_model)
    raise TypeError(
        f"{type(model).__name__}: cannot find the decoder stack "
        "(model.model.layers, or model.language_model.model.layers)"
    )


def num_decoder_layers(model: nn.Module) -> int:
    return len(base_model(model).layers)


class HiddenStateCapture:
    """Context manager: while active, each forward of `model` records the canonical `layers` and the teacher.

    `aux()` returns the recorded states concatenated in the given (ascending) order, [batch, seq, K*H];
    `teacher()` the teacher state [batch, seq, H]. Only the hooked modules' outputs are kept, never all layers.
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], teacher: str | None = None):
        self.base = base_model(model)
        n = len(self.base.layers)
        self.layers = list(layer_contract.validate_canonical(layers, n))
        self.points = [layer_contract.hf_capture_point(k, n) for k in self.layers]
        self.teacher_point = layer_contract.hf_teacher_capture_point(teacher, n) if teacher else None
        self._states: dict[str, torch.Tensor] = {}
        self._handles: list = []

    def _hook(self, name: str):
        def record(_module, _inputs, output):
            self._states[name] = output[0] if isinstance(output, tuple) else output

        return record

    def __enter__(self) -> "HiddenStateCapture":
        names = dict.fromkeys(self.points + ([self.teacher_point] if self.teacher_point else []))
        for name in names:
            module = self.base.get_submodule(name)
            self._handles.append(module.register_forward_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def clear(self) -> None:
        self._states.clear()

    def state(self, point: str) -> torch.Tensor:
        if point not in self._states:
            raise RuntimeError(f"no state captured at {point}: run a forward inside the capture context first")
        return self._states[point]

    def aux(self) -> torch.Tensor:
        """The recorded states side by side, on the first one's device (a target spread over several GPUs
        records each layer's state where that layer sits)."""
        states = [self.state(p) for p in self.points]
        return torch.cat([s.to(states[0].device) for s in states], dim=-1)

    def teacher(self) -> torch.Tensor:
        if self.teacher_point is None:
            raise RuntimeError("this capture was created without a teacher kind")
        return self.state(self.teacher_point)


def teacher_logits(model: nn.Module, state: torch.Tensor, teacher: str) -> torch.Tensor:
    """The target's next-token logits from a stored teacher state of the given kind."""
    if teacher == "pre_norm":
        state = base_model(model).norm(state)
    elif teacher != "post_norm":
        raise ValueError(f"teacher kind {teacher!r} unknown; expected one of {layer_contract.TEACHER_KINDS}")
    return model.get_output_embeddings()(state)
