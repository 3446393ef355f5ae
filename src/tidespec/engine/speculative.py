"""Speculative decoding with continuous batching: the engine and its step.

One step, top to bottom (`Engine.step`, after vLLM v1's engine step and gpt-fast's one-page
`speculative_decode`): admit waiting requests (their prefill rides in the step's forward) → plan
(`plan.Planner`: each running request's proposer and option — none, the EAGLE3 chain, an EAGLE-2
tree, or a prefix of its suffix proposal — fixed, or chosen for the whole batch by the goodput
policy `adaptive.AdaptiveK`) → propose (one `proposers.Proposer` per method, batched over its
requests) → verify (one ragged target forward over every request's new rows: prefills, and
[last token, d_1..d_k] or a tree per running request, no padding: `Target.forward_batch`) →
accept / emit (`_after_verify`) → observe (each proposer rolls back what was rejected and teaches
the policy) → finish (retire finished requests, resolve their futures). Requests join and leave
between steps; a request's output is identical to running it alone (greedy).

Acceptance: Leviathan et al. 2023 (arXiv 2211.17192) §2 / Chen et al. 2023 (arXiv 2302.01318):
greedy accepts the longest prefix of drafts equal to the target's argmax plus the target's own
token at the first mismatch (the bonus), so the output is the target's greedy output token for
token (fp32: see models/target.py); sampled requests use lossless rejection sampling
(`sampling.rejection_verify`); trees accept the longest path of argmax tokens (`tree.accept_greedy`).
Drafts: EAGLE-3 (arXiv 2503.01840), EAGLE-2 trees (arXiv 2406.16858 §3), SuffixDecoding
(arXiv 2411.04975).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..config import tree_num_draft_tokens as tree_size
from ..models.eagle3 import DraftRunner
from ..models.target import Segment, Target
from .adaptive import AdaptiveK, first_token_priors
from .goodput import draft_batches
from .health import DraftHealth
from .logits import check_token_ids
from .plan import TREE, Planner, StepPlan, adaptive_for, k_max
from .proposers import Eagle3Chain, Eagle3Tree, GrammarProposer, Proposer, Slot, SuffixProposer, catch_up
from .request import Request, Seq
from .sampling import GREEDY, SamplingParams, TokenLogprob, rejection_verify, warp
from .stats import RequestTiming, SpecDecodingStats
from .suffix import SuffixCache
from .tree import accept_greedy

log = logging.getLogger(__name__)

__all__ = ["CaptureSink", "Engine", "Generation", "Request"]


@dataclass
class Generation:
    """Result of one request.

    tokens: generated ids (prompt excluded), cut exactly at the stop condition; stats: per-request
    spec-decode counters (tokens cut off after a stop are never counted as accepted); timing:
    prefill and per-step wall times; finish_reason: "stop" (EOS, a stop token id or a stop string),
    "length" (max_new_tokens) or "abort" (`Engine.abort`); stop_reason: vLLM's — None for EOS or
    length, the stop token id, or the stop string; logprobs: one `TokenLogprob` per token when the
    request asked (`SamplingParams.logprobs`); grammar_error: why the request's grammar could not go on
    (finish_reason "length"; None otherwise); record: capture tensors (when the request was captured):
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
    stats_by_proposer: dict[str, SpecDecodingStats] = field(default_factory=dict)  # "eagle3", "suffix", "grammar"
    grammar_error: str | None = None
    constraint: dict | None = None  # the constraint spec of a constrained request (`engine.constraint`)
    workload: str = "default"  # the request's workload class (the policy's and the capture's key)

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
    `forced_tokens`: constrained requests propose the tokens their grammar forces (`proposers.grammar`);
    evaluation turns it off so τ measures the draft alone (under the grammar's masks).
    `replayed`: the draft's replayed first-token acceptance (class → (a₁, chains)), as `set_draft`'s
    (ValueError when malformed).
    Proposers (`_proposers`, `engine.proposers`): the EAGLE3 chain, the EAGLE-2 tree, the suffix
    proposal, a constrained request's grammar-forced tokens; a new one is one `Proposer` class plus its entry there and its option in the plan.
    Also raises ValueError for num_draft_tokens, max_batch or eagle_topk < 1, max_seq_len beyond the
    target's context (`max_position`), or a draft of another target (vocab, hidden size, aux layers, id).
    """

    def __init__(self, target: Target, draft: DraftRunner | None = None, num_draft_tokens: int = 4,
                 max_seq_len: int = 1024, draft_version: str | None = None, max_batch: int = 8,
                 adaptive: AdaptiveK | None = None, capture: CaptureSink | None = None,
                 suffix: SuffixCache | None = None, suffix_min_expected: float = 1.0, draft_early_stop: bool = False,
                 eagle_topk: int = 1, tree_num_draft_tokens: int | None = None, forced_tokens: bool = True,
                 replayed: Mapping[str, tuple[float, float]] | None = None):
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
        self.forced_tokens = forced_tokens  # constrained requests: the grammar's forced tokens as a proposer
        self.tree_nodes = n_tree - 1  # drafted nodes verified per tree (at most)
        self._lock = threading.Lock()  # draft swap + queues
        self._step_lock = threading.Lock()  # one step at a time
        self._draft = draft
        self._draft_version = draft_version
        self._waiting: list[Seq] = []
        self._seqs: dict[str, Seq] = {}  # request id → state, waiting or running (abort)
        self._running: list[Seq] = []
        self._proposers: dict[str, Proposer] = {  # the plan's option name → its proposer (drafting order)
            "eagle3": Eagle3Chain(), TREE: Eagle3Tree(eagle_topk), "suffix": SuffixProposer(target.cfg.vocab_size),
            "grammar": GrammarProposer(target.cfg.vocab_size)}
        self._pending_global = None  # a global suffix tree waiting to be installed between steps
        self.health = DraftHealth()  # live first-token acceptance per (draft version, class)
        if draft is not None:  # as set_draft: health's reference and the policy's a₁ from the replay
            self._check_draft(draft)
            first_token_priors(replayed or {}, 0.0)
            self.health.serve(draft_version, replayed)
            if adaptive is not None and replayed:
                adaptive.reset(replayed)

    def _check_draft(self, draft: DraftRunner) -> None:
        c, t = draft.config, self.target.cfg
        if c.vocab_size != t.vocab_size or c.target_hidden_size != t.hidden_size:
            raise ValueError(f"draft (V={c.vocab_size}, Ht={c.target_hidden_size}) does not fit the target "
                             f"(V={t.vocab_size}, H={t.hidden_size})")
        if tuple(c.aux_layer_ids) != tuple(self.target.aux_layers):
            raise ValueError(f"draft aux layers {c.aux_layer_ids} != target capture layers {self.target.aux_layers}")
        if c.target_id and self.target.target_id != "unknown" and c.target_id != self.target.target_id:
            raise ValueError(f"draft trained for target {c.target_id[:12]}, serving {self.target.target_id[:12]}")

    def set_draft(self, draft: DraftRunner | None, version: str | None = None,
                  replayed: dict[str, tuple[float, float]] | None = None) -> None:
        """Swap the draft (None = no speculation). Raises ValueError for a draft of another target.
        `replayed`: the first-token acceptance its evaluation replayed and the chains it counted
        (class → (a₁, chains), "" overall), what `health` compares its live acceptance with; a
        malformed one raises ValueError before anything changes. The adaptive policy's acceptance
        estimates restart (they described the old draft): a₁ from the replayed first-token acceptance
        where given (`adaptive.first_token_priors`), else the policy's prior; a draft whose steps it has
        not timed (another shape, or the engine started without one) is timed first
        (`AdaptiveK.ensure_draft_costs`, ~0.5 s)."""
        if draft is not None:
            self._check_draft(draft)
            first_token_priors(replayed or {}, 0.0)  # ValueError for a malformed replay, before anything changes
            if self.adaptive is not None:  # a draft of another shape (or the first one) is timed before it serves
                self.adaptive.ensure_draft_costs(self.target, draft)
        with self._lock:
            self._draft, self._draft_version = draft, version
        if draft is not None:
            self.health.serve(version, replayed)
        if self.adaptive is not None:
            self.adaptive.reset(replayed if draft is not None else None)

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
        """Adaptive k for this request? (`plan.adaptive_for`)"""
        return adaptive_for(self.adaptive, req)

    def _k_max(self, req: Request) -> int:
        return k_max(self.adaptive, self.k, req)

    def _tree_for(self, s: Seq) -> bool:
        """Does this request draft EAGLE-2 trees? With eagle_topk > 1, an EAGLE3 draft, greedy
        and no logits transforms (they depend on the path: trees would need one per branch — a
        grammar too, so constrained requests draft chains); sampled requests draft chains (exact
        rejection sampling)."""
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
        if req.grammar is not None:
            if req.grammar.vocab_size != V:
                raise ValueError(f"grammar compiled for a vocabulary of {req.grammar.vocab_size}, the target has {V}")
            if req.sampling.min_tokens:
                raise ValueError("min_tokens cannot be combined with a grammar (it would mask the stop the "
                                 "grammar requires): drop min_tokens")
        if req.stop is not None and not callable(req.stop):
            raise ValueError("stop must be a callable (a stop-string check) or None")
        k = self._k_max(req) if req.speculative else 0  # a tree verifies what the KV room leaves (`Planner._tree_ladder`)
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
            seq = Seq(req, rid, draft, version, self.target.cfg.vocab_size, bool(capture), self._eos)
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
        """One engine step for every running request: admit (waiting requests join; their prefill
        rides in this step's forward) → plan (each request's proposer and option) → propose (each
        proposer drafts for its requests, batched) → verify (one ragged target forward) → accept /
        emit (per request) → observe (each proposer rolls back what was rejected and teaches the
        policy) → finish (retire finished requests).

        Returns the Generations finished in this step. An error in the shared part (planning,
        drafting, the forward) fails this step's requests; an error in one request's own
        bookkeeping fails only that request; the engine keeps serving. Futures are resolved after
        the step lock is released, so a done-callback may call back into the engine. A request
        cancelled before it starts is dropped.
        """
        results: list[tuple[Seq, Generation | BaseException]] = []
        with self._step_lock:
            if self._pending_global is not None:
                self._install_pending()
            new = self._admit()
            results += self._retire_aborted()
            running = self._running
            t0 = time.perf_counter()
            try:
                for s in new:
                    s.alloc(self.target, self.max_seq_len)
                plan = self._planner().plan(running, self._proposers)
                t_catch = time.perf_counter()
                catch_up(plan.named("eagle3"))  # EAGLE3 drafts read the rows verified last step
                t_draft = time.perf_counter()  # the cost model's window: drafting + verify (not the catch-up)
                for proposer, slots in plan.groups(self._proposers.values()):
                    proposer.propose(slots)
                _cut_to_grammar(plan.slots)
                outs = self._verify(new, plan)
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                results += [(s, e) for s in new + running]  # after the aborted ones: every future resolves
                self._running = []
            else:
                t_end = time.perf_counter()
                for s, out in zip(new, outs):
                    _guard(s, self._after_prefill, s, out, time.perf_counter() - s.t_submit)
                for sl, out in zip(plan.slots, outs[len(new):]):
                    _guard(sl.seq, self._after_verify, sl, out, t_end - t0)  # accept, emit
                for sl in plan.slots:
                    if sl.proposer is not None and sl.seq.error is None:
                        _guard(sl.seq, sl.proposer.observe, sl)
                self._observe_cost(plan, bool(new), 1000 * (t_end - t_draft),
                                   1000 * (time.perf_counter() - t0 - (t_draft - t_catch)))
                results += self._retire(new + running)
        return self._resolve(results)

    def _admit(self) -> list[Seq]:
        """Waiting requests that fit the batch (`max_batch`), in order; a cancelled one is dropped."""
        with self._lock:
            n_new = max(0, self.max_batch - len(self._running))
            new, self._waiting = self._waiting[:n_new], self._waiting[n_new:]
        started = [s.future.set_running_or_notify_cancel() for s in new]
        with self._lock:
            for s, ok in zip(new, started):
                if not ok:
                    self._seqs.pop(s.rid, None)
        return [s for s, ok in zip(new, started) if ok]

    def _planner(self) -> Planner:
        """This step's planning knobs (read now: `suffix` may have been replaced since the last step)."""
        return Planner(self.k, self.max_seq_len, self.adaptive, self.suffix, self.suffix_min_expected,
                       self.draft_early_stop, self.topk, self.tree_nodes, self.forced_tokens)

    def _verify(self, new: list[Seq], plan: StepPlan):
        """One ragged target forward: each new request's prompt (logits of its last row only), each
        running request's [last token, drafts...] (a chain, or a tree with its attention mask).
        Returns one `TargetOutput` per segment, new requests first (logits `[n, V]` fp32; aux
        `[n, 3H]` and hidden `[n, H]` when a draft or a capture needs them)."""
        segs = [Segment(torch.tensor(s.req.prompt_ids, dtype=torch.int64), s.cache, last_only=True) for s in new]
        segs += [Segment(torch.tensor([sl.seq.next_token] + sl.drafts), sl.seq.cache,
                         tree=None if sl.layout is None else (sl.layout.visible, sl.layout.depth)) for sl in plan.slots]
        if not segs:
            return []
        need_hidden = any(s.draft is not None or s.capture for s in new + [sl.seq for sl in plan.slots])
        return self.target.forward_batch(segs, need_hidden=need_hidden)

    def _after_prefill(self, s: Seq, out, ttft_s: float) -> None:
        """The first token from the prompt's last row; the suffix cache opens the request's tree; the
        prompt's aux rows `[P, 3H]` become the draft's first backlog."""
        prompt = torch.tensor(s.req.prompt_ids, dtype=torch.int64)
        rows = s.process(out.logits[-1:], [])
        s.emit([s.pick(rows[0])], rows)
        if self.suffix is not None:
            self.suffix.start(s.rid, list(s.req.prompt_ids) + s.gen)
        if s.capture:
            s.rows.add(out, len(prompt))
        if s.draft is not None:
            s.feed(out.aux.clone(), torch.cat([prompt[1:], torch.tensor([s.next_token])]))
        s.timing.prefill_s = ttft_s

    def _after_verify(self, sl: Slot, out, dt: float) -> None:
        """Accept and emit one request's verified rows (`out`: logits `[k+1, V]` fp32, aux `[k+1, 3H]`):
        the accepted drafts plus the target's token after them, cut at a stop (`Seq.emit`); the KV
        cache keeps the accepted rows only (a tree's path compacted); counters count drafts accepted
        and kept (a draft past a stop is never counted accepted; `SpecDecodingStats.as_vllm` adds them back); the accepted rows' aux join the
        draft's backlog and, when captured, the capture rows."""
        s = sl.seq
        start = s.cache.length - sl.k - 1  # the cache before this step's verify rows
        new, rows, idx = self._accept_tree(sl, out) if sl.layout is not None else self._accept_chain(sl, out)
        n = sl.accepted = len(new) - 1
        kept = s.emit(new, rows)
        if self.suffix is not None:
            self.suffix.append(s.rid, new[:kept])
        s.cache.keep(start, idx)  # roll back: the rejected rows go
        feed = s.draft is not None and not s.finished
        if s.capture or feed:
            sel = torch.tensor(idx)
            aux = out.aux[sel]  # a copy: a view would keep the whole step's aux alive
            if s.capture:
                s.rows.aux.append(aux)
                s.rows.hidden.append(out.hidden[sel])
            if feed:
                s.feed(aux, torch.tensor(new))
        if sl.k and sl.layout is None and sl.proposer.name == "eagle3":  # the draft's health: a₁ of its chains
            self.health.observe(s.version, s.req.workload, n > 0)
        if sl.k or sl.layout is not None:
            depth = sl.layout.max_depth if sl.layout is not None else None
            s.stats.observe(sl.k, min(n, kept), positions=depth, num_verified=n)
            s.by_via.setdefault(sl.proposer.name, SpecDecodingStats(0)).observe(sl.k, min(n, kept), positions=depth,
                                                                                num_verified=n)
        s.timing.steps.append((dt, kept))

    @staticmethod
    def _accept_chain(sl: Slot, out) -> tuple[list[int], torch.Tensor, list[int]]:
        """A chain's (or no drafts') accepted drafts + the target's token, the processed rows `[k+1, V]`
        they were chosen from, and the verify rows kept (0..n). Greedy: the longest prefix of drafts
        equal to the argmax; sampled: rejection sampling (Leviathan et al. 2023 §2.3, Chen et al. 2023
        Alg. 2; `sampling.rejection_verify`), exact for any proposal q (`slot.draft_probs`)."""
        s, k = sl.seq, sl.k
        rows = s.process(out.logits, sl.drafts)  # row i given the output + drafts[:i]
        if k == 0:
            n, tok = 0, s.pick(rows[0])
        elif s.rng is None:
            preds = rows.argmax(-1).tolist()
            n = 0
            while n < k and sl.drafts[n] == preds[n]:
                n += 1
            tok = preds[n]
        else:
            n, tok = rejection_verify(warp(rows, s.req.sampling), torch.stack(sl.draft_probs), sl.drafts, s.rng)
        return sl.drafts[:n] + [tok], rows, list(range(n + 1))

    @staticmethod
    def _accept_tree(sl: Slot, out) -> tuple[list[int], torch.Tensor, list[int]]:
        """A tree's accepted path + the target's token after it (`tree.accept_greedy`, EAGLE-2 §3),
        the logits rows `[n+1, V]` they were chosen from, and the verify rows kept (root + path)."""
        lay = sl.layout
        preds = out.logits.argmax(-1).tolist()
        idx = [0] + accept_greedy(lay, preds)
        return [lay.tokens[r] for r in idx[1:]] + [preds[idx[-1]]], out.logits[idx], idx

    def _observe_cost(self, plan: StepPlan, prefill: bool, ms: float, step_ms: float) -> None:
        """The policy learns from decode-only steps (no prefill) in which no request failed: its cost
        model the measured drafting + verify time `ms`; its realized margin the tokens the step
        verified in `step_ms` (the whole step but the draft's catch-up) against the plan's
        prediction, where the policy chose every option (`AdaptiveK.observe_realized`)."""
        slots = plan.slots
        if self.adaptive is None or not slots or prefill or any(sl.seq.error is not None for sl in slots):
            return
        fw = draft_batches([sl.draft_forwards for sl in slots], [sl.draft_rows for sl in slots])
        self.adaptive.observe_step(len(slots), sum(sl.k + 1 for sl in slots), fw, ms)
        if plan.predicted is not None:
            self.adaptive.observe_realized([sl.seq.req.workload for sl in slots], any(sl.n for sl in slots),
                                           plan.predicted, sum(sl.accepted + 1 for sl in slots), step_ms)

    def _retire_aborted(self) -> list[tuple[Seq, Generation]]:
        """Aborted running requests leave before any compute (their suffix trees closed unlearned)."""
        out = []
        for s in [s for s in self._running if s.aborted]:
            if self.suffix is not None:
                self.suffix.finish(s.rid)
            s.finish_reason = "abort"
            out.append((s, self._finish(s)))
        self._running = [s for s in self._running if not s.aborted]
        return out

    def _retire(self, seqs: list[Seq]) -> list[tuple[Seq, Generation | BaseException]]:
        """Finished and failed requests leave the batch; a finished one's output joins the suffix
        proposer's global tree. Returns their results (Generation, or the error)."""
        done = [s for s in seqs if s.finished or s.error is not None]
        self._running = [s for s in seqs if not (s.finished or s.error is not None)]
        out: list[tuple[Seq, Generation | BaseException]] = []
        for s in done:
            if self.suffix is not None:  # not an aborted/failed one
                self.suffix.finish(s.rid, s.gen if s.error is None and not s.aborted else None)
            try:
                out.append((s, s.error if s.error is not None else self._finish(s)))
            except Exception as e:  # noqa: BLE001
                out.append((s, e))
        return out

    def _resolve(self, results: list[tuple[Seq, Generation | BaseException]]) -> list[Generation]:
        """Outside the step lock: free the requests' KV memory, hand captured ones to the sink
        (a slow sink cannot stall the batch; a failing one never fails the request), resolve the
        futures. Returns the Generations."""
        with self._lock:
            for s, _ in results:
                self._seqs.pop(s.rid, None)
        for s, r in results:
            s.cache = s.draft_cache = None
            s.drain()
            if s.capture and self.capture is not None and not s.aborted and not isinstance(r, BaseException):
                try:
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

    def _finish(self, s: Seq) -> Generation:
        """The request's Generation; a captured one gets its record (see `Generation.record`)."""
        gen = s.gen  # already cut at the stop (`Seq.emit`)
        res = Generation(s.rid, len(s.req.prompt_ids), gen, s.stats, s.timing, s.version,
                         finish_reason=s.finish_reason or "length", stop_reason=s.stop_reason, logprobs=s.logprobs,
                         stats_by_proposer=dict(s.by_via), grammar_error=s.grammar_error,
                         constraint=s.req.grammar.spec if s.req.grammar is not None else None,
                         workload=s.req.workload)
        if s.capture and not s.aborted:
            p = list(s.req.prompt_ids)
            T = len(p) + len(gen) - 1
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[len(p):] = 1
            res.record = {"input_ids": torch.tensor(p + gen[:-1], dtype=torch.int32), "loss_mask": mask,
                          "aux_hidden_states": torch.cat(s.rows.aux)[:T],
                          "hidden_states": torch.cat(s.rows.hidden)[:T]}
        return res


def _cut_to_grammar(slots: list[Slot]) -> None:
    """A constrained request's drafts end before the first token its grammar forbids (such a draft
    could never be accepted: its row masks it), so no verify row is spent on it. Exact for sampled
    requests too: a cut happens only to deterministic (one-hot q) proposals — EAGLE3 drafts are drawn
    from the grammar-masked distribution and are always valid."""
    for sl in slots:
        g = sl.seq.lp.grammar
        if g is not None and sl.drafts and sl.layout is None:
            n = g.valid_prefix(sl.drafts)
            if n < len(sl.drafts):
                sl.drafts, sl.draft_probs = sl.drafts[:n], sl.draft_probs[:n]


def _guard(s: Seq, fn, *args) -> None:
    """Run one request's own bookkeeping; an error fails that request only (`s.error`)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - this request only
        s.error = e
