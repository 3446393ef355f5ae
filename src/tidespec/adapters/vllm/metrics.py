"""vLLM's spec-decode counters (`vllm:spec_decode_*` on its /metrics, as `v1/spec_decode/metrics.py` names them):
parsed, scraped, differenced, and the check that live τ sits clearly below a draft's replay."""

from __future__ import annotations

from dataclasses import dataclass

from .server import VLLMError

METRIC_PREFIX = "vllm:spec_decode_"


# -- counters ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's spec-decode counters (cumulative since the server started, or a difference of two
    scrapes): drafts (verify steps with a draft), draft tokens, accepted tokens, accepted per draft
    position (index 0 = first drafted token)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    @property
    def acceptance_length(self) -> float | None:
        """Mean acceptance length τ = 1 + accepted / drafts (tokens per verify step); None without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted tokens; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_length_se(self) -> float | None:
        """Standard error of τ: X = accepted tokens per draft (0..k) has P(X ≥ i) = per-pos count
        i-1 / drafts, so E[X] = Σ P(X ≥ i), E[X²] = Σ (2i−1)·P(X ≥ i), SE = sqrt(Var X / drafts)
        (drafts treated as independent). None without drafts."""
        n = self.num_drafts
        if not n:
            return None
        p = [c / n for c in self.accepted_per_pos]
        mean, sq = sum(p), sum((2 * i + 1) * q for i, q in enumerate(p))
        return max(sq - mean * mean, 0.0) ** 0.5 / n ** 0.5

    @property
    def per_position_rate(self) -> tuple[float, ...]:
        """Per-position acceptance: accepted at position i / drafts."""
        return tuple(a / self.num_drafts for a in self.accepted_per_pos) if self.num_drafts else ()

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda t: tuple(t) + (0,) * (n - len(t))  # noqa: E731
        return SpecDecodeCounters(self.num_drafts - other.num_drafts, self.num_draft_tokens - other.num_draft_tokens,
                                  self.num_accepted_tokens - other.num_accepted_tokens,
                                  tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))))


def live_below_replay(live: SpecDecodeCounters, replay_tau: float, z: float = 3.0, min_drafts: int = 100) -> bool:
    """True when the live τ is clearly below the replayed one: live τ + z·SE < replay τ with at
    least `min_drafts` drafts (z = 3: one false alarm in ~740 healthy checks under the normal
    approximation). vLLM counts accepted drafts a cut drops, tidespec's replay does not: the
    comparison leans towards not flagging."""
    se = live.acceptance_length_se
    return se is not None and live.num_drafts >= min_drafts and live.acceptance_length + z * se < replay_tau


def parse_metrics(text: str) -> SpecDecodeCounters | None:
    """vLLM's spec-decode counters from a `/metrics` exposition (summed over its label sets, e.g.
    several engines); None when the server exports none (no speculation, or an older vLLM): live τ
    is then unknown, never 0."""
    from prometheus_client.parser import text_string_to_metric_families
    vals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(METRIC_PREFIX):
            continue
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            name = s.name.removeprefix(METRIC_PREFIX).removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            else:
                vals[name] = vals.get(name, 0.0) + s.value
    if "num_drafts" not in vals:
        return None
    pos = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeCounters(int(vals["num_drafts"]), int(vals.get("num_draft_tokens", 0)),
                              int(vals.get("num_accepted_tokens", 0)), pos)


def scrape(url: str, timeout_s: float = 10.0, client=None) -> SpecDecodeCounters | None:
    """GET `<url>/metrics` and parse it (`parse_metrics`). Raises VLLMError when the server does not answer."""
    import httpx
    try:
        r = (client or httpx).get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise VLLMError(f"vLLM at {url} did not answer /metrics: {e}") from None
    if r.status_code != 200:
        raise VLLMError(f"vLLM at {url} answered /metrics with {r.status_code}")
    return parse_metrics(r.text)
