"""Online rehydration: a tokens-only snapshot (`ingest.mode: online`, 5 bytes a token at rest)
trains without its hidden states ever reaching the disk.

`OnlineRecords` wraps a curated set's records: a tokens-only record gets its hidden states from
the target when the trainer reads it (`capture.ingest.Rehydrator`: one prefill in this process,
`EmbeddedRehydrator`, or a vLLM hidden-state extraction server, `backends.vllm.VLLMRehydrator`,
`rehydrate_batch` records at a time), cast to bf16 as the capture writer stores them, so a record
rehydrated here equals the one `ingest.mode: hidden` writes to disk (with the embedded target:
bit for bit, and so do the trained weights: tests/test_online.py). The trainer reads records
ahead through a producer thread and a bounded queue (`train.prefetch`, `train.prefetch_mb`), so
the target's prefill for the next records runs while the draft trains on the current ones.

Cost: a set whose prepared examples fit `train.buffer_mb` is rehydrated once (its examples are
kept across epochs); a larger one once per epoch plus once for the plan's survey. Online
training as SpecForge's `--is-online` and vLLM speculators' online mode: the hidden states
regenerated from the target during training, only tokens kept.
"""
from __future__ import annotations

import torch

from ..capture.ingest import EmbeddedRehydrator, Rehydrator
from ..capture.rehydrate import exchange_of
from ..capture.store import DTYPES, HIDDEN_FIELDS, TOKEN_FIELDS
from .resume import fingerprint
from .source import RecordSource


class OnlineRecords(RecordSource):
    """`source`'s records, a tokens-only one with its hidden states rebuilt by `rehydrator`
    (aux_hidden_states `[T, 3H]`, hidden_states `[T, H]`, bf16). `name` identifies the producer
    in the resume fingerprint (e.g. "embedded", a vLLM URL). Raises ValueError when the rehydrator
    refuses a record (its ids outside the target's vocabulary or past its context: another
    target's data) or returns other ids than the record's."""

    def __init__(self, source: RecordSource, rehydrator: Rehydrator, name: str):
        self.source, self.rehydrator, self.name = source, rehydrator, name
        self.lengths, self.units = source.lengths, source.units
        self.read_batch = max(1, int(getattr(rehydrator, "batch_size", 1)))

    def tokens_only(self, i: int) -> bool:
        return False  # every record read here holds hidden states

    def read(self, i: int, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        if not self.source.tokens_only(i) or (fields is not None and not set(fields) & set(HIDDEN_FIELDS)):
            return self.source.read(i, fields)
        rec = self.read_many([i])[0]
        return rec if fields is None else {k: rec[k] for k in fields}

    def read_many(self, positions: list[int]) -> list[dict[str, torch.Tensor]]:
        """The records at `positions`; the tokens-only ones rehydrated in one rehydrator call."""
        out = {i: self.source.read(i) for i in positions if not self.source.tokens_only(i)}
        todo = [i for i in positions if i not in out]
        toks = [self.source.read(i, TOKEN_FIELDS) for i in todo]
        for i, tok, rec in zip(todo, toks, self.rehydrator([exchange_of(t) for t in toks]) if todo else []):
            if isinstance(rec, ValueError):
                raise ValueError(f"record {i} cannot be rehydrated by the target ({rec}): curate this target's "
                                 "own traffic") from rec
            if not torch.equal(rec["input_ids"].to(torch.int32), tok["input_ids"].to(torch.int32)):
                raise ValueError(f"record {i}: the rehydrator returned other token ids than the record's")
            out[i] = {k: tok[k] for k in TOKEN_FIELDS} | {k: rec[k].to("cpu", DTYPES[k]) for k in HIDDEN_FIELDS}
        return [out[i] for i in positions]

    def fingerprint(self) -> str:
        return fingerprint(self.source.fingerprint(), "online", self.name)


def online(source: RecordSource, rehydrator: Rehydrator | None, target, name: str = "embedded") -> RecordSource:
    """`source` as is when none of its records is tokens-only; else wrapped in `OnlineRecords`
    over `rehydrator` (None: the target in this process, `EmbeddedRehydrator`)."""
    if not any(source.tokens_only(i) for i in range(len(source))):
        return source
    return OnlineRecords(source, rehydrator or EmbeddedRehydrator(target), name)


__all__ = ["OnlineRecords", "online"]
