"""A vLLM worker extension that loads new EAGLE3 draft weights into a running server, in place.

Loaded by the vLLM server's own interpreter (never by tidespec): `--worker-extension-cls
tidespec_draft_swap.TidespecDraftSwap` with this directory on PYTHONPATH (`backends.vllm.launch_args`
/ `launch_env` when `VLLMLaunch.draft_swap_root` is set). vLLM mixes the class into its worker
(`ParallelConfig.worker_extension_cls`), so `POST /collective_rpc {"method": "tidespec_load_draft",
"args": [DIR]}` (a development route, served with VLLM_SERVER_DEV_MODE=1 on a loopback port) runs
`tidespec_load_draft(DIR)` on every worker between two engine steps.

The load is vLLM's own in-place reload (`model_executor/model_loader/reload/`): record the draft's
layers (`initialize_layerwise_reload`), `load_weights` from the new `model.safetensors`, then
`finalize_layerwise_reload` with the draft's model config, which re-runs the kernels' weight
processing (the CPU linear layers repack their weights after loading; a bare `load_weights` fails
there). The draft module comes from `model_runner.get_draft_model()` (`v1/worker/gpu_model_runner.py`,
which the CPU runner subclasses). Only drafts under $TIDESPEC_DRAFT_ROOT load; the caller checks
that the new draft has the served one's config (same shapes, vocabulary and aux layers).
"""
from __future__ import annotations

import os
import time
from pathlib import Path


class TidespecDraftSwap:
    """Mixed into vLLM's worker; `self` is the worker (model_runner, vllm_config)."""

    def tidespec_load_draft(self, path: str) -> dict:
        """Load `path`/model.safetensors into the served draft. Returns {"seconds", "tensors"}.
        Raises ValueError for a path outside $TIDESPEC_DRAFT_ROOT, RuntimeError when the server runs
        no draft."""
        import torch
        from safetensors.torch import load_file
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        root = os.environ.get("TIDESPEC_DRAFT_ROOT")
        p = Path(path).resolve()
        if not root or not p.is_relative_to(Path(root).resolve()):
            raise ValueError(f"draft {path} is outside TIDESPEC_DRAFT_ROOT ({root}): not loaded")
        draft = self.model_runner.get_draft_model()
        if draft is None:
            raise RuntimeError("this vLLM server runs no draft model: start it with one")
        t0 = time.perf_counter()
        weights = load_file(str(p / "model.safetensors"))
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(draft)
            draft.load_weights(iter(weights.items()))
            finalize_layerwise_reload(draft, self.vllm_config.speculative_config.draft_model_config)
        return {"seconds": time.perf_counter() - t0, "tensors": len(weights)}
