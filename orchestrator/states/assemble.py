"""An engine's raw per-layer output to `SequenceStates`, in one place for every capture engine: the check that the
states are of the tokens sent, the target's final norm where the engine captured the last layer before it, the
embedding output where the engine has no id for it (taken from the checkpoint's table), and the extraction's dtype.
HF's hooks (orchestrator/engines/hf/) and vLLM's extractor (orchestrator/engines/vllm/capture.py) differ only in what
they hand in."""

from __future__ import annotations

from typing import Any

import torch

from orchestrator.artifacts import ArtifactError
from orchestrator.compute import DTYPES
from orchestrator.states.shards import SequenceStates


def rms_norm(state: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The target's final RMSNorm, as HF's Llama-family models compute it (in the state's dtype)."""
    return state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + eps) * weight


class Assembler:
    """Turns one sequence's captured states into `SequenceStates` in `dtype` (an `extract.dtype` name). With `norm`
    (the final norm's weight, and `eps`), the teacher is handed in as the last layer's raw output and normed here,
    as the target's model norms it; without, it is handed in as the teacher already is. With `embed` (the
    checkpoint's embedding table, as stored), the aux states are handed in without the embedding output, and its
    rows at the sequence's tokens go first: the state a family whose embedding is a plain look-up computes there
    (`families.Family.embedding_lookup`), to the last bit."""

    def __init__(
        self, dtype: str, norm: torch.Tensor | None = None, eps: float = 1e-6, embed: torch.Tensor | None = None
    ):
        self.dtype, self.norm, self.eps, self.embed = DTYPES[dtype], norm, eps, embed

    @property
    def computed(self) -> int:
        """How many of the aux layers this assembler computes rather than receives (the embedding output, or none)."""
        return int(self.embed is not None)

    def sequence(
        self,
        rendered: Any,
        aux: torch.Tensor,
        teacher: torch.Tensor,
        captured_ids: torch.Tensor | None = None,
        where: str = "",
    ) -> SequenceStates:
        """`rendered` (its `input_ids` and `loss_mask`) with its states: `aux` [>=T, K, H] or [>=T, K*H] and
        `teacher` [>=T, H], of which the first T positions are the sequence's (a capture may hold tokens past a
        response's cut). `captured_ids`, where the engine reports the tokens it computed, must begin with the
        sequence's: states of other tokens are refused, naming `where` (what captured them)."""
        length = len(rendered.input_ids)
        if captured_ids is not None and (
            len(captured_ids) < length or captured_ids[:length].tolist() != list(rendered.input_ids)
        ):
            raise ArtifactError(f"{where or 'a capture'} holds the states of other tokens than were sent")
        aux, teacher = aux[:length], teacher[:length]
        if self.embed is not None:
            ids = torch.tensor(rendered.input_ids, dtype=torch.long)
            hidden = self.embed.shape[1]
            aux = torch.cat([self.embed[ids].to(aux.dtype)[:, None], aux.reshape(length, -1, hidden)], dim=1)
        if self.norm is not None:
            teacher = rms_norm(teacher.float(), self.norm, self.eps)
        return SequenceStates(
            torch.tensor(rendered.input_ids, dtype=torch.long),
            torch.tensor(rendered.loss_mask, dtype=torch.bool),
            aux.flatten(1).to(self.dtype),
            teacher.to(self.dtype),
        )
