"""The last captured records, kept in memory for the draft-health guard: what it scores two draft
versions on, teacher-forced, when it must decide whether to roll one back (`serve.judge`).

`RecentRecords` is a capture sink (`engine.generation.CaptureSink`) of its own, so an engine without
a writer can feed it, and `capture.writer.CaptureWriter` keeps one beside its queue.
"""
from __future__ import annotations

import threading
from collections import deque

import torch


class RecentRecords:
    """The newest `maxlen` captured records (all classes together), each with its workload class.

    A record: input_ids `[T]` int32, loss_mask `[T]` uint8, aux_hidden_states `[T, 3H]` bf16,
    hidden_states `[T, H]` bf16 (`capture.store`); memory ~8·H·T bytes each (~0.9 MB at H = 576,
    T = 200). Thread-safe. Raises ValueError for maxlen < 1."""

    def __init__(self, maxlen: int = 64):
        if maxlen < 1:
            raise ValueError(f"maxlen must be >= 1 record, got {maxlen}")
        self._items: deque[tuple[str, dict[str, torch.Tensor]]] = deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def wants(self, request_id: str) -> bool:
        """Every request (as a sink of its own; a writer asks its sample rate first)."""
        return True

    def submit_generation(self, gen, workload: str = "default", prompt_id: str = "") -> bool:
        """Keep `gen.record` (a finished, captured Generation) under `workload`; False without one."""
        if gen.record is None:
            return False
        with self._lock:
            self._items.append((workload, gen.record))
        return True

    def records(self, workload: str | None = None) -> list[dict[str, torch.Tensor]]:
        """The kept records of one class (None: all), oldest first."""
        with self._lock:
            return [r for w, r in self._items if workload is None or w == workload]
