"""Acceptance: what one request keeps of its verified rows (the engine step's accept / emit part).

Leviathan et al. 2023 (arXiv 2211.17192) §2 / Chen et al. 2023 (arXiv 2302.01318): greedy accepts
the longest prefix of drafts equal to the target's argmax plus the target's own token at the first
mismatch (the bonus), so the output is the target's greedy output token for token (fp32: see
models/target.py); sampled requests use lossless rejection sampling (`sampling.rejection_verify`);
trees accept the longest path of argmax tokens (`tree.accept_greedy`, EAGLE-2 §3).
"""
from __future__ import annotations

import torch

from .draft_tree import accept_greedy
from .health import DraftHealth
from .proposers.base import Slot
from .request import Seq
from .sampling import rejection_verify, warp
from .stats import SpecDecodingStats
from .suffix_tree import SuffixCache


def after_prefill(s: Seq, out, ttft_s: float, suffix: SuffixCache | None) -> None:
    """The first token from the prompt's last row; the suffix cache opens the request's tree; the
    prompt's aux rows `[P, 3H]` become the draft's first backlog."""
    prompt = torch.tensor(s.req.prompt_ids, dtype=torch.int64)
    rows = s.process(out.logits[-1:], [])
    s.emit([s.pick(rows[0])], rows)
    if suffix is not None:
        suffix.start(s.rid, list(s.req.prompt_ids) + s.gen)
    if s.capture:
        s.rows.add(out, len(prompt))
    if s.draft is not None:
        s.feed(out.aux.clone(), torch.cat([prompt[1:], torch.tensor([s.next_token])]))
    s.timing.prefill_s = ttft_s


def after_verify(sl: Slot, out, dt: float, suffix: SuffixCache | None, health: DraftHealth) -> None:
    """Accept and emit one request's verified rows (`out`: logits `[k+1, V]` fp32, aux `[k+1, 3H]`):
    the accepted drafts plus the target's token after them, cut at a stop (`Seq.emit`); the KV cache
    keeps the accepted rows only (a tree's path compacted); counters count drafts accepted and kept
    (a draft past a stop is never counted accepted; `SpecDecodingStats.as_vllm` adds them back); the
    accepted rows' aux join the draft's backlog and, when captured, the capture rows; a token the
    target emitted in place of a rejected draft-model proposal is noted (`Seq.rejected`); a draft
    model's chains teach its health their first-token acceptance."""
    s = sl.seq
    start = s.cache.length - sl.k - 1  # the cache before this step's verify rows
    new, rows, idx = accept_tree(sl, out) if sl.layout is not None else accept_chain(sl, out)
    n = sl.accepted = len(new) - 1
    kept = s.emit(new, rows)
    if kept == len(new) and sl.proposer is not None and sl.proposer.uses_draft and _rejected_one(sl, idx):
        s.rejected.append(len(s.gen) - 1)  # the target's token replaced a draft-model proposal
    if suffix is not None:
        suffix.append(s.rid, new[:kept])
    s.cache.keep(start, idx)  # roll back: the rejected rows go
    feed = s.draft is not None and not s.finished
    if s.capture or feed:
        sel = torch.tensor(idx)
        aux = out.aux[sel]  # a copy: a view would keep the whole step's aux alive
        if s.capture:
            s.rows.aux.append(aux)
            s.rows.hidden.append(out.hidden[sel])
        if feed:
            s.feed(aux, torch.tensor(new))
    if sl.k and sl.layout is None and sl.proposer.uses_draft:  # the draft's health: a₁ of its chains
        health.observe(s.version, s.req.workload, n, sl.k)
    if sl.k or sl.layout is not None:
        depth = sl.layout.max_depth if sl.layout is not None else None
        s.stats.observe(sl.k, min(n, kept), positions=depth, num_verified=n)
        s.by_proposer.setdefault(sl.proposer.name, SpecDecodingStats(0)).observe(sl.k, min(n, kept),
                                                                                 positions=depth, num_verified=n)
        if sl.proposer.uses_draft:
            s.draft_kinds.add(sl.proposer.name)
    s.timing.steps.append((dt, kept))


def _rejected_one(sl: Slot, idx: list[int]) -> bool:
    """Did verification reject a draft token where the target's own token went (`idx`: the verify rows
    kept, root first)? A chain: a draft past the accepted ones; a tree: a child of the last accepted node."""
    if sl.layout is None:
        return sl.k > len(idx) - 1
    return idx[-1] in sl.layout.parent


def accept_chain(sl: Slot, out) -> tuple[list[int], torch.Tensor, list[int]]:
    """A chain's (or no drafts') accepted drafts + the target's token, the processed rows `[k+1, V]`
    they were chosen from, and the verify rows kept (0..n). Greedy: the longest prefix of drafts
    equal to the argmax; sampled: rejection sampling (Leviathan et al. 2023 §2.3, Chen et al. 2023
    Alg. 2; `sampling.rejection_verify`), exact for any proposal q (`slot.draft_probs`)."""
    s, k = sl.seq, sl.k
    rows = s.process(out.logits, sl.drafts)  # row i given the output + drafts[:i]
    if k == 0:
        n, tok = 0, s.pick(rows[0])
    elif s.rng is None:
        preds = rows.argmax(-1).tolist()
        n = 0
        while n < k and sl.drafts[n] == preds[n]:
            n += 1
        tok = preds[n]
    else:
        n, tok = rejection_verify(warp(rows, s.req.sampling), torch.stack(sl.draft_probs), sl.drafts, s.rng)
    return sl.drafts[:n] + [tok], rows, list(range(n + 1))


def accept_tree(sl: Slot, out) -> tuple[list[int], torch.Tensor, list[int]]:
    """A tree's accepted path + the target's token after it (`tree.accept_greedy`, EAGLE-2 §3), the
    logits rows `[n+1, V]` they were chosen from, and the verify rows kept (root + path)."""
    lay = sl.layout
    preds = out.logits.argmax(-1).tolist()
    idx = [0] + accept_greedy(lay, preds)
    return [lay.tokens[r] for r in idx[1:]] + [preds[idx[-1]]], out.logits[idx], idx


def cut_to_grammar(slots: list[Slot]) -> None:
    """A constrained request's drafts end before the first token its grammar forbids (such a draft
    could never be accepted: its row masks it), so no verify row is spent on it. Exact for sampled
    requests too: a cut happens only to deterministic (one-hot q) proposals — EAGLE3 drafts are drawn
    from the grammar-masked distribution and are always valid."""
    for sl in slots:
        g = sl.seq.lp.grammar
        if g is not None and sl.drafts and sl.layout is None:
            n = g.valid_prefix(sl.drafts)
            if n < len(sl.drafts):
                sl.drafts, sl.draft_probs = sl.drafts[:n], sl.draft_probs[:n]


def guard(s: Seq, fn, *args) -> None:
    """Run one request's own bookkeeping; an error fails that request only (`s.error`)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - this request only
        s.error = e
