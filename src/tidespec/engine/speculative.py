"""Speculative decoding with continuous batching: the engine and its step.

One step, top to bottom (`Engine.step`, after vLLM v1's engine step and gpt-fast's one-page
`speculative_decode`): admit waiting requests (their prefill rides in the step's forward) → plan
(`plan.Planner`: each running request's proposer and option, fixed or chosen for the whole batch by
the goodput policy, `plan.StepPolicy`) → propose (each of the engine's proposers, batched over its
requests) → verify (one ragged target forward over every request's new rows: prefills, and [last
token, d_1..d_k] or a tree per running request, no padding: `Target.forward_batch`) → accept / emit
(`accept`) → observe (each proposer rolls back what was rejected, its estimator learns) → finish.
Requests join and leave between steps; a request's output is identical to running it alone
(greedy), and equals target-only decoding (fp32; sampled: lossless rejection sampling).
Drafts: EAGLE-3 (arXiv 2503.01840), EAGLE-2 trees (arXiv 2406.16858 §3), SuffixDecoding
(arXiv 2411.04975), grammar-forced tokens; acceptance: Leviathan et al. 2023 (arXiv 2211.17192).
"""
from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Mapping
from concurrent.futures import Future

import torch

from ..config import EngineParams
from ..models.runner import DraftRunner
from ..models.target import Segment, Target
from .accept import after_prefill, after_verify, cut_to_grammar, guard
from .drafts import GENERALIST, ServedDrafts, check_fits, check_replayed
from .generation import CaptureSink, Generation, generation_of, wanted
from .health import DraftHealth
from .invalid import InvalidRequest
from .plan import Planner, StepPlan, StepPolicy
from .policy import draft_batches
from .proposers import Build, ProposerRegistry, catch_up, default_proposers
from .request import Request, Seq, check_request, max_draft, with_context
from .sampling import GREEDY, SamplingParams
from .stats import SpecDecodingStats
from .suffix_tree import SuffixCache

log = logging.getLogger(__name__)

__all__ = ["GENERALIST", "CaptureSink", "Engine", "Generation", "InvalidRequest", "Request"]


class Engine:
    """Embedded engine: target + optional EAGLE3 draft (hot-swappable), continuous batching.

    cfg (`EngineParams`, whole): num_draft_tokens (k, or the policy's longest), max_seq_len (tokens
    per request, None: the target's context; `self.cfg` holds the resolved value), max_batch
    (running requests per step), draft_early_stop, tree (EAGLE-2 trees: eagle_topk > 1 makes greedy
    requests without logits transforms verify trees), suffix.min_expected; default `EngineParams()`.
    policy: the goodput policy (None: every request takes its fixed option); suffix: the suffix
    proposer's cache (None: no suffix proposer); registry: the proposers it may run (`ProposerRegistry`,
    default `default_proposers()`; the policy's must be the same), those that run with these settings
    in `self.proposers`; capture: asked at admission whether it wants each request, handed each
    captured one's record when it finishes; draft_version, replayed: the draft's version and its
    replayed first-token acceptance (class → (a₁, chains), as `set_draft`'s); forced_tokens:
    constrained requests propose their grammar's forced tokens (off in evaluation: τ of the draft alone).

    `generate` runs one request; `generate_batch` / `submit` run many together, up to max_batch per
    step. Any thread may drive the engine: `step()` is serialised. `set_draft` swaps the draft
    atomically; a request keeps the draft it started with. Raises ValueError for max_seq_len beyond
    the target's context, a draft of another target (vocab, hidden size, aux layers, id), or a
    policy without an estimator for one of its proposers (built over another registry).
    """

    def __init__(self, target: Target, draft: DraftRunner | None = None, cfg: EngineParams | None = None, *,
                 policy: StepPolicy | None = None, suffix: SuffixCache | None = None,
                 registry: ProposerRegistry | None = None, capture: CaptureSink | None = None,
                 draft_version: str | None = None, replayed: Mapping[str, tuple[float, float]] | None = None,
                 forced_tokens: bool = True):
        cfg = with_context(cfg or EngineParams(), target.cfg.max_position)
        self.target, self.cfg, self.policy, self.capture, self.suffix = target, cfg, policy, capture, suffix
        self._lock = threading.Lock()  # draft swap + queues
        self._step_lock = threading.Lock()  # one step at a time
        self._drafts = ServedDrafts(int(cfg.draft_memory_mb * 2**20))  # per class, "" the generalist
        self._waiting: list[Seq] = []
        self._seqs: dict[str, Seq] = {}  # request id → state, waiting or running (abort)
        self._running: list[Seq] = []
        self.registry = registry if registry is not None else default_proposers()
        self.proposers = self.registry.build(Build(cfg, target.cfg.vocab_size, suffix, forced_tokens))
        self._planner = Planner(cfg, self.proposers, policy)
        self.health = DraftHealth()  # live first-token acceptance per (draft version, class)
        if draft is not None:  # as set_draft: health's reference and the policy's a₁ from the replay
            check_fits(draft, self.target)
            check_replayed(replayed)
            self._drafts.check_memory(GENERALIST, draft)
            self._drafts.put(GENERALIST, draft, draft_version, replayed)
            self.health.serve(draft_version, replayed)
            if policy is not None and replayed:
                policy.reset(replayed)

    def set_draft(self, draft: DraftRunner | None, version: str | None = None,
                  replayed: dict[str, tuple[float, float]] | None = None, workload: str = GENERALIST) -> None:
        """Swap the draft of one workload class, or the generalist (`workload` ""; it serves every class
        without its own). None: the class falls back to the generalist; no generalist: no EAGLE3
        drafts for those classes. Raises ValueError before anything changes (`check_fits`, a
        malformed `replayed` — class → (a₁, chains), "" overall, what `health` compares live
        acceptance with —, over `engine.draft_memory_mb`). Running requests keep their draft. The
        policy forgets what it learned (a₁ restarts from each class's draft's replay) and times an
        untimed draft shape first (`StepPolicy.ensure_draft_costs`, ~0.5 s)."""
        if draft is not None:
            check_fits(draft, self.target)
            check_replayed(replayed)
            self._drafts.check_memory(workload, draft)
            if self.policy is not None:
                self.policy.ensure_draft_costs(self.target, draft)
        with self._lock:  # between admissions: a request starts with the old draft or the new, whole
            pri = self._drafts.put(workload, draft, version, replayed)
        if draft is not None:
            self.health.serve(version, replayed, slot=workload)
        if self.policy is not None:
            self.policy.reset(pri or None)

    @property
    def draft_version(self) -> str | None:
        """The generalist's version (None: none serves)."""
        return self._drafts.versions().get(GENERALIST)

    @property
    def draft_versions(self) -> dict[str, str | None]:
        """{class: version} of every draft served ("" = the generalist)."""
        return self._drafts.versions()

    def set_suffix_corpus(self, seqs: list[list[int]]) -> int:
        """Replace the suffix proposer's global tree with one over `seqs` (oldest first; the newest
        kept within its token budget): a champion's corpus, deployed with its draft. Built now,
        installed between steps (at once when the engine is idle). Returns the tokens retained.
        Raises ValueError without a suffix proposer (engine.suffix.enabled: true) or for a token id
        outside the vocabulary."""
        if self.suffix is None:
            raise ValueError("this engine has no suffix proposer; set engine.suffix.enabled: true in params.yaml")
        n = self.suffix.stage_global(seqs, self.target.cfg.vocab_size)
        if self._step_lock.acquire(blocking=False):  # idle engine: install now (never waits for a step)
            try:
                self.suffix.install_staged()
            finally:
                self._step_lock.release()
        return n

    # -- admission --------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raise InvalidRequest (a ValueError naming the field and the fix) for a request this engine
        cannot run (`request.check_request`)."""
        k = max_draft(self.policy, self.cfg.num_draft_tokens, req) if req.speculative else 0
        check_request(req, self.target.cfg.vocab_size, self.cfg.max_seq_len, k)

    def submit(self, req: Request) -> Future:
        """Queue a request; returns a Future resolving to its Generation. Raises InvalidRequest."""
        self.validate(req)
        rid = req.request_id or uuid.uuid4().hex
        capture = req.capture if req.capture is not None else wanted(self.capture, rid)
        topk = self.cfg.tree.eagle_topk
        with self._lock:
            draft, version = self._drafts.route(req.workload) if req.speculative else (None, None)
            if rid in self._seqs:
                raise InvalidRequest(
                    "request_id", f"request id {rid!r} is already in flight; request ids must be unique"
                )
            s = Seq(req, rid, draft, version, self.target.cfg.vocab_size, bool(capture), self._eos)
            # trees: greedy requests without logits transforms (they depend on the path; sampled ones chain)
            s.tree = topk > 1 and draft is not None and s.rng is None and not s.lp.active
            k = max_draft(self.policy, self.cfg.num_draft_tokens, req)
            s.draft_extra = max(0, k - 1) * topk if s.tree else 0
            s.stats = SpecDecodingStats(k if draft is not None else 0)
            self._waiting.append(s)
            self._seqs[rid] = s
        return s.future

    def abort(self, request_id: str) -> bool:
        """Stop a request (client gone, cancelled): a queued one resolves now, a running one at the
        start of the next step, before any more compute; it is never captured. Its Future resolves
        to a Generation with finish_reason "abort" and the tokens so far. Returns False for an
        unknown or finished request id."""
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
            s.future.set_result(generation_of(s))
        return True

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
        """Generate up to `max_new_tokens` after `prompt_ids` (stops at EOS); greedy by default. Raises
        InvalidRequest (`validate`); bad sampling values are refused when `SamplingParams` is built."""
        return self.generate_batch([Request(list(prompt_ids), max_new_tokens, speculative, k, capture, request_id,
                                            sampling, workload, prompt_id=prompt_id)])[0]

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running."""
        return len(self._running) + len(self._waiting)

    # -- one engine step --------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Generation]:
        """One step for every running request (module docstring). Returns the Generations finished in
        it. An error in the shared part (planning, drafting, the forward) fails this step's
        requests; one in a request's own bookkeeping fails only that request; the engine keeps
        serving. Futures resolve after the step lock is released (a done-callback may call back in)."""
        results: list[tuple[Seq, Generation | BaseException]] = []
        with self._step_lock:
            if self.suffix is not None:
                self.suffix.install_staged()
            new = self._admit()
            results += self._retire_aborted()
            running = self._running
            t0 = time.perf_counter()
            try:
                for s in new:
                    s.alloc(self.target, self.cfg.max_seq_len)
                plan = self._planner.plan(running)
                t_catch = time.perf_counter()
                catch_up(plan.drafting())  # draft models read the rows verified last step
                t_draft = time.perf_counter()  # the cost model's window: drafting + verify (not the catch-up)
                for proposer, slots in plan.groups(self.proposers):
                    proposer.propose(slots)
                cut_to_grammar(plan.slots)
                outs = self._verify(new, plan)
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                for s in new + running:  # after the aborted ones: every future resolves, suffix state freed
                    s.error = e
                results += self._retire(new + running)
            else:
                t_end = time.perf_counter()
                for s, out in zip(new, outs):
                    guard(s, after_prefill, s, out, time.perf_counter() - s.t_submit, self.suffix)
                for sl, out in zip(plan.slots, outs[len(new):]):
                    guard(sl.seq, after_verify, sl, out, t_end - t0, self.suffix, self.health)
                for sl in plan.slots:
                    if sl.proposer is not None and sl.seq.error is None:
                        guard(sl.seq, sl.proposer.observe, sl)
                        if sl.estimator is not None:
                            guard(sl.seq, sl.estimator.observe, sl)
                self._observe_cost(plan, bool(new), 1000 * (t_end - t_draft),
                                   1000 * (time.perf_counter() - t0 - (t_draft - t_catch)))
                results += self._retire(new + running)
        return self._resolve(results)

    def _admit(self) -> list[Seq]:
        """Waiting requests that fit the batch (`max_batch`), in order; a cancelled one is dropped."""
        with self._lock:
            n_new = max(0, self.cfg.max_batch - len(self._running))
            new, self._waiting = self._waiting[:n_new], self._waiting[n_new:]
        started = [s.future.set_running_or_notify_cancel() for s in new]
        with self._lock:
            for s, ok in zip(new, started):
                if not ok:
                    self._seqs.pop(s.rid, None)
        return [s for s, ok in zip(new, started) if ok]

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

    def _observe_cost(self, plan: StepPlan, prefill: bool, ms: float, step_ms: float) -> None:
        """The policy learns from decode-only steps (no prefill) in which no request failed: its cost model
        the measured drafting + verify time `ms`; its realized margin the tokens the step verified in `step_ms`
        (all but the catch-up) against the plan's prediction, where the policy chose every option."""
        slots = plan.slots
        if self.policy is None or not slots or prefill or any(sl.seq.error is not None for sl in slots):
            return
        fw = draft_batches([sl.draft_forwards for sl in slots], [sl.draft_rows for sl in slots])
        self.policy.observe_step(len(slots), sum(sl.k + 1 for sl in slots), fw, ms)
        if plan.predicted is not None:
            self.policy.observe_realized([sl.seq.req.workload for sl in slots], any(sl.n for sl in slots),
                                         plan.predicted, sum(sl.accepted + 1 for sl in slots), step_ms)

    def _retire_aborted(self) -> list[tuple[Seq, Generation]]:
        """Aborted running requests leave before any compute (their suffix trees closed unlearned)."""
        out = []
        for s in [s for s in self._running if s.aborted]:
            if self.suffix is not None:
                self.suffix.finish(s.rid)
            s.finish_reason = "abort"
            out.append((s, generation_of(s)))
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
                out.append((s, s.error if s.error is not None else generation_of(s)))
            except Exception as e:  # noqa: BLE001 - its future resolves to the error
                out.append((s, e))
        return out

    def _resolve(self, results: list[tuple[Seq, Generation | BaseException]]) -> list[Generation]:
        """Outside the step lock: free the requests' KV memory, hand captured ones to the sink (a
        failing sink never fails the request), resolve the futures. Returns the Generations."""
        with self._lock:
            for s, _ in results:
                self._seqs.pop(s.rid, None)
        for s, r in results:
            s.cache = s.draft_cache = None
            s.drain()
            if s.capture and self.capture is not None and not s.aborted and not isinstance(r, BaseException):
                try:
                    self.capture.submit_generation(r, s.req.workload, s.req.prompt_id)
                except Exception:
                    log.exception("capture sink refused request %s", s.rid)
            if isinstance(r, BaseException):
                s.future.set_exception(r)
            else:
                s.future.set_result(r)
        return [r for _, r in results if not isinstance(r, BaseException)]

    @functools.cached_property
    def _eos(self) -> set[int]:
        return set(self.target.cfg.eos_token_ids)
