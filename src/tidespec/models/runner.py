"""The EAGLE3 draft at inference (`DraftRunner`): batched catch-up over verified rows, chain and tree steps,
per-request draft KV caches (`DraftCache`), and the draft-to-target vocabulary maps. EAGLE-3 (arXiv 2503.01840 §3);
the module it runs is `models.eagle3.Eagle3Draft`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .eagle3 import Eagle3Config, Eagle3Draft
from .layers import (
    PREFILL_CHUNK,
    PackedLinear,
    apply_rope,
    causal_bias,
    chunk_rounds,
    gqa_attention,
    grow_kv,
    visible_bias,
)


class DraftCache:
    """Draft KV cache for one sequence: k/v `[nkv, capacity, hd]`, `length` valid positions; the
    capacity grows on demand up to `max_len` (`reserve`, as `KVCache`)."""

    def __init__(self, c: Eagle3Config, max_len: int, dtype=torch.float32, device: torch.device | str = "cpu"):
        self.k = torch.empty(c.num_key_value_heads, 0, c.head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.length = 0
        self.max_len = max_len

    def reserve(self, n: int) -> None:
        """Make room for `n` positions (ValueError beyond max_len: a draft cache overflow)."""
        self.k, self.v = grow_kv(self.k, self.v, n, self.length, self.max_len, dim=1)


class DraftRunner:
    """Inference view of a trained `Eagle3Draft`: packed fp32 weights, incremental KV cache.

    `extend` feeds rows with known target features (after a verify step); `step` feeds the draft's
    own hidden for chain drafting. Positions and masks match `ttt_forward`, so the draft serves
    what it was trained as (tested in tests/test_eagle3.py).
    """

    def __init__(self, draft: Eagle3Draft):
        self.draft = draft.eval()
        self.config = c = draft.config
        L = draft.midlayer
        self.fc = PackedLinear(draft.fc.weight.detach())
        self.qkv_w = PackedLinear(torch.cat([L.self_attn.q_proj.weight, L.self_attn.k_proj.weight,
                                             L.self_attn.v_proj.weight]).detach())
        self.o = PackedLinear(L.self_attn.o_proj.weight.detach())
        self.gate_up = PackedLinear(torch.cat([L.mlp.gate_proj.weight, L.mlp.up_proj.weight]).detach())
        self.down = PackedLinear(L.mlp.down_proj.weight.detach())
        self.lm_head = PackedLinear(draft.lm_head.weight.detach())
        self.device = draft.fc.weight.device  # the draft's weights, caches and hidden states; logits go to CPU
        self.d2t = draft.d2t.clone().cpu()
        self.used = torch.arange(self.d2t.shape[0]) + self.d2t  # target ids of the draft vocab
        self.nq = c.num_attention_heads * c.head_dim
        self.nk = c.num_key_value_heads * c.head_dim

    @property
    def weight_bytes(self) -> int:
        """Bytes this draft keeps resident beyond the target: its weights (each storage once; the
        target's embedding is shared, not counted) and oneDNN's prepacked copies of them (counted at
        the weight's size). What `engine.draft_memory_mb` budgets."""
        packs = (self.fc, self.qkv_w, self.o, self.gate_up, self.down, self.lm_head)
        tensors = list(self.draft.state_dict().values()) + [p.weight for p in packs]
        seen, total = set(), 0
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total + sum(p.weight.numel() * p.weight.element_size() for p in packs if p.packed is not None)

    def new_cache(self, max_len: int) -> DraftCache:
        return DraftCache(self.config, max_len, device=self.device)

    @torch.inference_mode()
    def _layer(self, toks: list[torch.Tensor], g: torch.Tensor, caches: list[DraftCache], last_only: bool,
               trees: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """The draft layer over a ragged batch (flattened rows, per-sequence attention; see
        `Target.forward_batch`). toks: `[n_i]` each; g: `[Σn_i, H]`; trees: per sequence
        (visible `[n_i, length_i + n_i]` bool over its cache and new rows, positions `[n_i]`), None:
        causal at consecutive positions. Returns per sequence (pre-norm hidden `[n_i, H]`, logits
        `[n_i or 1, Vd]` fp32)."""
        c, d, L = self.config, self.draft, self.draft.midlayer
        ns, ps = [t.shape[0] for t in toks], [cc.length for cc in caches]
        for cc, p, n in zip(caches, ps, ns):
            cc.reserve(p + n)
        N, hd, dev = sum(ns), c.head_dim, self.device
        emb = F.embedding(torch.cat(toks).to(dev), d.embed)
        x = torch.cat([L.input_layernorm(emb), L.hidden_norm(g)], dim=-1)
        qkv = self.qkv_w(x)
        pos = torch.cat([torch.arange(p, p + n, device=dev) for p, n in zip(ps, ns)]) if trees is None \
            else torch.cat([t[1] for t in trees]).to(dev)
        cos, sin = d.rope_cos[pos][:, None], d.rope_sin[pos][:, None]
        q = apply_rope(qkv[:, :self.nq].view(N, -1, hd), cos, sin)
        k = apply_rope(qkv[:, self.nq:self.nq + self.nk].view(N, -1, hd), cos, sin)
        v = qkv[:, self.nq + self.nk:].view(N, -1, hd)
        outs, o = [], 0
        rep = c.num_attention_heads // c.num_key_value_heads
        for i, (cc, p, n) in enumerate(zip(caches, ps, ns)):
            cc.k[:, p:p + n], cc.v[:, p:p + n] = k[o:o + n].transpose(0, 1), v[o:o + n].transpose(0, 1)
            mask = (causal_bias(n, p, rep, device=dev) if trees is None
                    else visible_bias(trees[i][0], p, rep, device=dev))
            a = gqa_attention(q[o:o + n].transpose(0, 1), cc.k[:, :p + n], cc.v[:, :p + n], mask)
            outs.append(a.transpose(0, 1).reshape(n, self.nq))
            cc.length = p + n
            o += n
        h = g + self.o(torch.cat(outs) if len(outs) > 1 else outs[0])
        gu = self.gate_up(L.post_attention_layernorm(h))
        gg, uu = gu.split(c.intermediate_size, dim=-1)
        h = h + self.down(F.silu(gg) * uu)
        ends = torch.tensor(ns).cumsum(0)
        rows = (ends - 1) if last_only else torch.arange(N)
        logits = self.lm_head(d.norm(h[rows.to(dev)])).float().cpu()
        hs = h.split(ns)
        ls = logits.split([1] * len(ns) if last_only else ns)
        return list(zip(hs, ls))

    def extend(self, aux: torch.Tensor, next_tokens: torch.Tensor, cache: DraftCache):
        """Rows with target features: aux `[n, 3Ht]`, next_tokens `[n]` (token after each row).

        Returns (pre-norm hidden `[n, H]`, draft logits `[n, Vd]` fp32).
        """
        return self._layer([next_tokens], self.fc(aux.to(self.device, torch.float32)), [cache], last_only=False)[0]

    def step(self, hidden: torch.Tensor, token: torch.Tensor, cache: DraftCache):
        """One chain step: hidden `[1, H]` (previous draft output), token `[1]` → (hidden, logits)."""
        return self._layer([token], hidden, [cache], last_only=False)[0]

    def extend_batch(self, items: list[tuple[torch.Tensor, torch.Tensor, DraftCache]]):
        """Batched `extend` over sequences `(aux [n_i, 3Ht], next_tokens [n_i], cache)`.

        Returns per sequence (last pre-norm hidden `[1, H]`, last-row logits `[Vd]` fp32): the
        chain's starting point (only the last row's prediction is drafted from). Rows beyond
        `PREFILL_CHUNK` per sequence run in chunks (as `Target.forward_batch`).
        """
        if any(t.shape[0] > PREFILL_CHUNK for _, t, _ in items):
            last: list = [None] * len(items)
            for a, idx in chunk_rounds([t.shape[0] for _, t, _ in items], PREFILL_CHUNK):
                sub = [(items[i][0][a:a + PREFILL_CHUNK], items[i][1][a:a + PREFILL_CHUNK], items[i][2]) for i in idx]
                for i, out in zip(idx, self.extend_batch(sub)):
                    last[i] = out
            return last
        g = self.fc(torch.cat([a for a, _, _ in items]).to(self.device, torch.float32))
        out = self._layer([t for _, t, _ in items], g, [c for _, _, c in items], last_only=True)
        return [(h[-1:], lg[0]) for h, lg in out]

    def step_batch(self, items: list[tuple[torch.Tensor, torch.Tensor, DraftCache]]):
        """Batched `step` over sequences `(hidden [1, H], token [1], cache)` → [(hidden [1, H], logits [Vd])]."""
        g = torch.cat([h for h, _, _ in items])
        out = self._layer([t for _, t, _ in items], g, [c for _, _, c in items], last_only=True)
        return [(h, lg[0]) for h, lg in out]

    def tree_step_batch(self, items: list[tuple[torch.Tensor, torch.Tensor, DraftCache, torch.Tensor, torch.Tensor]]):
        """One EAGLE-2 tree expansion step (arXiv 2406.16858 §3), batched over sequences. Each item:
        (parent hidden `[m, H]`, node tokens `[m]`, cache, visible `[m, length + m]` bool: the cached
        positions each node sees — the prefix and its tree ancestors — plus the new rows, positions
        `[m]` int64). The m rows are appended to the cache. Returns per sequence (hidden `[m, H]`,
        logits `[m, Vd]` fp32): each node's children are drafted from its row."""
        g = torch.cat([h for h, _, _, _, _ in items])
        return self._layer([t for _, t, _, _, _ in items], g, [c for _, _, c, _, _ in items], last_only=False,
                           trees=[(vis, pos) for _, _, _, vis, pos in items])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab ids to target ids: `draft + d2t[draft]`."""
        return draft_ids + self.d2t[draft_ids]

    def to_target_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits `[Vd]` as target-vocab logits `[V]` fp32 (-inf outside the draft vocab)."""
        out = torch.full((self.config.vocab_size,), float("-inf"))
        out[self.used] = logits.float()
        return out

    def to_target_probs(self, probs: torch.Tensor) -> torch.Tensor:
        """Scatter draft-vocab probabilities `[Vd]` into the target vocab `[V]` (zeros elsewhere)."""
        out = torch.zeros(self.config.vocab_size, dtype=probs.dtype)
        out[self.used] = probs
        return out
