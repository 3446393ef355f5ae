"""The building blocks of the lean Llama forwards (target and EAGLE3 draft, gpt-fast style): linears
(prepacked fp32, bf16, int8 and int4 weight-only), RMSNorm, additive attention masks, grouped-query
attention, RoPE, and growing KV tensors. Shapes are in each docstring; no module state.

Every linear here is *row-consistent*: a row's result is bitwise the same whether it is computed
alone (a one-token decode step) or among others (a k-token verify step), which is what makes
speculative decoding reproduce target-only decoding exactly at each precision (tests/test_precision.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

PREFILL_CHUNK = 1024  # rows of one segment per forward (`Target.forward_batch`); trees are ≤ 64


class PackedLinear:
    """`y = x @ W.T` with W prepacked for oneDNN (fp32), falling back to `F.linear`.

    Why: on CPUs where MKL's small-M GEMM re-packs the weight every call, a k-token verify costs
    ~2x a 1-token step; a prepacked oneDNN weight makes it ~1.25x and is bitwise identical across
    M ≥ 2 (rows do not depend on how many are batched; one row is run as two), so verification
    reproduces one-token greedy.
    Same mechanism as torch inductor's CPU weight prepacking (`mkldnn._linear_pointwise`).
    """

    def __init__(self, w: torch.Tensor, batch_hint: int = 8):
        self.weight = w.contiguous()
        self.packed = None
        if w.dtype == torch.float32 and w.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
            except (RuntimeError, AttributeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and x.device.type == "cpu":
            # oneDNN's one-row kernel sums long rows (K ≥ 1152: the MLP's down projection) in another
            # order than its many-row one, on fp32 and bf16 alike: a single row is computed as two,
            # so a decode step and a verify step give the same bits (tests/test_precision.py)
            return self._mm(x.expand(2, -1))[:1]
        return self._mm(x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)

    @property
    def nbytes(self) -> int:
        """Bytes this linear keeps: the weight, and oneDNN's prepacked copy (at the weight's size)."""
        n = self.weight.numel() * self.weight.element_size()
        return 2 * n if self.packed is not None else n


class Int8Linear:
    """Weight-only int8 `y = x @ (q * s).T`: q `[N, K]` int8, one fp scale per output row s = max|w|/127
    (symmetric, per channel), activations bf16. A quarter of fp32's bytes read per step, which is what
    bounds a small model's decode step on a CPU. gpt-fast `quantize.py` (WeightOnlyInt8Linear) on
    torch's `_weight_int8pack_mm` (its CPU kernel is row-consistent; fast only on bf16 input).
    Input `[M, K]` any float dtype (rounded to bf16 for the kernel) → `[M, N]` in the input's dtype."""

    def __init__(self, w: torch.Tensor):
        w = w.detach().float()
        # the kernel's bf16 scale, rounded up (bf16 rounds to within 2⁻⁹): no weight clips, |error| ≤ scale/2
        self.scales = (w.abs().amax(dim=1).clamp(min=1e-30) / 127 * (1 + 2 ** -8)).to(torch.bfloat16)
        self.q = torch.round(w / self.scales.float()[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.shape = tuple(w.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.q, self.scales).to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight as the kernel sees it, `[N, K]` fp32 (tests)."""
        return self.q.float() * self.scales.float()[:, None]

    @property
    def nbytes(self) -> int:
        """Bytes kept: the int8 weight (1 per weight) and the bf16 scales (2 per output row)."""
        return self.q.numel() + self.scales.numel() * 2


INT4_GROUP = 32  # weights per (scale, zero) pair along K: GGUF Q4_1's block


class Int4Linear:
    """Weight-only int4 `y = x @ w.T`, w = (q − 8)·scale + zero per group of `INT4_GROUP` (32) weights
    along K, q in 0..15, scale = (max − min)/15 and zero = min + 8·scale per group (asymmetric).
    This is GGUF Q4_1's layout (llama.cpp `ggml-quants.c`, `quantize_row_q4_1`: blocks of 32, w = d·q + m),
    so the weights of a Q4_1 GGUF come back on their own grid (d, m rounded to bf16). An eighth of
    fp32's bytes. gpt-fast `quantize.py` (WeightOnlyInt4Linear) on torch's `_weight_int4pack_mm_for_cpu`.
    Input `[M, K]` any float dtype (rounded to bf16 for the kernel: its fp32 path is ~20× slower) →
    `[M, N]` in the input's dtype. Raises ValueError when K is not a multiple of 32 or N of 16."""

    def __init__(self, w: torch.Tensor):
        w = w.detach().float()
        n, k = w.shape
        if k % INT4_GROUP or n % 16:
            raise ValueError(f"int4 needs in-features divisible by {INT4_GROUP} and out-features by 16 (torch's int4 "
                             f"packing), got a [{n}, {k}] weight")
        g = w.view(n, k // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        zero = lo + 8 * scale
        self.scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.shape = (n, k)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), self.packed, INT4_GROUP,
                                                 self.scales_zeros).to(x.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes kept: the packed int4 weight (½ per weight) and the bf16 scale/zero pairs (4 per group)."""
        return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2


QUANTIZATIONS = ("none", "int8", "int4")


def make_linear(w: torch.Tensor, quantization: str = "none"):
    """The linear for weight `w` `[N, K]` (already in the model dtype and on its device) at
    `quantization`: "none" → `PackedLinear`, "int8" → `Int8Linear`, "int4" → `Int4Linear` (weight-only;
    CPU). Raises ValueError for another name."""
    if quantization == "none":
        return PackedLinear(w)
    if quantization == "int8":
        return Int8Linear(w)
    if quantization == "int4":
        return Int4Linear(w)
    raise ValueError(f"quantization {quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in fp32 (HF `LlamaRMSNorm`); fp32 input takes the fused
    `F.rms_norm` (bitwise the same here, fewer kernel launches)."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def causal_bias(n: int, p: int, rep: int, dtype=torch.float32, device=None) -> torch.Tensor | None:
    """Additive mask `[rep*n, p+n]` (0 / -inf) for n new queries after p cached keys, rows
    repeated for the rep query heads folded per KV head; None for n == 1 (nothing to mask).
    Built once per forward and shared by all layers."""
    if n == 1:
        return None
    keep = torch.ones(n, p + n, dtype=torch.bool, device=device).tril(diagonal=p)
    return torch.zeros(n, p + n, dtype=dtype, device=device).masked_fill(~keep, float("-inf")).repeat(rep, 1)


def visible_bias(visible: torch.Tensor, p: int, rep: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """Additive mask `[rep*n, p+n]` (0 / -inf) for n new queries: `visible` `[n, n]` bool marks the
    new keys each sees (a tree: its ancestors and itself) on top of all p cached keys, or
    `[n, p+n]` marks every key (a draft tree whose earlier nodes are cached)."""
    n = visible.shape[0]
    visible = visible.to(device)
    keep = visible if visible.shape[1] == p + n else torch.cat(
        [torch.ones(n, p, dtype=torch.bool, device=device), visible], dim=1)
    return torch.zeros(n, p + n, dtype=dtype, device=device).masked_fill(~keep, float("-inf")).repeat(rep, 1)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention: q `[nh, n, hd]`, k/v `[nkv, L, hd]`, bias `[rep*n, L]` additive
    (`causal_bias`) or None → `[nh, n, hd]`.

    The rep = nh/nkv query heads sharing a KV head are folded into the query rows
    (`[nkv, rep*n, hd]`, head h uses KV head h // rep as in HF `repeat_kv`): two bmm and a
    softmax, no K/V repeat, no per-layer mask conversion. Measured here for L=300: 5-token verify
    block 127 µs vs 299 µs for SDPA with a bool mask (which takes its math path), 2 tokens 92 vs 235.
    """
    nh, n, hd = q.shape
    nkv = k.shape[0]
    qg = q.reshape(nkv, (nh // nkv) * n, hd)
    kt = k.transpose(1, 2)
    if bias is None:
        s = torch.bmm(qg, kt).mul_(hd ** -0.5)
    else:
        s = torch.baddbmm(bias.expand(nkv, -1, -1), qg, kt, alpha=hd ** -0.5)
    p = torch.softmax(s if s.dtype == torch.float64 else s.float(), dim=-1).to(v.dtype)
    return torch.bmm(p, v).reshape(nh, n, hd)


def rope_tables(head_dim: int, theta: float, max_pos: int, dtype: torch.dtype):
    """cos/sin tables `[max_pos, head_dim]` for the default (non-scaled) RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    f = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[..., n, head_dim]` with `cos/sin` `[n, head_dim]` (HF rotate_half layout)."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


def chunk_rounds(lengths: list[int], chunk: int):
    """The chunked-prefill schedule for sequences of `lengths` rows: per round, (start row, indices of
    the sequences that still have rows from there); each round takes rows [start, start + chunk)."""
    for a in range(0, max(lengths), chunk):
        yield a, [i for i, n in enumerate(lengths) if n > a]


def grow_kv(k: torch.Tensor, v: torch.Tensor, n: int, length: int, max_len: int, dim: int):
    """`(k, v)` with room for `n` positions along `dim`: unchanged when they have it, else new
    tensors of max(n, 2 × capacity, 64) positions (at most `max_len`) holding the first `length`.
    Doubling keeps the copies amortised O(1) per token. Raises ValueError for n > max_len."""
    cap = k.shape[dim]
    if n <= cap:
        return k, v
    if n > max_len:
        raise ValueError(f"sequence of {n} tokens exceeds the cache ({max_len}); raise engine.max_seq_len "
                         "or shorten the prompt")
    shape = list(k.shape)
    shape[dim] = min(max_len, max(n, 2 * cap, 64))
    out = []
    with torch.inference_mode(False):  # a normal tensor: callers update caches outside inference mode too
        for t in (k, v):
            g = torch.empty(shape, dtype=t.dtype, device=t.device)
            g.narrow(dim, 0, length).copy_(t.narrow(dim, 0, length))
            out.append(g)
    return out[0], out[1]
