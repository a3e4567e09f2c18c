"""vLLM's hidden-states connector, made to run on a CPU as well: `CPUHiddenStatesConnector`.

Runs inside vLLM's environment, loaded by vLLM itself through `kv_connector_module_path` (capture.py sets it).
vLLM 0.32's `ExampleHiddenStatesConnector` (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) copies each finished request's states out of its cache with CUDA streams,
CUDA events and pinned host memory, so on a CPU it fails ("pin_memory=True requires a CUDA or other accelerator
backend"). Where the cache is on the CPU this subclass reads the same slots and then writes the same file (the same
`hidden_states` [tokens, layers, hidden] and `token_ids` tensors) the way the GPU path does: the request counts as
done sending once its states are copied out of the cache, and the file is written afterwards by vLLM's own writer
thread pool (`_write_tensors`), the lock file held exclusively from before the request's path is returned until
the file is whole. A reader must wait on that lock (vLLM's `load_hidden_states`; side/capture.py `_written`).
On a GPU it is vLLM's own path, unchanged.

`ORCHESTRATOR_CONNECTOR_WRITE_DELAY_S` (seconds, default 0) delays each CPU write by that much inside the writer
thread, lock held: a GPU's late write of a 117-470 MB file reproduced on a CPU, for the tests
(tests/test_vllm_capture.py).
"""

from __future__ import annotations

import fcntl
import os
import time
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

WRITE_DELAY = "ORCHESTRATOR_CONNECTOR_WRITE_DELAY_S"


class _Copied:
    """Stands for the CUDA event of the device-to-host copy: on a CPU the copy is done when the states are cloned
    out of the cache. `synchronize` (the writer thread's wait for the copy) adds the configured delay."""

    def __init__(self, delay_s: float):
        self.delay_s = delay_s

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda or not self._is_tp_rank_zero:
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        # cloned now: the request's blocks are freed once it counts as done sending
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        copied = _Copied(float(os.environ.get(WRITE_DELAY, "0") or 0))
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        future = self._executor.submit(self._write_tensors, tensors, copied, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copied
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
