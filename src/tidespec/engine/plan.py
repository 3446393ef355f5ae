"""The step's plan: which proposer and option each running request takes this step (`StepPlan`).

Every registered proposer offers each request a rung of options (`Proposer.offer`), capped so the
output and the KV cache have room for the drafts plus the bonus token. Under the goodput policy
the options of the whole batch are chosen together by predicted tokens/s
(`policy.GoodputPolicy.plan_step`); a request outside it (a fixed k, a seeded one, no policy) takes
the option its proposers claim with the lowest rank (`Rung.fixed`): a grammar's ≥ 2 forced tokens,
then a confident suffix proposal, then the draft's chain of its k (or tree), then a weak suffix
proposal, then a single forced token. The policy may leave a gated proposer's offers uncomputed for
a class (`GoodputPolicy.offer_due`).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import EngineParams
from .policy import NONE, GoodputPolicy, Ladder, predicted_step
from .proposers.base import Proposer, Rung, Slot
from .request import Seq, under_policy


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
        """Slots whose proposer runs the request's draft model (EAGLE3 chains and trees)."""
        return [sl for sl in self.slots if sl.proposer is not None and sl.proposer.uses_draft]


class Planner:
    """Plans steps for an engine: `cfg` (its `EngineParams`: max_seq_len, draft_early_stop), its
    proposers (rung order) and its policy (None: every request takes its fixed option). Raises
    ValueError when the policy has no estimator for one of the proposers (registered after it)."""

    def __init__(self, cfg: EngineParams, proposers: list[Proposer], policy: GoodputPolicy | None):
        self.cfg, self.proposers, self.policy = cfg, proposers, policy
        unknown = sorted({p.name for p in proposers} - set(policy.estimators)) if policy else []
        if unknown:
            raise ValueError(f"the policy has no estimator for proposer(s) {unknown} (registered after it was "
                             "built): register proposers first, then build the GoodputPolicy")

    def plan(self, running: list[Seq]) -> StepPlan:
        """Each request's slot: its proposer and option size, its early-stop threshold, its proposals."""
        pol = self.policy
        slots = [Slot(s, learn=under_policy(pol, s.req)) for s in running]
        gated = self._gated(slots)
        ladders = [self._ladder(sl, gated) for sl in slots]
        stop, predicted = 0.0, None
        if pol is not None and any(lad.fixed is None for lad in ladders):
            probes: list[int] = []
            choice = pol.plan_step([s.req.workload for s in running], ladders, probes,
                                   [s.prompt_backlog for s in running])
            self._observe_offers(slots, ladders, choice, gated)
            if self.cfg.draft_early_stop:
                stop = pol.stop_below(ladders, choice)
            if not probes and all(lad.fixed is None for lad in ladders):  # the policy's own choice, every request
                predicted = predicted_step(ladders, choice, pol.cost)
        else:
            choice = [lad.fixed for lad in ladders]
        for sl, lad, (kind, n) in zip(slots, ladders, choice):
            sl.stop_below = stop if lad.fixed is None else 0.0
            sl.n = n
            if n:
                sl.proposer = lad.rung(kind).proposer
                sl.estimator = pol.estimator(kind) if sl.learn else None
                if sl.proposer.uses_draft:
                    sl.depth = lad.rung(kind).depth_of(n)
        return StepPlan(slots, predicted)

    def _gated(self, slots: list[Slot]) -> set[tuple[str, str]]:
        """(kind, class) pairs whose offers the policy leaves uncomputed this step (gated proposers;
        `GoodputPolicy.offer_due`, asked once per class and step)."""
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

    def _observe_offers(self, slots: list[Slot], ladders: list[Ladder], choice: list[tuple[str, int]],
                        gated: set[tuple[str, str]]) -> None:
        """Tell the policy, per gated kind and class whose offers were computed and gave the plan an
        option (a step where none matched says nothing about whether a match would pay), whether one
        was chosen."""
        kinds = {p.name for p in self.proposers if p.gated}
        chosen: dict[tuple[str, str], bool] = {}
        for sl, lad, (kind, _) in zip(slots, ladders, choice):
            if not sl.learn:
                continue
            for r in lad.rungs:
                if r.kind in kinds and r.gains and (r.kind, sl.workload) not in gated:
                    key = (r.kind, sl.workload)
                    chosen[key] = chosen.get(key, False) or kind == r.kind
        for (kind, w), yes in chosen.items():
            self.policy.offered(kind, w, len(slots), yes)
