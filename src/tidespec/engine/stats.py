"""Speculative-decoding statistics, named after vLLM `vllm/v1/spec_decode/metrics.py`.

`SpecDecodingStats` counts drafts and accepted tokens; derived figures use the field's terms:
acceptance length τ = 1 + accepted / drafts (bonus token included), acceptance rate =
accepted / draft tokens, per-position acceptance = accepted at position i / drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int  # k
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one verify step: `num_draft_tokens` proposed, the first `num_accepted` accepted."""
        if num_draft_tokens > len(self.num_accepted_tokens_per_pos):
            self.num_accepted_tokens_per_pos += [0] * (num_draft_tokens - len(self.num_accepted_tokens_per_pos))
            self.num_spec_tokens = num_draft_tokens
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1

    def merge(self, other: "SpecDecodingStats") -> "SpecDecodingStats":
        k = max(self.num_spec_tokens, other.num_spec_tokens)
        a = self.num_accepted_tokens_per_pos + [0] * (k - len(self.num_accepted_tokens_per_pos))
        b = other.num_accepted_tokens_per_pos + [0] * (k - len(other.num_accepted_tokens_per_pos))
        return SpecDecodingStats(k, self.num_drafts + other.num_drafts,
                                 self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens,
                                 [x + y for x, y in zip(a, b)])

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


@dataclass
class RequestTiming:
    """Wall times of one request: prefill (TTFT) and per-step decode, in seconds."""

    prefill_s: float = 0.0
    steps: list[tuple[float, int]] = field(default_factory=list)  # (seconds, tokens emitted)

    @property
    def decode_s(self) -> float:
        return sum(s for s, _ in self.steps)

    def itl_ms(self) -> list[float]:
        """Inter-token latency samples (ms): a step emitting n tokens gives n samples of step/n."""
        return [1000 * s / n for s, n in self.steps for _ in range(n) if n]


@dataclass
class EngineStats:
    """Engine-wide aggregates since start: spec-decode counters overall and per workload class,
    finished requests, generated tokens, and the last `itl_window` inter-token latencies (ms)."""

    spec: SpecDecodingStats = field(default_factory=lambda: SpecDecodingStats(0))
    per_workload: dict[str, SpecDecodingStats] = field(default_factory=dict)
    num_requests: int = 0
    num_generated_tokens: int = 0
    itl_ms: list[float] = field(default_factory=list)
    itl_window: int = 10_000

    def add(self, workload: str, stats: SpecDecodingStats, timing: RequestTiming, tokens: int) -> None:
        """Fold in one finished request (its counters, its ITL samples in ms, `tokens` generated)."""
        self.spec = self.spec.merge(stats)
        self.per_workload[workload] = self.per_workload.get(workload, SpecDecodingStats(0)).merge(stats)
        self.num_requests += 1
        self.num_generated_tokens += tokens
        self.itl_ms = (self.itl_ms + timing.itl_ms())[-self.itl_window:]

    def summary(self) -> dict:
        """Flat dict: counts, τ, acceptance rate, accepted_per_pos/i, itl_ms_p50/p99 (ms), per_workload."""
        d = {"num_requests": self.num_requests, "num_generated_tokens": self.num_generated_tokens,
             **self.spec.metrics(), **itl_percentiles(self.itl_ms)}
        d["per_workload"] = {w: s.metrics() for w, s in self.per_workload.items()}
        return d


def itl_percentiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"itl_ms_p50": float("nan"), "itl_ms_p99": float("nan")}
    a = np.asarray(samples)
    return {"itl_ms_p50": float(np.percentile(a, 50)), "itl_ms_p99": float(np.percentile(a, 99))}


def simulated_acceptance_length(acc: list[float]) -> float:
    """1 + Σ_k Π_{j≤k} acc_j from per-position (conditional) accuracies (DESIGN.md cost model)."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau
