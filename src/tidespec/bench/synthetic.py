"""A wide synthetic target for scale figures: a random-init Llama at a real model's widths (hidden
2048-4096, vocab 32k) with few layers, built in memory (no weights to download). It exercises
memory, bytes at rest and throughput at real widths; its outputs mean nothing, so it is never
used for quality (τ, acceptance)."""
from __future__ import annotations

import torch

from ..models.target import Target, TargetConfig

WIDTHS = {  # name → (hidden, layers, heads, kv heads, intermediate, vocab); hidden as the named model
    "smollm2": (576, 30, 9, 3, 1536, 49152),
    "h2048": (2048, 4, 16, 4, 5632, 32000),
    "llama8b-width": (4096, 4, 32, 8, 14336, 32000),
}


def synthetic_target(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                     seed: int = 0, device: torch.device | str = "cpu", max_position: int = 8192) -> Target:
    """A `Target` with random weights (normal, std 0.02; norms 1) of the given widths, fp32 on
    `device`. Memory: (vocab · hidden + layers · (hidden · (2 · hidden + 2 · hidden · kv_heads /
    heads) + 3 · hidden · intermediate)) · 4 bytes: 3.7 GiB at "llama8b-width" (4 layers). Aux
    layers: the default `[1, L//2-1, L-4]`, or `[0, L//2, L-1]` under 8 layers (4 layers: [0, 2, 3]).
    Raises ValueError when heads does not divide hidden or kv_heads does not divide heads."""
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must divide hidden ({hidden}) and kv_heads ({kv_heads}) heads")
    hd = hidden // heads
    cfg = TargetConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, head_dim=hd, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position=max_position, bos_token_id=1, eos_token_ids=(2,))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.02

    w = {"model.embed_tokens.weight": rnd(vocab, hidden), "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
              p + "self_attn.k_proj.weight": rnd(kv_heads * hd, hidden),
              p + "self_attn.v_proj.weight": rnd(kv_heads * hd, hidden),
              p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
              p + "mlp.gate_proj.weight": rnd(intermediate, hidden),
              p + "mlp.up_proj.weight": rnd(intermediate, hidden),
              p + "mlp.down_proj.weight": rnd(hidden, intermediate),
              p + "input_layernorm.weight": torch.ones(hidden),
              p + "post_attention_layernorm.weight": torch.ones(hidden)}
    aux = (0, layers // 2, layers - 1) if layers < 8 else None
    return Target(cfg, w, aux_layers=aux, target_id=f"synthetic-h{hidden}-l{layers}-v{vocab}-s{seed}", device=device)


def named(name: str, **kw) -> Target:
    """`synthetic_target` at one of `WIDTHS` (KeyError names the choices)."""
    if name not in WIDTHS:
        raise KeyError(f"synthetic target {name!r}: one of {', '.join(WIDTHS)}")
    return synthetic_target(*WIDTHS[name], **kw)
