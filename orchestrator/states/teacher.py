"""The teacher's head: the target's frozen final norm and lm_head, applied to a captured teacher state. Training
takes the teacher's distribution from it, and eval through a capture engine takes the target's greedy token from it,
so that neither loads the target's decoder."""

from __future__ import annotations

import torch

from orchestrator.states.assemble import rms_norm


class TeacherHead(torch.nn.Module):
    """The target's frozen final norm (for pre-norm teacher states) and lm_head. The teacher's logits are computed
    only on the draft vocabulary's rows of the head; its argmax over the full vocabulary goes a block of rows at a
    time, so that no [B, L, vocabulary] logits tensor exists: a block holds at most `block_elements` logits."""

    def __init__(self, tensors: dict[str, torch.Tensor], teacher: str, eps: float, block_elements: int = 2**28):
        super().__init__()
        self.teacher, self.eps, self.block_elements = teacher, eps, block_elements
        self.register_buffer("norm", tensors["norm"])
        self.register_buffer("lm_head", tensors["lm_head"])

    def forward(self, state: torch.Tensor, kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's logits on the draft vocabulary (target ids `kept`) [..., Vd], and its argmax over the full
        vocabulary [...] (a token outside the draft vocabulary is one the draft can never match)."""
        if self.teacher == "pre_norm":
            state = rms_norm(state, self.norm, self.eps)
        kept_logits = state @ self.lm_head.index_select(0, kept).T
        vocab = self.lm_head.shape[0]
        rows = max(1, self.block_elements // max(1, state.shape[:-1].numel()))
        best_value = best_id = None
        for start in range(0, vocab, rows):
            value, index = (state @ self.lm_head[start : start + rows].T).max(-1)
            if best_id is None:
                best_value, best_id = value, index
            else:  # strictly greater: on a tie the lower id wins, as one argmax over the vocabulary would have it
                better = value > best_value
                best_value, best_id = (
                    torch.where(better, value, best_value),
                    torch.where(better, index + start, best_id),
                )
        return kept_logits, best_id
