"""How much a plan must beat plain decoding by (`MarginController`).

Hysteresis: speculation turns on where the predicted gain reaches `margin` and, once a draft model
drafted for every class in the batch last step, stays on while it reaches `margin_off` (≤ margin):
a load where the two predictions cross does not switch the draft on and off every step (each switch
back on costs a catch-up over the rows it missed).

Realized margin: what the cost model leaves out (the engine's own work per step) and the optimism
of a plan chosen because its prediction was high are measured instead of modelled. Per workload
class and calibrated batch size, each decode step's realized tokens per ms is compared with its
plan's prediction, separately for steps that speculated and steps that did not; each ratio clipped
to [1/REALIZED_CLIP, REALIZED_CLIP], a running mean then an EMA, shrunk towards 1 by REALIZED_PRIOR
steps, the speculative evidence aging while plain steps run. A plan must then clear
(1 + margin) · ρ_plain / ρ_spec − 1 for the class of the batch where that is highest, never less
than `margin`. Measurements behind it: docs/design/policy.md.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Sequence

from .cost import StepCost

REALIZED_PRIOR = 8  # steps the neutral realized / predicted ratio (1.0) is worth, per batch size and kind
REALIZED_CLIP = 2.0  # one step's realized / predicted goodput is clipped to [1/2, 2] (a stalled step is one step)


class MarginController:
    """Hysteresis and the realized margin (module docstring). `cost` gives the calibrated batch
    sizes (`StepCost.bucket`); alpha: EMA weight of one step. Raises ValueError unless
    0 <= margin_off <= margin < 1. Thread-safe."""

    def __init__(self, cost: StepCost, margin: float = 0.05, margin_off: float | None = None, alpha: float = 0.05):
        margin_off = margin if margin_off is None else margin_off
        if not 0 <= margin < 1:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if not 0 <= margin_off <= margin:
            raise ValueError(f"margin_off {margin_off} must be in [0, margin {margin}] (engine.adaptive_margin_off "
                             "<= engine.adaptive_margin: the band speculation stays on in)")
        self.cost, self.margin, self.margin_off, self.alpha = cost, margin, margin_off, alpha
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self._on: set[str] = set()  # classes a draft model drafted for last step (probes aside)
            # (class, batch size, speculated) → [mean realized / predicted tokens per ms, steps (aged)]
            self._real: dict[tuple[str, int, bool], list[float]] = {}

    def for_plan(self, workloads: Iterable[str], b: int, eager: set[str]) -> float:
        """The margin a plan of b requests of these classes must clear: `margin_off` when every class
        that could draft (`eager`) drafted last step, else `margin`; raised by the realized margin."""
        with self._lock:
            m = self.margin_off if eager and eager <= self._on else self.margin
        return self.margin_at(workloads, b, m)

    def drafted(self, classes: set[str]) -> None:
        """The classes a draft model drafted for this step (the plan's choice, probes aside)."""
        with self._lock:
            self._on = set(classes)

    def observe(self, workloads: Sequence[str], speculated: bool, predicted: tuple[float, float], tokens: int,
                ms: float) -> None:
        """A decode step as it ran: its plan's `predicted` (expected tokens, ms) against the tokens it
        verified (accepted drafts + one per request) and its wall time (ms). The ratio counts for
        every class in the step; a plain step ages the speculative evidence of its classes at its
        batch size (weight × (1 − alpha/4)). Non-finite or non-positive values are ignored."""
        b = len(workloads)
        p_tok, p_ms = predicted
        if b < 1 or tokens < 1 or not all(math.isfinite(x) and x > 0 for x in (p_tok, p_ms, ms)):
            return
        x = min(REALIZED_CLIP, max(1 / REALIZED_CLIP, (tokens / p_tok) * (p_ms / ms)))
        bucket = self.cost.bucket(b)
        with self._lock:
            for w in set(workloads):
                st = self._real.setdefault((w, bucket, speculated), [1.0, 0.0])
                st[1] += 1
                st[0] += max(self.alpha, 1.0 / st[1]) * (x - st[0])
                if not speculated and (w, bucket, True) in self._real:
                    self._real[(w, bucket, True)][1] *= 1 - self.alpha / 4

    def ratio(self, workload: str, b: int, speculated: bool) -> float | None:
        """ρ: the class's mean realized ÷ predicted tokens per ms at b's calibrated batch size over
        steps that did (or did not) speculate, shrunk towards 1 by REALIZED_PRIOR steps (weight:
        steps seen, aged, at most 1/alpha). None when none was seen."""
        with self._lock:
            st = self._real.get((workload, self.cost.bucket(b), speculated))
        if st is None:
            return None
        w = min(st[1], 1.0 / self.alpha)
        return (w * st[0] + REALIZED_PRIOR) / (w + REALIZED_PRIOR)

    def margin_at(self, workloads: Iterable[str], b: int, margin: float) -> float:
        """`margin` raised by what speculation realized of its predictions relative to plain decoding
        at this batch size: (1 + margin) · ρ_plain / ρ_spec − 1 for the class where that is highest;
        `margin` for a class until both kinds of step were seen there."""
        return max([margin, *(self._class_margin(w, b, margin) for w in set(workloads))])

    def _class_margin(self, workload: str, b: int, margin: float) -> float:
        plain, spec = self.ratio(workload, b, False), self.ratio(workload, b, True)
        return margin if plain is None or spec is None or plain <= spec else (1 + margin) * plain / spec - 1

    def report(self) -> dict[str, dict[int, dict[str, float | None]]]:
        """Per class and calibrated batch size seen: ρ of plain and speculative steps and the margin a
        plan of that class there must clear."""
        with self._lock:
            seen = sorted({(w, b) for w, b, _ in self._real})

        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)
        out: dict[str, dict[int, dict[str, float | None]]] = {}
        for w, b in seen:
            out.setdefault(w, {})[b] = {"plain": r(self.ratio(w, b, False)), "speculative": r(self.ratio(w, b, True)),
                                        "margin": round(self.margin_at([w], b, self.margin), 4)}
        return out
