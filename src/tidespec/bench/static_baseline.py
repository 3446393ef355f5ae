"""`tidespec bench static-baseline`: τ per workload of static and adapted drafts (a fair static baseline).

Each draft (name=DIR) serves the same prompts per workload — code (HumanEval holdout), chat (MT-Bench
turn 1), math (GSM8K EN), the `tidespec bench engine` sets — greedily with a fixed EAGLE3 chain of
k = engine.num_draft_tokens (no goodput policy: τ describes the draft, not the policy), and, with
`--tree TOPK,N`, with EAGLE-2 trees of that topk and size. τ only (no timing): safe to run on a busy
machine. Every output is checked against target-only decoding.

`--holdout sequence`: instead, the held-out prompts per class of `tidespec bench sequence` (code,
chat, math-en, structured; 8 × 32 tokens by default), served as its cycle-0 point serves the first
champion (`sequence.static_tau`): a static's τ beside a sequence run's static arm, without the arms
(a learning curve of statics, say; ≈ 2 min per draft on 2 cores).

    tidespec bench static-baseline \\
        --draft static-old=.cache/tidespec/bootstrap/static-523ca57e5ba2 \\
        --draft static-100k=<the static draft dir make demo cached> \\
        --draft adapted=data/drafts/champion --prompts 6 --max-new-tokens 64 --tree 4,12 \\
        --out bench/results/static-baseline-2026-12-01
    tidespec bench static-baseline --holdout sequence --draft general-100k=<DIR> --out /tmp/curve
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, replace
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
    ap.add_argument("--holdout", choices=("engine", "sequence"), default="engine",
                    help="engine: `bench engine`'s sets (code, chat, math); sequence: `bench sequence`'s held-out "
                         "prompts per class, as its cycle-0 point")
    ap.add_argument("--prompts", type=int, default=None, help="per workload (default 6; sequence: 8)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64 (sequence: 32)")
    ap.add_argument("--tree", default="", help="TOPK,N: also EAGLE-2 trees (eagle_topk, num_draft_tokens); "
                                               "--holdout engine only")
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    for flag, v in (("--prompts", a.prompts), ("--max-new-tokens", a.max_new_tokens)):
        if v is not None and v < 1:
            raise SystemExit(f"{flag} {v}: must be >= 1")
    params = load_params(a.params)
    if a.holdout == "sequence":
        return sequence_holdout(a, params)
    a.prompts = 6 if a.prompts is None else a.prompts
    a.max_new_tokens = 64 if a.max_new_tokens is None else a.max_new_tokens
    target, tok = get_target(params)
    k = params.engine.num_draft_tokens
    wl = workload_prompts(tok, params, a.prompts)
    prompts = [{"id": pid, "input_ids": ids, "workload": w} for w in WORKLOADS for pid, ids in wl[w]]
    configs = {"target-only": (make_engine(params.engine.fixed(num_draft_tokens=k), target), False)}
    meta = {}
    for name, path in parse_drafts(a.draft).items():
        runner = runner_for(Path(path), target)
        if runner is None:
            raise SystemExit(f"draft {name}: no checkpoint at {path}")
        meta[name] = _meta(Path(path))
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


def sequence_holdout(a: argparse.Namespace, params) -> None:
    """`--holdout sequence`: `sequence.static_tau` for every `--draft`, written to `a.out`.{json,md}.
    Exits with a message for `--tree` (the sequence measures chains) or a missing draft."""
    from tidespec.bench.sequence import SequenceConfig, static_tau
    if a.tree:
        raise SystemExit("--tree: EAGLE-2 trees are measured with --holdout engine; the sequence's point is chains")
    cfg = SequenceConfig()  # other sizes than a run's measure what no `bench sequence` report shows
    cfg = replace(cfg, **{k: v for k, v in (("eval_prompts", a.prompts), ("max_new_tokens", a.max_new_tokens))
                          if v is not None})
    drafts = parse_drafts(a.draft)
    t0 = time.time()
    try:
        res = static_tau(params, cfg, drafts)
    except (ValueError, OSError) as e:
        raise SystemExit(str(e)) from None
    out = {"date": time.strftime("%Y-%m-%d"), "holdout": "sequence", "k": params.engine.num_draft_tokens,
           "params_sha": params.sha(), "config": asdict(cfg), "classes": list(cfg.classes),
           "max_new_tokens": cfg.max_new_tokens, "drafts": {n: _meta(d) for n, d in drafts.items()}, **res,
           "wall_s": time.time() - t0}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(out, indent=2) + "\n")
    n = max(len(ids) for ids in res["prompt_ids"].values())
    lines = [f"# τ per class on `bench sequence`'s held-out prompts ({out['date']}): {n} prompts × "
             f"{cfg.max_new_tokens} tokens per class, greedy, k = {out['k']} chains", "",
             "| draft | " + " | ".join(cfg.classes) + " | outputs ≠ target-only |",
             "|---|" + "---|" * (len(cfg.classes) + 1)]
    for name, tau in res["tau"].items():
        lines.append(f"| {name} | " + " | ".join(f"{tau[w]:.2f}" if tau[w] else "–" for w in cfg.classes)
                     + f" | {res['mismatches'][name]} |")
    lines += ["", "Drafts: " + "; ".join(f"{n}: {m}" for n, m in out["drafts"].items()), ""]
    Path(a.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


def _exit(msg: str) -> None:
    raise SystemExit(msg)


def parse_drafts(specs: list[str], error=_exit) -> dict[str, Path]:
    """`--draft NAME=DIR` flags (every `tidespec bench` that takes drafts) as {name: dir}; calls
    `error(message)` (default: exit with it; an argparse parser's `error` for a usage error), naming
    `--draft`, for a spec without a name or a dir, or a name given twice."""
    out: dict[str, Path] = {}
    for spec in specs:
        name, eq, path = spec.partition("=")
        if not (name and eq and path):
            error(f"--draft {spec!r}: expected NAME=DIR")
        if name in out:
            error(f"--draft {name}: given twice; name each draft once")
        out[name] = Path(path)
    return out


def _meta(d: Path) -> dict:
    """What a draft dir says of its training: its path, train_metrics.json's token counts, and its
    provenance.json's recipe (`bench static-general`'s) when it has one."""
    from tidespec.bench.sequence import static_provenance
    tm = d / "train_metrics.json"
    out = {"path": str(d)} | ({k: v for k, v in json.loads(tm.read_text()).items()
                               if k in ("train_tokens", "train_examples", "train_seconds")} if tm.exists() else {})
    prov = static_provenance(d)
    return out | ({"provenance": prov} if prov else {})
