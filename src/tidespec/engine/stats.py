"""Speculative-decoding statistics, named after vLLM `vllm/v1/spec_decode/metrics.py`.

`SpecDecodingStats` counts drafts and accepted tokens; derived figures use the field's terms:
acceptance length τ = 1 + accepted / drafts (bonus token included), acceptance rate =
accepted / draft tokens, per-position acceptance = accepted at position i / drafts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # accepted by the verifier, then dropped by a stop / EOS / max_tokens cut inside the same step:
    # tidespec never counts them accepted, vLLM does (`as_vllm`)
    num_cut_accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        k = self.num_spec_tokens
        self.num_accepted_tokens_per_pos = _pad(self.num_accepted_tokens_per_pos, k)
        self.num_cut_accepted_per_pos = _pad(self.num_cut_accepted_per_pos, k)

    def observe(self, num_draft_tokens: int, num_accepted: int, positions: int | None = None,
                num_verified: int | None = None) -> None:
        """Record one verify step: `num_draft_tokens` proposed, the first `num_accepted` accepted and
        kept. positions: draft positions (a tree's depth; default: a chain, num_draft_tokens);
        num_verified: accepted by the verifier before a cut (default num_accepted)."""
        pos = num_draft_tokens if positions is None else positions
        if pos > self.num_spec_tokens:
            self.num_spec_tokens = pos
            self.__post_init__()
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(num_accepted, num_accepted if num_verified is None else num_verified):
            self.num_cut_accepted_per_pos[i] += 1

    def merge(self, other: SpecDecodingStats) -> SpecDecodingStats:
        k = max(self.num_spec_tokens, other.num_spec_tokens)
        add = lambda a, b: [x + y for x, y in zip(_pad(a, k), _pad(b, k))]  # noqa: E731
        return SpecDecodingStats(k, self.num_drafts + other.num_drafts,
                                 self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens,
                                 add(self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
                                 add(self.num_cut_accepted_per_pos, other.num_cut_accepted_per_pos))

    def as_vllm(self) -> tuple[int, int, int, tuple[int, ...]]:
        """(drafts, draft tokens, accepted, accepted per position) as vLLM's spec-decode counters
        count them: vLLM's scheduler counts every token its rejection sampler accepted before the
        stop check trims the output (`vllm/v1/core/sched/scheduler.py`, `update_from_output`), so
        drafts past a cut count as accepted there."""
        per = tuple(a + c for a, c in zip(self.num_accepted_tokens_per_pos, self.num_cut_accepted_per_pos))
        return self.num_drafts, self.num_draft_tokens, sum(per), per

    @property
    def acceptance_length(self) -> float:
        """τ = 1 + accepted / drafts; 1.0 with no drafts (every step yields one token)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def accepted_per_pos(self) -> list[float]:
        """Fraction of drafts whose token at position i was accepted (non-increasing in i)."""
        d = max(self.num_drafts, 1)
        return [a / d for a in self.num_accepted_tokens_per_pos]

    def metrics(self) -> dict[str, float]:
        m = {"acceptance_length": self.acceptance_length, "acceptance_rate": self.acceptance_rate,
             "num_drafts": float(self.num_drafts), "num_draft_tokens": float(self.num_draft_tokens),
             "num_accepted_tokens": float(self.num_accepted_tokens)}
        m.update({f"accepted_per_pos/{i}": v for i, v in enumerate(self.accepted_per_pos)})
        return m


def _pad(xs: list[int], k: int) -> list[int]:
    return list(xs) + [0] * (k - len(xs))


@dataclass
class RequestTiming:
    """Wall times of one request: prefill (TTFT) and per-step decode, in seconds."""

    prefill_s: float = 0.0
    steps: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens output: cut at the stop)

    @property
    def decode_s(self) -> float:
        return sum(s for s, _ in self.steps)

    def itl_ms(self) -> list[float]:
        """Inter-token latency samples (ms): a step emitting n tokens gives n samples of step/n."""
        return [1000 * s / n for s, n in self.steps for _ in range(n) if n]


def tau_by_k(per_pos: list[float]) -> list[float]:
    """τ(k) for k = 0..K from one chain replay at K: `per_pos[i]` = accepted at position i / drafts
    (`SpecDecodingStats.accepted_per_pos`). A chain accepts position i only if every earlier one was
    accepted and drafting fewer tokens does not change the earlier ones (greedy chains), so
    τ(k) = 1 + Σ_{i<k} per_pos[i] exactly (the cost model's τ(k) = 1 + Σ_i Π_{j≤i} a_j, Leviathan et
    al. 2023, arXiv 2211.17192 §3.1, with per_pos[i] = Π_{j≤i} a_j)."""
    out = [1.0]
    for p in per_pos:
        out.append(out[-1] + p)
    return out


def per_position(metrics: dict) -> list[float]:
    """The per-position acceptance `[accepted_per_pos/0, /1, …]` of a metrics dict (`SpecDecodingStats.metrics`,
    a replay's, a bench arm's), in position order while the keys are consecutive; [] when it has none."""
    out = []
    while f"accepted_per_pos/{len(out)}" in metrics:
        out.append(float(metrics[f"accepted_per_pos/{len(out)}"]))
    return out


def tau_standard_error(per_pos: list[float], num_drafts: float) -> float:
    """Standard error of a measured τ = 1 + mean accepted drafts per verify step, treating the
    `num_drafts` steps as independent: per_pos[i] = P(accepted ≥ i + 1) (`accepted_per_pos`), so
    E[X] = Σ_i per_pos[i], E[X²] = Σ_i (2i + 1) per_pos[i] and SE = sqrt(Var X / num_drafts).
    Steps within one request are correlated (a hard stretch rejects several in a row), so this is a
    lower bound; 0.0 without drafts."""
    if num_drafts <= 0:
        return 0.0
    m = sum(per_pos)
    m2 = sum((2 * i + 1) * p for i, p in enumerate(per_pos))
    return math.sqrt(max(0.0, m2 - m * m) / num_drafts)


def itl_percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"itl_ms_p50": float("nan"), "itl_ms_p99": float("nan")}
    a = np.asarray(samples)
    return {"itl_ms_p50": float(np.percentile(a, 50)), "itl_ms_p99": float(np.percentile(a, 99))}


def simulated_acceptance_length(acc: list[float]) -> float:
    """Expected tokens per target forward with k = len(acc) chained drafts: τ = 1 + Σ_{i<k} Π_{j≤i} a_j.

    `acc`: the CONDITIONAL acceptance per draft position, a_j = P(draft token j accepted | draft
    tokens 0..j-1 accepted), each in [0, 1] (position 0 first). Π_{j≤i} a_j is then the probability
    that the first i+1 drafts are all accepted, so τ = 1 + E[min(L, k)] with L the number of
    leading accepted drafts (the bonus token is the 1). Source: the expected accepted prefix of
    chained drafting (Leviathan et al. 2023, arXiv 2211.17192 §3, there with one i.i.d. rate) with
    per-position rates, as EAGLE-3's training-time test evaluates drafts step by step (arXiv
    2503.01840 §3). Feeding unconditional per-step accuracies (step j right regardless of steps
    < j, e.g. the trainer's `val/acc_{j}`) gives a different, wrong number: drafts' errors at
    consecutive steps are correlated. Producers of conditional a_j: `train.holdout.evaluate_holdout`
    (teacher-forced) and `proposers.eagle3_estimate.Eagle3Estimator` (from verify steps). Returns 1.0 for [].
    """
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
