"""Loading the models as params.yaml says: the target (once per process: `get_target` is cached)
and a draft's inference runner. Engines are built from them in one place, `engine.build`."""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from ..config import Params
from .device import resolve_device
from .eagle3 import load_checkpoint
from .hf_files import target_dir
from .precision import check_precision
from .runner import DraftRunner
from .target import Target, load_target


@functools.lru_cache(maxsize=2)
def _target(source: str, dtype: str, aux: tuple | None, device: str, quantization: str) -> tuple[Target, object]:
    return load_target(target_dir(source), dtype=getattr(torch, dtype), aux_layers=aux, device=device,
                       quantization=quantization)


def get_target(params: Params) -> tuple[Target, object]:
    """(Target, tokenizer or None) on `target.device` (`auto` with a quantized target: the CPU, whose
    kernels int8/int4 are) at `target.dtype` / `target.quantization`, cached
    per process (tasks pass params, not tensors). Raises ValueError for a device torch cannot see
    (`models.device.resolve_device`) or a precision it cannot run there (`models.target.check_precision`)."""
    t = params.target
    quantized_auto = t.device == "auto" and t.quantization != "none"  # int8/int4 are CPU kernels: auto → cpu
    dev = "cpu" if quantized_auto else str(resolve_device(t.device, "target.device"))
    check_precision(getattr(torch, t.dtype), t.quantization, torch.device(dev))  # before the load, not after
    return _target(t.source, t.dtype, tuple(t.aux_layers) if t.aux_layers else None, dev, t.quantization)


def runner_for(path: Path | None, target: Target) -> DraftRunner | None:
    """Inference runner for a draft dir (None or a missing dir → None). Raises as `load_checkpoint`
    (ValueError for another target's draft or wrong shapes)."""
    if path is None or not Path(path).exists():
        return None
    return DraftRunner(load_checkpoint(Path(path), target.embed, target.target_id).to_device(target.device))
