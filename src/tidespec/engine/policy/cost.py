"""Predicted step wall time for the whole batch (`StepCost`), from the machine's calibrated costs.

A step of b running requests where request i verifies n_i drafted tokens costs T(b, Σ(n_i + 1)) +
Σ_j D(b_j): the ragged target forward over all verify rows (measured on a (batch, rows) grid,
`engine.calibration`) plus one batched draft forward per chain position j, b_j = requests drafting
at position j (the first is the draft's catch-up over the rows verified last step). A proposal
without a draft model costs verify rows only. Each measured step (no prefill) re-fits a factor
measured / predicted in its (batch size, rows per request) cell, as a clipped EMA; the factor
applied to a cell is the largest over the cells with fewer rows per request at that batch size, so
load measured during plain decoding scales speculative steps too, and an outlier can only make
speculation look dearer than the calibration says, never cheaper. Measurements: docs/design/policy.md.
"""
from __future__ import annotations

import math
import threading

from ..calibration import Calibration


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
