"""The SGLang adapter (CUDA only): its server's launch line, process and /generate client with
hidden-state capture (`server`), its spec-decode counters (`metrics`), and in-place draft swaps
(`swap`, through `plugin/`, which runs in SGLang's own environment)."""

from .metrics import parse_metrics, scrape
from .server import (
    CONDITIONAL_PLUS_ONE,
    PROBE,
    SGLANG_FLOAT32_ARGS,
    SGLANG_VERSION,
    VENV,
    SGLangError,
    SGLangLaunch,
    SGLangResult,
    SGLangServer,
    SGLangUnavailable,
    auto_dtype,
    capture_record,
    check_aux_ids,
    default_python,
    generate,
    launch_args,
    prefill_rows,
    serve_and_capture,
    submit_capture,
    unavailable_reason,
)
from .swap import SWAP_SCRIPT, SGLangRefused, load_draft_in_place, vocab_map_change

__all__ = [
    "CONDITIONAL_PLUS_ONE",
    "PROBE",
    "SGLANG_FLOAT32_ARGS",
    "SGLANG_VERSION",
    "SWAP_SCRIPT",
    "SGLangError",
    "SGLangLaunch",
    "SGLangRefused",
    "SGLangResult",
    "SGLangServer",
    "SGLangUnavailable",
    "VENV",
    "auto_dtype",
    "capture_record",
    "check_aux_ids",
    "default_python",
    "generate",
    "launch_args",
    "load_draft_in_place",
    "parse_metrics",
    "prefill_rows",
    "scrape",
    "serve_and_capture",
    "submit_capture",
    "unavailable_reason",
    "vocab_map_change",
]
