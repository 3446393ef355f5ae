"""The step's plan: which proposer and option each running request takes this step (`StepPlan`).

Every proposer of the engine offers each request a rung of options (`Proposer.offer`), capped so
the output and the KV cache have room for the drafts plus the bonus token. Under the goodput
policy the options of the whole batch are chosen together by predicted tokens/s
(`StepPolicy.choose`; `policy.GoodputPolicy` implements it); a request outside it (a fixed k, a
seeded one, no policy) takes the option its proposers claim with the lowest rank (`Rung.fixed`): a
grammar's ≥ 2 forced tokens, then a confident suffix proposal, then the draft's chain of its k (or
tree), then a weak suffix proposal, then a single forced token. The policy may leave a gated
proposer's offers uncomputed for a class (`StepPolicy.offer_due`). `StepPolicy` is all the engine
asks of the policy.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..config import EngineParams
from .policy import NONE, Ladder, StepChoice
from .proposers.base import Proposer, ProposerPolicy, Rung, Slot
from .request import Seq, under_policy


class StepPolicy(ProposerPolicy, Protocol):
    """What the engine asks of the goodput policy (`policy.GoodputPolicy`), beyond what its proposers
    ask (`ProposerPolicy`: k_max, estimator, catch_up_ms). kinds: the proposer kinds it has an
    estimator for; offer_due: compute a gated kind's offers for a class in a batch of b this step;
    choose: the step's plan over the requests' ladders (`StepChoice`); observe_step /
    observe_realized: a measured decode step, and what it realized against its plan's prediction;
    reset: forget what was learned (a new draft serves); ensure_draft_costs: time a draft the
    calibration has not timed (a hot-swap)."""

    kinds: frozenset[str]

    def offer_due(self, kind: str, workload: str, b: int) -> bool: ...

    def choose(self, workloads: list[str], ladders: list[Ladder], prompt_backlogs: list[int] | None = None,
               early_stop: bool = False) -> StepChoice: ...

    def observe_step(self, b: int, total_rows: int, draft_batches: list[int], ms: float) -> None: ...

    def observe_realized(self, workloads: Sequence[str], speculated: bool, predicted: tuple[float, float],
                         tokens: int, ms: float) -> None: ...

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None: ...

    def ensure_draft_costs(self, target, runner) -> bool: ...


@dataclass
class StepPlan:
    """One step's slots, in the running order (one per running request, proposer None = no drafts);
    predicted: (expected tokens, predicted ms) of the policy's plan (`search.predicted_step`), None
    when the policy did not choose every request's option (no policy, a request outside it, a probe)."""

    slots: list[Slot]
    predicted: tuple[float, float] | None = None

    def groups(self, proposers: list[Proposer]) -> list[tuple[Proposer, list[Slot]]]:
        """(proposer, its slots) for each proposer with work this step, in the order given."""
        out = [(p, [sl for sl in self.slots if sl.proposer is p]) for p in proposers]
        return [(p, group) for p, group in out if group]

    def drafting(self) -> list[Slot]:
        """Slots whose proposer runs the request's draft model (`Proposer.uses_draft`)."""
        return [sl for sl in self.slots if sl.proposer is not None and sl.proposer.uses_draft]


class Planner:
    """Plans steps for an engine: `cfg` (its `EngineParams`: max_seq_len, draft_early_stop), its
    proposers (rung order) and its policy (None: every request takes its fixed option). Raises
    ValueError when the policy has no estimator for one of the proposers (it was built over another
    `ProposerRegistry` than the engine's)."""

    def __init__(self, cfg: EngineParams, proposers: list[Proposer], policy: StepPolicy | None):
        self.cfg, self.proposers, self.policy = cfg, proposers, policy
        unknown = sorted({p.name for p in proposers} - policy.kinds) if policy else []
        if unknown:
            raise ValueError(f"the policy has no estimator for proposer(s) {unknown}: build the GoodputPolicy "
                             "over the engine's ProposerRegistry (GoodputPolicy(..., proposers=registry))")

    def plan(self, running: list[Seq]) -> StepPlan:
        """Each request's slot: its proposer and option size, its early-stop threshold, its proposals."""
        pol = self.policy
        slots = [Slot(s, learn=under_policy(pol, s.req)) for s in running]
        gated = self._gated(slots)
        ladders = [self._ladder(sl, gated) for sl in slots]
        if pol is not None and any(lad.fixed is None for lad in ladders):
            step = pol.choose([s.req.workload for s in running], ladders, [s.prompt_backlog for s in running],
                              self.cfg.draft_early_stop)
        else:
            step = StepChoice([lad.fixed for lad in ladders])
        for sl, lad, (kind, n) in zip(slots, ladders, step.options):
            sl.stop_below = step.stop_below if lad.fixed is None else 0.0
            sl.n = n
            if n:
                sl.proposer = lad.rung(kind).proposer
                sl.estimator = pol.estimator(kind) if sl.learn else None
                if sl.proposer.uses_draft:
                    sl.depth = lad.rung(kind).depth_of(n)
        return StepPlan(slots, step.predicted)

    def _gated(self, slots: list[Slot]) -> set[tuple[str, str]]:
        """(kind, class) pairs whose offers the policy leaves uncomputed this step (gated proposers;
        `StepPolicy.offer_due`, asked once per class and step)."""
        if self.policy is None:
            return set()
        classes = {sl.workload for sl in slots if sl.learn}
        return {(p.name, w) for p in self.proposers if p.gated for w in classes
                if not self.policy.offer_due(p.name, w, len(slots))}

    def _ladder(self, sl: Slot, gated: set[tuple[str, str]]) -> Ladder:
        """The request's options this step: every proposer's rung under the policy, else the claim of
        lowest rank."""
        s = sl.seq
        room = min(s.req.max_new_tokens - len(s.gen), self.cfg.max_seq_len - s.cache.length) - 1
        rungs: list[Rung] = []
        for p in self.proposers:
            if sl.learn and (p.name, sl.workload) in gated:
                continue
            r = p.offer(sl, room, self.policy)
            if r is not None:
                rungs.append(r)
        if sl.learn:
            return Ladder(tuple(rungs))
        claims = [r for r in rungs if r.fixed is not None]
        if not claims:
            return Ladder(fixed=NONE)
        r = min(claims, key=lambda x: x.fixed[0])
        return Ladder((r,), fixed=(r.kind, r.fixed[1]), fixed_gain=r.fixed[2])
