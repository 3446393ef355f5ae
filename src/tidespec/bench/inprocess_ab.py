"""`tidespec bench inprocess-ab`: a speculation config (`--config hybrid`: the EAGLE3 draft plus the
suffix proposer under the goodput policy, the default; `default`: the draft alone under the policy;
`none`: an A/A run) against no speculation, both engines in ONE process sharing the target's
weights, alternating run by run, per workload × concurrency cell. A paired ratio here measures only
the engine's own work per step (planning, proposals, bookkeeping), not what differs between two
processes. `--breakdown` adds the seconds each engine spent in its steps, plans, the draft's
catch-up and the verify forwards, and a counted ratio (forwards costed by the calibration at the
cell's measured speed). `--workload` also takes traffic the warm-up never shows (`UNSEEN`), and
`--prompts-file` a user's prompts (JSONL, `assets.prompts.from_file`): cells `<file stem>/<workload>`,
served as their workload's class after a warm-up on the built-in sets. Timed:
run it alone on the machine. Results: `--out PREFIX`.json/.md; `--render` rewrites the report.

    tidespec bench inprocess-ab --draft data/drafts/champion --workload code --concurrency 16 \
        --passes 8 --out bench/results/default-config/inprocess-code-16
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from itertools import islice
from pathlib import Path

import torch

import tidespec.engine.speculative as speculative
from tidespec.assets import prompts
from tidespec.bench.engine import workload_prompts
from tidespec.bench.engine_report import WORKLOADS
from tidespec.bench.methods import MethodSpec, TidespecMethod
from tidespec.bench.policy_report import report
from tidespec.config import load_params
from tidespec.engine.plan import Planner
from tidespec.engine.policy import draft_batches
from tidespec.engine.proposers import default_proposers
from tidespec.models.chat import prompt_ids
from tidespec.models.load import get_target

# --breakdown: seconds inside the engine's step, its plan (proposals + the goodput search), the draft's
# catch-up and chain/tree drafting, the target's verify forward, per engine, and the calibrated cost of
# the decode steps it ran (wrapped here; the engine is not changed)
SPENT: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
_current = ["warm-up"]
_COST: list = []  # the StepCost every engine's steps are costed with (the speculative engine's calibration)


def _timed(name: str, f):
    def run(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[_current[0]][name] += time.perf_counter() - t
            SPENT[_current[0]][name + " calls"] += 1
    return run


def _costed(f):
    """Engine._observe_cost, also summing the calibrated ms of each decode step (no prefill) it ran:
    the forward work of the steps, free of the machine's noise."""
    def run(self, plan, prefill, *a):
        if _COST and plan.slots and not prefill:
            sl = plan.slots
            fw = draft_batches([x.draft_forwards for x in sl], [x.draft_rows for x in sl])
            SPENT[_current[0]]["calibrated"] += _COST[0].calibrated(len(sl), sum(x.k + 1 for x in sl), fw) / 1000
        return f(self, plan, prefill, *a)
    return run


def _instrument() -> None:
    speculative.Engine.step = _timed("step", speculative.Engine.step)
    speculative.Engine._verify = _timed("verify", speculative.Engine._verify)
    speculative.Engine._observe_cost = _costed(speculative.Engine._observe_cost)
    speculative.catch_up = _timed("catch-up", speculative.catch_up)
    Planner.plan = _timed("plan", Planner.plan)
    for e in default_proposers().specs:  # the proposers that run the draft model: their forwards are "draft" time
        if e.cls.uses_draft:
            e.cls.propose = _timed("draft", e.cls.propose)


def _own(spent: dict) -> float:
    """The engine's own work: its steps' seconds outside the target's and the draft's forwards."""
    return spent["step"] - spent["verify"] - spent["catch-up"] - spent["draft"]


UNSEEN = {"math-ko": "gsm-ko", "math-ja": "gsm-ja", "structured": "mtbench", "sharegpt": "sharegpt"}


def unseen_prompts(tok, n: int, names: list[str],
                   max_len: int | None = None) -> dict[str, list[tuple[str, list[int]]]]:
    """n prompts of each `UNSEEN` workload in `names`, as (id, chat-templated ids): MT-Bench's
    structured turn-1 questions for "structured" (extraction and coding in turn), the set's first n
    otherwise, skipping a prompt longer than `max_len` tokens (it would not fit the engine's KV
    cache with the output: ShareGPT's 17th first turn is 2821 tokens)."""
    out = {}
    for w in names:
        ps = prompts.load(UNSEEN[w])
        if w == "structured":
            ext, code = ([p for p in ps if p.category == c] for c in ("extraction", "coding"))
            ps = [p for pair in zip(ext, code) for p in pair]
        ids = ((p.id, prompt_ids(tok, p.text)) for p in ps)
        out[w] = list(islice((x for x in ids if max_len is None or len(x[1]) <= max_len), n))
    return out


def _wave(m: TidespecMethod, prompts: list, max_new: int, workload: str, c: int) -> dict:
    m.reset()  # the global suffix tree must not hold these prompts' outputs already
    t = time.perf_counter()
    r = m.run_many(prompts, max_new, workload, c)
    wall = time.perf_counter() - t
    steps = [dt for x in r["results"] for dt, _ in x["steps"]]
    tokens = sum(len(x["tokens"]) for x in r["results"])
    return {"wall_s": wall, "tokens_per_s": tokens / wall, "itl_ms_p50": 1000 * statistics.median(steps),
            "tau": tokens / max(1, sum(len(x["steps"]) + 1 for x in r["results"]))}


def _warm_up(m: TidespecMethod, wl: dict, max_new: int) -> None:
    """The grid's warm-up: c = 1 on every workload, then c = 4 and 8."""
    m.run(wl["code"][0][1], 8, "warmup")
    for w in WORKLOADS:
        for _, ids in wl[w][:8]:
            m.run(ids, max_new, w)
    for cc in (4, 8):
        for w in WORKLOADS:
            _wave(m, wl[w][:8], max_new, w, cc)


def _forwards(spent: dict) -> float:
    """Seconds in the target's and the draft's forwards (verify, catch-up, chain/tree drafting)."""
    return spent["verify"] + spent["catch-up"] + spent["draft"]


def modeled_ratio(spent: dict, name: str) -> float | None:
    """The paired ratio `name` / none with the forwards counted instead of timed: each engine's
    decode steps costed by the calibration (rows, batch sizes, draft forwards), scaled by the cell's
    measured forward seconds over its calibrated ones (both engines together: the machine's speed
    while the cell ran), plus the engine's own work as measured. The tokens are the same, so
    (work_none) / (work_name). None without --breakdown data."""
    a, b = spent.get("none"), spent.get(name)
    if not a or not b or not a["calibrated"] or not b["calibrated"]:
        return None
    level = (_forwards(a) + _forwards(b)) / (a["calibrated"] + b["calibrated"])
    return (level * a["calibrated"] + _own(a)) / (level * b["calibrated"] + _own(b))


def _cell_md(name: str, runs: dict, ratios: list[float], spent: dict, breakdown: bool) -> str:
    med = {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in runs.items()}
    itl = {k: statistics.median(r["itl_ms_p50"] for r in v) for k, v in runs.items()}
    inside = ratios[0] <= 1.0 <= ratios[-1]
    cols = ("step", "plan", "draft forwards", "verify", "own", "calibrated decode")
    val = {
        "step": lambda x: x["step"],
        "plan": lambda x: x["plan"],
        "draft forwards": lambda x: x["catch-up"] + x["draft"],
        "verify": lambda x: x["verify"],
        "own": _own,
        "calibrated decode": lambda x: x["calibrated"],
    }
    table = ("\n| engine | wall s (all waves) | steps | " + " | ".join(f"{x} s" for x in cols) + " |\n|---|---|---|"
             + "---|" * len(cols) + "\n" + "".join(
                 f"| {k} | {sum(r['wall_s'] for r in runs[k]):.2f} | {spent[k]['step calls']:.0f} | "
                 + " | ".join(f"{val[x](spent[k]):.3f}" for x in cols) + " |\n" for k in runs)
             + (f"\nModeled ratio (forwards counted: calibrated cost × the cell's measured speed; own work as "
                f"measured): {modeled_ratio(spent, name):.3f}×.\n" if modeled_ratio(spent, name) else "")) \
        if breakdown else ""
    return ("| engine | tokens/s (median) | ITL p50 ms (median) | τ (median) |\n|---|---|---|---|\n"
            + "".join(f"| {k} | {med[k]:.1f} | {itl[k]:.1f} | {statistics.median(r['tau'] for r in runs[k]):.2f} |\n"
                      for k in runs)
            + f"\nPaired ratio {name} / none: {statistics.median(ratios):.3f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})"
            + (" ~ inside the noise" if inside else "") + ".\n" + table)


def _sizes(cells: list[dict]) -> str:
    """The prompts a wave of each cell served (older results did not record them: '–')."""
    return ", ".join(f"{c['workload']} c={c['concurrency']}: {c.get('prompts', '–')}" for c in cells)


def write_report(res: dict, out: Path) -> str:
    """PREFIX.json (the result) and PREFIX.md (the summary table, each cell's detail, the command)
    from a result dict; returns the markdown."""
    name, breakdown = res["config"], res["breakdown"]
    workloads = list(dict.fromkeys(c["workload"] for c in res["cells"]))
    levels = sorted({c["concurrency"] for c in res["cells"]})
    for cell in res["cells"]:
        spent = {k: defaultdict(float, v) for k, v in cell["breakdown_s"].items()}
        cell["modeled_ratio"] = modeled_ratio(spent, name) if breakdown else None
        cell["md"] = _cell_md(name, cell["runs"], cell["ratio"]["all"], spent, breakdown)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res | {
        "cells": [{k: v for k, v in c.items() if k != "md"} for c in res["cells"]]}, indent=2, default=str) + "\n")

    def fmt(c: dict) -> str:
        r = c["ratio"]
        return (f"{r['median']:.3f} ({r['min']:.2f}–{r['max']:.2f}){' ~' if r['min'] <= 1 <= r['max'] else ''}"
                + (f" · {c['modeled_ratio']:.3f}" if c["modeled_ratio"] is not None else ""))
    by = {(c["workload"], c["concurrency"]): c for c in res["cells"]}
    summary = ("| workload | " + " | ".join(f"c={c}" for c in levels) + " |\n|---|" + "---|" * len(levels) + "\n"
               + "".join(f"| {w} | " + " | ".join(fmt(by[(w, c)]) if (w, c) in by else "–" for c in levels) + " |\n"
                         for w in workloads))
    text = (
        f"# In-process A/B: {name} vs no speculation ({res['date']})\n\n"
        f"Both engines in one process (shared target weights), {res['passes']} alternating passes over the cells; "
        f"a wave is {res['prompts_per_wave'].replace('concurrency', 'c')} prompts (at most the set's: "
        f"{_sizes(res['cells'])}) × ≤ {res['max_new_tokens']} tokens with c closed-loop clients, after the "
        f"grid's warm-up; draft `{res['draft']}`; {res['wall_s'] / 60:.1f} min.\n\n"
        f"Paired ratio {name} / none per cell, median (range); ~ = the range holds 1.0 (inside the noise)"
        + (
            "; after · the modeled ratio: the forwards counted instead of timed (each engine's decode steps costed "
            "by the calibration, scaled to the machine's measured speed in that cell), the engine's own work (its "
            "step time outside the forwards) as measured"
            if breakdown
            else ""
        )
        + ":\n\n"
        + summary
        + "".join(f"\n## {c['workload']}, concurrency {c['concurrency']}\n\n{c['md']}" for c in res["cells"])
        + f"\n`{res['command']}`\n"
    )
    out.with_suffix(".md").write_text(text)
    return text


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench inprocess-ab` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench inprocess-ab", description=__doc__.splitlines()[0])
    ap.add_argument("--draft", help="the EAGLE3 champion's directory")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--workload", action="append", choices=(*WORKLOADS, *UNSEEN),
                    help="repeatable (default: code); " + ", ".join(UNSEEN) + ": traffic the warm-up never shows")
    ap.add_argument("--prompts-file", help="JSONL prompts ({prompt, workload, id} a line), never warmed up on: "
                                           "a cell per workload of the file, in place of --workload's")
    ap.add_argument("--config", default="hybrid", choices=("hybrid", "default", "none"),
                    help="hybrid: draft + suffix proposer (params.yaml's default); default: the draft alone "
                         "(the name is historical: engine.suffix.enabled: false); none: a second plain engine "
                         "(an A/A run: the noise of the measurement itself)")
    ap.add_argument("--concurrency", type=int, action="append", help="repeatable (default: 16)")
    ap.add_argument("--passes", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts-per-client", type=int, default=1,
                    help="a wave is max(N × c, 8) prompts, at most the set's: 1 (default) is one closed batch at c "
                         ">= 8, its wall time set by its longest request; N >= 2 keeps c requests running while "
                         "others finish, as `vllm bench serve` with --num-prompts several times --max-concurrency")
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    ap.add_argument("--breakdown", action="store_true", help="also time step / plan / catch-up / verify per engine")
    ap.add_argument("--render", action="store_true", help="only rewrite PREFIX.md (and the derived fields of "
                                                          "PREFIX.json) from an existing PREFIX.json")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = parser()
    a = ap.parse_args(argv)
    out = Path(a.out)
    if a.render:
        print(write_report(json.loads(out.with_suffix(".json").read_text()), out))
        return
    if a.prompts_file and a.workload:
        ap.error("--prompts-file gives the cells (its workloads): drop --workload, or drop --prompts-file")
    if not a.draft and a.config != "none":
        ap.error("--draft is required (unless --render or --config none)")
    workloads, levels = a.workload or ["code"], sorted(set(a.concurrency or [16]))
    if min(levels) < 1 or a.passes < 1 or a.prompts_per_client < 1:
        ap.error("--concurrency, --passes and --prompts-per-client must be >= 1")
    def per_wave(c: int) -> int:
        return max(a.prompts_per_client * c, 8)
    if a.breakdown:
        _instrument()
    torch.set_num_threads(2)
    params = load_params(a.params)
    target, tok = get_target(params)
    top = max(levels)
    wl = workload_prompts(tok, params, per_wave(top))
    context = params.engine.max_seq_len or target.cfg.max_position
    fits = context - a.max_new_tokens - params.engine.num_draft_tokens - 1
    wl |= unseen_prompts(tok, per_wave(top), [w for w in workloads if w in UNSEEN], fits)
    cls = {w: w for w in workloads}  # a cell's name → the class its requests are served as
    if a.prompts_file:
        mine = workload_prompts(tok, params, per_wave(top), Path(a.prompts_file))
        cls = {f"{Path(a.prompts_file).stem}/{w}": w for w in mine}
        wl |= {cell: mine[w] for cell, w in cls.items()}
        workloads = list(cls)
    name = "none (A/A)" if a.config == "none" else a.config
    none = TidespecMethod(MethodSpec("none", "tidespec", max_batch=top), params)
    spec = TidespecMethod(MethodSpec("none", "tidespec", max_batch=top) if a.config == "none" else
                          MethodSpec(name, "tidespec", draft=a.draft, suffix=name == "hybrid", max_batch=top), params)
    if spec.engine.policy is not None:
        _COST.append(spec.engine.policy.cost)
    t0 = time.time()
    for m in (none, spec):
        _warm_up(m, wl, a.max_new_tokens)
    cells = [(w, c) for w in workloads for c in levels]
    runs = {cell: {"none": [], name: []} for cell in cells}
    spent = {cell: defaultdict(lambda: defaultdict(float)) for cell in cells}
    for ps in range(a.passes):  # alternating order, every cell each pass
        for w, c in cells:
            for n, m in ((("none", none), (name, spec)) if ps % 2 == 0 else ((name, spec), ("none", none))):
                SPENT.clear()
                _current[0] = n
                runs[(w, c)][n].append(_wave(m, wl[w][:per_wave(c)], a.max_new_tokens, cls[w], c))
                for k, v in SPENT[n].items():
                    spent[(w, c)][n][k] += v
    res = {"experiment": "inprocess_ab", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "config": name, "draft": a.draft, "passes": a.passes, "max_new_tokens": a.max_new_tokens,
           "prompts_per_wave": "max(concurrency, 8)" if a.prompts_per_client == 1 else
           f"max({a.prompts_per_client} × concurrency, 8)", "breakdown": a.breakdown, "wall_s": time.time() - t0,
           "command": (f"tidespec bench inprocess-ab --draft {a.draft} --config {a.config} "
                       + "".join(f"--workload {w} " for w in ([] if a.prompts_file else workloads))
                       + "".join(f"--concurrency {c} " for c in levels)
                       + f"--passes {a.passes} --max-new-tokens {a.max_new_tokens} --out {a.out}"
                       + (f" --prompts-per-client {a.prompts_per_client}" if a.prompts_per_client > 1 else "")
                       + (" --breakdown" if a.breakdown else "")
                       + (f" --prompts-file {a.prompts_file}" if a.prompts_file else "")),
           "policy": report(spec.engine.policy) if spec.engine.policy else None,
           "realized": spec.engine.policy.margins.report() if spec.engine.policy else None, "cells": []}
    for w, c in cells:
        r = runs[(w, c)]
        ratios = sorted(h["tokens_per_s"] / n["tokens_per_s"] for h, n in zip(r[name], r["none"]))
        res["cells"].append({"workload": w, "concurrency": c, "prompts": len(wl[w][:per_wave(c)]), "runs": r,
                             "ratio": {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1],
                                       "all": ratios},
                             "breakdown_s": {k: dict(v) for k, v in spent[(w, c)].items()}})
    print(write_report(res, out))

