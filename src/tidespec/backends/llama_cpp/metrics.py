"""llama.cpp's spec-decode counters (`llamacpp:spec_decode_*` on its /metrics with `--metrics`, as
`tools/server/server-task.cpp` names them), parsed and scraped into the counters type the vLLM
backend gives (`engine.spec_counters.SpecDecodeCounters`), so τ and per-position acceptance come out
the same way.

`num_drafts_total` counts verification steps with a non-empty draft; `..._per_pos_total{position=i}`
counts steps that accepted at least i+1 draft tokens (vLLM's meaning), its series absent until the
first speculative request finishes. llama.cpp adds a request's counts when it finishes (not while
it streams), never those of a failed request, from 0 at the process start.
"""
from __future__ import annotations

from ...engine.spec_counters import SpecDecodeCounters
from ..base import metrics_text, parse_spec_decode
from .server import LlamaCppError

METRIC_PREFIX = "llamacpp:spec_decode_"
__all__ = ["METRIC_PREFIX", "SpecDecodeCounters", "parse_metrics", "scrape"]


def parse_metrics(text: str) -> SpecDecodeCounters | None:
    """llama.cpp's spec-decode counters from a `/metrics` exposition; None when it exports none
    (`backends.base.parse_spec_decode`). A server without a draft exports them at 0."""
    return parse_spec_decode(text, METRIC_PREFIX)


def scrape(url: str, timeout_s: float = 10.0, client=None) -> SpecDecodeCounters | None:
    """GET `<url>/metrics` and parse it (`parse_metrics`). Raises LlamaCppError when the server does not answer."""
    return parse_metrics(metrics_text(url, "llama-server", LlamaCppError, timeout_s, client))
