"""What a goodput policy would do for one request alone and per batch size, for the benchmark reports
(`engine.policy.GoodputPolicy` decides per step; these figures describe it, the engine never asks
for them): predicted step times and tokens/s of one request alone with k = 0..k_max chain drafts,
the k it would choose alone and per calibrated batch size, and a per-class report of it all.
"""
from __future__ import annotations

from ..engine.policy import GoodputPolicy, Ladder, plan
from ..engine.proposers import Rung


def chain_kind(pol: GoodputPolicy) -> str:
    """The kind of the policy's first proposer (rung order) that runs the draft model."""
    return next(e.cls.name for e in pol.proposers.specs if e.cls.uses_draft)


def step_ms(pol: GoodputPolicy) -> list[float]:
    """Predicted ms of one request's step alone with k = 0..k_max chain drafts; the factor applied
    to k drafts is the largest over 0..k (`StepCost.factor`), so a load spike during plain steps
    never makes the predicted speed-up exceed τ(k) · T_cal(0)/T_cal(k)."""
    return [pol.cost.predict(1, k + 1, [1] * k) for k in range(pol.k_max + 1)]


def observe_time(pol: GoodputPolicy, k: int, ms: float, alpha: float = 0.1) -> None:
    """A measured single-request step with k chain drafts took `ms` (k outside 0..k_max: ignored)."""
    if 0 <= k <= pol.k_max:
        pol.cost.observe(1, k + 1, [1] * k, ms, alpha)


def predicted_tokens_per_s(pol: GoodputPolicy, workload: str, kind: str | None = None) -> list[float]:
    """Predicted tokens/s of one request alone with k = 0..k_max drafts of a chain proposer (the
    first drafting kind by default, `chain_kind`)."""
    gains = (0.0, *pol.estimator(kind or chain_kind(pol)).gains(workload))
    ms = step_ms(pol)
    return [1000 * (1 + gains[k]) / ms[k] for k in range(pol.k_max + 1)]


def best_k(pol: GoodputPolicy, workload: str) -> int:
    """The k ≥ 1 with the highest predicted tokens/s of a request alone if it beats plain decoding
    by the margin, else 0 (speculation off); no probing."""
    tps = predicted_tokens_per_s(pol, workload)
    k = max(range(1, len(tps)), key=tps.__getitem__)
    return k if tps[k] > (1 + pol.config.margin) * tps[0] else 0


def k_by_batch(pol: GoodputPolicy, workload: str) -> dict[int, int]:
    """The chain k the policy would give every request of a batch of b requests of this class (no
    other proposers), for each calibrated batch size b."""
    kind = chain_kind(pol)
    ladder = Ladder((Rung(kind, None, pol.estimator(kind).gains(workload), drafts=True),))
    out = {}
    for b in pol.cal.batch_sizes:
        ch = plan([ladder] * b, pol.cost, pol.margins.margin_at([workload], b, pol.config.margin))
        out[b] = max(n for _, n in ch)
    return out


def report(pol: GoodputPolicy) -> dict[str, dict]:
    """Per class seen: the chain k alone and by batch size, the predicted speed-up alone, each
    estimator's figures, and the batch sizes at which each gated kind's offers are off."""
    classes = set(pol.probes.classes()).union(*(e.classes() for e in pol.estimators.values()))
    out = {}
    for w in sorted(classes):
        tps = predicted_tokens_per_s(pol, w)
        k = best_k(pol, w)
        out[w] = {"k": k, "speculation": k > 0, "predicted_speedup": tps[k] / tps[0],
                  "k_by_batch": k_by_batch(pol, w), "step_ms": [round(x, 2) for x in step_ms(pol)]}
        for est in pol.estimators.values():
            out[w] |= est.report(w)
        out[w] |= {f"{kind}_off_at_batch": pol.probes.gated_at(kind, w) for kind in sorted(pol.gated)}
    return out
