"""`tidespec demo --llama-cpp` (`make demo-llama-cpp`): one TIDE cycle around llama.cpp's
`llama-server` (`make llama-server`), on SmolLM2-135M (its shipped Q4_1 GGUF) and HumanEval, with no
hand step between the requests and the new draft (`run_demo_llama_cpp`): the loop of `demos.served`
with `tidespec serve --backend llama-cpp`, each champion converted to an EAGLE-3 GGUF and swapped in
blue/green, τ before and after as llama.cpp's own counters report it. llama-server decodes on one
thread here (`OMP_NUM_THREADS=1` for the serve command): the demo measures acceptance, not speed,
and the cycle trains on the same cores meanwhile, where llama.cpp's spinning threads slow down
several times over (two threads on 2 busy cores: 0.7 tokens/s).
"""
from __future__ import annotations

from pathlib import Path

from ..backends import llama_cpp
from ..config.serve_launch import LLAMA_ENV
from .served import ServedEngine, run_demo


def run_demo_llama_cpp(root: Path, params_path: Path, results: Path | None = None) -> dict:
    """The demo (module docstring). Returns the summary, also written to `results`/demo-llama-cpp.json
    (default `root`/data/work/results, git-ignored). Raises LlamaCppUnavailable naming the fix,
    RuntimeError when a step does not happen in time."""
    reason = llama_cpp.unavailable_reason()
    if reason:
        raise llama_cpp.LlamaCppUnavailable(f"{reason} (make demo-llama-cpp runs `make llama-server` first)")
    engine = ServedEngine("llama-cpp", "llama.cpp", (), llama_cpp.scrape, "blue/green", unset=LLAMA_ENV,
                          env={"OMP_NUM_THREADS": "1"})
    return run_demo(engine, root, params_path, results)
