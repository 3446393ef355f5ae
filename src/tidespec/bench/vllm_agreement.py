"""`tidespec bench vllm-agreement`: cross-engine agreement on the real target: vLLM (`make vllm`) and
tidespec's engine serve the same HumanEval prompts with the same draft, greedy, same k; their tokens and
vLLM's spec-decode counters (drafts, draft tokens, accepted, per position; `SpecDecodingStats.as_vllm`) must
be equal. Counts only, no timing: safe on a busy machine. The tiny-target version runs in the suite
(tests/test_vllm_real.py); this one takes a real draft, e.g. the champion `make demo` deploys:

    tidespec bench vllm-agreement data/drafts/champion \\
        --prompts 5 --max-new-tokens 64 --k 3 --out bench/results/vllm-agreement.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from tidespec.assets.prompts import humaneval
from tidespec.backends import vllm
from tidespec.config import EngineParams, Params
from tidespec.engine.build import make_engine
from tidespec.engine.sampling import SamplingParams
from tidespec.engine.stats import SpecDecodingStats
from tidespec.models.chat import prompt_ids
from tidespec.models.eagle3 import load_checkpoint
from tidespec.models.load import get_target
from tidespec.models.runner import DraftRunner
from tidespec.workspace import engine_dir


def agreement_parser(name: str, doc: str, prompts: int, k: int) -> argparse.ArgumentParser:
    """An agreement script's command line (`tidespec bench NAME` ARGS): the draft, --prompts, --max-new-tokens,
    --k, --out; `doc`: its module docstring (the first line describes it)."""
    ap = argparse.ArgumentParser(prog=f"tidespec bench {name}", description=doc.splitlines()[0])
    ap.add_argument("draft", type=Path, help="a draft bundle (data/drafts/champion) or engine dir")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=k)
    ap.add_argument("--out", type=Path)
    return ap


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench vllm-agreement` ARGS)."""
    ap = agreement_parser("vllm-agreement", __doc__, prompts=5, k=3)
    ap.add_argument("--python", default=f"{vllm.VENV}/bin/python")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    target, tok = get_target(Params())
    prompts = [prompt_ids(tok, p.text) for p in humaneval()[-a.prompts:]]
    eng = make_engine(EngineParams().fixed(num_draft_tokens=a.k, max_seq_len=1024), target,
                      DraftRunner(load_checkpoint(a.draft, target.embed, target.target_id).to_device(target.device)))
    ours, total = [], SpecDecodingStats(a.k)
    for p in prompts:
        g = eng.generate(p, a.max_new_tokens, sampling=SamplingParams(ignore_eos=True))
        ours.append(g.tokens)
        total = total.merge(g.stats)
    want = vllm.SpecDecodeCounters(*total.as_vllm())
    cfg = vllm.VLLMLaunch.from_params(Params(), python=a.python, draft_path=str(engine_dir(a.draft)),
                                      num_speculative_tokens=a.k, served_model_name="smollm2", max_model_len=1024,
                                      max_num_seqs=8)  # the shipped target (SmolLM2), fp32
    t0 = time.monotonic()
    with vllm.VLLMServer(cfg, Path(".tidespec") / "vllm-agreement.log") as srv:
        start_s = time.monotonic() - t0
        before, theirs = vllm.scrape(srv.url), []
        for p in prompts:
            r = httpx.post(f"{srv.url}/v1/completions", json={"model": "smollm2", "prompt": p, "temperature": 0,
                                                              "max_tokens": a.max_new_tokens, "ignore_eos": True,
                                                              "return_token_ids": True}, timeout=600)
            r.raise_for_status()
            theirs.append(r.json()["choices"][0]["token_ids"])
        got = vllm.scrape(srv.url) - before
    res = {"draft": str(a.draft), "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "k": a.k,
           "tidespec": want.__dict__, "vllm": got.__dict__, "tau": got.acceptance_length,
           "equal_counters": got == want, "equal_tokens": theirs == ours, "vllm_start_s": round(start_s, 1)}
    print(json.dumps(res, indent=2))
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    if not (res["equal_counters"] and res["equal_tokens"]):
        raise SystemExit("vLLM and tidespec disagree")

