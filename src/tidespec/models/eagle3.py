"""EAGLE3 draft model: fc over 3 aux hidden states, one decoder layer over [embedding; hidden], draft vocab.

Sources: EAGLE-3 (Li et al., arXiv 2503.01840, §3); module layout, names and the training-time-test
(TTT) attention pattern follow SpecForge `specforge/modeling/draft/llama3_eagle.py` and
`specforge/algorithms/eagle3/model.py`; the checkpoint follows what SGLang
`python/sglang/srt/models/llama_eagle3.py` and vLLM `vllm/model_executor/models/llama_eagle3.py`
load (both loaders' name mapping is replayed in tests/test_export_compat.py).

Shapes: H = draft hidden, Ht = target hidden (== H here, so the target embedding is shared),
V = target vocab, Vd = draft vocab. The embedding is the target's, frozen, never saved.

One file (~450 lines) because model, TTT forward, serving runner and checkpoint format must change
together: the test that the runner computes what the TTT unroll trains reads them side by side.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from ..workspace import engine_dir
from .layers import apply_rope, rope_tables

ARCH = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    """Draft hyper-parameters; serialised to config.json in the SGLang/vLLM layout."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # target vocab V
    draft_vocab_size: int  # Vd
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int]  # output-of-layer (SpecForge HF convention)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    target_id: str = ""

    @classmethod
    def for_target(cls, tcfg, aux_layers, draft_vocab_size: int, intermediate_size: int | None = None,
                   target_id: str = "") -> Eagle3Config:
        """Draft sized like one layer of the target (`TargetConfig`)."""
        return cls(hidden_size=tcfg.hidden_size, intermediate_size=intermediate_size or tcfg.intermediate_size,
                   num_attention_heads=tcfg.num_heads, num_key_value_heads=tcfg.num_kv_heads,
                   head_dim=tcfg.head_dim, vocab_size=tcfg.vocab_size,
                   draft_vocab_size=min(draft_vocab_size, tcfg.vocab_size),
                   target_hidden_size=tcfg.hidden_size, aux_layer_ids=tuple(aux_layers),
                   rms_norm_eps=tcfg.rms_norm_eps, rope_theta=tcfg.rope_theta,
                   max_position_embeddings=tcfg.max_position, bos_token_id=tcfg.bos_token_id,
                   eos_token_id=list(tcfg.eos_token_ids), target_id=target_id)

    def to_hf(self) -> dict:
        """config.json dict. Aux ids: nested (SGLang, output-of-layer) and top-level +1 (vLLM, input-of-layer)."""
        d = dict(architectures=[ARCH], model_type="llama", hidden_act="silu", num_hidden_layers=1,
                 hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                 num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                 head_dim=self.head_dim, vocab_size=self.vocab_size, draft_vocab_size=self.draft_vocab_size,
                 target_hidden_size=self.target_hidden_size, rms_norm_eps=self.rms_norm_eps,
                 rope_theta=self.rope_theta, rope_scaling=None,
                 max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=False,
                 torch_dtype="float32", bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
                 eagle_config={"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                               "use_aux_hidden_state": True},
                 eagle_aux_hidden_state_layer_ids=[i + 1 for i in self.aux_layer_ids],
                 tidespec={"target_id": self.target_id, "aux_layer_convention": "output-of-layer"})
        return d

    @classmethod
    def from_hf(cls, d: dict) -> Eagle3Config:
        if ARCH not in d.get("architectures", []):
            raise ValueError(f"not an EAGLE3 draft config: architectures={d.get('architectures')}")
        if d.get("num_hidden_layers", 1) != 1:
            raise ValueError("only single-layer EAGLE3 drafts are supported (num_hidden_layers=1)")
        aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if aux is None and "eagle_aux_hidden_state_layer_ids" in d:
            aux = [i - 1 for i in d["eagle_aux_hidden_state_layer_ids"]]
        return cls(hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
                   head_dim=d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"],
                   vocab_size=d["vocab_size"], draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
                   target_hidden_size=d.get("target_hidden_size") or d["hidden_size"],
                   aux_layer_ids=tuple(aux), rms_norm_eps=d.get("rms_norm_eps", 1e-5),
                   rope_theta=d.get("rope_theta", 10000.0),
                   max_position_embeddings=d.get("max_position_embeddings", 8192),
                   bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                   target_id=(d.get("tidespec") or {}).get("target_id", ""))


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        if x.dtype == torch.float32:  # fused kernel, same values
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        h2 = 2 * c.hidden_size
        self.q_proj = nn.Linear(h2, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)


class MLP(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # normalises the embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # normalises the feature input
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Eagle3Draft(nn.Module):
    """The EAGLE3 draft. State-dict keys are exactly the checkpoint keys SGLang/vLLM load.

    Buffers: `d2t` int64 `[Vd]` offsets (target_id = draft_id + d2t[draft_id]); `t2d` bool `[V]`.
    The target embedding `[V, H]` is attached with `set_embed` and is not part of the state dict.
    """

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = MidLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
        self.embed: torch.Tensor | None = None
        cos, sin = rope_tables(c.head_dim, c.rope_theta, c.max_position_embeddings, torch.float32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_embed(self, embed: torch.Tensor) -> None:
        """Attach the target's (frozen) embedding `[V, H]`."""
        c = self.config
        if tuple(embed.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embedding {tuple(embed.shape)} does not fit draft (V={c.vocab_size}, H={c.hidden_size})")
        self.embed = embed.detach()

    def to_device(self, device: torch.device) -> Eagle3Draft:
        """Move the draft to `device`, its attached target embedding too (`nn.Module.to` does not:
        the embedding is not a parameter). Returns self."""
        self.to(device)
        if self.embed is not None:
            self.embed = self.embed.to(device)
        return self

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    # -- pieces shared by training and inference --------------------------------------------
    def qkv(self, emb: torch.Tensor, g: torch.Tensor, pos: torch.Tensor):
        """emb, g: `[..., n, H]`; pos: `[n]` positions. Returns q `[..., nh, n, hd]`, k/v `[..., nkv, n, hd]`."""
        c, L = self.config, self.midlayer
        x = torch.cat([L.input_layernorm(emb), L.hidden_norm(g)], dim=-1)  # [.., n, 2H], embedding first
        lead, n = x.shape[:-2], x.shape[-2]

        def heads(t, nh):
            return t.view(*lead, n, nh, c.head_dim).transpose(-3, -2)

        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        q = apply_rope(heads(L.self_attn.q_proj(x), c.num_attention_heads), cos, sin)
        k = apply_rope(heads(L.self_attn.k_proj(x), c.num_key_value_heads), cos, sin)
        v = heads(L.self_attn.v_proj(x), c.num_key_value_heads)
        return q, k, v

    def finish(self, g: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual + MLP. g `[..., n, H]`, attn `[..., nh, n, hd]` → pre-norm hidden `[..., n, H]`."""
        L = self.midlayer
        a = attn.transpose(-3, -2).flatten(-2)
        h = g + L.self_attn.o_proj(a)
        return h + L.mlp(L.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits `[..., Vd]` fp32 from pre-norm hidden `[..., H]`."""
        return self.lm_head(self.norm(h)).float()

    # -- training-time test -----------------------------------------------------------------
    def ttt_forward(self, aux: torch.Tensor, input_ids: torch.Tensor, steps: int,
                    key_valid: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Unrolled training-time test (SpecForge `algorithms/eagle3/model.py`, EAGLE-3 §3.2).

        aux: `[B, T, 3*Ht]` target aux hidden states; input_ids: `[B, T]` int64 (row t of step j
        reads token t+1+j, zero-padded past the end); key_valid: `[B, T]` bool padding mask.
        Returns one pre-norm hidden `[B, T, H]` per step (logits: `self.logits(h)`): step j row t
        predicts the token at t+2+j. Attention: step-0 keys causally + each later step's diagonal key.
        """
        if self.embed is None:
            raise RuntimeError("call set_embed(target_embedding) before using the draft")
        B, T, _ = aux.shape
        c = self.config
        rep = c.num_attention_heads // c.num_key_value_heads
        g = self.fc(aux)
        causal = torch.ones(T, T, dtype=torch.bool, device=aux.device).tril()
        mask0 = causal if key_valid is None else causal & key_valid[:, None, None, :]
        scale = c.head_dim ** -0.5
        pos = torch.arange(T, device=aux.device)
        ks, vs, outs = [], [], []
        for j in range(steps):
            tok = F.pad(input_ids[:, 1 + j:], (0, 1 + j))[:, :T]
            emb = F.embedding(tok, self.embed)
            q, k, v = self.qkv(emb, g, torch.clamp(pos + j, max=c.max_position_embeddings - 1))
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [B, nh, T, hd]
            ks.append(k)
            vs.append(v)
            s0 = (q @ ks[0].transpose(-1, -2)) * scale  # [B, nh, T, T]
            s0 = s0.masked_fill(~mask0, float("-inf"))
            sd = [(q * kk).sum(-1, keepdim=True) * scale for kk in ks[1:]]  # each [B, nh, T, 1]
            p = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)
            attn = p[..., :T] @ vs[0]
            for i, vv in enumerate(vs[1:]):
                attn = attn + p[..., T + i:T + i + 1] * vv
            h = self.finish(g, attn)
            outs.append(h)
            g = h  # EAGLE-3: the pre-norm hidden is fed to the next step
        return outs


# -- draft vocabulary (SpecForge `data/preprocessing.py::generate_vocab_mapping_file`) --------
def build_vocab(counts: Counter, draft_vocab_size: int, vocab_size: int):
    """d2t `[Vd]` int64 offsets and t2d `[V]` bool from token counts over loss-masked tokens.

    The Vd most frequent ids (padded with ids 0.. when fewer distinct ids were seen), sorted
    ascending by target id, so `target_logits[..., t2d]` is in draft-id order. Raises ValueError
    when Vd > V.
    """
    if draft_vocab_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} > target vocab {vocab_size}")
    top = [t for t, _ in counts.most_common(draft_vocab_size)]
    seen, fill = set(top), 0
    while len(top) < draft_vocab_size:
        if fill not in seen:
            top.append(fill)
            seen.add(fill)
        fill += 1
    used = torch.tensor(sorted(top), dtype=torch.int64)
    d2t = used - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


def used_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocab, `[Vd]` ascending."""
    return torch.arange(d2t.shape[0]) + d2t


def remap_lm_head(draft: Eagle3Draft, d2t_new: torch.Tensor, t2d_new: torch.Tensor,
                  fallback_rows: torch.Tensor) -> None:
    """Switch the draft to a new vocab: rows of ids kept are copied, new ids take `fallback_rows[id]`.

    fallback_rows: `[V, H]` (the target's lm_head, a good init when draft H == target H).
    """
    old_ids, new_ids = used_ids(draft.d2t), used_ids(d2t_new)
    old_row = {int(t): i for i, t in enumerate(old_ids)}
    w_old = draft.lm_head.weight.data
    w = fallback_rows[new_ids].to(w_old.dtype).clone()
    for i, t in enumerate(new_ids.tolist()):
        j = old_row.get(t)
        if j is not None:
            w[i] = w_old[j]
    draft.lm_head.weight.data = w
    draft.set_vocab(d2t_new, t2d_new)


# -- checkpoint ------------------------------------------------------------------------------
def save_checkpoint(draft: Eagle3Draft, out: Path, extra: dict | None = None) -> Path:
    """Write `config.json` + `model.safetensors` (unprefixed keys, no embedding) atomically-ish."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().contiguous() for k, v in draft.state_dict().items()}
    save_file(sd, str(out / "model.safetensors.tmp"), metadata={"format": "pt"})
    (out / "model.safetensors.tmp").replace(out / "model.safetensors")
    cfg = draft.config.to_hf()
    if extra:
        cfg["tidespec"].update(extra)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def load_checkpoint(path: Path, embed: torch.Tensor | None = None, target_id: str | None = None) -> Eagle3Draft:
    """Load a draft directory (a flat checkpoint, or a bundle: its `draft/` engine dir,
    `workspace.engine_dir`). Raises FileNotFoundError / ValueError naming what is wrong
    (missing files, another target's draft, shape mismatch with the target embedding)."""
    path = engine_dir(Path(path))
    if not (path / "config.json").exists() or not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path} is not a draft checkpoint (needs config.json + model.safetensors)")
    cfg = Eagle3Config.from_hf(json.loads((path / "config.json").read_text()))
    if target_id and cfg.target_id and cfg.target_id != target_id:
        raise ValueError(f"draft {path} was trained for target {cfg.target_id[:12]}, not {target_id[:12]}")
    draft = Eagle3Draft(cfg)
    sd = load_file(str(path / "model.safetensors"))
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint keys do not match EAGLE3 layout; missing={missing} unexpected={unexpected}"
        )
    if embed is not None:
        draft.set_embed(embed)
    return draft


def count_tokens(seqs, masks) -> Counter:
    """Counter over `ids[mask == 1]` for paired 1-D tensors."""
    c: Counter = Counter()
    for ids, m in zip(seqs, masks):
        c.update(ids[m.bool()].tolist())
    return c


__all__ = ["Eagle3Config", "Eagle3Draft", "build_vocab", "remap_lm_head", "save_checkpoint", "load_checkpoint",
           "count_tokens", "used_ids", "ARCH"]
