"""The llama.cpp adapter: llama.cpp's `llama-server` and draft converter built from pinned sources
(`build`, `make llama-server`), a tidespec draft converted to an EAGLE-3 GGUF (`convert`), the server
serving the target GGUF with it (`server`) and its spec-decode counters (`metrics`)."""

from .build import ENV_HOME, LLAMA_CPP_COMMIT, SDIST, build_llama_server, server_binary, server_home
from .convert import draft_gguf, draft_key, drafts_dir
from .metrics import METRIC_PREFIX, SpecDecodeCounters, parse_metrics, scrape
from .server import (
    SPEC_TYPE,
    LlamaCppError,
    LlamaCppLaunch,
    LlamaCppServer,
    LlamaCppUnavailable,
    launch_args,
    request_refusal,
    speculating,
    unavailable_reason,
)

__all__ = [
    "ENV_HOME",
    "LLAMA_CPP_COMMIT",
    "METRIC_PREFIX",
    "SDIST",
    "SPEC_TYPE",
    "LlamaCppError",
    "LlamaCppLaunch",
    "LlamaCppServer",
    "LlamaCppUnavailable",
    "SpecDecodeCounters",
    "build_llama_server",
    "draft_gguf",
    "draft_key",
    "drafts_dir",
    "launch_args",
    "parse_metrics",
    "request_refusal",
    "scrape",
    "server_binary",
    "server_home",
    "speculating",
    "unavailable_reason",
]
