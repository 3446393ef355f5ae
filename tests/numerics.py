"""Numeric tolerances derived from fp32 arithmetic (not guessed), for tests that compare two
evaluations of the same function that differ only in summation order.

Speculative verification runs the target on `k+1` rows per forward; decoding without it runs one
row. oneDNN/MKL pick other GEMM blockings (and AVX-512/AMX vs AVX2 kernels) for other row counts, so
each inner product of length `n` is accumulated in another order. With unit roundoff u = 2^-24,
the probabilistic rounding-error model (Higham & Mary, "A new approach to probabilistic rounding
error analysis", SISC 2019, Thm 3.1: error ≲ λ·sqrt(n)·u relative, λ ≈ 1 for high confidence at
these sizes) gives a relative error of about sqrt(n)·u per GEMM. Errors of the successive GEMM
stages of a forward (per layer: qkv, attention output, gate/up, down; then the lm_head) are
independent, so they add as a random walk: relative logit error δ ≈ u·sqrt(n·stages) with n the
widest inner dimension. A log-softmax moves by at most 2·max|Δz| (z_i minus a 1-Lipschitz
logsumexp), so

    |logprob_multi_row − logprob_one_row| ≤ 2 · u · sqrt(n · stages) · max|z|.

SmolLM2-135M (n = 1536, 121 stages, max|z| ≈ 29 on "The capital of France is"): 1.5e-3; measured 1.4e-5 on an Intel Xeon
(AVX-512/AMX) and < 1e-5 on AMD EPYC. The tiny 8-layer target (n = 128, 33 stages): ≈ 1e-5 · max|z|.
A wrong row, position or missing logits transform moves logprobs by 1e-2 … 1 and still fails.
"""
from __future__ import annotations

import math

import torch

U_FP32 = 2.0 ** -24


def logit_scale(target, ids: list[int]) -> float:
    """max |logit| of `target` over every position of `ids` (one prefill forward, fp32)."""
    cache = target.new_cache(len(ids) + 1)
    with torch.inference_mode():
        z = target.forward(torch.tensor(ids), cache, need_hidden=False).logits
    return float(z.abs().max())


def fp32_logprob_tol(cfg, scale: float) -> float:
    """Bound on the fp32 difference of one log-probability computed from a multi-row and from a
    one-row forward of a Llama target with config `cfg` (TargetConfig) whose logits reach
    `scale` in magnitude (see the module docstring for the derivation)."""
    n = max(cfg.hidden_size, cfg.intermediate_size)
    stages = 4 * cfg.num_layers + 1
    return 2 * U_FP32 * math.sqrt(n * stages) * max(scale, 1.0)
