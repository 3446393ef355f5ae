"""`tidespec bench structured`: speculation on structured output and tool calls, side by side.

The structured prompt sets (held-out splits), each request constrained by its own grammar. Methods,
each in its own worker process: constrained decoding without speculation (the reference),
grammar-forced tokens, the suffix proposer, the static and adapted drafts under the policy, and the
hybrid. Every output must equal the constrained reference token for token and be valid against its
schema. Output: `<out>/structured.json`, `.md`. Why no HF or vLLM rows: docs/design/bench.md.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import jsonschema
import torch

from ..assets import prompts
from ..engine.constraint import parse_tool_calls, render
from ..models.chat import chat_ids
from ..models.load import get_target
from .engine import _sweep, _Worker, pass_ratios, summarize, sweep_summary
from .methods import MethodSpec

REF = "tidespec_no_spec"
WORKLOAD = "structured"  # the policy's class for all of them, as plain OpenAI traffic would be one class


def structured_prompts(tok, params, n: int, sets=prompts.STRUCTURED) -> dict[str, list[tuple[str, list[int], str]]]:
    """{set: [(id, chat ids with the tools rendered, constraint spec JSON)]}: the held-out split of each
    set (`workload.holdout_fraction`, `workload.seed`; all of mtbench-json, 10 prompts), n each."""
    w = params.workload
    out = {}
    for name in sets:
        ps = prompts.load(name)
        hold = ps if len(ps) <= 20 else prompts.split(ps, w.holdout_fraction, w.seed)[1]
        out[name] = [(p.id, chat_ids(tok, render([{"role": "user", "content": p.text}], p.spec.get("tools")), True),
                      p.constraint) for p in hold[:n]]
    return out


def default_methods(static: Path | None, adapted: Path | None) -> list[MethodSpec]:
    m = [MethodSpec(REF, "tidespec"), MethodSpec("tidespec_grammar_forced", "tidespec", forced=True),
         MethodSpec("tidespec_suffix", "tidespec", suffix=True)]
    if static is not None:
        m.append(MethodSpec("tidespec_static_adaptive", "tidespec", draft=str(static)))
    if adapted is not None:
        m += [MethodSpec("tidespec_adapted_adaptive", "tidespec", draft=str(adapted)),
              MethodSpec("tidespec_hybrid_adaptive", "tidespec", draft=str(adapted), suffix=True)]
    return m


def valid(tok, tokens: list[int], constraint: str) -> bool:
    """Is this output valid for its constraint: JSON that parses (`json_object`), validates against the
    schema (`json_schema`), or tool calls whose arguments validate against their tool's parameters?"""
    spec, text = json.loads(constraint), tok.decode(tokens, skip_special_tokens=True)
    try:
        if "tools" in spec:
            _, calls = parse_tool_calls(text)
            params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in spec["tools"]}
            for c in calls:
                jsonschema.validate(json.loads(c["function"]["arguments"]), params[c["function"]["name"]])
            return bool(calls)
        obj = json.loads(text)
        rf = spec["response_format"]
        if rf["type"] == "json_schema":
            jsonschema.validate(obj, rf["json_schema"]["schema"])
        return isinstance(obj, dict)
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def run(params, out: Path, static: Path | None, adapted: Path | None, n_prompts: int = 6, max_new_tokens: int = 160,
        threads: int | None = None, passes: int = 3, concurrency: tuple[int, ...] = (1,),
        sets: tuple[str, ...] = prompts.STRUCTURED, progress=print) -> dict:
    """Run the benchmark (module docstring); writes `out/structured.json` and `.md`, returns the result."""
    threads = threads or torch.get_num_threads()
    _, tok = get_target(params)
    levels = sorted({c for c in concurrency if c > 1})
    wl_all = structured_prompts(tok, params, max([n_prompts, *levels]), sets)
    wl = {k: v[:n_prompts] for k, v in wl_all.items()}
    specs = default_methods(static, adapted)
    if levels:
        specs = [replace(s, max_batch=max(levels)) for s in specs]
    ctx, pdict = mp.get_context("spawn"), params.model_dump(mode="json")
    raw: dict[str, dict[str, list]] = {s.name: {w: [] for w in wl} for s in specs}
    t0, workers = time.time(), []
    try:
        for s in specs:
            workers.append(_Worker(ctx, s, pdict, threads, None))
            workers[-1].ready()
        for w in workers:
            w.call("run", wl[next(iter(wl))][0][1], 8, "warmup", wl[next(iter(wl))][0][2])
        order = [(name, i) for i in range(n_prompts) for name in wl if i < len(wl[name])]
        for ps in range(passes):
            for w in workers:
                w.call("reset")
            for j, (name, i) in enumerate(order):
                pid, ids, con = wl[name][i]
                r0 = (j + ps) % len(workers)
                for w in workers[r0:] + workers[:r0]:
                    r = w.call("run", ids, max_new_tokens, WORKLOAD, con) | {"id": pid, "pass": ps}
                    raw[w.spec.name][name].append(r)
                progress(f"pass {ps + 1}/{passes} · {j + 1}/{len(order)} · {name} {pid}")
        sweep_raw = _sweep(workers, wl_all, levels, n_prompts, max_new_tokens, passes, progress) if levels else {}
        info = {w.spec.name: w.call("info") for w in workers}
    finally:
        for w in workers:
            w.stop()
    cons = {pid: con for v in wl_all.values() for pid, _, con in v}
    rows = {}
    for s in specs:
        rows[s.name] = {}
        for name in wl:
            rs = raw[s.name][name]
            ref = {r["id"]: r["tokens"] for r in raw[REF][name]}
            done = [r for r in rs if r["finish_reason"] == "stop"]
            rows[s.name][name] = summarize(rs, ref) | {
                "finished": len(done) / len(rs),
                "valid_of_finished": (sum(valid(tok, r["tokens"], cons[r["id"]]) for r in done) / len(done)
                                      if done else None),
                "accepted_by_proposer": _by_proposer(rs)}
    res = {"benchmark": "structured", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cores": os.cpu_count(), "threads": threads, "torch": torch.__version__},
           "setup": {"sets": list(wl), "prompts_per_set": n_prompts, "max_new_tokens": max_new_tokens, "greedy": True,
                     "k_max": params.engine.num_draft_tokens, "static_draft": str(static) if static else None,
                     "adapted_draft": str(adapted) if adapted else None, "passes": passes,
                     "concurrency": [1, *levels], "wall_s": time.time() - t0},
           "methods": [asdict(s) for s in specs], "results": rows, "info": info,
           "spread": pass_ratios(raw, REF, passes),
           "concurrency": {str(c): sweep_summary(per, REF) for c, per in sweep_raw.items()}}
    res["goals"] = goals(res)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "structured.md").write_text(markdown(res))
    return res


def _by_proposer(rs: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rs:
        for k, v in r.get("by_proposer", {}).items():
            out[k] = out.get(k, 0) + v["num_accepted_tokens"]
    return out


def goals(res: dict) -> dict:
    """Issue 27's goals per set: the best method's paired ratio and τ at concurrency 1 (≥ 2.0×, τ ≥ 3.0),
    its ratio at the highest concurrency (≥ 1.2×), the forced tokens alone (> 1.0×), validity and equality."""
    out = {}
    top = max(res["concurrency"], key=int) if res["concurrency"] else None
    for w, per in res["spread"].items():
        best = max(per, key=lambda m: per[m]["median"])
        g = {"best_method_c1": best, "ratio_c1": per[best]["median"], "tau_c1": res["results"][best][w]["tau"],
             "grammar_forced_ratio_c1": per.get("tidespec_grammar_forced", {}).get("median")}
        if top is not None:
            lvl = res["concurrency"][top]
            best_c = max((m for m in lvl if m != REF), key=lambda m: lvl[m][w]["ratio"]["median"])
            g |= {"concurrency": int(top), "best_method_at_concurrency": best_c,
                  "ratio_at_concurrency": lvl[best_c][w]["ratio"]["median"]}
        g["all_valid_of_finished"] = all(r[w]["valid_of_finished"] in (1.0, None) for r in res["results"].values())
        g["finished"] = min(r[w]["finished"] for r in res["results"].values())
        g["all_identical"] = all(r[w]["identical_to_target_only"] == 1.0 for r in res["results"].values())
        out[w] = g
    return out


def markdown(res: dict) -> str:
    s = res["setup"]
    lines = [
        f"# Structured output and tool calls under speculation ({res['date']})",
        "",
        f"SmolLM2-135M fp32, greedy, {s['prompts_per_set']} held-out prompts per set × ≤ {s['max_new_tokens']} new "
        f"tokens, {s['passes']} interleaved passes, one process per method, {res['machine']['threads']} threads. "
        "Every request constrained by its own grammar; τ = tokens per target forward. Ratios are paired per "
        "pass to constrained decoding without speculation (median, range; ~ = the range spans 1.0).",
        "",
    ]
    for w in s["sets"]:
        lines += [f"## {w}", "", "| method | tokens/s | ratio c=1 | τ | finished | valid | = reference | accepted by "
                  "proposer |", "|---|---|---|---|---|---|---|---|"]
        for name, per in res["results"].items():
            r, x = per[w], res["spread"].get(w, {}).get(name)
            ratio = (
                "1.00×"
                if x is None
                else f"{x['median']:.2f}× ({x['min']:.2f}–{x['max']:.2f}){' ~' if x['inside_noise'] else ''}"
            )
            lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {ratio} | {r['tau']:.2f} | {r['finished']:.0%} | "
                         f"{'-' if r['valid_of_finished'] is None else format(r['valid_of_finished'], '.0%')} | "
                         f"{r['identical_to_target_only']:.0%} | "
                         f"{', '.join(f'{k} {v}' for k, v in sorted(r['accepted_by_proposer'].items())) or '-'} |")
        for c, lvl in res["concurrency"].items():
            cells = [f"{m} {v[w]['ratio']['median']:.2f}× ({v[w]['ratio']['min']:.2f}–{v[w]['ratio']['max']:.2f})"
                     f"{' ~' if v[w]['ratio']['inside_noise'] else ''}" for m, v in lvl.items() if "ratio" in v[w]]
            lines += ["", f"Concurrency {c} (closed loop, paired per pass): " + "; ".join(cells)]
        lines.append("")
    lines += ["## Goals", "", "| set | best c=1 | ratio | τ | forced alone | best at c | ratio | valid | "
              "identical |", "|---|---|---|---|---|---|---|---|---|"]
    for w, g in res["goals"].items():
        gf = g["grammar_forced_ratio_c1"]
        at_c = (f"{g['best_method_at_concurrency']} (c={g['concurrency']}) | {g['ratio_at_concurrency']:.2f}×"
                if "ratio_at_concurrency" in g else "- | -")
        lines.append(
            f"| {w} | {g['best_method_c1']} | {g['ratio_c1']:.2f}× | {g['tau_c1']:.2f} | "
            f"{'-' if gf is None else f'{gf:.2f}×'} | {at_c} | {'100 %' if g['all_valid_of_finished'] else 'NO'} "
            f"| {'100 %' if g['all_identical'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"
