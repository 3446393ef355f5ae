"""vLLM's spec-decode counters (`vllm:spec_decode_*` on its /metrics, as `v1/spec_decode/metrics.py` names them),
parsed and scraped into `engine.spec_counters.SpecDecodeCounters` (which differences them and judges live τ against
a draft's replay)."""

from __future__ import annotations

from ...engine.spec_counters import SpecDecodeCounters, live_below_replay
from .server import VLLMError

METRIC_PREFIX = "vllm:spec_decode_"
__all__ = ["METRIC_PREFIX", "SpecDecodeCounters", "live_below_replay", "parse_metrics", "scrape"]


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
