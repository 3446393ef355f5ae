"""Chain speculative decoding with an EAGLE3 draft, batched: one target forward verifies k drafted
tokens for every running request.

Algorithm: Leviathan et al. 2023 (arXiv 2211.17192) §2: the draft proposes k tokens
autoregressively (EAGLE-3 feeds its own hidden state forward, arXiv 2503.01840 §3); the target
scores [last token, d_1..d_k] in one forward. Greedy: the longest prefix where d_i equals the
target's argmax is accepted and the target's own token at the first mismatch is the bonus, so the
output is the target's greedy output token for token (fp32: see models/target.py). Sampling:
lossless rejection sampling (engine/sampling.py).

Batching (vLLM v1 style continuous batching): requests join and leave between steps; a step runs
one ragged target forward over every running request's new tokens (prefills included, no padding:
`Target.forward_batch`), each request with its own proposer and length (fixed, or chosen per step
for the whole batch by the goodput policy `adaptive.AdaptiveK`: none, the EAGLE3 chain, or the
suffix proposal `suffix.SuffixCache`; with `eagle_topk` > 1 the EAGLE3 proposal of a greedy request
is an EAGLE-2 draft tree, `engine/tree.py`). Per-request output is identical to running it alone (greedy).

One file: admission, the step (plan → draft → verify → accept) and the per-request state it
mutates are one state machine; the proposers (`models.eagle3.DraftRunner`, `suffix`), the policy
(`adaptive`, `goodput`) and the acceptance rule (`sampling`) live apart.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import tree_num_draft_tokens as tree_size
from ..models.eagle3 import DraftRunner
from ..models.target import Segment, Target
from .adaptive import AdaptiveK
from .goodput import NONE, Ladder, draft_batches
from .logits import RequestLogits, check_token_ids
from .sampling import (
    GREEDY,
    SamplingParams,
    TokenLogprob,
    logprobs_of,
    rejection_verify,
    sample,
    token_logprobs,
    warp,
)
from .stats import RequestTiming, SpecDecodingStats
from .suffix import Proposal, SuffixCache
from .tree import Layout, TreeJob, accept_greedy, expand, layout, max_nodes, select, widen

log = logging.getLogger(__name__)


@dataclass
class Generation:
    """Result of one request.

    tokens: generated ids (prompt excluded), cut exactly at the stop condition; stats: per-request
    spec-decode counters (tokens cut off after a stop are never counted as accepted); timing:
    prefill and per-step wall times; finish_reason: "stop" (EOS, a stop token id or a stop string),
    "length" (max_new_tokens) or "abort" (`Engine.abort`); stop_reason: vLLM's — None for EOS or
    length, the stop token id, or the stop string; logprobs: one `TokenLogprob` per token when the
    request asked (`SamplingParams.logprobs`); record: capture tensors (when the request was captured):
    input_ids `[T]` int32, loss_mask `[T]` uint8, aux_hidden_states `[T, 3H]`, hidden_states `[T, H]`
    where T = tokens the target processed (prompt + generated minus the last, whose hidden state
    is never computed).
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
    stats_by_proposer: dict[str, SpecDecodingStats] = field(default_factory=dict)  # "eagle3", "suffix"

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


@dataclass
class _Rows:
    """Accumulates the target's aux/hidden rows of processed positions for capture."""

    aux: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def add(self, out, n: int):
        self.aux.append(out.aux[:n])
        self.hidden.append(out.hidden[:n])


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


class _Seq:
    """Decode state of one running request."""

    def __init__(self, req: Request, rid: str, draft, version, target: Target, max_len: int, capture: bool,
                 eos: set[int]):
        self.req, self.rid, self.draft, self.version = req, rid, draft, version
        self.lp = RequestLogits(req.sampling, req.prompt_ids, target.cfg.vocab_size, eos)
        sp = req.sampling
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[TokenLogprob] | None = [] if sp.logprobs is not None else None
        self.aborted = False
        self.capture = capture  # collect hidden-state rows for a capture record
        self.cache = self.draft_cache = None  # KV caches: allocated on admission (`alloc`), not while queued
        self._target, self._max_len = target, max_len
        self.rng = None if req.sampling.greedy else req.sampling.generator()
        self.gen: list[int] = []
        self.next_token = -1
        self.draft_hidden = self.draft_logits = None  # draft chain start: hidden [1, H], logits [Vd]
        self.backlog: list[tuple[torch.Tensor, torch.Tensor]] = []  # (aux rows, next tokens) not yet fed to the draft
        self.stats = SpecDecodingStats(0)
        self.timing = RequestTiming()
        self.rows = _Rows()
        self.t_submit = time.perf_counter()
        self.future: Future = Future()
        self.k = 0  # drafts this step
        self.via = ""  # this step's proposer: "eagle3", "suffix" or "" (no drafts)
        self.proposal: Proposal | None = None  # this step's suffix proposal (capped to the room)
        self.stop_below = 0.0  # early stop: end the chain before a token whose reach estimate is below this
        self.confs: list[float] = []  # the draft's probability of each drafted token this step
        self.reach = 1.0
        self.stopped = False  # early stop cut this step's chain (it ran one more draft forward than k)
        self.k_plan = 0  # the k the plan gave this step's chain
        self.tree = False  # EAGLE3 drafts an EAGLE-2 tree (engine.tree, greedy without logits transforms)
        self.tree_depth = 0  # this step's tree depth
        self.layout: Layout | None = None  # this step's verified tree
        self.tree_cap = 0  # most nodes this step's tree may verify (engine.tree, KV and output room)
        self.draft_extra = 0  # draft cache rows beyond max_len for tree expansion
        self.by_via: dict[str, SpecDecodingStats] = {}
        self.drafts: list[int] = []
        self.draft_probs: list[torch.Tensor] = []  # draft probs per drafted token (sampling)
        self.base = 0  # draft cache length before this step's chain
        self.last_draft: torch.Tensor | None = None  # last drafted token
        self.finished = False
        self.error: BaseException | None = None
        self.sent = 0  # output tokens already streamed

    def alloc(self) -> None:
        """Allocate the target and draft KV caches (`max_len` positions each): a queued request
        holds none, so memory is bounded by the running batch, not by the queue."""
        self.cache = self._target.new_cache(self._max_len)
        self.draft_cache = self.draft.new_cache(self._max_len + self.draft_extra) if self.draft is not None else None

    def process(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """The request's transforms on verify rows `[n, V]` (row i after drafts[:i])."""
        return self.lp.apply(logits, drafts) if self.lp.active else logits

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
        if self.logprobs is not None and kept:
            self.logprobs += token_logprobs(logprobs_of(rows[:m], req.sampling), kept, req.sampling.logprobs)
        self.next_token = new[-1]
        self.finished = self.finish_reason is not None
        if req.on_tokens is not None and kept:
            req.on_tokens(kept, self.logprobs[-len(kept):] if self.logprobs is not None else None)
        return m

    def pick(self, row: torch.Tensor) -> int:
        """A token from one processed row `[V]`: argmax, or a draw from the warped distribution."""
        if self.rng is None:
            return int(row.argmax())
        return sample(warp(row, self.req.sampling), self.rng)

    def propose(self, draft_logits: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token j (target id `[1]`) and, when sampling, its proposal distribution `[V]`.
        With transforms, the draft's logits are mapped into the target vocab and transformed with
        prefix drafts[:j], so the proposal follows the same rules as the verification."""
        sp = self.req.sampling
        if self.lp.active:
            x = self.lp.apply(self.draft.to_target_logits(draft_logits)[None], self.drafts, start=j)[0]
            if self.rng is None:
                return x.argmax().view(1), None
            q = warp(x, sp)
        elif self.rng is None:
            return self.draft.to_target_ids(draft_logits.argmax().view(1)), None
        else:
            q = self.draft.to_target_probs(warp(draft_logits, sp))
        return torch.multinomial(q, 1, generator=self.rng), q


def _by_draft(seqs: list[_Seq]):
    """(draft, its requests) groups: requests keep the draft they started with, so after a hot-swap
    one step may hold two drafts; each group runs one batched draft forward."""
    for draft in {id(s.draft): s.draft for s in seqs}.values():
        yield draft, [s for s in seqs if s.draft is draft]


class Engine:
    """Embedded engine: target + optional EAGLE3 draft (hot-swappable), continuous batching.

    `generate` runs one request; `generate_batch` / `submit` run many together, up to `max_batch`
    per step (the rest wait). Any thread may drive the engine: `step()` is serialised, and every
    caller waiting on a result steps all running requests. `set_draft` swaps the draft atomically;
    a request keeps the draft it started with. `adaptive` (AdaptiveK): the goodput policy, which
    picks each request's proposer and length per step for the whole batch.
    `capture` (CaptureSink): asked at admission whether it wants each request, handed the record of
    each captured request when it finishes (TIDE's capture: the engine owns the wiring).
    `eagle_topk` > 1: greedy requests without logits processors verify EAGLE-2 draft trees of depth
    `num_draft_tokens` and at most `tree_num_draft_tokens` tokens, root included (SGLang's knobs;
    `engine.tree`); raises ValueError for a size outside [depth + 1, 1 + topk + (depth − 1)·topk²] or > 64.
    """

    def __init__(self, target: Target, draft: DraftRunner | None = None, num_draft_tokens: int = 4,
                 max_seq_len: int = 1024, draft_version: str | None = None, max_batch: int = 8,
                 adaptive: AdaptiveK | None = None, capture: CaptureSink | None = None,
                 suffix: SuffixCache | None = None, suffix_min_expected: float = 1.0, draft_early_stop: bool = False,
                 eagle_topk: int = 1, tree_num_draft_tokens: int | None = None):
        if num_draft_tokens < 1:
            raise ValueError("num_draft_tokens (k) must be >= 1; use speculative=False to turn speculation off")
        if max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if eagle_topk < 1:
            raise ValueError(f"eagle_topk must be >= 1 (1: chains), got {eagle_topk}")
        n_tree = tree_size(num_draft_tokens, eagle_topk, tree_num_draft_tokens)  # ValueError naming the range
        if max_seq_len > target.cfg.max_position:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the target's context {target.cfg.max_position}; "
                             "lower engine.max_seq_len")
        self.target = target
        self.k = num_draft_tokens
        self.max_seq_len = max_seq_len
        self.max_batch = max_batch
        self.adaptive = adaptive
        self.capture = capture
        self.suffix = suffix  # suffix proposer (engine/suffix.py); with a draft too: hybrid per step
        self.suffix_min_expected = suffix_min_expected
        self.draft_early_stop = draft_early_stop  # under the policy: chains stop where a token stops paying
        self.topk = eagle_topk  # > 1: greedy EAGLE3 requests verify EAGLE-2 trees (engine/tree.py)
        self.tree_nodes = n_tree - 1  # drafted nodes verified per tree (at most)
        self._lock = threading.Lock()  # draft swap + queues
        self._step_lock = threading.Lock()  # one step at a time
        self._draft = draft
        self._draft_version = draft_version
        self._waiting: list[_Seq] = []
        self._seqs: dict[str, _Seq] = {}  # request id → state, waiting or running (abort)
        self._running: list[_Seq] = []
        self._pending_global = None  # a global suffix tree waiting to be installed between steps
        if draft is not None:
            self._check_draft(draft)

    def _check_draft(self, draft: DraftRunner) -> None:
        c, t = draft.config, self.target.cfg
        if c.vocab_size != t.vocab_size or c.target_hidden_size != t.hidden_size:
            raise ValueError(f"draft (V={c.vocab_size}, Ht={c.target_hidden_size}) does not fit the target "
                             f"(V={t.vocab_size}, H={t.hidden_size})")
        if tuple(c.aux_layer_ids) != tuple(self.target.aux_layers):
            raise ValueError(f"draft aux layers {c.aux_layer_ids} != target capture layers {self.target.aux_layers}")
        if c.target_id and self.target.target_id != "unknown" and c.target_id != self.target.target_id:
            raise ValueError(f"draft trained for target {c.target_id[:12]}, serving {self.target.target_id[:12]}")

    def set_draft(self, draft: DraftRunner | None, version: str | None = None) -> None:
        """Swap the draft (None = no speculation). Raises ValueError for a draft of another target.
        The adaptive policy's acceptance estimates restart from its prior (they described the old
        draft); a draft whose steps it has not timed (another shape, or the engine started without
        one) is timed first (`AdaptiveK.ensure_draft_costs`, ~0.5 s)."""
        if draft is not None:
            self._check_draft(draft)
            if self.adaptive is not None:  # a draft of another shape (or the first one) is timed before it serves
                self.adaptive.ensure_draft_costs(self.target, draft)
        with self._lock:
            self._draft, self._draft_version = draft, version
        if self.adaptive is not None:
            self.adaptive.reset()

    @property
    def draft_version(self) -> str | None:
        return self._draft_version

    # -- admission ------------------------------------------------------------------------
    def set_suffix_corpus(self, seqs: list[list[int]]) -> int:
        """Replace the suffix proposer's global tree with one over `seqs` (oldest first; the newest
        kept within its token budget): a champion's corpus, deployed with its draft. Built before
        the swap, installed between steps. Returns the tokens retained. Raises ValueError when the
        engine has no suffix proposer (the fix: engine.suffix.enabled: true)."""
        if self.suffix is None:
            raise ValueError("this engine has no suffix proposer; set engine.suffix.enabled: true in params.yaml")
        V = self.target.cfg.vocab_size
        bad = next((t for seq in seqs for t in seq if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"suffix corpus token id {bad} outside the target vocabulary [0, {V}); "
                             "it was built for another target: rebuild it with the cycle")
        built = self.suffix.build_global(seqs)
        with self._lock:  # installed by the next step, before it plans (never waits for the step lock)
            self._pending_global = built
        if self._step_lock.acquire(blocking=False):  # idle engine: install now
            try:
                self._install_pending()
            finally:
                self._step_lock.release()
        return built[2]

    def _install_pending(self) -> None:
        with self._lock:
            built, self._pending_global = self._pending_global, None
        if built is not None:
            self.suffix.install_global(built)

    def _adaptive_for(self, req: Request) -> bool:
        """Adaptive k for this request? Not with a fixed k, and not for seeded sampling (the random
        stream a seed fixes depends on k, so a seeded request keeps the engine's k: reproducible)."""
        return self.adaptive is not None and req.k is None and (req.sampling.greedy or req.sampling.seed is None)

    def _k_max(self, req: Request) -> int:
        if req.k is not None:
            return req.k
        return self.adaptive.k_max if self._adaptive_for(req) else self.k

    def _tree_for(self, s: "_Seq") -> bool:
        """Does this request draft EAGLE-2 trees? With eagle_topk > 1, an EAGLE3 draft, greedy
        and no logits transforms (they depend on the path: trees would need one per branch);
        sampled requests draft chains (exact rejection sampling)."""
        return self.topk > 1 and s.draft is not None and s.rng is None and not s.lp.active

    def validate(self, req: Request) -> None:
        """Raise ValueError naming the fix for a request the engine cannot run."""
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        if not isinstance(req.prompt_ids, (list, tuple)) or not req.prompt_ids:
            raise ValueError("empty prompt: send at least one token id")
        V = self.target.cfg.vocab_size
        if not all(is_int(t) and 0 <= t < V for t in req.prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {V})")
        if not is_int(req.max_new_tokens) or req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {req.max_new_tokens!r}")
        if req.k is not None and (not is_int(req.k) or req.k < 1):
            raise ValueError(f"k (num_draft_tokens) must be an integer >= 1, got {req.k!r}; "
                             "use speculative=False to turn speculation off")
        if not isinstance(req.sampling, SamplingParams):
            raise ValueError("sampling must be a SamplingParams")
        if not isinstance(req.workload, str):
            raise ValueError(f"workload must be a string label, got {type(req.workload).__name__}")
        check_token_ids(req.sampling, V)
        if req.stop is not None and not callable(req.stop):
            raise ValueError("stop must be a callable (a stop-string check) or None")
        k = self._k_max(req) if req.speculative else 0  # a tree verifies what the KV room leaves (`_tree_ladder`)
        need = len(req.prompt_ids) + req.max_new_tokens + k + 1
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(req.prompt_ids)}) + max_new_tokens ({req.max_new_tokens}) + k ({k}) + 1 = "
                             f"{need} exceeds max_seq_len {self.max_seq_len}; shorten the prompt or raise "
                             "engine.max_seq_len")

    def submit(self, req: Request) -> Future:
        """Queue a request; returns a Future resolving to its Generation. Raises ValueError for bad input."""
        self.validate(req)
        rid = req.request_id or uuid.uuid4().hex
        capture = req.capture if req.capture is not None else self._wanted(rid)
        with self._lock:
            draft, version = (self._draft, self._draft_version) if req.speculative else (None, None)
            if rid in self._seqs:
                raise ValueError(f"request id {rid!r} is already in flight; request ids must be unique")
            seq = _Seq(req, rid, draft, version, self.target, self.max_seq_len, bool(capture), self._eos)
            seq.tree = self._tree_for(seq)
            seq.draft_extra = max(0, self._k_max(req) - 1) * self.topk if seq.tree else 0
            seq.stats = SpecDecodingStats(self._k_max(req) if draft is not None else 0)
            self._waiting.append(seq)
            self._seqs[rid] = seq
        return seq.future

    def abort(self, request_id: str) -> bool:
        """Stop a request (client gone, cancelled): a queued one resolves now, a running one at the
        start of the next step, before any more compute; its KV caches are freed and it is never
        captured. Its Future resolves to a Generation with finish_reason "abort" and the tokens
        generated so far. Returns False for an unknown or finished request id."""
        with self._lock:
            s = self._seqs.get(request_id)
            if s is None or s.finished:
                return False
            s.aborted = True
            queued = s in self._waiting
            if queued:
                self._waiting.remove(s)
                self._seqs.pop(request_id, None)
        if queued:
            s.finish_reason = "abort"
            s.future.set_result(self._finish(s))
        return True

    def _wanted(self, rid: str) -> bool:
        """The capture sink's admission answer; a sink that fails is logged and the request served
        uncaptured (capture never fails a request)."""
        if self.capture is None:
            return False
        try:
            return bool(self.capture.wants(rid))
        except Exception:  # noqa: BLE001
            log.exception("capture sink failed at admission of request %s; serving it uncaptured", rid)
            return False

    def generate_batch(self, reqs: list[Request]) -> list[Generation]:
        """Run requests together; returns their Generations in order. Validates all before running any."""
        for r in reqs:
            self.validate(r)
        futs = [self.submit(r) for r in reqs]
        for f in futs:
            while not f.done():
                self.step()
        return [f.result() for f in futs]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, speculative: bool = True,
                 k: int | None = None, capture: bool | None = None, request_id: str | None = None,
                 sampling: SamplingParams = GREEDY, workload: str = "default", prompt_id: str = "") -> Generation:
        """Generate up to `max_new_tokens` after `prompt_ids` (stops at EOS); greedy by default.

        Raises ValueError for an empty prompt, k < 1, ids outside the vocab, or prompt +
        max_new_tokens beyond `max_seq_len` (the fix: shorten the prompt or raise
        engine.max_seq_len); bad sampling values are refused when `SamplingParams` is built.
        """
        req = Request(list(prompt_ids), max_new_tokens, speculative, k, capture, request_id, sampling, workload,
                      prompt_id=prompt_id)
        return self.generate_batch([req])[0]

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self._running) + len(self._waiting)

    # -- one engine step ------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Generation]:
        """Admit waiting requests, run one draft+verify step for all running ones, retire finished.

        Returns the Generations finished in this step. An error in the shared forward fails this
        step's requests; an error in one request's own bookkeeping fails only that request; the
        engine keeps serving. Futures are resolved after the step lock is released, so a
        done-callback may call back into the engine. A request cancelled before it starts is dropped.
        """
        results: list[tuple[_Seq, Generation | BaseException]] = []
        with self._step_lock:
            if self._pending_global is not None:
                self._install_pending()
            with self._lock:
                n_new = max(0, self.max_batch - len(self._running))
                new, self._waiting = self._waiting[:n_new], self._waiting[n_new:]
            started = [s.future.set_running_or_notify_cancel() for s in new]
            with self._lock:
                for s, ok in zip(new, started):
                    if not ok:
                        self._seqs.pop(s.rid, None)
            new = [s for s, ok in zip(new, started) if ok]
            for s in [s for s in self._running if s.aborted]:
                if self.suffix is not None:
                    self.suffix.finish(s.rid)
                s.finish_reason = "abort"
                results.append((s, self._finish(s)))
            running = self._running = [s for s in self._running if not s.aborted]
            t0 = time.perf_counter()
            try:
                for s in new:
                    s.alloc()
                self._plan(running)
                t_plan = time.perf_counter()  # the cost model times the forwards, not the planning
                self._draft_chain([s for s in running if s.via == "eagle3" and not s.tree])
                self._draft_trees([s for s in running if s.via == "eagle3" and s.tree])
                outs = self._verify(new, running)
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                results = [(s, e) for s in new + running]
                self._running = []
            else:
                t_end = time.perf_counter()
                dt = t_end - t0
                for i, (s, out) in enumerate(zip(new + running, outs)):
                    try:
                        if i < len(new):
                            self._after_prefill(s, out, time.perf_counter() - s.t_submit)
                        else:
                            self._after_verify(s, out, dt)
                    except Exception as e:  # noqa: BLE001 - this request only
                        s.error = e
                if self.adaptive is not None and running and not new and all(s.error is None for s in running):
                    eag = [s for s in running if s.via == "eagle3"]  # draft forwards each chain / tree ran
                    fw = draft_batches([s.tree_depth if s.tree else s.k + s.stopped for s in eag],
                                       [self.topk if s.tree else 1 for s in eag])
                    self.adaptive.observe_step(len(running), sum(s.k + 1 for s in running), fw, 1000 * (t_end - t_plan))
                done = [s for s in new + running if s.finished or s.error is not None]
                self._running = [s for s in new + running if not (s.finished or s.error is not None)]
                for s in done:
                    if self.suffix is not None:  # its output joins the global tree (not an aborted/failed one)
                        self.suffix.finish(s.rid, s.gen if s.error is None and not s.aborted else None)
                    try:
                        results.append((s, s.error if s.error is not None else self._finish(s)))
                    except Exception as e:  # noqa: BLE001
                        results.append((s, e))
        with self._lock:
            for s, _ in results:
                self._seqs.pop(s.rid, None)
        for s, r in results:  # outside the lock
            s.cache = s.draft_cache = None  # free the KV memory now
            s.backlog = []
            if s.capture and self.capture is not None and not s.aborted and not isinstance(r, BaseException):
                try:  # after the step lock: a slow sink cannot stall the batch; a failing one never fails the request
                    self.capture.submit_generation(r, s.req.workload, s.req.prompt_id)
                except Exception:  # noqa: BLE001
                    log.exception("capture sink refused request %s", s.rid)
            if isinstance(r, BaseException):
                s.future.set_exception(r)
            else:
                s.future.set_result(r)
        return [r for _, r in results if not isinstance(r, BaseException)]

    @functools.cached_property
    def _eos(self) -> set[int]:
        return set(self.target.cfg.eos_token_ids)

    def _plan(self, running: list[_Seq]) -> None:
        """Pick this step's proposer and drafted tokens per request, then feed pending target rows
        to the drafts that will draft.

        With the goodput policy (`adaptive`), every request's option — none, the EAGLE3 chain with
        k = 1..k_max, a prefix of its suffix proposal — is chosen for the whole batch by predicted
        tokens/s (`AdaptiveK.plan_step`). A request outside the policy (a fixed k, seeded sampling,
        no policy) drafts k = its own or the engine's k, or takes the suffix proposal when its
        expected accepted tokens (the sum of its chain scores) reach `suffix_min_expected` or it has
        no EAGLE3 draft."""
        for s in running:
            s.drafts, s.draft_probs, s.via, s.k, s.proposal, s.layout, s.tree_depth = [], [], "", 0, None, None, 0
        ladders = [self._ladder(s) for s in running]
        stop = 0.0
        if self.adaptive is not None and any(lad.fixed is None for lad in ladders):
            choice = self.adaptive.plan_step([s.req.workload for s in running], ladders)
            if self.draft_early_stop:
                stop = self.adaptive.stop_below(ladders, choice)
        else:
            choice = [lad.fixed for lad in ladders]
        for s, lad in zip(running, ladders):
            s.stop_below = stop if lad.fixed is None else 0.0
        for s, (via, n), lad in zip(running, choice, ladders):
            s.via, s.k = via, n
            if via == "eagle3" and s.tree:
                s.tree_depth = lad.depth(n)
            if via == "suffix":
                s.drafts = list(s.proposal.tokens[:n])
                if s.rng is not None:  # a deterministic proposal: q is one-hot, rejection sampling stays exact
                    V = self.target.cfg.vocab_size
                    s.draft_probs = [torch.zeros(V).index_fill_(0, torch.tensor([t]), 1.0) for t in s.drafts]
        for draft, group in _by_draft([s for s in running if s.via == "eagle3" and s.backlog]):
            items = [(torch.cat([a for a, _ in s.backlog]), torch.cat([t for _, t in s.backlog]), s.draft_cache)
                     for s in group]
            for s, (h, dl) in zip(group, draft.extend_batch(items)):
                s.draft_hidden, s.draft_logits, s.backlog = h, dl, []

    def _ladder(self, s: _Seq) -> Ladder:
        """The request's options this step (`goodput.Ladder`): drafts are capped so the output and
        the KV cache have room for them plus the bonus token."""
        room = min(s.req.max_new_tokens - len(s.gen), self.max_seq_len - s.cache.length) - 1
        if self.suffix is not None and s.req.speculative and room > 0:
            p = self.suffix.propose(s.rid)
            s.proposal = Proposal(p.tokens[:room], p.score, p.match_len, p.source, p.scores[:room])
        p = s.proposal
        if s.tree:  # one token left (or no KV room): no tree
            return self._tree_ladder(s) if room > 0 else Ladder(fixed=NONE)
        if self._adaptive_for(s.req):
            eagle = self.adaptive.eagle_gains(s.req.workload, room) if s.draft is not None else ()
            suffix = self.adaptive.suffix_gains(s.req.workload, p.scores) if p is not None else ()
            return Ladder(eagle, suffix)
        if p is not None and p.tokens and (s.draft is None or sum(p.scores) >= self.suffix_min_expected):
            return Ladder(fixed=("suffix", len(p.tokens)), fixed_gain=sum(p.scores))
        if s.draft is None:
            return Ladder(fixed=NONE)
        k = s.req.k if s.req.k is not None else self.k
        gain = self.adaptive.eagle_gains(s.req.workload, k)[-1] if self.adaptive is not None else 0.0
        return Ladder(fixed=("eagle3", k), fixed_gain=gain)

    def _tree_ladder(self, s: _Seq) -> Ladder:
        """A tree request's options: n = 1..N−1 verified nodes (N = tree num_draft_tokens, capped by
        the KV room), depth min(num_steps, n, output room) — under the policy its gains
        (`AdaptiveK.tree_gains`) and width are the plan's; else the fixed tree of SGLang's knobs."""
        steps = self._k_max(s.req)
        out_room = s.req.max_new_tokens - len(s.gen) - 1
        cap = min(self.tree_nodes, max_nodes(min(steps, out_room), self.topk), self.max_seq_len - s.cache.length - 1)
        depth = tuple(min(steps, n, out_room) for n in range(1, cap + 1))
        s.tree_cap = cap
        p = s.proposal
        if self._adaptive_for(s.req):
            eagle = self.adaptive.tree_gains(s.req.workload, cap, lambda n: depth[n - 1])
            suffix = self.adaptive.suffix_gains(s.req.workload, p.scores) if p is not None else ()
            return Ladder(eagle, suffix, eagle_depth=depth, draft_rows=self.topk)
        if p is not None and p.tokens and sum(p.scores) >= self.suffix_min_expected:
            return Ladder(fixed=("suffix", len(p.tokens)), fixed_gain=sum(p.scores))
        gain = self.adaptive.tree_gains(s.req.workload, cap, lambda n: depth[n - 1])[-1] if self.adaptive else 0.0
        return Ladder(fixed=("eagle3", cap), fixed_gain=gain, eagle_depth=depth, draft_rows=self.topk)

    def _draft_trees(self, seqs: list[_Seq]) -> None:
        """EAGLE-2 trees (`engine.tree`): expand to the planned depth with topk, batched over
        requests per depth, keep the planned number of nodes of highest value; the tree's draft rows
        are discarded afterwards (the verified path is fed back as the next step's catch-up)."""
        for draft, group in _by_draft(seqs):
            for s in group:
                s.base = s.draft_cache.length
            jobs = [TreeJob(s.draft_hidden, s.draft_logits, s.draft_cache, s.tree_depth, self.topk) for s in group]
            expand(draft, jobs)
            for s, j in zip(group, jobs):
                nodes = select(j.tree, s.k)
                if s.stop_below > 0:  # EAGLE-2 value selection: more nodes while each still pays
                    w = s.req.workload
                    nodes = widen(j.tree, nodes, lambda c: self.adaptive.accept_given_confidence(w, c),
                                  s.stop_below, s.tree_cap)
                s.layout = layout(j.tree, nodes, s.next_token)
                s.k = s.layout.num_nodes
                s.drafts = s.layout.tokens[1:]
                s.draft_cache.length = s.base

    def _draft_chain(self, seqs: list[_Seq]) -> None:
        """Chain drafting: k tokens per request; draft forwards batched across requests per position.

        Early stop (`draft_early_stop`, requests under the goodput policy): the probability that
        drafted token j is reached and accepted is estimated as the product over i ≤ j of the
        learned P(accept | draft confidence) (`AdaptiveK.accept_given_confidence`); the chain ends
        before a token whose estimate falls below the step's break-even (`AdaptiveK.stop_below`).
        At least one token is drafted, so acceptance keeps being measured."""
        for s in seqs:
            s.base = s.draft_cache.length
            s.confs, s.reach, s.stopped, s.k_plan = [], 1.0, False, s.k
        for j in range(max((s.k for s in seqs), default=0)):
            active = [s for s in seqs if s.k > j]
            for s in active:
                d, q = s.propose(s.draft_logits, j)
                if s.stop_below > 0:  # the draft's probability of the token it drafted
                    conf = float(q[d]) if q is not None else float(torch.softmax(s.draft_logits, -1).max())
                    reach = s.reach * self.adaptive.accept_given_confidence(s.req.workload, conf)
                    if j > 0 and reach < s.stop_below:
                        s.k, s.stopped = j, True  # the chain ends here: no verify row, no more draft steps
                        continue  # (the token drawn is discarded: the verify never saw it, still exact)
                    s.reach = reach
                    s.confs.append(conf)
                if q is not None:
                    s.draft_probs.append(q)
                s.drafts.append(int(d))
                s.last_draft = d
            active = [s for s in active if s.k > j]
            for draft, group in _by_draft([s for s in active if s.k > j + 1]):
                for s, (h, dl) in zip(group, draft.step_batch([(s.draft_hidden, s.last_draft.view(1), s.draft_cache) for s in group])):
                    s.draft_hidden, s.draft_logits = h, dl

    def _verify(self, new: list[_Seq], running: list[_Seq]):
        segs = [Segment(torch.tensor(s.req.prompt_ids, dtype=torch.int64), s.cache, last_only=True) for s in new]
        segs += [Segment(torch.tensor([s.next_token] + s.drafts), s.cache,
                         tree=None if s.layout is None else (s.layout.visible, s.layout.depth)) for s in running]
        if not segs:
            return []
        need_hidden = any(s.draft is not None or s.capture for s in new + running)
        return self.target.forward_batch(segs, need_hidden=need_hidden)

    def _after_prefill(self, s: _Seq, out, ttft_s: float) -> None:
        prompt = torch.tensor(s.req.prompt_ids, dtype=torch.int64)
        rows = s.process(out.logits[-1:], [])
        s.emit([s.pick(rows[0])], rows)
        if self.suffix is not None:
            self.suffix.start(s.rid, list(s.req.prompt_ids) + s.gen)
        s.k = 0
        if s.capture:
            s.rows.add(out, len(prompt))
        if s.draft is not None:
            s.backlog.append((out.aux.clone(), torch.cat([prompt[1:], torch.tensor([s.next_token])])))
        s.timing.prefill_s = ttft_s

    def _after_verify(self, s: _Seq, out, dt: float) -> None:
        if s.layout is not None:
            return self._after_tree(s, out, dt)
        k, L = s.k, s.cache.length - s.k - 1
        rows = s.process(out.logits, s.drafts)  # row i given the output + drafts[:i]
        if k == 0:
            n, new = 0, [s.pick(rows[0])]
        elif s.rng is None:
            preds = rows.argmax(-1).tolist()
            n = 0
            while n < k and s.drafts[n] == preds[n]:
                n += 1
            new = s.drafts[:n] + [preds[n]]
        else:
            n, tok = rejection_verify(warp(rows, s.req.sampling), torch.stack(s.draft_probs), s.drafts, s.rng)
            new = s.drafts[:n] + [tok]
        kept = s.emit(new, rows)
        if self.suffix is not None:
            self.suffix.append(s.rid, new[:kept])
        s.cache.crop(L + n + 1)
        if s.capture:
            s.rows.add(out, n + 1)
        if k:
            s.stats.observe(k, min(n, kept))  # drafts past a stop are not output: never counted accepted
            s.by_via.setdefault(s.via, SpecDecodingStats(0)).observe(k, min(n, kept))
        if s.via == "eagle3":
            s.draft_cache.length = s.base
            if self._adaptive_for(s.req):
                # a chain cut by early stop counts its stop position as not accepted: the planner's
                # a_j must describe what planning k returns with early stop on
                self.adaptive.observe(s.req.workload, s.k_plan if s.stopped and n == k else k, n)
                if s.confs:
                    self.adaptive.observe_confidence(s.req.workload, s.confs, n)
        elif s.via == "suffix" and self._adaptive_for(s.req):
            self.adaptive.observe_suffix(s.req.workload, sum(s.proposal.scores[:k]), n)
        if s.draft is not None and not s.finished:  # a copy: a view would keep the whole step's aux alive
            s.backlog.append((out.aux[:n + 1].clone(), torch.tensor(new)))
        s.timing.steps.append((dt, kept))

    def _after_tree(self, s: _Seq, out, dt: float) -> None:
        """Greedy acceptance of a verified tree (`tree.accept_greedy`): the accepted path's KV rows
        become the cache's next positions, its aux rows the capture rows and the draft's catch-up."""
        lay, k, L = s.layout, s.k, s.cache.length - s.k - 1
        preds = out.logits.argmax(-1).tolist()
        path = accept_greedy(lay, preds)
        idx = [0] + path
        n = len(path)
        new = [lay.tokens[r] for r in path] + [preds[idx[-1]]]
        kept = s.emit(new, out.logits[idx])
        if self.suffix is not None:
            self.suffix.append(s.rid, new[:kept])
        s.cache.keep(L, idx)
        sel = torch.tensor(idx)
        if s.capture or not s.finished:
            aux = out.aux[sel]
        if s.capture:
            s.rows.aux.append(aux)
            s.rows.hidden.append(out.hidden[sel])
        s.stats.observe(k, min(n, kept), positions=lay.max_depth)
        s.by_via.setdefault("eagle3", SpecDecodingStats(0)).observe(k, min(n, kept), positions=lay.max_depth)
        if self._adaptive_for(s.req):
            self.adaptive.observe_tree(s.req.workload, k, lay.max_depth, n)
        if not s.finished:
            s.backlog.append((aux, torch.tensor(new)))
        s.timing.steps.append((dt, kept))

    def _finish(self, s: _Seq) -> Generation:
        gen = s.gen  # already cut at the stop (`_Seq.emit`)
        res = Generation(s.rid, len(s.req.prompt_ids), gen, s.stats, s.timing, s.version,
                         finish_reason=s.finish_reason or "length", stop_reason=s.stop_reason, logprobs=s.logprobs,
                         stats_by_proposer=dict(s.by_via))
        if s.capture and not s.aborted:
            p = list(s.req.prompt_ids)
            T = len(p) + len(gen) - 1
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[len(p):] = 1
            res.record = {"input_ids": torch.tensor(p + gen[:-1], dtype=torch.int32), "loss_mask": mask,
                          "aux_hidden_states": torch.cat(s.rows.aux)[:T],
                          "hidden_states": torch.cat(s.rows.hidden)[:T]}
        return res
