"""Training examples streamed from a `RecordSource` through a bounded buffer, split across ranks.

The plan is made from lengths alone, so every rank makes the same one and the LR schedule knows
its step count before any tensor is read:

1. `survey`: each rank prepares its share of the records (teacher logits, `examples.prepare`)
   once, to learn each one's trainable length (0: dropped, with the reason); the shares are
   gathered, so every rank holds the same lengths.
2. `epoch_plan`: when every prepared example fits `train.buffer_mb`, one buffer holds them all
   (kept in memory across epochs, the set prepared once). Otherwise the shard groups are
   shuffled (seeded by seed and epoch) and cut into buffers that fit; within a buffer examples
   are grouped by length into batches of ≤ `train.batch_tokens` padded tokens, and the batches
   shuffled (the trainer's RNG). A bounded shuffle buffer, as `torch.utils.data` shuffles an
   iterable dataset.
3. `batches`: rank r reads, prepares and collates rows r, r+world, … of each global batch.
   Each batch carries the global batch's token count, so a rank's loss divided by it, summed
   over ranks (`ranks.sum_grads`), is the one-process loss of the whole batch.

Records are read ahead by a producer thread (`train.prefetch`, `train.prefetch_mb`): while the
trainer works through one buffer, the next one's records are read (and, for a tokens-only
record, rehydrated: `train.online`) into a bounded queue.

Memory: one buffer of prepared examples (≤ `buffer_mb`, divided over the ranks), the prefetch
queue (≤ `prefetch_mb` + one record), the decoded shards `capture.store` caches, and one batch;
it does not grow with the set's size.
"""
from __future__ import annotations

import ctypes
import random
from collections import Counter
from collections.abc import Iterator

import torch

from ..config import TrainParams
from ..models.target import Target
from ..models.ttt import Example, collate, group_by_length
from . import ranks
from .examples import prepare
from .prefetch import read_ahead
from .source import RecordSource


def release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc `malloc_trim(0)`; a no-op elsewhere).
    A freed buffer's examples are hundreds of mid-sized tensors: glibc keeps them on its heap
    (its mmap threshold rises to the largest freed block), so without this the process holds
    a buffer's worth of freed memory on top of the next one."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM = None


def example_bytes_per_token(hidden: int, draft_vocab: int, weighted: bool = False) -> int:
    """Bytes one prepared token holds, at most: aux (3·4·H counted at fp32; bf16 records hold half)
    + teacher logits bf16 (2·Vd) + ids int64 + valid/keep bools (+ a loss weight fp32 when `weighted`)."""
    return 12 * hidden + 2 * draft_vocab + 8 + 2 + 4 * weighted


class ExampleStream:
    """Examples of `source` for one rank (`rank` of `world`), as `tparams` (`train` params) says:
    cut at `max_seq_len`, batched by `batch_tokens`, planned in buffers of at most `buffer_mb` MiB of
    prepared examples, records read `prefetch_mb` MiB ahead by a producer thread (0: in line),
    shuffled by `seed`; `loss_on_prompt` and `rejected_weight` (never for a `validation` stream: it
    scores generated positions, unweighted). `dropped` counts the records `prepare` drops (every rank's, gathered).
    Raises as `RecordSource.read` (a missing or corrupt shard, a record the target cannot
    rehydrate)."""

    def __init__(self, source: RecordSource, target: Target, t2d: torch.Tensor, tparams: TrainParams,
                 dropped: Counter, rank: int = 0, world: int = 1, *, validation: bool = False,
                 collective: bool = True):
        self.source, self.target, self.t2d = source, target, t2d
        self.prefetch_bytes = int(tparams.prefetch_mb * 2**20)
        self.max_len, self.batch_tokens, self.seed = tparams.max_seq_len, tparams.batch_tokens, tparams.seed
        self.loss_on_prompt = tparams.loss_on_prompt and not validation  # validation scores generated positions
        self.rejected_weight = 0.0 if validation else tparams.rejected_weight  # a loss weight: not scored
        buffer_mb, batch_tokens = tparams.buffer_mb, tparams.batch_tokens
        self.rank, self.world = rank, world
        per_token = example_bytes_per_token(target.cfg.hidden_size, int(t2d.sum()), self.rejected_weight > 0)
        self.capacity = max(1, int(buffer_mb * 2**20 // per_token))  # tokens of prepared examples per buffer
        if self.capacity < batch_tokens:  # batches are cut within a buffer: a smaller one would shrink them
            raise ValueError(f"train.buffer_mb {buffer_mb} holds {self.capacity} prepared tokens, fewer than "
                             f"train.batch_tokens {batch_tokens}: raise buffer_mb to at least "
                             f"{batch_tokens * per_token / 2**20:.2f} (a prepared token is {per_token} bytes here)")
        self._cache: dict[int, Example] | None = {}
        self.lengths = self._survey(dropped, collective)
        self.resident = sum(self.lengths) <= self.capacity  # every example in one buffer, kept across epochs
        if not self.resident:
            self._cache = None

    def __len__(self) -> int:
        """Examples kept (records not dropped)."""
        return sum(1 for t in self.lengths if t)

    def _prepare(self, record: dict, dropped: Counter) -> Example | None:
        ex = prepare([record], self.target, self.t2d, self.max_len, self.loss_on_prompt, dropped, self.rejected_weight)
        return ex[0] if ex else None

    def _read(self, positions: list[int]):
        """(position, record) for `positions` in order, read ahead by the producer thread."""
        return read_ahead(self.source.read_many, positions, self.prefetch_bytes, self.source.read_batch)

    def _survey(self, dropped: Counter, collective: bool) -> list[int]:
        """Every record's prepared length (0: dropped); each rank prepares its share, kept in the
        cache while the total fits one buffer (one process: the set is prepared once). Sets
        `weighted_positions`: learnable positions whose loss weight is not 1 (`rejected_weight`), all ranks'."""
        n = len(self.source)
        first, step = (self.rank, self.world) if collective else (0, 1)
        mine, local, held, weighted = {}, Counter(), 0, 0
        for i, rec in self._read(range(first, n, step)):
            ex = self._prepare(rec, local)
            mine[i] = 0 if ex is None else int(ex.ids.shape[0])
            if ex is not None and ex.weight is not None:
                weighted += int(((ex.weight != 1) & ex.valid).sum())  # learnable ones
            if ex is not None and self._cache is not None and step == 1:  # ranks cache their own rows later
                held += mine[i]
                self._cache[i] = ex
                if held > self.capacity:
                    self._cache = None  # does not fit: stream it
        parts = ranks.gather((mine, local, weighted)) if collective else [(mine, local, weighted)]
        lengths, self.weighted_positions = [0] * n, 0
        for m, c, w in parts:
            for i, t in m.items():
                lengths[i] = t
            dropped.update(c)
            self.weighted_positions += w
        return lengths

    def epoch_plan(self, epoch: int, rng: random.Random, shuffle: bool = True) -> list[list[list[int]]]:
        """The epoch's buffers, each a list of global batches (record positions, sorted by
        length). `rng` shuffles the batches within each buffer (the trainer's RNG: its state is
        the resume point); the shard order comes from (seed, epoch)."""
        live = [i for i, t in enumerate(self.lengths) if t]
        if self.resident:
            buffers = [live]
        else:
            units = list(self.source.units)
            if shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(units)
            buffers, cur, held = [], [], 0
            for i in (i for u in units for i in u if self.lengths[i]):
                if cur and held + self.lengths[i] > self.capacity:
                    buffers.append(cur)
                    cur, held = [], 0
                cur.append(i)
                held += self.lengths[i]
            if cur:
                buffers.append(cur)
        plan = []
        for buf in buffers:
            buf = sorted(buf)  # position order, so one buffer groups as the whole set would
            groups = group_by_length([self.lengths[i] for i in buf], self.batch_tokens, shuffle, rng)
            plan.append([[buf[j] for j in g] for g in groups])
        return plan

    def batches(self, plan: list[list[list[int]]], skip: int = 0, device: torch.device | str = "cpu",
                ) -> Iterator[tuple[int, int, tuple[torch.Tensor, ...] | None]]:
        """(batch number, global batch tokens, this rank's batch or None when its share is empty)
        over `plan`, from batch `skip` on (buffers before it are not read). One producer reads
        every buffer's records in turn, so the next buffer's are read while this one trains."""
        todo, b = [], 0
        for groups in plan:
            if b + len(groups) > skip:
                mine = [g[self.rank::self.world] for g in groups]
                todo.append((b, groups, mine, sorted(i for g in mine[max(0, skip - b):] for i in g)))
            b += len(groups)
        records = self._read([i for *_, pos in todo for i in pos if not self._cached(i)])
        for b, groups, mine, pos in todo:
            ex = self._examples(pos, records)
            for g, own in zip(groups, mine):
                if b >= skip:
                    yield b, sum(self.lengths[i] for i in g), collate([ex[i] for i in own], device) if own else None
                b += 1
            del ex
            if not self.resident:
                release_free_heap()

    def _cached(self, i: int) -> bool:
        return self._cache is not None and i in self._cache

    def _examples(self, positions: list[int], records: Iterator[tuple[int, dict]]) -> dict[int, Example]:
        """Prepared examples at `positions`: from the cache when resident, else the next of
        `records` (which yields the uncached positions in this order)."""
        out = {}
        for i in positions:
            if not self._cached(i):
                j, rec = next(records)
                assert j == i, (j, i)
                ex = self._prepare(rec, Counter())
                if self._cache is not None:
                    self._cache[i] = ex
                out[i] = ex
            else:
                out[i] = self._cache[i]
        return out

    def chunks(self) -> Iterator[list[Example]]:
        """Every kept example (this process, all ranks' shares), one buffer at a time, in
        position order (the holdout evaluation's input)."""
        bufs = [sorted(i for g in groups for i in g) for groups in self.epoch_plan(0, random.Random(0), shuffle=False)]
        records = self._read([i for pos in bufs for i in pos if not self._cached(i)])
        for pos in bufs:
            ex = self._examples(pos, records)
            yield [ex[i] for i in pos]


def token_counts(source: RecordSource, rank: int = 0, world: int = 1) -> Counter:
    """Counts of the loss-masked token ids over every record (each rank reads its share; the
    shares are gathered), inserted in order of first appearance in position order, so
    `Counter.most_common` breaks ties as one process counting in order would
    (`models.eagle3.count_tokens`, the draft vocabulary's input)."""
    seen: dict[int, list[int]] = {}  # token → [count, first record position, first offset]
    for i in range(rank, len(source), world):
        r = source.read(i, ("input_ids", "loss_mask"))
        for j, t in enumerate(r["input_ids"][r["loss_mask"].bool()].tolist()):
            if t in seen:
                seen[t][0] += 1
            else:
                seen[t] = [1, i, j]
    merged: dict[int, list[int]] = {}
    for part in ranks.gather(seen):
        for t, (c, i, j) in part.items():
            m = merged.setdefault(t, [0, i, j])
            m[0] += c
            m[1:] = min(m[1:], [i, j])
    return Counter({t: m[0] for t, m in sorted(merged.items(), key=lambda kv: kv[1][1:])})
