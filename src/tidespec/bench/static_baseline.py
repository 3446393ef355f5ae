"""`tidespec bench static-baseline`: τ per workload of static and adapted drafts (a fair static baseline).

Each draft (name=DIR) serves the same prompts per workload — code (HumanEval holdout), chat (MT-Bench
turn 1), math (GSM8K EN), the `tidespec bench engine` sets — greedily with a fixed EAGLE3 chain of
k = engine.num_draft_tokens (no goodput policy: τ describes the draft, not the policy), and, with
`--tree TOPK,N`, with EAGLE-2 trees of that topk and size. τ only (no timing): safe to run on a busy
machine. Every output is checked against target-only decoding.

    tidespec bench static-baseline \\
        --draft static-old=.cache/tidespec/bootstrap/static-523ca57e5ba2 \\
        --draft static-100k=<the static draft dir make demo cached> \\
        --draft adapted=data/drafts/champion --prompts 6 --max-new-tokens 64 --tree 4,12 \\
        --out bench/results/static-baseline-2026-12-01
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tidespec.bench.engine import workload_prompts
from tidespec.bench.engine_report import WORKLOADS
from tidespec.config import load_params
from tidespec.engine.build import make_engine
from tidespec.engine.replay import replay
from tidespec.models.load import get_target, runner_for


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench static-baseline` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench static-baseline", description=__doc__.splitlines()[0])
    ap.add_argument("--draft", action="append", required=True, help="name=DIR (repeat)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree", default="", help="TOPK,N: also EAGLE-2 trees (eagle_topk, num_draft_tokens)")
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    params = load_params(a.params)
    target, tok = get_target(params)
    k = params.engine.num_draft_tokens
    wl = workload_prompts(tok, params, a.prompts)
    prompts = [{"id": pid, "input_ids": ids, "workload": w} for w in WORKLOADS for pid, ids in wl[w]]
    configs = {"target-only": (make_engine(params.engine.fixed(num_draft_tokens=k), target), False)}
    meta = {}
    for spec in a.draft:
        name, _, path = spec.partition("=")
        runner = runner_for(Path(path), target)
        if runner is None:
            raise SystemExit(f"draft {name}: no checkpoint at {path}")
        tm = Path(path) / "train_metrics.json"
        meta[name] = {"path": path, **({kk: v for kk, v in json.loads(tm.read_text()).items()
                                         if kk in ("train_tokens", "train_examples", "train_seconds")}
                                       if tm.exists() else {})}
        configs[f"{name} chain k={k}"] = (make_engine(params.engine.fixed(num_draft_tokens=k), target, runner), True)
        if a.tree:
            topk, n = (int(x) for x in a.tree.split(","))
            configs[f"{name} tree topk={topk} N={n}"] = (
                make_engine(params.engine.fixed(num_draft_tokens=k, tree={"eagle_topk": topk, "num_draft_tokens": n}),
                            target, runner), True)
    t0 = time.time()
    res = replay(configs, prompts, a.max_new_tokens, reference="target-only")
    rows = {name: {**{w: r["metrics"].get(f"acceptance_length/{w}") for w in WORKLOADS},
                   "all": r["metrics"]["acceptance_length"], "mismatches": r["metrics"]["mismatches"]}
            for name, r in res.items() if name != "target-only"}
    out = {"date": time.strftime("%Y-%m-%d"), "k": k, "prompts_per_workload": a.prompts,
           "max_new_tokens": a.max_new_tokens, "drafts": meta, "tau": rows, "wall_s": time.time() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    lines = [
        f"# τ per workload ({out['date']}): {a.prompts} prompts × {a.max_new_tokens} tokens per workload, greedy",
        "",
        "| draft, drafting | code | chat | math | all | outputs ≠ target-only |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{r[w]:.2f}" if r[w] else "–" for w in (*WORKLOADS, "all"))
                     + f" | {r['mismatches']} |")
    lines += ["", "Drafts: " + "; ".join(f"{n}: {m}" for n, m in meta.items()), ""]
    Path(a.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))

