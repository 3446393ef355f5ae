"""A KV connector for vLLM's `extract_hidden_states` method that runs on CPU: loaded by the vLLM
server process (`kv_connector_module_path`, this directory on its PYTHONPATH), never by tidespec.

vLLM 0.32's `ExampleHiddenStatesConnector` (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py) copies each finished request's hidden states out of the
hidden-state KV cache on a CUDA stream into pinned host memory, which fails without an accelerator
(`pin_memory=True requires a CUDA or other accelerator backend`). This subclass keeps everything
else (file naming, the per-file flock clients wait on, block bookkeeping) and replaces only that
copy: on CPU the cache already is host memory, so the rows are indexed out synchronously and handed
to the writer thread. Output per request: `<shared_storage_path>/<request id>.safetensors` with
`hidden_states` `[tokens, n_layers, hidden]` (the layers of `eagle_aux_hidden_state_layer_ids`, in
that order; vLLM's id k = the input of layer k) and `token_ids` `[tokens]`.
"""
from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the base class waits on: a CPU copy is complete when made."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class TidespecCPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous host-memory copy (no CUDA stream, no pinning)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        rows = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": rows, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
