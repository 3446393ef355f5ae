"""SGLang's spec-decode counters, read from its Prometheus `/metrics` (`--enable-metrics`), as
`engine.spec_counters.SpecDecodeCounters`.

SGLang 0.5.23 counts, per finished request (`srt/observability/metrics_collector.py`),
`sglang:spec_verify_calls_total` (verify forwards), `sglang:generation_tokens_total` (output
tokens) and `sglang:num_requests_total`; its gauges (`sglang:spec_accept_length`) hold only the
last batch's. A request's first output token comes from its prefill, every later one from a verify
step (which yields its accepted draft tokens + 1), so: drafts = verify calls, accepted = output
tokens − requests − verify calls, draft tokens = drafts × k. Exact when every decode step verifies
a draft, as with EAGLE3 in SGLang; SGLang's own per-request `spec_accept_length` (output tokens /
verify calls) counts the prefill's token too and sits above this τ. No per-position acceptance.
Labels (`model_name`, `engine_type`, `is_streaming`, custom ones) are summed over. A retracted
request (the swap's pause, or KV-cache pressure: `managers/schedule_batch.py::reset_for_retract`
keeps its output and verify count) prefills again and takes one more token no verify produced, so
accepted is over-counted by one per retraction; requests running across a swap finish, and count
whole, under the new version.
"""
from __future__ import annotations

from ...engine.spec_counters import SpecDecodeCounters
from ..base import metrics_text
from .server import SGLangError

VERIFY = "sglang:spec_verify_calls"
GENERATED = "sglang:generation_tokens"
REQUESTS = "sglang:num_requests"


def parse_metrics(text: str, num_draft_tokens: int) -> SpecDecodeCounters | None:
    """The spec-decode counters of an SGLang `/metrics` exposition (summed over label sets:
    streaming or not, several ranks), with `num_draft_tokens` = k per draft. None when SGLang
    exports no verify counter (no speculation, or metrics off): live τ is then unknown, never 0."""
    from prometheus_client.parser import text_string_to_metric_families
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens {num_draft_tokens} must be >= 1")
    vals: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in (VERIFY, GENERATED, REQUESTS):
            vals[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    if VERIFY not in vals:
        return None
    drafts = int(vals[VERIFY])
    accepted = max(int(vals.get(GENERATED, 0)) - int(vals.get(REQUESTS, 0)) - drafts, 0)
    return SpecDecodeCounters(drafts, drafts * num_draft_tokens, accepted, ())


def scrape(url: str, num_draft_tokens: int, timeout_s: float = 10.0) -> SpecDecodeCounters | None:
    """GET `<url>/metrics` and parse it (`parse_metrics`). Raises SGLangError when the server does not answer."""
    return parse_metrics(metrics_text(url, "SGLang", SGLangError, timeout_s), num_draft_tokens)
