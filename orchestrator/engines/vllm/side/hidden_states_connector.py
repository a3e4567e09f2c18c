"""vLLM's hidden-states connector, made to run on a CPU as well: `CPUHiddenStatesConnector`.

Runs inside vLLM's environment, loaded by vLLM itself through `kv_connector_module_path` (capture.py sets it).
vLLM 0.32's `ExampleHiddenStatesConnector` (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) copies each finished request's states out of its cache with CUDA streams,
CUDA events and pinned host memory, so on a CPU it fails ("pin_memory=True requires a CUDA or other accelerator
backend"). Where the cache is on the CPU this subclass reads the same slots and writes the same file (the same
`hidden_states` [tokens, layers, hidden] and `token_ids` tensors, the same lock-file handshake) synchronously;
on a GPU it is vLLM's own asynchronous path, unchanged.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands for the CUDA event vLLM polls in get_finished: a synchronous copy is complete when written."""

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda or not self._is_tp_rank_zero:
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
        self._req_copy_events[pending.req_id] = _Done()
