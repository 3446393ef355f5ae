"""`tidespec demo --vllm` (`make demo-vllm`): one TIDE cycle around a real vLLM, on SmolLM2-135M and
HumanEval, with no hand step between the requests and the new draft (`run_demo_vllm`): the loop of
`demos.served` with `tidespec serve --backend vllm`, τ before and after as vLLM's own counters
report it. The steps in full: docs/design/bench.md.
"""
from __future__ import annotations

from pathlib import Path

from ..backends import vllm
from ..config.serve_launch import VLLM_API_KEY_ENV
from .served import ServedEngine, run_demo


def run_demo_vllm(root: Path, params_path: Path, python: str | None = None, results: Path | None = None) -> dict:
    """The demo (module docstring). `python`: vLLM's interpreter (default: `make vllm`'s venv under
    `root`). Returns the summary, also written to `results`/demo-vllm.json (default
    `root`/data/work/results, git-ignored).
    Raises VLLMUnavailable naming the fix, RuntimeError when a step does not happen in time."""
    python = python or str(Path(root).resolve() / vllm.VENV / "bin" / "python")
    reason = vllm.unavailable_reason(python)
    if reason:
        raise vllm.VLLMUnavailable(f"{reason} (make demo-vllm runs `make vllm` first)")
    engine = ServedEngine("vllm", "vLLM", ("--vllm-python", python), vllm.scrape, "in place",
                          unset=(VLLM_API_KEY_ENV,))
    return run_demo(engine, root, params_path, results)
