"""Batch-aware goodput: predict a decode step's wall time for the whole batch and choose every
request's proposer and draft length to maximise the step's expected tokens per second.

Cost (`StepCost`): one step of b running requests where request i verifies n_i drafted tokens
costs T(b, Σ(n_i + 1)) + Σ_j D(b_j): the ragged target forward over all verify rows (measured on a
(batch, rows) grid, `engine.calibration`) plus one batched draft forward per chain position j,
b_j = requests drafting with the EAGLE3 chain at position j (the first is the draft's catch-up
over the rows the target verified last step). A suffix proposal costs verify rows only.
Online re-fit: every measured step (no prefill in it) updates a factor measured / predicted in its
(batch size, rows per request) cell, as a clipped EMA; the factor applied to a cell is the largest
over the cells with fewer rows per request at that batch size, so load measured during plain
decoding scales every speculative step too and an outlier can only make speculation look dearer
relative to plain decoding at the same batch size, never cheaper than the calibration says (a
noisy per-k model predicted 3.9× at τ 1.05 on a busy machine).

Choice (`plan`): per request a ladder of options — none, the EAGLE3 chain with k = 1..K (expected
accepted τ(k) − 1 from the conditional acceptance of its class), a prefix of m = 1..L tokens of its
suffix proposal (expected accepted Σ_{i≤m} of the chain's cumulative scores times a per-class
correction learned from measured acceptance), and for a constrained request a prefix of the tokens
its grammar forces (expected accepted Σ_{i≤m} a^i, a the class's measured acceptance of forced
tokens; verify rows only, like a suffix proposal). Goodput G = (b + Σ expected accepted) / cost:
start from the best of "no speculation" and one k for every EAGLE3 request, then coordinate
ascent (each request in turn takes its best option given the others, two sweeps); the result is
kept only if it beats plain decoding by `margin`. The
same objective as vLLM's goodput-driven speculation length (RFC #48627) and SGLang's adaptive
speculative steps, extended to per-request lengths and two proposers.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from .calibration import Calibration


@dataclass(frozen=True)
class Ladder:
    """One request's options this step.

    eagle: expected accepted tokens with the EAGLE3 chain at k = 1..len (cumulative: τ(k) − 1);
    suffix: expected accepted tokens with the first m = 1..len tokens of its suffix proposal
    (cumulative); grammar: the same for the first m tokens its grammar forces (constrained requests);
    fixed: (proposer, n) when the request's choice is not the policy's (a fixed k, a
    seeded request) — it counts in the cost and the gain but is not changed.
    With an EAGLE-2 draft tree (`engine.tree`) the EAGLE3 option n is a tree of n verified nodes:
    eagle_depth[n-1] is its depth (draft forwards), draft_rows the rows each request feeds per
    expansion forward (topk); a chain: depth n, one row. catch_up_ms: what drafting with EAGLE3
    now adds for the draft's catch-up over the request's backlog beyond the one row a step's
    catch-up is charged (`StepCost.catch_up_ms`: a long prompt's rows, spread over the steps left):
    the plan's objective counts it, the step's predicted wall time (`predicted_step`) does not.
    """

    eagle: tuple[float, ...] = ()
    suffix: tuple[float, ...] = ()
    grammar: tuple[float, ...] = ()
    fixed: tuple[str, int] | None = None
    fixed_gain: float = 0.0
    eagle_depth: tuple[int, ...] = ()
    draft_rows: int = 1
    catch_up_ms: float = 0.0

    def depth(self, n: int) -> int:
        """Draft forwards (chain positions / tree depth) of the EAGLE3 option with n drafted tokens."""
        return self.eagle_depth[n - 1] if self.eagle_depth and n else n


NONE = ("", 0)


class StepCost:
    """Predicted step wall time (ms) from a `Calibration`, re-fitted online. Thread-safe. The
    calibration's interpolated costs and cells are memoised (a step's plan asks the same few
    thousand times; replacing `cal` clears them)."""

    def __init__(self, cal: Calibration, alpha: float = 0.1):
        self.cal = cal
        self.alpha = alpha
        self._f = [[1.0] * len(cal.rows) for _ in cal.batch_sizes]  # measured / calibrated, per cell
        self._lock = threading.Lock()

    @property
    def cal(self) -> Calibration:
        """The calibration costs are predicted from; assigning one (a re-timed draft) drops the memo."""
        return self._state[0]

    @cal.setter
    def cal(self, cal: Calibration) -> None:
        # one assignment: a reader holds a (calibration, its memo) pair, never one's memo with the other's values
        # memo keys: ("t", b, rows) / ("d", b) / ("b", b) / ("r", rows per request)
        self._state: tuple[Calibration, dict[tuple, float | int]] = (cal, {})

    def _memoised(self, key: tuple, compute) -> float | int:
        cal, memo = self._state
        v = memo.get(key)
        if v is None:
            v = memo[key] = compute(cal)
        return v

    def _target(self, b: int, total_rows: int) -> float:
        return self._memoised(("t", b, total_rows), lambda cal: cal.target_cost(b, total_rows))

    def _draft(self, b: int) -> float:
        return self._memoised(("d", b), lambda cal: cal.draft_cost(b))

    def _batch_index(self, b: int) -> int:
        return self._memoised(("b", b), lambda cal: min(range(len(cal.batch_sizes)),
                                                        key=lambda i: abs(math.log(cal.batch_sizes[i] / b))))

    def bucket(self, b: int) -> int:
        """The calibrated batch size nearest to b (log scale): the cost cell a step of b requests uses."""
        return self.cal.batch_sizes[self._batch_index(b)]

    def _cell(self, b: int, rows_per_req: float) -> tuple[int, int]:
        rj = self._memoised(("r", rows_per_req), lambda cal: min(range(len(cal.rows)),
                                                                 key=lambda j: abs(cal.rows[j] - rows_per_req)))
        return self._batch_index(b), rj

    def factor(self, b: int, rows_per_req: float) -> float:
        """The correction applied to a step of b requests with this many rows each: the largest
        measured factor over the cells with fewer or equal rows at this batch size."""
        bi, rj = self._cell(b, rows_per_req)
        with self._lock:
            return max(self._f[bi][:rj + 1])

    def catch_up_ms(self, backlog_rows: int, steps_left: int) -> float:
        """The draft's catch-up over a request's backlog, amortised: (D(rows) − D(1)) / steps_left ms,
        D the calibrated draft step of that many rows (a forward of R rows costs as one of R
        requests, `draft_batches`; linear past the calibrated batch sizes, so 0 with a calibration of
        one batch size). A prompt's rows are read once, before the request's first draft: worth it
        when the draft serves the many steps left, not for the last few tokens of a long prompt.
        0 for at most one row; never below 0."""
        if backlog_rows <= 1:
            return 0.0
        return max(0.0, self._draft(backlog_rows) - self._draft(1)) / max(1, steps_left)

    def calibrated(self, b: int, total_rows: int, draft_batches: list[int] | tuple[int, ...] = ()) -> float:
        """Calibrated ms of a step: target forward of `total_rows` over `b` requests plus one draft
        step per entry of `draft_batches` (requests drafting at each chain position)."""
        return self._target(b, total_rows) + sum(self._draft(n) for n in draft_batches)

    def predict(self, b: int, total_rows: int, draft_batches: list[int] | tuple[int, ...] = ()) -> float:
        """Predicted ms of a step (calibrated × the re-fitted factor)."""
        return self.calibrated(b, total_rows, draft_batches) * self.factor(b, total_rows / b)

    def observe(self, b: int, total_rows: int, draft_batches: list[int] | tuple[int, ...], ms: float,
                alpha: float | None = None) -> None:
        """A measured step: updates its cell's factor (clipped to [½, 2]× the current one per
        observation, so one spike moves the estimate, never replaces it). Non-finite or ≤ 0: ignored."""
        if b < 1 or not math.isfinite(ms) or ms <= 0:
            return
        cal = self.calibrated(b, total_rows, draft_batches)
        if cal <= 0:
            return
        bi, rj = self._cell(b, total_rows / b)
        a = self.alpha if alpha is None else alpha
        with self._lock:
            prev = self._f[bi][rj]
            x = min(max(ms / cal, 0.5 * prev), 2.0 * prev)
            self._f[bi][rj] = prev + a * (x - prev)


def _gain(lad: Ladder, opt: tuple[str, int]) -> float:
    via, n = opt
    if n == 0:
        return 0.0
    return (lad.eagle if via == "eagle3" else lad.suffix if via == "suffix" else lad.grammar)[n - 1]


def _rising(via: str, gains: tuple[float, ...]) -> list[tuple[str, int]]:
    """The options n of one proposer whose expected accepted tokens exceed those of n − 1: a longer
    option that gains nothing more costs more rows for the same tokens, so it can never be chosen
    (and a proposal whose tokens are all predicted rejected offers nothing)."""
    return [(via, n) for n in range(1, len(gains) + 1) if gains[n - 1] > (gains[n - 2] if n > 1 else 0.0)]


def _options(lad: Ladder) -> list[tuple[str, int]]:
    return [NONE] + _rising("eagle3", lad.eagle) + _rising("suffix", lad.suffix) + _rising("grammar", lad.grammar)


def draft_batches(chain_lengths: list[int], widths: list[int] | None = None) -> list[int]:
    """Rows of each batched draft forward a step runs, for chains (width 1) and EAGLE-2 trees
    (width = topk) of these depths: the catch-up over last step's verified rows is one forward for
    all of them (one row per request, as calibrated); then chain position j = 1.. is one forward
    of the chains longer than j, and tree depth j = 1.. one forward of `width` rows per tree deeper
    than j (chains and trees draft in separate forwards). What `StepCost` charges (a forward of R
    rows costs as one of R requests)."""
    w = widths or [1] * len(chain_lengths)
    top = max(chain_lengths, default=0)
    first = sum(1 for k in chain_lengths if k > 0)
    chain = [sum(1 for k, wi in zip(chain_lengths, w) if wi == 1 and k > j) for j in range(1, top)]
    tree = [sum(wi for k, wi in zip(chain_lengths, w) if wi > 1 and k > j) for j in range(1, top)]
    return ([first] if first else []) + [c for c in chain if c] + [t for t in tree if t]


def step_draft_batches(ladders: list[Ladder], choice: list[tuple[str, int]]) -> list[int]:
    """`draft_batches` of a step's plan (EAGLE3 choices: their depth and rows per forward)."""
    eag = [(lad.depth(n), lad.draft_rows) for lad, (v, n) in zip(ladders, choice) if v == "eagle3" and n]
    return draft_batches([d for d, _ in eag], [w for _, w in eag])


def predicted_step(ladders: list[Ladder], choice: list[tuple[str, int]], cost: StepCost) -> tuple[float, float]:
    """(expected tokens, predicted ms) of the step with these choices: b + Σ expected accepted, and
    `StepCost.predict` of its verify rows and draft forwards."""
    b = len(ladders)
    rows = b + sum(n for _, n in choice)
    drafts = step_draft_batches(ladders, choice)
    gain = b + sum(lad.fixed_gain if lad.fixed else _gain(lad, c) for lad, c in zip(ladders, choice))
    return gain, cost.predict(b, rows, drafts)


def goodput(ladders: list[Ladder], choice: list[tuple[str, int]], cost: StepCost) -> float:
    """Expected tokens per ms of the step with these choices."""
    tokens, ms = predicted_step(ladders, choice, cost)
    return tokens / ms


class _Step:
    """`goodput` for one step's search, incremental: per-step tables of T(b, R) × factor and of the
    batched draft step costs, and running totals of rows, gains and drafts per chain position, so
    trying one request's option is O(chain length) instead of O(batch)."""

    def __init__(self, ladders: list[Ladder], cost: StepCost, choice: list[tuple[str, int]]):
        self.lad, self.cost, self.b = ladders, cost, len(ladders)
        self.draft = [cost._draft(n) for n in range(self.b * max((x.draft_rows for x in ladders), default=1) + 1)]
        self._t: dict[int, tuple[float, float]] = {}
        depth = max((max(x.depth(len(x.eagle)), x.depth(x.fixed[1]) if x.fixed and x.fixed[0] == "eagle3" else 0)
                     for x in ladders), default=0)
        self.counts = [0] * depth  # rows per draft forward: [catch-up, chain positions 1.., ]
        self.tree_counts = [0] * depth  # rows per tree expansion forward at depth 1.. (index 0 unused)
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
        via, n = c
        self.rows += sign * n
        self.gain += sign * (lad.fixed_gain if lad.fixed else _gain(lad, c))
        if via == "eagle3" and n:
            self.counts[0] += sign
            self.catch_up += sign * lad.catch_up_ms
            rows = self.counts if lad.draft_rows == 1 else self.tree_counts
            for j in range(1, lad.depth(n)):
                rows[j] += sign * lad.draft_rows

    def value(self) -> float:
        t, f = self._tf(self.rows)
        d = sum(self.draft[c] for c in self.counts if c) + sum(self.draft[c] for c in self.tree_counts if c)
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
    per_row = max(g / n for i in free for gains in (ladders[i].eagle, ladders[i].suffix, ladders[i].grammar)
                  for n, g in enumerate(gains, 1))
    total = sum(most.values())
    if per_row <= 0 or total <= 0:
        return 0.0
    rows = sum(max(len(ladders[i].eagle), len(ladders[i].suffix), len(ladders[i].grammar)) for i in free)
    drafts = step_draft_batches(ladders, st.choice)
    return max((st.gain + min(per_row * r, total)) / cost.predict(st.b, st.rows + r, drafts)
               for r in range(1, min(rows, math.ceil(total / per_row)) + 1))


def plan(ladders: list[Ladder], cost: StepCost, margin: float = 0.05, sweeps: int = 2) -> list[tuple[str, int]]:
    """Each request's (proposer, drafted tokens) for this step — ("", 0) = plain decoding — that
    maximises the predicted goodput of the whole step (see the module docstring: the best of plain
    decoding and one k for every EAGLE3 request as the start, then coordinate ascent). Speculation
    is kept only if it beats plain decoding (fixed choices kept) by `margin`. When no choice could
    beat it (`_bound`: gains per verify row against the cost of the rows), the search is skipped."""
    base = [lad.fixed or NONE for lad in ladders]
    if not ladders:
        return base
    st = _Step(ladders, cost, base)
    free = [i for i, lad in enumerate(ladders) if lad.fixed is None and (lad.eagle or lad.suffix or lad.grammar)]
    most = {i: max((*ladders[i].eagle, *ladders[i].suffix, *ladders[i].grammar)) for i in free}
    free.sort(key=lambda i: -most[i])
    g0 = best = st.value()
    best_choice = list(base)
    if not free or _bound(ladders, free, most, st, cost) < (1 + margin) * g0:
        return base
    for k in range(1, max((len(ladders[i].eagle) for i in free), default=0) + 1):
        # batch-wide start: one k for every EAGLE3 request (chain positions are batched, so their
        # draft cost is shared; one request at a time would not leave a shared optimum)
        for i in free:
            if ladders[i].eagle:
                st.set(i, ("eagle3", min(k, len(ladders[i].eagle))))
        g = st.value()
        if g > best:
            best, best_choice = g, list(st.choice)
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
