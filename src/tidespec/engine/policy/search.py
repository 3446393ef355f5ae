"""The plan search: every request's proposer and draft length chosen together, maximising the step's
expected tokens per ms over whatever proposers offered options (`Ladder`: their `Rung`s).

Goodput G = (b + Σ expected accepted) / predicted ms (`StepCost`). Start from the best of plain
decoding and one length for every drafting request (their draft forwards are batched, so their
cost is shared), then coordinate ascent: each request in turn takes its best option given the
others, two sweeps. The result is kept only if it beats plain decoding by `margin`. The objective
of vLLM's goodput-driven speculation length (RFC #48627) and SGLang's adaptive speculative steps,
extended to per-request lengths and several proposers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..proposers.base import Rung
from .cost import StepCost, draft_batches

NONE = ("", 0)  # the option "no drafts": plain decoding


@dataclass(frozen=True)
class Ladder:
    """One request's options this step: its proposers' rungs (rung order), or, outside the policy,
    `fixed` = (kind, n) with `fixed_gain` expected accepted tokens — counted in the step's cost and
    gain but never changed (its rung, when it has one, gives the draft forwards it costs)."""

    rungs: tuple[Rung, ...] = ()
    fixed: tuple[str, int] | None = None
    fixed_gain: float = 0.0

    def rung(self, kind: str) -> Rung | None:
        return next((r for r in self.rungs if r.kind == kind), None)

    def gain(self, opt: tuple[str, int]) -> float:
        """Expected accepted tokens of option (kind, n)."""
        kind, n = opt
        return self.rung(kind).gains[n - 1] if n else 0.0

    @property
    def options(self) -> int:
        """Options offered (all rungs together)."""
        return sum(len(r.gains) for r in self.rungs)


def _rising(r: Rung) -> list[tuple[str, int]]:
    """The options n of one rung whose expected accepted tokens exceed those of n − 1: a longer
    option that gains nothing more costs more rows for the same tokens, so it can never be chosen."""
    g = r.gains
    return [(r.kind, n) for n in range(1, len(g) + 1) if g[n - 1] > (g[n - 2] if n > 1 else 0.0)]


def _options(lad: Ladder) -> list[tuple[str, int]]:
    return [NONE] + [opt for r in lad.rungs for opt in _rising(r)]


def _drafting(lad: Ladder, opt: tuple[str, int]) -> Rung | None:
    kind, n = opt
    r = lad.rung(kind) if n else None
    return r if r is not None and r.drafts else None


def step_draft_batches(ladders: list[Ladder], choice: list[tuple[str, int]]) -> list[int]:
    """`draft_batches` of a step's plan: the chosen drafting options' depths and rows per forward."""
    eag = [(r.depth_of(c[1]), r.draft_rows) for lad, c in zip(ladders, choice) if (r := _drafting(lad, c))]
    return draft_batches([d for d, _ in eag], [w for _, w in eag])


def predicted_step(ladders: list[Ladder], choice: list[tuple[str, int]], cost: StepCost) -> tuple[float, float]:
    """(expected tokens, predicted ms) of the step with these choices: b + Σ expected accepted, and
    `StepCost.predict` of its verify rows and draft forwards."""
    b = len(ladders)
    rows = b + sum(n for _, n in choice)
    gain = b + sum(lad.fixed_gain if lad.fixed else lad.gain(c) for lad, c in zip(ladders, choice))
    return gain, cost.predict(b, rows, step_draft_batches(ladders, choice))


def goodput(ladders: list[Ladder], choice: list[tuple[str, int]], cost: StepCost) -> float:
    """Expected tokens per ms of the step with these choices."""
    tokens, ms = predicted_step(ladders, choice, cost)
    return tokens / ms


class _Step:
    """`goodput` for one step's search, incremental: tables of T(b, R) × factor and of batched draft
    step costs, running totals of rows, gains and rows per draft forward (keyed by (kind, 0) for a
    kind's catch-up, (kind, rows per request, position) after it), so trying one request's option
    costs O(its depth) instead of O(batch)."""

    def __init__(self, ladders: list[Ladder], cost: StepCost, choice: list[tuple[str, int]]):
        self.lad, self.cost, self.b = ladders, cost, len(ladders)
        wide = max((r.draft_rows for x in ladders for r in x.rungs), default=1)
        self.draft = [cost._draft(n) for n in range(self.b * wide + 1)]
        self._t: dict[int, tuple[float, float]] = {}
        self.forwards: dict[tuple, int] = {}
        self.choice = list(choice)
        self.rows, self.gain, self.catch_up = self.b, float(self.b), 0.0
        for i, c in enumerate(choice):
            self._add(i, c, 1)

    def _tf(self, rows: int) -> tuple[float, float]:
        if rows not in self._t:
            self._t[rows] = (self.cost._target(self.b, rows), self.cost.factor(self.b, rows / self.b))
        return self._t[rows]

    def _add(self, i: int, c: tuple[str, int], sign: int) -> None:
        lad = self.lad[i]
        self.rows += sign * c[1]
        self.gain += sign * (lad.fixed_gain if lad.fixed else lad.gain(c))
        r = _drafting(lad, c)
        if r is not None:
            fw = self.forwards
            fw[(r.kind, 0)] = fw.get((r.kind, 0), 0) + sign
            self.catch_up += sign * r.catch_up_ms
            for j in range(1, r.depth_of(c[1])):
                key = (r.kind, r.draft_rows, j)
                fw[key] = fw.get(key, 0) + sign * r.draft_rows

    def value(self) -> float:
        t, f = self._tf(self.rows)
        d = sum(self.draft[c] for c in self.forwards.values() if c)
        return self.gain / (f * (t + d + self.catch_up))

    def set(self, i: int, c: tuple[str, int]) -> None:
        self._add(i, self.choice[i], -1)
        self.choice[i] = c
        self._add(i, c, 1)


def _bound(ladders: list[Ladder], free: list[int], most: dict[int, float], st: _Step, cost: StepCost) -> float:
    """An upper bound on the goodput of any choice for the `free` requests: R more verify rows gain at
    most min(r·R, Σ best gains), r the most expected accepted tokens per row of any option, and the
    step costs at least its verify forward of R more rows (draft forwards cost ≥ 0). Past
    R = Σ best / r the gain stops growing while the cost does, so R stops there."""
    per_row = max(g / n for i in free for r in ladders[i].rungs for n, g in enumerate(r.gains, 1))
    total = sum(most.values())
    if per_row <= 0 or total <= 0:
        return 0.0
    rows = sum(max(len(r.gains) for r in ladders[i].rungs) for i in free)
    drafts = step_draft_batches(ladders, st.choice)
    return max((st.gain + min(per_row * r, total)) / cost.predict(st.b, st.rows + r, drafts)
               for r in range(1, min(rows, math.ceil(total / per_row)) + 1))


def _batch_wide_start(ladders: list[Ladder], free: list[int], st: _Step, best: float,
                      best_choice: list[tuple[str, int]]) -> tuple[float, list[tuple[str, int]]]:
    """The best of one length k for every free request's drafting rung (k = 1..the longest)."""
    first = {i: r for i in free if (r := next((x for x in ladders[i].rungs if x.drafts and x.gains), None))}
    for k in range(1, max((len(r.gains) for r in first.values()), default=0) + 1):
        for i, r in first.items():
            st.set(i, (r.kind, min(k, len(r.gains))))
        g = st.value()
        if g > best:
            best, best_choice = g, list(st.choice)
    return best, best_choice


def plan(ladders: list[Ladder], cost: StepCost, margin: float = 0.05, sweeps: int = 2) -> list[tuple[str, int]]:
    """Each request's (kind, drafted tokens) for this step — NONE = plain decoding — that maximises the
    predicted goodput of the whole step (module docstring). Speculation is kept only if it beats
    plain decoding (fixed choices kept) by `margin`. When no choice could beat it (`_bound`: gains
    per verify row against the cost of the rows), the search is skipped."""
    base = [lad.fixed or NONE for lad in ladders]
    if not ladders:
        return base
    st = _Step(ladders, cost, base)
    free = [i for i, lad in enumerate(ladders) if lad.fixed is None and lad.options]
    most = {i: max(g for r in ladders[i].rungs for g in r.gains) for i in free}
    free.sort(key=lambda i: -most[i])
    g0 = best = st.value()
    if not free or _bound(ladders, free, most, st, cost) < (1 + margin) * g0:
        return base
    best, best_choice = _batch_wide_start(ladders, free, st, best, list(base))
    for i in free:
        st.set(i, best_choice[i])
    for _ in range(sweeps):
        moved = False
        for i in free:
            keep = st.choice[i]
            for opt in _options(ladders[i]):
                if opt == keep:
                    continue
                st.set(i, opt)
                g = st.value()
                if g > best * (1 + 1e-9):
                    best, keep, moved = g, opt, True
            st.set(i, keep)
        if not moved:
            break
    return st.choice if best >= (1 + margin) * g0 else base


def best_alone(ladder: Ladder, rung: Rung, cost: StepCost) -> int:
    """The option n ≥ 1 of `rung` with the highest predicted goodput for this request alone."""
    g = [goodput([ladder], [(rung.kind, n)], cost) for n in range(1, len(rung.gains) + 1)]
    return 1 + max(range(len(g)), key=g.__getitem__)
