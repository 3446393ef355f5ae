"""A target's precision: its name (`precision_name`) and whether it can run on a device
(`check_precision`). `target.dtype` sets the residual stream, attention and KV cache; `target.quantization`
the linears (`models.layers.make_linear`)."""
from __future__ import annotations

import torch

from .layers import QUANTIZATIONS


def precision_name(dtype: torch.dtype, quantization: str) -> str:
    """A target precision's short name: "fp32" / "bf16" (no quantization), "int8" / "int4" (fp32
    residual stream), "bf16+int8" / "bf16+int4" (a bf16 one); another dtype by its torch name."""
    base = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))
    if quantization == "none":
        return base
    return quantization if base == "fp32" else f"{base}+{quantization}"


def check_precision(dtype: torch.dtype, quantization: str, device: torch.device) -> None:
    """Raise ValueError naming the setting and the fix unless (`target.dtype`, `target.quantization`)
    can run on `device`: int8/int4 are CPU kernels (torch ships no such CUDA kernel for this layout)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"target.quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if quantization != "none" and device.type != "cpu":
        raise ValueError(f"target.quantization {quantization} is a CPU kernel (torch `_weight_{quantization}pack_mm`) "
                         f"but target.device is {device}: set target.quantization: none, or target.device: cpu")
