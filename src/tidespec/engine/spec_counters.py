"""A serving engine's cumulative spec-decode counters (vLLM's `vllm:spec_decode_*`, SGLang's
`sglang:spec_verify_calls_total` / `sglang:generation_tokens_total`), differenced between scrapes,
and the check that live τ sits clearly below the τ a draft's evaluation replayed."""

from __future__ import annotations

from dataclasses import dataclass

Z = 3.0  # one-sided z of "clearly below" (one false alarm in ~740 healthy checks, normal approximation)
WINDOW_DRAFTS = 100  # drafts in a window before live τ is judged (the live guard, the SageMaker alarm)


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Spec-decode counters (cumulative since the server started, or a difference of two scrapes):
    drafts (verify steps with a draft), draft tokens, accepted tokens, accepted per draft position
    (index 0 = first drafted token; empty when the engine does not count per position, as SGLang)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    @property
    def acceptance_length(self) -> float | None:
        """Mean acceptance length τ = 1 + accepted / drafts (tokens per verify step); None without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict(self) -> dict:
        """The counters under vLLM's per-request names (`num_drafts`, `num_draft_tokens`,
        `num_accepted_tokens`, `num_accepted_tokens_per_pos`), JSON-ready; `from_dict` reads them back."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.accepted_per_pos)}

    @classmethod
    def from_dict(cls, d: dict) -> SpecDecodeCounters:
        """Counters from `as_dict`'s names. Raises KeyError for a missing name."""
        return cls(d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"],
                   tuple(d["num_accepted_tokens_per_pos"]))

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted tokens; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_length_se(self) -> float | None:
        """Standard error of τ (drafts treated as independent), None without drafts. X = accepted
        tokens per draft (0..k). With per-position counts, P(X ≥ i) = count at position i-1 / drafts,
        so E[X] = Σ P(X ≥ i), E[X²] = Σ (2i−1)·P(X ≥ i) and SE = sqrt(Var X / drafts). Without them
        (SGLang), the Bhatia–Davis bound Var X ≤ μ·(k − μ) for X in [0, k] with mean μ (k = draft
        tokens per draft): an upper bound, so the live check leans towards not flagging."""
        n = self.num_drafts
        if not n:
            return None
        if not self.accepted_per_pos:
            mu, k = self.num_accepted_tokens / n, self.num_draft_tokens / n
            return max(mu * (k - mu), 0.0) ** 0.5 / n ** 0.5
        p = [c / n for c in self.accepted_per_pos]
        mean, sq = sum(p), sum((2 * i + 1) * q for i, q in enumerate(p))
        return max(sq - mean * mean, 0.0) ** 0.5 / n ** 0.5

    @property
    def per_position_rate(self) -> tuple[float, ...]:
        """Per-position acceptance: accepted at position i / drafts (empty when not counted)."""
        return tuple(a / self.num_drafts for a in self.accepted_per_pos) if self.num_drafts else ()

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        return self._combine(other, -1)

    def __add__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        """Both sides' counts pooled (two classes, two replicas, two windows of one version)."""
        return self._combine(other, 1)

    def _combine(self, other: SpecDecodeCounters, sign: int) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda t: tuple(t) + (0,) * (n - len(t))  # noqa: E731
        return SpecDecodeCounters(self.num_drafts + sign * other.num_drafts,
                                  self.num_draft_tokens + sign * other.num_draft_tokens,
                                  self.num_accepted_tokens + sign * other.num_accepted_tokens,
                                  tuple(a + sign * b for a, b in zip(pad(self.accepted_per_pos),
                                                                     pad(other.accepted_per_pos))))


def live_below_replay(live: SpecDecodeCounters, replay_tau: float, z: float = Z,
                      min_drafts: int = WINDOW_DRAFTS) -> bool:
    """True when the live τ is clearly below the replayed one: live τ + z·SE < replay τ with at
    least `min_drafts` drafts (z = 3: one false alarm in ~740 healthy checks under the normal
    approximation). vLLM counts accepted drafts a cut drops, tidespec's replay does not: the
    comparison leans towards not flagging."""
    se = live.acceptance_length_se
    return se is not None and live.num_drafts >= min_drafts and live.acceptance_length + z * se < replay_tau
