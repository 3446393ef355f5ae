"""Where the trainer reads its records from: a list in memory, or a curated index's snapshot shards
read one record at a time (`RecordSource`).

The trainer never asks for the whole set: it asks for lengths and shard groups (to plan its
buffers, `train.stream`), then reads the records of one buffer at a time. Reading a record of an
uncompressed shard reads only that record's bytes; a zstd shard is decoded whole into a
4-shard cache (`capture.store.read_record`), so shard groups are read together.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from ..capture.curate import load_records
from ..capture.store import TOKEN_FIELDS
from .resume import records_fingerprint


class RecordSource:
    """Capture records by position 0..n-1 (tensors as `capture.store` documents them:
    input_ids/loss_mask `[T]`, aux_hidden_states `[T, 3H]` bf16, hidden_states `[T, H]` bf16).

    `lengths[i]`: record i's token count; `units`: lists of positions stored together (one
    shard), in storage order; `read(i)` loads record i, `read_many` `read_batch` of them at once
    (a rehydrator's batch: `train.online`); `fingerprint()` identifies the content (the resume
    state's key)."""

    lengths: list[int]
    units: list[list[int]]
    read_batch: int = 1

    def __len__(self) -> int:
        return len(self.lengths)

    def read(self, i: int, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def read_many(self, positions: list[int]) -> list[dict[str, torch.Tensor]]:
        """The records at `positions`, every field, in order."""
        return [self.read(i) for i in positions]

    def tokens_only(self, i: int) -> bool:
        """True when record i holds no hidden states at rest (`ingest.mode: online`)."""
        return False

    def fingerprint(self) -> str:
        raise NotImplementedError


class InMemory(RecordSource):
    """Records already in memory (benchmarks, tests, the bootstrap draft): one unit each."""

    def __init__(self, records: Sequence[dict]):
        self.records = list(records)
        self.lengths = [int(r["input_ids"].shape[0]) for r in self.records]
        self.units = [[i] for i in range(len(self.records))]

    def read(self, i: int, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        r = self.records[i]
        return r if fields is None else {k: r[k] for k in fields}

    def fingerprint(self) -> str:
        return records_fingerprint(self.records)


class ShardLocator(Protocol):
    """Where a shard missing from the workspace is read from (`adapters.versioning.RemoteShards`:
    the DVC remote, through a bounded cache)."""

    def locate(self, path: Path) -> Path: ...  # a local file holding `path`'s bytes

    def digest(self, path: Path) -> str | None: ...  # its content hash without reading it (None: unknown)


class IndexRecords(RecordSource):
    """The records a curated index names (`entries`: its "train" or "val" list; paths relative to
    `base`, the index's directory), read from their snapshot shards on demand; `shards`: where a
    shard the workspace lacks comes from (None: it must be here). Units: the entries of one shard
    file, in index order. Raises FileNotFoundError / CorruptShard on read as
    `capture.store.read_record`."""

    def __init__(self, entries: list[dict], base: Path, shards: ShardLocator | None = None):
        self.entries, self.base, self.shards = list(entries), Path(base), shards
        self.lengths = [int(e["num_tokens"]) for e in self.entries]
        by_shard: dict[tuple[str, str], list[int]] = {}
        for i, e in enumerate(self.entries):
            by_shard.setdefault((e["snapshot"], e["shard"]), []).append(i)
        self.units = list(by_shard.values())

    def read(self, i: int, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """Record i's `fields` (None: all it holds: a tokens-only record's ids and mask). Raises
        ValueError when hidden states are asked of a tokens-only record (`train.online` rebuilds them)."""
        if self.tokens_only(i):
            if fields is None:
                fields = TOKEN_FIELDS
            elif set(fields) - set(TOKEN_FIELDS):
                raise ValueError(f"record {self.entries[i]['request_id']} holds tokens only (ingest.mode: online): "
                                 "its hidden states come from the target (train.online.OnlineRecords)")
        return load_records([self.entries[i]], self.base, fields, self.shards and self.shards.locate)[0]

    def tokens_only(self, i: int) -> bool:
        return bool(self.entries[i].get("tokens_only"))

    def fingerprint(self) -> str:
        """sha256 (16 hex) of the entries (shard, offset, request) and of every shard they name:
        its DVC md5 when `shards` knows it (nothing fetched), else its bytes read in 1 MiB blocks
        (the memory a fingerprint takes does not grow with the set)."""
        h = hashlib.sha256(json.dumps([(e["snapshot"], e["shard"], e["offset"], e["request_id"])
                                       + ((e["rejected"],) if e.get("rejected") is not None else ())
                                       for e in self.entries]).encode())
        for snap, shard in dict.fromkeys((e["snapshot"], e["shard"]) for e in self.entries):
            path = self.base / snap / shard
            if self.shards is not None and (md5 := self.shards.digest(path)):
                h.update(md5.encode())
                continue
            with open(path, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
        return h.hexdigest()[:16]


def as_source(records: RecordSource | Sequence[dict]) -> RecordSource:
    """A `RecordSource` as is; a list of record dicts wrapped in `InMemory`."""
    return records if isinstance(records, RecordSource) else InMemory(records)
