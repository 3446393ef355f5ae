"""What an engine returns for a request (`Generation`) and where it hands captured ones (`CaptureSink`)."""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .sampling import TokenLogprob
from .stats import RequestTiming, SpecDecodingStats

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """Result of one request.

    tokens: generated ids (prompt excluded), cut exactly at the stop condition; stats: per-request
    spec-decode counters (tokens cut off after a stop are never counted as accepted); timing:
    prefill and per-step wall times; finish_reason: "stop" (EOS, a stop token id or a stop string),
    "length" (max_new_tokens) or "abort" (`Engine.abort`); stop_reason: vLLM's — None for EOS or
    length, the stop token id, or the stop string; logprobs: one `TokenLogprob` per token when the
    request asked (`SamplingParams.logprobs`); grammar_error: why the request's grammar could not go on
    (finish_reason "length"; None otherwise); by_proposer: the spec-decode counters per proposer
    kind (`Proposer.name`), draft_kinds the kinds among them that ran the draft model
    (`Proposer.uses_draft`; their counters together: `draft_stats`); rejected: indices into tokens of
    those the target emitted in place of a draft-model proposal it rejected, ascending (as record
    positions: `capture.writer.rejected_positions`; what `train.rejected_weight` weighs); record: capture tensors (when
    the request was captured): input_ids `[T]` int32, loss_mask `[T]` uint8, aux_hidden_states
    `[T, 3H]`, hidden_states `[T, H]` where T = tokens the target processed (prompt + generated
    minus the last, whose hidden state is never computed).
    """

    request_id: str
    prompt_len: int
    tokens: list[int]
    stats: SpecDecodingStats
    timing: RequestTiming
    draft_version: str | None = None
    record: dict[str, torch.Tensor] | None = None
    finish_reason: str = "length"
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    by_proposer: dict[str, SpecDecodingStats] = field(default_factory=dict)
    grammar_error: str | None = None
    constraint: dict | None = None  # the constraint spec of a constrained request (`engine.constraint`)
    workload: str = "default"  # the request's workload class (the policy's and the capture's key)
    draft_kinds: frozenset[str] = frozenset()
    rejected: list[int] = field(default_factory=list)

    @property
    def draft_stats(self) -> SpecDecodingStats | None:
        """The draft model's counters: those of the proposer kinds that ran it (`draft_kinds`), merged;
        None when no such proposer verified a draft for the request."""
        stats = [self.by_proposer[k] for k in sorted(self.draft_kinds) if k in self.by_proposer]
        if not stats:
            return None
        return stats[0] if len(stats) == 1 else functools.reduce(SpecDecodingStats.merge, stats)

    @property
    def tokens_per_s(self) -> float:
        t = self.timing.prefill_s + self.timing.decode_s
        return len(self.tokens) / t if t > 0 else 0.0


class CaptureSink(Protocol):
    """Where an engine hands captured requests (`capture.writer.CaptureWriter` is one).

    `wants(request_id)` is asked once at admission (sample rate: an unwanted request does not
    even collect hidden states); `submit_generation(gen, workload, prompt_id)` gets each captured
    request's finished Generation on the engine thread and must only enqueue (never block).
    """

    def wants(self, request_id: str) -> bool: ...

    def submit_generation(self, gen: Generation, workload: str = "default", prompt_id: str = "") -> bool: ...


def wanted(sink: CaptureSink | None, request_id: str) -> bool:
    """The capture sink's admission answer; a failing sink is logged and the request served
    uncaptured (capture never fails a request)."""
    if sink is None:
        return False
    try:
        return bool(sink.wants(request_id))
    except Exception:
        log.exception("capture sink failed at admission of request %s; serving it uncaptured", request_id)
        return False


def generation_of(s) -> Generation:
    """A finished (or aborted) request's Generation (`s`: its `request.Seq`); a captured one that was
    not aborted gets its record (see `Generation.record`)."""
    gen = s.gen  # already cut at the stop (`Seq.emit`)
    res = Generation(s.rid, len(s.req.prompt_ids), gen, s.stats, s.timing, s.version,
                     finish_reason=s.finish_reason or "length", stop_reason=s.stop_reason, logprobs=s.logprobs,
                     by_proposer=dict(s.by_proposer), grammar_error=s.grammar_error,
                     constraint=s.req.grammar.spec if s.req.grammar is not None else None, workload=s.req.workload,
                     draft_kinds=frozenset(s.draft_kinds), rejected=list(s.rejected))
    if s.capture and not s.aborted:
        p = list(s.req.prompt_ids)
        T = len(p) + len(gen) - 1
        mask = torch.zeros(T, dtype=torch.uint8)
        mask[len(p):] = 1
        res.record = {"input_ids": torch.tensor(p + gen[:-1], dtype=torch.int32), "loss_mask": mask,
                      "aux_hidden_states": torch.cat(s.rows.aux)[:T].cpu(),
                      "hidden_states": torch.cat(s.rows.hidden)[:T].cpu()}
    return res
