"""Where tensors live: `resolve_device` turns a `target.device` / `train.device` setting into a
`torch.device`, and `autocast_dtype` a `train.precision` into the autocast dtype (`resolve_training`:
both, for the trainer). Every model,
optimizer and tensor is placed through these; nothing moves implicitly."""
from __future__ import annotations

import torch


def resolve_device(spec: str, setting: str) -> torch.device:
    """`auto` → cuda when torch sees a GPU, else cpu; `cpu`; `cuda` / `cuda:N`. Raises ValueError
    naming `setting` (e.g. "train.device") when it asks for a GPU torch cannot see, or a GPU index
    beyond the visible ones."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{setting}: {spec} but torch sees no CUDA GPU here; set {setting}: cpu (or auto)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{setting}: {spec} but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of `train.precision` on `device`: bfloat16 → torch.bfloat16; float32 → None
    (no autocast); auto → torch.bfloat16 on CUDA, None on CPU (the tested float32 path)."""
    if precision == "bfloat16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def resolve_training(device: str, precision: str) -> tuple[torch.device, torch.dtype | None]:
    """(device, autocast dtype) of the trainer's `train.device` and `train.precision` settings, as
    `resolve_device` and `autocast_dtype` give them (precision `auto` depends on the device).
    Raises as `resolve_device`."""
    dev = resolve_device(device, "train.device")
    return dev, autocast_dtype(precision, dev)
