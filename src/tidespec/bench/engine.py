"""`tidespec bench engine`: the engine against what a user would otherwise run, side by side.

One run, interleaved: every prompt goes to every method in turn (rotating order), each method in
its own worker process, same prompts, same max tokens, greedy, fixed CPU threads. Workers are
started with the `spawn` context (fork + exec of a fresh interpreter: nothing of the coordinator,
which has loaded the target to tokenize, is inherited), and each reports its own address space's
peak RSS (`methods.peak_rss_mb`: VmHWM, not `ru_maxrss`, which Linux carries over fork + exec and
so reported the coordinator's ~1830 MB for every method).
Workloads: code (HumanEval holdout split, the adapted draft never saw it) and open-ended chat
(MT-Bench first turns). Output: `<out>/engine.json` + `<out>/engine.md`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from .. import prompts
from ..bootstrap import prompt_ids
from ..engine.adaptive import _cpu_model
from ..engine.stats import itl_percentiles
from ..runtime import get_target
from .methods import MethodSpec, TidespecMethod, worker


def default_methods(static: Path | None, adapted: Path | None, k: int, prompt_lookup: int) -> list[MethodSpec]:
    m = [MethodSpec("hf_generate", "hf"),
         MethodSpec(f"hf_prompt_lookup_{prompt_lookup}", "hf", prompt_lookup=prompt_lookup),
         MethodSpec("tidespec_no_spec", "tidespec"),
         MethodSpec("tidespec_no_spec_capture", "tidespec", capture=True),
         MethodSpec("tidespec_suffix", "tidespec", suffix=True)]
    if static is not None:
        m.append(MethodSpec("tidespec_static_adaptive", "tidespec", draft=str(static)))
    if adapted is not None:
        m += [MethodSpec(f"tidespec_adapted_k{k}", "tidespec", draft=str(adapted), k=k),
              MethodSpec(f"tidespec_adapted_k{k}_capture", "tidespec", draft=str(adapted), k=k, capture=True),
              MethodSpec("tidespec_adapted_adaptive", "tidespec", draft=str(adapted)),
              MethodSpec("tidespec_hybrid_adaptive", "tidespec", draft=str(adapted), suffix=True)]
    return m


def workload_prompts(tok, params, n: int) -> dict[str, list[tuple[str, list[int]]]]:
    """{"code": HumanEval holdout, "chat": MT-Bench turn 1}, n each, as (id, chat-templated ids)."""
    w = params.workload
    _, hold = prompts.split(prompts.load("humaneval"), w.holdout_fraction, w.seed)
    chat = [p for p in prompts.load("mtbench") if p.workload == "chat"]
    return {"code": [(p.id, prompt_ids(tok, p.text)) for p in hold[:n]],
            "chat": [(p.id, prompt_ids(tok, p.text)) for p in chat[:n]]}


class _Worker:
    def __init__(self, ctx, spec: MethodSpec, params_dict: dict, threads: int, capture_dir: str | None):
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(child, spec, params_dict, threads, capture_dir), daemon=True)
        self.proc.start()
        self.rss = 0.0

    def ready(self):
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"bench worker {self.spec.name}: {msg[1]}")
        self.rss = max(self.rss, msg[1])  # peak RSS (MB) of the worker after loading its method

    def call(self, *msg):
        self.conn.send(msg)
        r = self.conn.recv()
        if r[0] == "error":
            raise RuntimeError(f"bench worker {self.spec.name}: {r[1]}")
        self.rss = max(self.rss, r[2])
        return r[1]

    def stop(self):
        try:
            self.conn.send(("stop",))
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def summarize(results: list[dict], ref: dict[str, list[int]]) -> dict:
    """Aggregate one method × workload: tokens/s, τ, ITL p50/p99, TTFT, drafts, match vs reference."""
    toks = sum(len(r["tokens"]) for r in results)
    wall = sum(r["ttft_s"] + sum(s for s, _ in r["steps"]) for r in results)
    itl = [1000 * s / n for r in results for s, n in r["steps"] for _ in range(n) if n]
    fwd = sum(r["forwards"] for r in results)
    out = {"requests": len(results), "tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall if wall else 0.0,
           "tau": toks / fwd if fwd else 0.0,
           **itl_percentiles(itl),
           "ttft_ms_p50": float(np.median([1000 * r["ttft_s"] for r in results])),
           "identical_to_target_only": sum(r["tokens"] == ref[r["id"]] for r in results) / len(results)}
    d = [r["drafts"] for r in results if r["drafts"]]
    if d:
        nd, ndt = sum(x["num_drafts"] for x in d), sum(x["num_draft_tokens"] for x in d)
        na = sum(x["num_accepted_tokens"] for x in d)
        kmax = max(len(x["num_accepted_tokens_per_pos"]) for x in d)
        pos = [sum(x["num_accepted_tokens_per_pos"][i] for x in d if i < len(x["num_accepted_tokens_per_pos"]))
               for i in range(kmax)]
        out.update(num_drafts=nd, num_draft_tokens=ndt, num_accepted_tokens=na,
                   acceptance_length=1 + na / nd if nd else 1.0, acceptance_rate=na / ndt if ndt else 0.0,
                   accepted_per_pos=[p / nd if nd else 0.0 for p in pos],
                   spec_steps_fraction=nd / max(1, fwd - len(results)))
    return out


def run(params, out: Path, static: Path | None, adapted: Path | None, n_prompts: int = 6,
        max_new_tokens: int = 96, threads: int | None = None, prompt_lookup: int = 10,
        workloads: tuple[str, ...] = ("code", "chat"), profile: bool = True, progress=print, passes: int = 3,
        methods: list[MethodSpec] | None = None) -> dict:
    """Run the benchmark; writes `out/engine.json` and `out/engine.md`, returns the result dict.

    `passes` interleaved passes over the same prompts (each pass rotates the method order; the
    suffix proposer's global tree is reset at each pass start so a pass never sees the outputs of
    the pass before). Per pass, each method's tokens/s over no speculation gives one paired ratio;
    the report gives their median and range (`spread`) and flags a ratio whose range spans 1.0 as
    inside the noise. `methods`: default `default_methods`."""
    threads = threads or torch.get_num_threads()
    _, tok = get_target(params)
    wl = {k: v for k, v in workload_prompts(tok, params, n_prompts).items() if k in workloads}
    k = params.engine.num_draft_tokens
    specs = methods or default_methods(static, adapted, k, prompt_lookup)
    ctx = mp.get_context("spawn")  # not fork: a worker's memory must not start as a copy of ours
    pdict = params.model_dump(mode="json")
    cap_dir = tempfile.mkdtemp(prefix="tidespec-bench-capture-")
    raw: dict[str, dict[str, list]] = {s.name: {w: [] for w in wl} for s in specs}
    t0 = time.time()
    workers: list[_Worker] = []
    try:
        for s in specs:  # one at a time: loading (and the one-off calibration) must not overlap
            workers.append(_Worker(ctx, s, pdict, threads, os.path.join(cap_dir, s.name) if s.capture else None))
            workers[-1].ready()
        warm = next(iter(wl.values()))[0][1]
        for w in workers:  # warm-up (lazy init, allocator, adaptive calibration already cached)
            w.call("run", warm, 8, "warmup")
        order = [(name, i) for i in range(n_prompts) for name in wl if i < len(wl[name])]
        for ps in range(passes):
            for w in workers:
                w.call("reset")
            for j, (name, i) in enumerate(order):
                pid, ids = wl[name][i]
                r0 = (j + ps) % len(workers)
                for w in workers[r0:] + workers[:r0]:
                    r = w.call("run", ids, max_new_tokens, name)
                    r["id"], r["pass"] = pid, ps
                    raw[w.spec.name][name].append(r)
                progress(f"pass {ps + 1}/{passes} · {j + 1}/{len(order)} · {name} {pid}")
        info = {w.spec.name: w.call("info") for w in workers}
        rss = {w.spec.name: w.rss for w in workers}
    finally:
        for w in workers:
            w.stop()
    prof = None
    if profile:  # in this process, after the workers (its memory is not theirs)
        draft = adapted or static
        m = TidespecMethod(MethodSpec("profile", "tidespec", draft=str(draft) if draft else None, k=k), params)
        prof = m.profile(wl[next(iter(wl))][0][1], 48, "profile")
    ref_name = "tidespec_no_spec"
    rows = {}
    for s in specs:
        rows[s.name] = {}
        for name in wl:
            ref = {r["id"]: r["tokens"] for r in raw[ref_name][name]}
            rows[s.name][name] = summarize(raw[s.name][name], ref) | {"peak_rss_mb": rss[s.name]}
    spread = pass_ratios(raw, ref_name, passes)
    res = {"benchmark": "engine", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
                       "python": platform.python_version()},
           "setup": {"prompts_per_workload": n_prompts, "max_new_tokens": max_new_tokens, "greedy": True,
                     "dtype": params.target.dtype, "k": k, "prompt_lookup_num_tokens": prompt_lookup,
                     "static_draft": str(static) if static else None,
                     "adapted_draft": str(adapted) if adapted else None, "passes": passes,
                     "wall_s": time.time() - t0},
           "methods": [asdict(s) for s in specs], "results": rows, "info": info,
           "ratios": ratios(rows, k, prompt_lookup), "spread": spread}
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "engine.md").write_text(markdown(res, prof))
    return res


def pass_ratios(raw: dict, ref_name: str, passes: int) -> dict:
    """{workload: {method: {median, min, max, per_pass, inside_noise}}}: per pass, the method's
    tokens/s over the reference's on the same prompts in the same pass (paired), across passes."""
    def tps(rs):
        wall = sum(r["ttft_s"] + sum(s for s, _ in r["steps"]) for r in rs)
        return sum(len(r["tokens"]) for r in rs) / wall if wall else 0.0

    out: dict = {}
    for name, per in raw.items():
        if name == ref_name:
            continue
        for w, rs in per.items():
            ref = [r for r in raw[ref_name][w]]
            ratio = [tps([r for r in rs if r["pass"] == p]) / b for p in range(passes)
                     if (b := tps([r for r in ref if r["pass"] == p]))]
            if ratio:
                out.setdefault(w, {})[name] = {
                    "median": float(np.median(ratio)), "min": min(ratio), "max": max(ratio), "per_pass": ratio,
                    "inside_noise": min(ratio) <= 1.0 <= max(ratio)}
    return out


def _cpu() -> str:
    return _cpu_model()


def ratios(rows: dict, k: int, pl: int) -> dict:
    """The goal figures (issue 3) as measured ratios of tokens/s (and ITL for capture)."""
    def tps(m, w):
        return rows.get(m, {}).get(w, {}).get("tokens_per_s")

    r = {}
    for w in ("code", "chat"):
        base = tps("tidespec_no_spec", w)
        for m in (f"tidespec_adapted_k{k}", "tidespec_adapted_adaptive", "tidespec_static_adaptive",
                  "tidespec_suffix", "tidespec_hybrid_adaptive"):
            if base and tps(m, w):
                r[f"{w}: {m} / no_spec"] = tps(m, w) / base
        for m in ("tidespec_adapted_adaptive", "tidespec_hybrid_adaptive"):
            if tps(f"hf_prompt_lookup_{pl}", w) and tps(m, w):
                r[f"{w}: {m} / hf_prompt_lookup"] = tps(m, w) / tps(f"hf_prompt_lookup_{pl}", w)
        if tps("hf_generate", w) and base:
            r[f"{w}: tidespec_no_spec / hf_generate"] = base / tps("hf_generate", w)
        for base_m in ("tidespec_no_spec", f"tidespec_adapted_k{k}"):
            a, c = rows.get(base_m, {}).get(w), rows.get(f"{base_m}_capture", {}).get(w)
            if a and c:
                r[f"{w}: capture ITL p50 overhead % ({base_m})"] = 100 * (c["itl_ms_p50"] / a["itl_ms_p50"] - 1)
                r[f"{w}: capture tokens/s overhead % ({base_m})"] = 100 * (1 - c["tokens_per_s"] / a["tokens_per_s"])
    return r


def markdown(res: dict, prof: str | None = None) -> str:
    m, s = res["machine"], res["setup"]
    lines = [f"# Engine benchmark ({res['date']})", "",
             f"{m['cpu']}, {m['cores']} cores, {m['threads']} torch threads, torch {m['torch']}; "
             f"SmolLM2-135M {s['dtype']}, greedy, {s['prompts_per_workload']} prompts per workload × ≤"
             f"{s['max_new_tokens']} new tokens, interleaved, one process per method. k = {s['k']}, HF "
             f"prompt_lookup_num_tokens = {s['prompt_lookup_num_tokens']}. τ = tokens per target forward.", ""]
    for w in next(iter(res["results"].values())):
        lines += [f"## {w}", "", "| method | tokens/s | τ | accept rate | ITL p50 ms | ITL p99 ms | TTFT p50 ms "
                  "| peak RSS MB | = target-only |", "|---|---|---|---|---|---|---|---|---|"]
        for name, per in res["results"].items():
            r = per[w]
            ar = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
            lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {r['tau']:.2f} | {ar} | {r['itl_ms_p50']:.1f} | "
                         f"{r['itl_ms_p99']:.1f} | {r['ttft_ms_p50']:.0f} | {r['peak_rss_mb']:.0f} | "
                         f"{r['identical_to_target_only']:.0%} |")
        lines.append("")
    lines += ["## Ratios", ""] + [f"- {k}: {v:.3f}" for k, v in res["ratios"].items()] + [""]
    if res.get("spread"):
        lines += [f"## Paired ratios to tidespec_no_spec over {s.get('passes', 1)} interleaved passes "
                  "(median, range; ~ = the range spans 1.0: inside the noise)", "",
                  "| method | " + " | ".join(res["spread"]) + " |", "|---|" + "---|" * len(res["spread"])]
        for name in res["results"]:
            cells = []
            for w in res["spread"]:
                x = res["spread"][w].get(name)
                cells.append("-" if x is None else
                             f"{x['median']:.2f}× ({x['min']:.2f}–{x['max']:.2f}){' ~' if x['inside_noise'] else ''}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    ad = {n: i.get("adaptive") for n, i in res["info"].items() if i.get("adaptive")}
    if ad:
        lines += ["## Adaptive k (chosen per workload class at the end of the run)", ""]
        for n, rep in ad.items():
            for cls, v in rep.items():
                if cls in ("warmup", "profile"):
                    continue
                lines.append(f"- {n} / {cls}: k = {v['k']} (speculation {'on' if v['speculation'] else 'off'}), "
                             f"predicted speed-up {v['predicted_speedup']:.2f}×, conditional acceptance "
                             f"{v['conditional_acceptance']}")
        cal = next(i["calibration_ms"] for i in res["info"].values() if i.get("calibration_ms"))
        lines += ["", f"Calibration (ms): target forward of 1..k+1 tokens {[round(x, 1) for x in cal['target']]}, "
                  f"draft step {cal['draft_step']:.2f}.", ""]
    if prof:
        lines += ["## Profile (one request, tidespec with draft, torch.profiler, top ops by self CPU time)", "",
                  "```", prof.strip(), "```", ""]
    return "\n".join(lines)
