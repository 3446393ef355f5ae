"""How often the EAGLE3 draft's tokens are accepted, per workload class (`Eagle3Estimator`).

Acceptance (Leviathan et al. 2023, arXiv 2211.17192 §3.4): with k drafts a step emits
τ(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j tokens on average, a_j the conditional acceptance at position j — a
running mean that starts from a prior worth PRIOR_CHAINS observations, then (after 1/alpha
observations) an EMA, over verify steps that reached position j. a₁'s prior is the draft's
first-token acceptance its evaluation replayed on the class (`first_token_priors`), else `prior`.
EAGLE-2 trees (arXiv 2406.16858) keep their own per-depth acceptance and the mean accepted tokens
per tree size. Per confidence bin, P(accepted | the draft's probability of the token) drives the
early stop and tree widening (EAGLE-2 §4: a draft's confidence approximates its acceptance).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping

from ..drafts import check_replayed
from .base import Slot

CONF_BINS = 10  # draft-confidence bins for the early stop's acceptance estimate
PRIOR_CHAINS = 4  # observations the starting acceptance of a class is worth


def first_token_priors(replayed: Mapping[str, tuple[float, float]], prior: float) -> dict[str, float]:
    """a₁'s starting value per class from a draft's replayed first-token acceptance {class: (a₁,
    chains)} ("" = over all classes): the overall a₁ shrunk towards `prior`, a class's towards the
    overall one, each by PRIOR_CHAINS pseudo-chains — (n·a + PRIOR_CHAINS·fallback) / (n + PRIOR_CHAINS).
    Raises ValueError for an entry that is not (a₁ in [0, 1], chains >= 0) (`drafts.check_replayed`)."""
    rep = check_replayed(replayed)

    def shrunk(w: str, fallback: float) -> float:
        a, n = rep[w]
        return (n * a + PRIOR_CHAINS * fallback) / (n + PRIOR_CHAINS)

    overall = shrunk("", prior) if "" in rep else prior
    out = {w: shrunk(w, overall) for w in rep if w}
    return out | ({"": overall} if "" in rep else {})


def _mean(st: list, x: float, alpha: float) -> None:
    """Running mean of st = [mean, n] for the first 1/alpha observations, then an EMA."""
    st[1] += 1
    st[0] += max(alpha, 1.0 / st[1]) * (x - st[0])


class PositionAcceptance:
    """Conditional acceptance a_1..a_K per class (module docstring); `first(class)` gives a₁'s prior."""

    def __init__(self, k_max: int, prior: float, alpha: float, first: Callable[[str], float]):
        self.k_max, self.prior, self.alpha, self.first = k_max, prior, alpha, first
        self.acc: dict[str, list[float]] = {}
        self.obs: dict[str, list[int]] = {}

    def get(self, w: str) -> list[float]:
        return list(self.acc.get(w) or [self.first(w)] + [self.prior] * (self.k_max - 1))

    def observe(self, w: str, k: int, accepted: int) -> None:
        """One verify step: k drafts, the first `accepted` accepted; positions 1..min(accepted+1, k)."""
        if k < 1:
            return
        acc = self.acc.setdefault(w, self.get(w))
        obs = self.obs.setdefault(w, [PRIOR_CHAINS] * self.k_max)
        for j in range(min(accepted + 1, k, self.k_max)):
            obs[j] += 1
            acc[j] += max(self.alpha, 1.0 / obs[j]) * (float(j < accepted) - acc[j])


def cumulative(acc: list[float]) -> tuple[float, ...]:
    """τ(k) − 1 for k = 1..len(acc): cumulative sums of the products of conditional acceptance."""
    out, p = [], 1.0
    for a in acc:
        p *= a
        out.append((out[-1] if out else 0.0) + p)
    return tuple(out)


class Eagle3Estimator:
    """Per class: the chains' conditional acceptance, the trees' per-depth acceptance and mean
    accepted tokens per size, and P(accept | confidence). `settings`: `policy.PolicyConfig` (prior,
    alpha, k_max). Thread-safe."""

    def __init__(self, settings):
        self.k_max, self.prior, self.alpha = settings.k_max, settings.prior, settings.alpha
        self._lock = threading.Lock()
        self.reset()

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None:
        first = first_token_priors(replayed or {}, self.prior)
        with self._lock:
            self._chain = PositionAcceptance(self.k_max, self.prior, self.alpha,
                                             lambda w: first.get(w, first.get("", self.prior)))
            self._depth = PositionAcceptance(self.k_max, self.prior, self.alpha, lambda w: self.prior)
            self._size: dict[str, dict[int, list]] = {}  # class → nodes verified → [mean accepted, n]
            self._conf: dict[str, list[list[float]]] = {}  # class → per confidence bin [P(accept), n]

    def acceptance(self, workload: str) -> list[float]:
        """The class's conditional acceptance at positions 1..k_max (its prior until observed)."""
        with self._lock:
            return self._chain.get(workload)

    def gains(self, workload: str, room: int | None = None) -> tuple[float, ...]:
        """Expected accepted drafts τ(k) − 1 of a chain of k = 1..min(room, k_max)."""
        acc = self.acceptance(workload)
        return cumulative(acc[:self.k_max if room is None else min(room, self.k_max)])

    def tree_gains(self, workload: str, nodes: int, depth_of: Callable[[int], int]) -> tuple[float, ...]:
        """Expected accepted tokens of a tree of n = 1..nodes drafted nodes, depth `depth_of(n)`: the
        measured mean for that n where measured, else τ(depth) − 1 from the class's per-depth tree
        acceptance; made non-decreasing in n (a tree's best path is at least a shallower one's)."""
        with self._lock:
            chain = cumulative(self._depth.get(workload))
            seen = {n: v[0] for n, v in self._size.get(workload, {}).items()}
        out, best = [], 0.0
        for n in range(1, nodes + 1):
            d = min(depth_of(n), len(chain))
            best = max(best, seen.get(n, chain[d - 1] if d else 0.0))
            out.append(best)
        return tuple(out)

    def accept_given_confidence(self, workload: str, conf: float) -> float:
        """P(a drafted token is accepted | the ones before it were, the draft's probability of it is
        `conf`): the draft's own confidence until its bin has been observed, then what was accepted."""
        b = min(int(conf * CONF_BINS), CONF_BINS - 1)
        with self._lock:
            bins = self._conf.get(workload)
            return conf if bins is None or bins[b][1] == 0 else bins[b][0]

    def observe(self, slot: Slot) -> None:
        """A verified chain (one cut by early stop counts its stop position as not accepted: the plan's
        a_j must describe what planning k returns with early stop on) or tree."""
        k, n = slot.k, slot.accepted
        if slot.layout is not None:
            self.observe_tree(slot.workload, k, slot.layout.max_depth, n)
        else:
            self.observe_chain(slot.workload, slot.n if slot.stopped and n == k else k, n, slot.confs)

    def observe_chain(self, workload: str, k: int, accepted: int, confs: list[float] = ()) -> None:
        """A chain of k drafts, the first `accepted` accepted; `confs`: the draft's probability of each
        draft (its confidence bins learn up to the first rejection: later ones were never tested)."""
        with self._lock:
            self._chain.observe(workload, k, accepted)
        self.observe_confidence(workload, confs, accepted)

    def observe_confidence(self, workload: str, confs: list[float], accepted: int) -> None:
        if not confs:
            return
        with self._lock:
            bins = self._conf.setdefault(workload, [[0.0, 0] for _ in range(CONF_BINS)])
            for j, c in enumerate(confs[:accepted + 1]):
                _mean(bins[min(int(c * CONF_BINS), CONF_BINS - 1)], float(j < accepted), self.alpha)

    def observe_tree(self, workload: str, nodes: int, depth: int, accepted: int) -> None:
        """A verified tree of `nodes` drafted nodes and `depth`: `accepted` tokens on its accepted path."""
        if nodes < 1:
            return
        with self._lock:
            self._depth.observe(workload, depth, accepted)
            _mean(self._size.setdefault(workload, {}).setdefault(nodes, [0.0, 0]), accepted, self.alpha)

    def tree_acceptance(self, workload: str) -> list[float]:
        """The class's conditional acceptance of its trees by depth 1..k_max (the prior until observed)."""
        with self._lock:
            return self._depth.get(workload)

    def report(self, workload: str) -> dict:
        out = {"conditional_acceptance": [round(a, 4) for a in self.acceptance(workload)]}
        with self._lock:
            if workload in self._size:
                out |= {"conditional_acceptance_by_depth": [round(a, 4) for a in self._depth.get(workload)],
                        "accepted_by_tree_size": {n: round(v[0], 4) for n, v in sorted(self._size[workload].items())}}
        return out

    def classes(self) -> set[str]:
        with self._lock:
            return set(self._chain.acc) | set(self._size)
