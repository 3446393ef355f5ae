"""A request and the state of a running one: what it asked for (`Request`) and what persists between
engine steps (`Seq`: its KV caches, output so far, stop state, counters). Per-step scratch — the
proposer chosen, the drafts, the verified tree — lives in the step's `proposers.base.Slot`s.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..config import EngineParams
from ..models.target import Target
from .grammar_state import Grammar
from .invalid import InvalidRequest
from .logits import RequestLogits, check_token_ids
from .sampling import GREEDY, SamplingParams, TokenLogprob, logprobs_of, sample, token_logprobs, warp
from .stats import RequestTiming, SpecDecodingStats


@dataclass(frozen=True)
class Request:
    """One generation request.

    k: drafts per step; None = the engine's adaptive policy (or its fixed k when it has none).
    workload: class label the adaptive policy keys its acceptance estimate on (e.g. "code", "chat").
    on_tokens: streaming: called on the engine thread as `on_tokens(tokens, logprobs)` with each
    step's new output tokens (already cut at the stop, so the pieces concatenate to the final
    output) and their `TokenLogprob`s (None when not requested); must not block.
    capture: None = ask the engine's capture sink at admission (no sink: not captured); True =
    collect the record (`Generation.record`; handed to the sink too when there is one); False = never.
    prompt_id: the prompt's id in its set (capture manifest), "" when unknown.
    stop: stop-string check, called on the engine thread with each step's new tokens (already cut
    at EOS / stop ids / max_new_tokens), in order; returns None, or (tokens of these to keep, the
    stop string) to finish the request there (`detok.TextOutput` is one). Must not block.
    grammar: a compiled constraint (`engine.grammar_state.Grammar`: structured output, tool calls); every
    generated token is one the grammar allows, and the output equals constrained target-only decoding.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    speculative: bool = True
    k: int | None = None
    capture: bool | None = None
    request_id: str | None = None
    sampling: SamplingParams = GREEDY
    workload: str = "default"
    on_tokens: Callable[[list[int], list[TokenLogprob] | None], None] | None = field(default=None, compare=False)
    prompt_id: str = ""
    stop: Callable[[list[int]], tuple[int, str] | None] | None = field(default=None, compare=False)
    grammar: Grammar | None = field(default=None, compare=False)

    @property
    def seeded(self) -> bool:
        """A sampled request with a seed: it keeps the engine's k and never takes suffix proposals (the
        random stream a seed fixes depends on the proposal, which depends on other traffic)."""
        return not self.sampling.greedy and self.sampling.seed is not None


def under_policy(policy, req: Request) -> bool:
    """Does the goodput policy choose this request's options? Not with a fixed k, nor for a seeded one."""
    return policy is not None and req.k is None and not req.seeded


def max_draft(policy, k: int, req: Request) -> int:
    """The longest chain (or tree depth) the request may draft: its k, the policy's k_max when it is
    under the policy, else the engine's k (num_draft_tokens)."""
    if req.k is not None:
        return req.k
    return policy.k_max if under_policy(policy, req) else k


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def with_context(cfg: EngineParams, context: int) -> EngineParams:
    """`cfg` with max_seq_len resolved: None → the target's `context` (its max_position_embeddings).
    Raises ValueError for a max_seq_len beyond it. KV caches grow with each request (`KVCache`), so
    a long context costs memory only for requests that use it."""
    if cfg.max_seq_len is None:
        return cfg.model_copy(update={"max_seq_len": context})
    if cfg.max_seq_len > context:
        raise ValueError(f"engine.max_seq_len {cfg.max_seq_len} exceeds the target's context {context}; "
                         "lower it, or remove it to serve the target's whole context")
    return cfg


def check_request(req: Request, vocab_size: int, max_seq_len: int, k: int) -> None:
    """Raise InvalidRequest naming the field and the fix for a request an engine of this vocabulary
    size V and max_seq_len cannot run; `k`: the longest draft it may verify (0: not speculative)."""
    if not isinstance(req.prompt_ids, (list, tuple)) or not req.prompt_ids:
        raise InvalidRequest("prompt_ids", "empty prompt: send at least one token id")
    if not all(_is_int(t) and 0 <= t < vocab_size for t in req.prompt_ids):
        raise InvalidRequest("prompt_ids", f"prompt token ids must be integers in [0, {vocab_size})")
    if not _is_int(req.max_new_tokens) or req.max_new_tokens < 1:
        raise InvalidRequest("max_new_tokens", f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
    if req.k is not None and (not _is_int(req.k) or req.k < 1):
        raise InvalidRequest("k", f"k (num_draft_tokens) must be an integer >= 1, got {req.k!r}; use "
                             "speculative=False to turn speculation off")
    if not isinstance(req.sampling, SamplingParams):
        raise InvalidRequest("sampling", "sampling must be a SamplingParams")
    if not isinstance(req.workload, str):
        raise InvalidRequest("workload", f"workload must be a string label, got {type(req.workload).__name__}")
    check_token_ids(req.sampling, vocab_size)
    if req.grammar is not None:
        if req.grammar.vocab_size != vocab_size:
            raise InvalidRequest("grammar", f"grammar compiled for a vocabulary of {req.grammar.vocab_size}, the "
                                 f"target has {vocab_size}")
        if req.sampling.min_tokens:
            raise InvalidRequest("min_tokens", "min_tokens cannot be combined with a grammar (it would mask the "
                                 "stop the grammar requires): drop min_tokens")
    if req.stop is not None and not callable(req.stop):
        raise InvalidRequest("stop", "stop must be a callable (a stop-string check) or None")
    if len(req.prompt_ids) + 1 + k + 1 > max_seq_len:  # not even one new token fits: the prompt's fault
        raise InvalidRequest("prompt_ids", f"prompt ({len(req.prompt_ids)} tokens) + 1 new token + k ({k}) + 1 "
                             f"exceeds max_seq_len {max_seq_len}; shorten the prompt or raise engine.max_seq_len")
    need = len(req.prompt_ids) + req.max_new_tokens + k + 1
    if need > max_seq_len:
        raise InvalidRequest("max_new_tokens", f"prompt ({len(req.prompt_ids)}) + max_new_tokens "
                             f"({req.max_new_tokens}) + k ({k}) + 1 = {need} exceeds max_seq_len {max_seq_len}; "
                             "lower max_new_tokens, shorten the prompt or raise engine.max_seq_len")


@dataclass
class CaptureRows:
    """The target's rows of a captured request's processed positions, in order: aux `[n_i, 3H]` and
    hidden `[n_i, H]` per step (model dtype)."""

    aux: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def add(self, out, n: int):
        """The first n rows of a `TargetOutput`."""
        self.aux.append(out.aux[:n])
        self.hidden.append(out.hidden[:n])


class Seq:
    """A running request's state between steps.

    draft: the `DraftRunner` it started with (None: no EAGLE3 drafts), kept across a hot-swap;
    tree: it drafts EAGLE-2 trees with that draft (`engine.draft_tree`); draft_extra: draft cache rows
    beyond the engine's max_seq_len for tree expansion. cache / draft_cache: its KV caches, allocated
    at admission (`alloc`). gen: output tokens so far (cut at the stop); next_token: the last
    emitted token, the next step's first verify row. backlog: (aux `[n, 3H]`, next tokens `[n]`
    int64) of verified rows the draft has not read yet. stats / by_proposer: spec-decode counters
    (all, and per proposer kind); draft_kinds: the kinds in by_proposer that ran the draft model
    (`Proposer.uses_draft`); rows: capture rows (`capture`); rejected: indices into gen of the tokens the
    target emitted in place of a draft-model proposal it rejected (`accept.after_verify`).
    """

    def __init__(self, req: Request, rid: str, draft, version: str | None, vocab_size: int, capture: bool,
                 eos: set[int]):
        self.req, self.rid, self.draft, self.version = req, rid, draft, version
        self.lp = RequestLogits(req.sampling, req.prompt_ids, vocab_size, eos,
                                grammar=req.grammar.state() if req.grammar is not None else None)
        self.rng = None if req.sampling.greedy else req.sampling.generator()
        self.capture = capture
        self.tree = False
        self.draft_extra = 0
        self.cache = self.draft_cache = None  # allocated on admission (`alloc`), not while queued
        self.gen: list[int] = []
        self.next_token = -1
        self.logprobs: list[TokenLogprob] | None = [] if req.sampling.logprobs is not None else None
        self.backlog: list[tuple[torch.Tensor, torch.Tensor]] = []  # `feed` / `drain`
        self.backlog_rows = 0  # rows in the backlog (what the draft's next catch-up reads)
        self.prompt_read = False  # has the draft caught up over the prompt
        self.stats = SpecDecodingStats(0)
        self.by_proposer: dict[str, SpecDecodingStats] = {}
        self.draft_kinds: set[str] = set()
        self.timing = RequestTiming()
        self.rows = CaptureRows()
        self.rejected: list[int] = []
        self.t_submit = time.perf_counter()
        self.future: Future = Future()
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finished = self.aborted = False
        self.error: BaseException | None = None

    def alloc(self, target: Target, max_len: int) -> None:
        """Allocate the target and draft KV caches (`max_len` positions each, the draft's plus
        `draft_extra`): a queued request holds none, so memory is bounded by the running batch."""
        self.cache = target.new_cache(max_len)
        self.draft_cache = self.draft.new_cache(max_len + self.draft_extra) if self.draft is not None else None

    def feed(self, aux: torch.Tensor, ids: torch.Tensor) -> None:
        """Queue verified rows for the draft: aux `[n, 3H]`, next tokens `[n]` int64."""
        self.backlog.append((aux, ids))
        self.backlog_rows += ids.shape[0]

    def drain(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Hand the backlog to the draft's catch-up (or drop it at the end): the draft has now read
        the prompt."""
        items, self.backlog, self.backlog_rows, self.prompt_read = self.backlog, [], 0, True
        return items

    @property
    def prompt_backlog(self) -> int:
        """Rows the draft must read before its first draft for this request (the prompt's, and what
        was verified since), 0 once it has read the prompt: what a probe would first pay for."""
        return 0 if self.prompt_read else self.backlog_rows

    @property
    def grammar_error(self) -> str | None:
        """Why the request's grammar dead-ended (None: no grammar, or it can go on)."""
        return self.lp.grammar.error if self.lp.grammar is not None else None

    def process(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """The request's transforms on verify rows `[n, V]` fp32 (row i after drafts[:i])."""
        return self.lp.apply(logits, drafts) if self.lp.active else logits

    def pick(self, row: torch.Tensor) -> int:
        """A token from one processed row `[V]`: argmax, or a draw from the warped distribution."""
        if self.rng is None:
            return int(row.argmax())
        return sample(warp(row, self.req.sampling), self.rng)

    def emit(self, new: list[int], rows: torch.Tensor) -> int:
        """Append the verified tokens up to the first stop (max_new_tokens; EOS or a stop id once
        min_tokens is reached; a stop string) and return how many were kept. rows: the processed
        logits `[≥len(new), V]` the tokens were chosen from (for logprobs)."""
        req, room = self.req, self.req.max_new_tokens - len(self.gen)
        m = min(len(new), room)
        if m == room:
            self.finish_reason = "length"
        for i, t in enumerate(new[:m]):
            if t in self.lp.stop_ids and len(self.gen) + i + 1 >= req.sampling.min_tokens:
                m, self.finish_reason = i + 1, "stop"
                self.stop_reason = t if t in req.sampling.stop_token_ids else None
                break
        if req.stop is not None and m:
            hit = req.stop(new[:m])
            if hit is not None:
                m, self.finish_reason, self.stop_reason = hit[0], "stop", hit[1]
        kept = new[:m]
        self.gen.extend(kept)
        self.lp.advance(kept)
        if self.grammar_error is not None:  # its matcher hit a work limit: the request ends here
            self.finish_reason, self.stop_reason = "length", None
        if self.logprobs is not None and kept:
            self.logprobs += token_logprobs(logprobs_of(rows[:m], req.sampling), kept, req.sampling.logprobs)
        self.next_token = new[-1]
        self.finished = self.finish_reason is not None
        if req.on_tokens is not None and kept:
            req.on_tokens(kept, self.logprobs[-len(kept):] if self.logprobs is not None else None)
        return m
