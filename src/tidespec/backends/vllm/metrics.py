"""vLLM's spec-decode counters (`vllm:spec_decode_*` on its /metrics, as `v1/spec_decode/metrics.py` names them),
parsed and scraped into `engine.spec_counters.SpecDecodeCounters` (which differences them and judges live τ against
a draft's replay)."""

from __future__ import annotations

from ...engine.spec_counters import SpecDecodeCounters, live_below_replay
from ..base import metrics_text, parse_spec_decode
from .server import VLLMError

METRIC_PREFIX = "vllm:spec_decode_"
__all__ = ["METRIC_PREFIX", "SpecDecodeCounters", "live_below_replay", "parse_metrics", "scrape"]


def parse_metrics(text: str) -> SpecDecodeCounters | None:
    """vLLM's spec-decode counters from a `/metrics` exposition (summed over its label sets, e.g.
    several engines); None when the server exports none (no speculation, or an older vLLM): live τ
    is then unknown, never 0 (`backends.base.parse_spec_decode`)."""
    return parse_spec_decode(text, METRIC_PREFIX)


def scrape(url: str, timeout_s: float = 10.0, client=None) -> SpecDecodeCounters | None:
    """GET `<url>/metrics` and parse it (`parse_metrics`). Raises VLLMError when the server does not answer."""
    return parse_metrics(metrics_text(url, "vLLM", VLLMError, timeout_s, client))
