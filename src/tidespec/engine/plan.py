"""The step's plan: which proposer and option each running request takes this step (`StepPlan`).

Per request a ladder of options (`goodput.Ladder`: none, EAGLE3 chain lengths or tree sizes,
prefixes of its suffix proposal, prefixes of the tokens its grammar forces), capped so the output
and the KV cache have room for the drafts plus the bonus token. With the goodput policy
(`adaptive.AdaptiveK.plan_step`) the options of the whole batch are chosen together by predicted
tokens/s; a request outside the policy (a fixed k, seeded sampling, no policy) takes a fixed option:
its grammar's forced tokens when there are at least two (or it has no other proposer), else its
suffix proposal when the expected accepted tokens (the sum of its chain scores) reach
`suffix_min_expected` or it has no EAGLE3 draft, else the EAGLE3 chain of its k (or the engine's),
or the tree of SGLang's knobs. The policy may leave a class's suffix proposals uncomputed
(`AdaptiveK.suffix_due`: unchosen at this batch size, probed with back-off).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .adaptive import AdaptiveK
from .goodput import NONE, Ladder, predicted_step
from .proposers.base import Proposer, Slot
from .request import Request, Seq
from .suffix import Proposal, SuffixCache
from .tree import max_nodes

TREE = "eagle3/tree"  # the proposer table's key of the EAGLE3 option for a request that drafts trees


def adaptive_for(adaptive: AdaptiveK | None, req: Request) -> bool:
    """Does the goodput policy choose this request's option? Not with a fixed k, and not for seeded
    sampling (the random stream a seed fixes depends on k: a seeded request keeps the engine's k)."""
    return adaptive is not None and req.k is None and not seeded(req)


def seeded(req: Request) -> bool:
    """A sampled request with a seed: it never takes suffix proposals (their tokens depend on what
    other requests served, and the random stream rejection sampling draws depends on the proposal,
    so the same seed would not give the same output)."""
    return not req.sampling.greedy and req.sampling.seed is not None


def k_max(adaptive: AdaptiveK | None, k: int, req: Request) -> int:
    """The longest chain (or tree depth) the request may draft: its k, the policy's k_max, or the engine's k."""
    if req.k is not None:
        return req.k
    return adaptive.k_max if adaptive_for(adaptive, req) else k


@dataclass
class StepPlan:
    """One step's slots, in the running order (one per running request, proposer None = no drafts);
    predicted: (expected tokens, predicted ms) of the policy's plan (`goodput.predicted_step`), None
    when the policy did not choose every request's option (no policy, a request outside it, a probe)."""

    slots: list[Slot]
    predicted: tuple[float, float] | None = None

    def groups(self, proposers: Iterable[Proposer]) -> list[tuple[Proposer, list[Slot]]]:
        """(proposer, its slots) for each proposer with work this step, in the order given."""
        out = [(p, [sl for sl in self.slots if sl.proposer is p]) for p in proposers]
        return [(p, group) for p, group in out if group]

    def named(self, name: str) -> list[Slot]:
        """Slots whose proposer is called `name` (e.g. "eagle3": chains and trees)."""
        return [sl for sl in self.slots if sl.proposer is not None and sl.proposer.name == name]


@dataclass(frozen=True)
class Planner:
    """The engine's planning knobs, read at each step (`Engine.suffix` may be replaced between
    steps): k (fixed chain length), max_seq_len (KV positions per request), the policy, the suffix
    cache, suffix_min_expected, early_stop (`draft_early_stop`), topk and tree_nodes (EAGLE-2: children
    per node, most verified nodes), forced_tokens (the grammar proposer on)."""

    k: int
    max_seq_len: int
    adaptive: AdaptiveK | None
    suffix: SuffixCache | None
    suffix_min_expected: float
    early_stop: bool
    topk: int
    tree_nodes: int
    forced_tokens: bool = True

    def plan(self, running: list[Seq], proposers: Mapping[str, Proposer]) -> StepPlan:
        """Each request's slot: its proposer (from `proposers` by option name; `TREE` for a tree
        request's EAGLE3 option) and option size, its early-stop threshold, its suffix proposal."""
        slots = [Slot(s, learn=self.adaptive if adaptive_for(self.adaptive, s.req) else None) for s in running]
        gated = self._suffix_gated(slots)
        ladders = [self._ladder(sl, not seeded(sl.seq.req) and (sl.learn is None or sl.seq.req.workload not in gated))
                   for sl in slots]
        stop, predicted = 0.0, None
        if self.adaptive is not None and any(lad.fixed is None for lad in ladders):
            workloads = [s.req.workload for s in running]
            probes: list[int] = []
            choice = self.adaptive.plan_step(workloads, ladders, probes, [s.prompt_backlog for s in running])
            self._observe_suffix(slots, ladders, choice, gated)
            if self.early_stop:
                stop = self.adaptive.stop_below(ladders, choice)
            if not probes and all(lad.fixed is None for lad in ladders):  # the policy's own choice, every request
                predicted = predicted_step(ladders, choice, self.adaptive.cost)
        else:
            choice = [lad.fixed for lad in ladders]
        for sl, lad, (via, n) in zip(slots, ladders, choice):
            sl.stop_below = stop if lad.fixed is None else 0.0
            sl.n = n
            if via == "eagle3" and sl.seq.tree:
                sl.proposer, sl.depth = proposers[TREE], lad.depth(n)
            elif via:
                sl.proposer = proposers[via]
        return StepPlan(slots, predicted)

    def _suffix_gated(self, slots: list[Slot]) -> set[str]:
        """Classes whose suffix proposals the policy leaves uncomputed this step (`AdaptiveK.suffix_due`:
        left unchosen at this batch size, no probe due); asked once per class and step."""
        if self.suffix is None:
            return set()
        classes = {sl.seq.req.workload for sl in slots if sl.learn is not None}
        return {w for w in classes if not self.adaptive.suffix_due(w, len(slots))}

    def _observe_suffix(self, slots: list[Slot], ladders: list[Ladder], choice: list[tuple[str, int]],
                        gated: set[str]) -> None:
        """Tell the policy, per class whose requests' suffix proposals were computed and offered the
        plan an option (a step where no request's trie matched says nothing about whether a match
        would pay: it is not a miss), whether one was chosen."""
        if self.suffix is None:
            return
        chosen: dict[str, bool] = {}
        for sl, lad, (via, _) in zip(slots, ladders, choice):
            w = sl.seq.req.workload
            if sl.learn is not None and w not in gated and any(lad.suffix):
                chosen[w] = chosen.get(w, False) or via == "suffix"
        for w, yes in chosen.items():
            self.adaptive.observe_suffix_plan(w, len(slots), yes)

    def _ladder(self, sl: Slot, consult_suffix: bool = True) -> Ladder:
        """The request's options this step; sets `sl.proposal` (capped to the room) when
        `consult_suffix` (the policy may leave a class's suffix proposals out: `_suffix_gated`)."""
        s = sl.seq
        room = min(s.req.max_new_tokens - len(s.gen), self.max_seq_len - s.cache.length) - 1
        if self.suffix is not None and s.req.speculative and room > 0 and consult_suffix:
            p = self.suffix.propose(s.rid)
            sl.proposal = Proposal(p.tokens[:room], p.score, p.match_len, p.source, p.scores[:room])
        p = sl.proposal
        if self.forced_tokens and s.lp.grammar is not None and s.req.speculative and room > 0:
            sl.forced = tuple(s.lp.grammar.forced()[:room])
        f = sl.forced
        if s.tree:  # one token left (or no KV room): no tree
            return self._tree_ladder(sl) if room > 0 else Ladder(fixed=NONE)
        if sl.learn is not None:
            eagle = self.adaptive.eagle_gains(s.req.workload, room) if s.draft is not None else ()
            suffix = self.adaptive.suffix_gains(s.req.workload, p.scores) if p is not None else ()
            return Ladder(eagle, suffix, self.adaptive.grammar_gains(s.req.workload, len(f)),
                          catch_up_ms=self._catch_up_ms(s) if eagle else 0.0)
        if len(f) >= 2 or (f and s.draft is None and not (p is not None and p.tokens)):
            n = min(len(f), s.req.k if s.req.k is not None else self.k)
            return Ladder(fixed=("grammar", n), fixed_gain=float(n))
        if p is not None and p.tokens and (s.draft is None or sum(p.scores) >= self.suffix_min_expected):
            return Ladder(fixed=("suffix", len(p.tokens)), fixed_gain=sum(p.scores))
        if s.draft is None:
            return Ladder(fixed=NONE)
        k = s.req.k if s.req.k is not None else self.k
        gain = self.adaptive.eagle_gains(s.req.workload, k)[-1] if self.adaptive is not None else 0.0
        return Ladder(fixed=("eagle3", k), fixed_gain=gain)

    def _catch_up_ms(self, s: Seq) -> float:
        """The amortised catch-up of the request's backlog (`StepCost.catch_up_ms`) over the steps
        it has left at one token a step (its output room: the most steps, the smallest charge)."""
        return self.adaptive.cost.catch_up_ms(s.backlog_rows, s.req.max_new_tokens - len(s.gen))

    def _tree_ladder(self, sl: Slot) -> Ladder:
        """A tree request's options: n = 1..N−1 verified nodes (N = tree num_draft_tokens, capped by
        the KV room), depth min(num_steps, n, output room) — under the policy its gains
        (`AdaptiveK.tree_gains`) and width are the plan's; else the fixed tree of SGLang's knobs.
        Sets `sl.cap`."""
        s, p = sl.seq, sl.proposal
        steps = k_max(self.adaptive, self.k, s.req)
        out_room = s.req.max_new_tokens - len(s.gen) - 1
        cap = min(self.tree_nodes, max_nodes(min(steps, out_room), self.topk), self.max_seq_len - s.cache.length - 1)
        depth = tuple(min(steps, n, out_room) for n in range(1, cap + 1))
        sl.cap = cap
        if sl.learn is not None:
            eagle = self.adaptive.tree_gains(s.req.workload, cap, lambda n: depth[n - 1])
            suffix = self.adaptive.suffix_gains(s.req.workload, p.scores) if p is not None else ()
            return Ladder(eagle, suffix, eagle_depth=depth, draft_rows=self.topk, catch_up_ms=self._catch_up_ms(s))
        if p is not None and p.tokens and sum(p.scores) >= self.suffix_min_expected:
            return Ladder(fixed=("suffix", len(p.tokens)), fixed_gain=sum(p.scores))
        gain = self.adaptive.tree_gains(s.req.workload, cap, lambda n: depth[n - 1])[-1] if self.adaptive else 0.0
        return Ladder(fixed=("eagle3", cap), fixed_gain=gain, eagle_depth=depth, draft_rows=self.topk)
