"""Records read ahead of the trainer by a producer thread, through a queue bounded in bytes.

The producer runs `read(positions)` over the positions in order, `batch` at a time (a shard
read, or, for tokens-only records, the target's prefill: `train.online`) while the trainer
prepares and trains on what it already has; torch releases the GIL inside its kernels, so the
two overlap. The queue holds at most `max_bytes` of records plus the batch being read: a
bounded, pipelined producer/consumer, as
`torch.utils.data.DataLoader`'s prefetch, without worker processes (a worker would need its own
copy of the target). `max_bytes` 0 reads in line, in the caller's thread.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch


def record_bytes(r: dict) -> int:
    """Bytes of a record's tensors."""
    return sum(t.numel() * t.element_size() for t in r.values() if isinstance(t, torch.Tensor))


class Prefetch:
    """(position, record) for each of `positions`, in order, read `batch` at a time by a producer
    thread that stays at most `max_bytes` (plus one batch) ahead of the consumer. Iterate once; `close()` (or
    leaving a `with` block, or abandoning the iteration) stops the producer. An exception raised
    by `read` is raised by the iteration at that record's turn. `peak_bytes`: the most the queue
    held (what the bound allowed, for tests and benchmarks)."""

    def __init__(self, read: Callable[[list[int]], list[dict]], positions: Sequence[int], max_bytes: int,
                 batch: int = 1):
        self._read, self._positions, self._max, self._batch = read, list(positions), int(max_bytes), max(1, batch)
        self._cv = threading.Condition()
        self._items: deque = deque()
        self._held = self.peak_bytes = 0
        self._stop = False
        self._thread = threading.Thread(target=self._produce, name="tidespec-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        for k in range(0, len(self._positions), self._batch):
            chunk = self._positions[k:k + self._batch]
            with self._cv:
                self._cv.wait_for(lambda: self._stop or not self._items or self._held < self._max)
                if self._stop:
                    return
            try:
                items = [(i, r, None, record_bytes(r)) for i, r in zip(chunk, self._read(chunk), strict=True)]
            except BaseException as e:  # noqa: BLE001 -- handed to the consumer, raised there at this chunk's turn
                items = [(chunk[0], None, e, 0)]
            with self._cv:
                self._items.extend(items)
                self._held += sum(n for *_, n in items)
                self.peak_bytes = max(self.peak_bytes, self._held)
                self._cv.notify_all()
            if items[0][2] is not None:
                return

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        try:
            for _ in self._positions:
                with self._cv:
                    self._cv.wait_for(lambda: self._items)
                    i, rec, err, n = self._items.popleft()
                    self._held -= n
                    self._cv.notify_all()
                if err is not None:
                    raise err
                yield i, rec
        finally:
            self.close()

    def close(self) -> None:
        """Stop the producer (it finishes the record it is reading) and drop what it queued."""
        with self._cv:
            self._stop = True
            self._items.clear()
            self._held = 0
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_ahead(read: Callable[[list[int]], list[dict]], positions: Sequence[int], max_bytes: int,
               batch: int = 1) -> Iterator[tuple[int, dict]]:
    """(position, record) for each of `positions`, read `batch` at a time: through a `Prefetch`
    when `max_bytes` > 0 and there is something to read, else in line."""
    if max_bytes > 0 and len(positions):
        yield from Prefetch(read, positions, max_bytes, batch)
    else:
        positions = list(positions)
        for k in range(0, len(positions), max(1, batch)):
            chunk = positions[k:k + max(1, batch)]
            yield from zip(chunk, read(chunk), strict=True)
