"""`tidespec bench llama-cpp-agreement`: llama.cpp's acceptance against the embedded engine's at the
same draft weights: the same HumanEval prompts (token ids), greedy, the same k; llama-server (`make
llama-server`) runs the shipped Q4_1 GGUF with the draft converted to an EAGLE-3 GGUF, the embedded
engine runs `target.quantization: int4` (the same Q4_1 grid, dequantized to fp32 linears). Reports
both engines' counters (drafts, draft tokens, accepted, per position; the embedded engine's as
`SpecDecodingStats.as_vllm` counts them), τ, and per prompt whether the outputs are the same tokens
and where they first part (with the int4 target's logit margin there: its token's logit less
llama.cpp's token's). Counts only, no timing: safe on a busy machine.

    tidespec bench llama-cpp-agreement .tidespec/demo-llama-cpp/data/drafts/champion \\
        --prompts 8 --max-new-tokens 64 --k 4 --out bench/results/llama-cpp-agreement.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import httpx

from tidespec.assets.prompts import humaneval
from tidespec.backends import llama_cpp
from tidespec.config import EngineParams, Params
from tidespec.engine.build import make_engine
from tidespec.engine.sampling import SamplingParams
from tidespec.engine.stats import SpecDecodingStats
from tidespec.models.chat import prompt_ids
from tidespec.models.eagle3 import load_checkpoint
from tidespec.models.load import get_target, target_dir
from tidespec.models.runner import DraftRunner
from tidespec.workspace import engine_dir

from .vllm_agreement import agreement_parser


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench llama-cpp-agreement` ARGS)."""
    ap = agreement_parser("llama-cpp-agreement", __doc__, prompts=8, k=4)
    ap.add_argument("--threads", type=int, default=1, help="llama-server's CPU threads")
    return ap


def _int4_target():
    return get_target(Params.model_validate({"target": {"quantization": "int4"}}))[0]


def _embedded(draft: Path, prompts: list[list[int]], k: int, n: int) -> tuple[list[list[int]], SpecDecodingStats]:
    """The embedded engine at int4 with `draft`: each prompt's `n` greedy tokens and the summed counters."""
    target = _int4_target()
    eng = make_engine(EngineParams().fixed(num_draft_tokens=k, max_seq_len=1024), target,
                      DraftRunner(load_checkpoint(draft, target.embed, target.target_id).to_device(target.device)))
    outs, total = [], SpecDecodingStats(k)
    for p in prompts:
        g = eng.generate(p, n, sampling=SamplingParams(ignore_eos=True))
        outs.append(list(g.tokens))
        total = total.merge(g.stats)
    return outs, total


def _llama_cpp(draft: Path, prompts: list[list[int]], k: int, n: int, threads: int, log: Path
               ) -> tuple[list[list[int]], llama_cpp.SpecDecodeCounters]:
    """llama-server with `draft` converted: each prompt's `n` greedy tokens (its native /completion,
    one request at a time) and its counters over them."""
    gguf = llama_cpp.draft_gguf(engine_dir(draft), target_dir("smollm2"))
    cfg = llama_cpp.LlamaCppLaunch.from_params(Params(), draft_path=str(gguf), num_speculative_tokens=k, parallel=1,
                                               ctx_per_slot=1024, threads=threads)
    outs = []
    with llama_cpp.LlamaCppServer(cfg, log) as srv:
        for p in prompts:
            r = httpx.post(f"{srv.url}/completion", json={"prompt": p, "n_predict": n, "temperature": 0,
                                                           "ignore_eos": True, "return_tokens": True,
                                                           "cache_prompt": False}, timeout=600)
            r.raise_for_status()
            outs.append(r.json()["tokens"])
        return outs, llama_cpp.scrape(srv.url)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (None: equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def _margins(prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]], parts: list[int | None]
             ) -> list[float | None]:
    """Where the outputs part: the int4 target's logit of its own token less that of llama.cpp's
    token at the first difference (None where equal): how near a tie the two roundings split."""
    import torch
    target, out = _int4_target(), []
    for p, a, b, i in zip(prompts, ours, theirs, parts):
        if i is None or i >= min(len(a), len(b)):
            out.append(None)
            continue
        ids = torch.tensor(p + a[:i])
        with torch.inference_mode():
            logits = target.forward(ids, target.new_cache(len(ids)), need_hidden=False).logits[-1]
        out.append(round(float(logits[a[i]] - logits[b[i]]), 4))
    return out


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    reason = llama_cpp.unavailable_reason()
    if reason:
        raise SystemExit(f"llama.cpp cannot run here: {reason}")
    tok = get_target(Params())[1]
    prompts = [prompt_ids(tok, p.text) for p in humaneval()[-a.prompts:]]
    ours, stats = _embedded(engine_dir(a.draft), prompts, a.k, a.max_new_tokens)
    want = llama_cpp.SpecDecodeCounters(*stats.as_vllm())
    theirs, got = _llama_cpp(a.draft, prompts, a.k, a.max_new_tokens, a.threads,
                             Path(".tidespec") / "llama-cpp-agreement.log")
    parts = [_first_difference(x, y) for x, y in zip(ours, theirs)]
    res = {"draft": str(a.draft), "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "k": a.k,
           "embedded_int4": want.__dict__ | {"tau": want.acceptance_length, "per_position": want.per_position_rate},
           "llama_cpp": got.__dict__ | {"tau": got.acceptance_length, "per_position": got.per_position_rate},
           "same_tokens": sum(p is None for p in parts), "first_difference": parts,
           "logit_margin_at_difference": _margins(prompts, ours, theirs, parts)}
    print(json.dumps(res, indent=2))
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
