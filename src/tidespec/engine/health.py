"""Draft health: is the served EAGLE3 draft accepted as well as its evaluation said, and as well as the
version it replaced? (`DraftHealth`)

The measure is the first-token acceptance a₁ of EAGLE3 chains (independent of the chain length the
policy chose), per (draft version, workload class), as decayed sums over about the last `window`
chains. Two verdicts, each a one-sided z-test (z = 3) plus a relative floor: **against its replay**
(live a₁ clearly below the replayed a₁: drift or a deployment problem) and **against the previous
version** (after a swap, on the same class, both measured here: the evidence for an automatic
rollback, `serve.guard`). EAGLE-2 trees are not counted. Why these numbers: docs/design/engine.md.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from .spec_counters import SpecDecodeCounters, Z

MIN_CHAINS = 100  # chains (decayed count) before a verdict
TOLERANCE = 0.25  # "clearly below" also means at least 25 % below (relative)
ALL = ""  # the replay's figure over every class
MAX_CLASSES = 64  # classes kept apart per version (clients may name classes)
OTHER = "other"


@dataclass(frozen=True)
class Verdict:
    """One (version, class): live a₁ and its decayed chain count, the reference a₁ it is compared
    with (replayed, or the previous version's live; None: unknown), and whether it is clearly below."""

    version: str
    workload: str
    live: float | None
    chains: float
    reference: float | None
    below: bool

    def line(self, against: str) -> str:
        """A log line naming the figures."""
        return (f"draft v{self.version}, class {self.workload!r}: first-token acceptance {self.live:.3f} over "
                f"~{self.chains:.0f} chains is clearly below {against} {self.reference:.3f}")


def clearly_below(p: float, n: float, p0: float, n0: float | None = None, z: float = Z,
                  tolerance: float = TOLERANCE, min_n: float = MIN_CHAINS) -> bool:
    """Is proportion p (over n trials) clearly below p0 — over n0 trials (two-proportion test), or a
    fixed reference when n0 is None (standard error under H₀: p = p0)? Needs n (and n0) ≥ min_n, a
    z-score above `z`, and p < p0·(1 − tolerance)."""
    if n < min_n or (n0 is not None and n0 < min_n) or p0 <= 0:
        return False
    var = p0 * (1 - p0) / n if n0 is None else p * (1 - p) / n + p0 * (1 - p0) / n0
    se = math.sqrt(max(var, 1e-12))
    return (p0 - p) / se > z and p < p0 * (1 - tolerance)


class DraftHealth:
    """Live first-token acceptance per (draft version, workload class) against each version's
    replayed figures and against the version served before it. Thread-safe.

    window: chains over which live counts are kept (decayed sums: each chain multiplies the old
    counts by 1 − 1/window). Raises ValueError for window < 1.
    """

    def __init__(self, window: int = 2000):
        if window < 1:
            raise ValueError(f"window must be >= 1 chain, got {window}")
        self.window = window
        self._live: dict[tuple[str, str], list[float]] = {}  # (version, class) → [accepted first, chains]
        self._counts: dict[tuple[str, str], list[int]] = {}  # (version, class) → [chains, drafted, accepted, *per pos]
        self._classes: dict[str, set[str]] = {}  # version → its classes kept apart
        self._replayed: dict[str, dict[str, tuple[float, float]]] = {}  # version → class ("" all) → (a₁, chains)
        self._previous: dict[str, str] = {}  # version → the version served before it
        self._current: dict[str, str] = {}  # slot (class, "" the generalist) → the version serving it
        self._lock = threading.Lock()

    def serve(self, version: str | None, replayed: dict[str, tuple[float, float]] | None = None,
              slot: str = ALL) -> None:
        """A draft version starts serving `slot` (a workload class with a draft of its own, or ""
        for the generalist); `replayed`: its evaluation's (a₁, chains), overall (key "") and per
        class. The version served there until now becomes its previous one — for a class's first
        draft, the generalist, which served the class before — only the first time a version is
        served (a restored version keeps the predecessor it was first judged against)."""
        if version is None:
            return
        with self._lock:
            first = version not in self._classes
            prev = self._current.get(slot) or self._current.get(ALL)
            if first and prev is not None and prev != version:
                self._previous[version] = prev
            self._classes.setdefault(version, set())
            self._current[slot] = version
            if replayed:
                self._replayed[version] = {k: (float(a), float(n)) for k, (a, n) in replayed.items()}

    def observe(self, version: str | None, workload: str, accepted: int, k: int = 1) -> None:
        """One EAGLE3 chain of `k` drafted tokens verified, `accepted` of them accepted (a bool: the
        first one or none, k = 1): its first-token acceptance enters the decayed a₁, and the chain the
        cumulative counters (`counters`)."""
        if version is None:
            return
        d, accepted = 1.0 - 1.0 / self.window, int(accepted)
        with self._lock:
            kept = self._classes.setdefault(version, set())
            if workload not in kept:
                workload = workload if len(kept) < MAX_CLASSES else OTHER
                kept.add(workload)
            st = self._live.setdefault((version, workload), [0.0, 0.0])
            st[0] = st[0] * d + float(accepted > 0)
            st[1] = st[1] * d + 1.0
            c = self._counts.setdefault((version, workload), [0, 0, 0])
            c[0], c[1], c[2] = c[0] + 1, c[1] + k, c[2] + accepted
            c.extend([0] * (3 + max(k, accepted) - len(c)))
            for i in range(accepted):
                c[3 + i] += 1

    def counters(self, version: str, workload: str) -> SpecDecodeCounters | None:
        """A version's cumulative chain counters on a class since it first served (drafts = chains,
        per-position acceptance as vLLM counts it); None before any chain. The live guard differences
        them into windows (`serve.guard.LiveGuard`)."""
        with self._lock:
            c = self._counts.get((version, workload))
            return None if c is None else SpecDecodeCounters(c[0], c[1], c[2], tuple(c[3:]))

    def live(self, version: str, workload: str) -> tuple[float | None, float]:
        """(a₁, decayed chain count) of a version on a class; a₁ None before any chain."""
        with self._lock:
            acc, n = self._live.get((version, workload), (0.0, 0.0))
        return (acc / n if n else None), n

    def against_replay(self, version: str, workload: str) -> Verdict:
        """The version's live a₁ on a class against its replayed a₁ (the class's own, else overall),
        a two-proportion test with the replay's chains."""
        p, n = self.live(version, workload)
        with self._lock:
            rep = self._replayed.get(version, {})
        ref, n0 = rep.get(workload, rep.get(ALL, (None, 0.0)))
        below = p is not None and ref is not None and clearly_below(p, n, ref, n0)
        return Verdict(version, workload, p, n, ref, below)

    def against_previous(self, version: str, workload: str) -> Verdict:
        """The version's live a₁ on a class against the live a₁ of the version served before it, on
        the same class (both measured by this engine)."""
        with self._lock:
            prev = self._previous.get(version)
        p, n = self.live(version, workload)
        q, m = self.live(prev, workload) if prev is not None else (None, 0.0)
        below = p is not None and q is not None and clearly_below(p, n, q, m)
        return Verdict(version, workload, p, n, q, below)

    def previous(self, version: str) -> str | None:
        """The version served before `version` (None: it was the first)."""
        with self._lock:
            return self._previous.get(version)

    def classes(self, version: str) -> list[str]:
        """Classes with live chains of this version (at most MAX_CLASSES + "other")."""
        with self._lock:
            return sorted(self._classes.get(version, ()))


@dataclass(frozen=True)
class PairedComparison:
    """The previous version against the current one on the same traffic: `diff` = mean over `n`
    pairs of (previous − current) in the unit compared (τ per window, teacher-forced τ per record), `se` its
    standard error (both sides' uncertainty), `z` the one-sided threshold. `previous_better`: clearly,
    diff > z·se with at least 2 pairs: the only evidence a guard rolls back on."""

    diff: float
    se: float
    n: int
    z: float = Z

    @property
    def previous_better(self) -> bool:
        return self.n >= 2 and self.diff - self.z * self.se > 0

    def line(self, current: str, previous: str, unit: str) -> str:
        """"v<previous> − v<current> = d ± se over n <unit>" (a log line and an audit reason)."""
        return f"v{previous} − v{current} = {self.diff:+.3f} ± {self.se:.3f} over {self.n} {unit}"


def paired_comparison(diffs: list[float], variances: list[float] | None = None, z: float = Z) -> PairedComparison:
    """Paired test of previous − current over units of the same traffic (a switchback's window pairs,
    or records both drafts were scored on). diffs: d_i = previous_i − current_i. `variances`: each
    d_i's known variance (a window pair: SE²(previous window) + SE²(current window)), giving SE =
    sqrt(Σ var_i)/n; with 3 or more pairs the sample SE sd(d)/√n is taken when larger (traffic that
    differs between windows adds variance the counters do not see). None: the sample SE alone
    (records). Raises ValueError when the lengths differ."""
    n = len(diffs)
    if variances is not None and len(variances) != n:
        raise ValueError(f"{n} differences but {len(variances)} variances")
    if n == 0:
        return PairedComparison(0.0, float("inf"), 0, z)
    mean = sum(diffs) / n
    sample = (math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n >= 2 else float("inf"))
    if variances is None:
        return PairedComparison(mean, sample, n, z)
    known = math.sqrt(sum(variances)) / n
    return PairedComparison(mean, max(known, sample) if n >= 3 else known, n, z)
