"""`StateSource`: what training and eval read states from, without knowing where they come from.

A source is one split's sequences, numbered 0..len-1. The trainer asks for them in the order of `step_indices`, a
seeded permutation per epoch that depends on the step alone, so a resumed run asks for exactly what an
uninterrupted one would, and so a producer that computes states on the fly (a live capture engine streaming them)
can compute the same order and run ahead of the trainer by a bounded buffer. The offline source is the extraction's
shards (`orchestrator.states.shards.ShardedSplit`), read in any order.
"""

from __future__ import annotations

import math
from typing import Iterable, Protocol

import torch

from orchestrator.states.shards import SequenceStates


class StateSource(Protocol):
    def __len__(self) -> int:
        """The split's sequences (one epoch)."""

    def take(self, indices: Iterable[int]) -> list[SequenceStates]:
        """The states of the sequences `indices`, in that order."""

    def close(self) -> None:
        """Releases what the source holds (open files; a stream's connection)."""


def step_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the sequences in global step `step`: a seeded permutation per epoch, so a resumed run
    sees exactly the batches an uninterrupted one would."""
    per_epoch = math.ceil(n / batch_size)
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()
    return order[index * batch_size : (index + 1) * batch_size]
