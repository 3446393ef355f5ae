"""Experiment for issue 28 (the hybrid as the default): the hybrid (EAGLE3 draft + suffix proposer
under the goodput policy) — or with `--config default` params.yaml's default (the EAGLE3 draft alone
under the policy) — against no speculation at one concurrency, both engines in ONE process sharing
the same target weights, alternating run by run.

`tidespec bench engine` runs each method in its own worker process, as a deployment would; at 16
concurrent requests on 2 cores a cell's paired ratios then carry whatever differs between the two
processes (memory placement, the machine's load while each ran) on top of what the configuration
costs. Here both engines share one process and one copy of the weights, so a paired ratio measures
only the engine's own work per step: planning, proposals, bookkeeping, the draft's aux rows. The
warm-up mirrors the grid's (c = 1 on every workload, then c = 4 and 8), so the policy has learned
what it learns there. `--breakdown` also reports the seconds each engine spent in its steps, its
plans (suffix proposals + the goodput search), the draft's catch-up and the target's verify forwards
(timers wrapped around those functions by this script). Timed: run it alone on the machine.

    PYTHONPATH=src .venv/bin/python bench/inprocess_ab.py --draft .tidespec/demo-vllm/data/drafts/champion \\
        --workload code --concurrency 16 --passes 8 --out bench/results/default-config/inprocess-code-16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import tidespec.engine.speculative as speculative
from tidespec.bench.engine import WORKLOADS, workload_prompts
from tidespec.bench.methods import MethodSpec, TidespecMethod
from tidespec.config import load_params
from tidespec.engine.plan import Planner
from tidespec.runtime import get_target

# --breakdown: seconds inside the engine's step, its plan (proposals + the goodput search), the draft's
# catch-up and the target's verify forward, per engine (wrapped here; the engine is not changed)
SPENT: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_current = ["warm-up"]


def _timed(name: str, f):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[_current[0]][name] += time.perf_counter() - t
            SPENT[_current[0]][name + " calls"] += 1
    return run


def _instrument() -> None:
    speculative.Engine.step = _timed("step", speculative.Engine.step)
    speculative.Engine._verify = _timed("verify", speculative.Engine._verify)
    speculative.catch_up = _timed("catch-up", speculative.catch_up)
    Planner.plan = _timed("plan", Planner.plan)


def _wave(m: TidespecMethod, prompts: list, max_new: int, workload: str, c: int) -> dict:
    m.reset()  # the global suffix tree must not hold these prompts' outputs already
    t = time.perf_counter()
    r = m.run_many(prompts, max_new, workload, c)
    wall = time.perf_counter() - t
    steps = [dt for x in r["results"] for dt, _ in x["steps"]]
    tokens = sum(len(x["tokens"]) for x in r["results"])
    return {"wall_s": wall, "tokens_per_s": tokens / wall, "itl_ms_p50": 1000 * statistics.median(steps),
            "tau": tokens / max(1, sum(len(x["steps"]) + 1 for x in r["results"]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft", required=True, help="the EAGLE3 champion's directory")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--workload", default="code", choices=WORKLOADS)
    ap.add_argument("--config", default="hybrid", choices=("hybrid", "default"),
                    help="hybrid: draft + suffix proposer; default: the draft alone (engine.suffix.enabled: false)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--breakdown", action="store_true", help="also time step / plan / catch-up / verify per engine")
    a = ap.parse_args()
    if a.breakdown:
        _instrument()
    torch.set_num_threads(2)
    params = load_params(a.params)
    _, tok = get_target(params)
    c = a.concurrency
    wl = workload_prompts(tok, params, max(c, 8))
    none = TidespecMethod(MethodSpec("none", "tidespec", max_batch=c), params)
    name = a.config
    hybrid = TidespecMethod(MethodSpec(name, "tidespec", draft=a.draft, suffix=name == "hybrid", max_batch=c), params)
    t0 = time.time()
    for m in (none, hybrid):  # the grid's warm-up: c = 1 on every workload, then c = 4 and 8
        m.run(wl["code"][0][1], 8, "warmup")
        for w in WORKLOADS:
            for _, ids in wl[w][:8]:
                m.run(ids, a.max_new_tokens, w)
        for cc in (4, 8):
            for w in WORKLOADS:
                _wave(m, wl[w][:8], a.max_new_tokens, w, cc)
    runs: dict[str, list[dict]] = {"none": [], name: []}
    SPENT.clear()
    for ps in range(a.passes):  # alternating order
        for n, m in ((("none", none), (name, hybrid)) if ps % 2 == 0 else ((name, hybrid), ("none", none))):
            _current[0] = n
            runs[n].append(_wave(m, wl[a.workload][:c], a.max_new_tokens, a.workload, c))
    ratios = sorted(h["tokens_per_s"] / n["tokens_per_s"] for h, n in zip(runs[name], runs["none"]))
    res = {"experiment": "inprocess_ab", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "config": name, "draft": a.draft, "workload": a.workload, "concurrency": c, "passes": a.passes,
           "max_new_tokens": a.max_new_tokens, "wall_s": time.time() - t0, "runs": runs,
           "ratio": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1], "all": ratios},
           "suffix_off_at_batch": hybrid.engine.adaptive.suffix_off_at(a.workload),
           "breakdown_s": {k: dict(v) for k, v in SPENT.items()}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    itl = {k: statistics.median(r["itl_ms_p50"] for r in v) for k, v in runs.items()}
    inside = ratios[0] <= 1.0 <= ratios[-1]
    parts = ("step", "plan", "catch-up", "verify")
    table = ("\n| engine | wall s (all waves) | steps | " + " | ".join(f"{x} s" for x in parts) + " |\n|---|---|---|"
             + "---|" * len(parts) + "\n" + "".join(
                 f"| {k} | {sum(r['wall_s'] for r in runs[k]):.2f} | {SPENT[k]['step calls']:.0f} | "
                 + " | ".join(f"{SPENT[k][x]:.3f}" for x in parts) + " |\n" for k in runs)) if a.breakdown else ""
    out.with_suffix(".md").write_text(
        f"# In-process A/B: {name} vs no speculation, {a.workload}, concurrency {c} ({res['date']})\n\n"
        f"Both engines in one process (shared target weights), {a.passes} alternating waves of {c} requests × "
        f"≤ {a.max_new_tokens} tokens after the grid's warm-up; draft `{a.draft}`.\n\n"
        f"| engine | tokens/s (median) | ITL p50 ms (median) | τ (median) |\n|---|---|---|---|\n"
        + "".join(f"| {k} | {med[k]:.1f} | {itl[k]:.1f} | {statistics.median(r['tau'] for r in runs[k]):.2f} |\n"
                  for k in runs)
        + f"\nPaired ratio {name} / none: {res['ratio']['median']:.3f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})"
        + (" ~ inside the noise" if inside else "")
        + (f"; suffix proposals off at batch sizes {res['suffix_off_at_batch']}" if name == "hybrid" else "") + ".\n"
        + table + "\n"
        f"`PYTHONPATH=src .venv/bin/python bench/inprocess_ab.py --draft {a.draft} --config {name} --workload {a.workload} "
        f"--concurrency {c} --passes {a.passes} --max-new-tokens {a.max_new_tokens} --out {a.out}"
        + (" --breakdown" if a.breakdown else "") + "`\n")
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
