"""`tidespec bench engine`: the engine against what a user would otherwise run, side by side.

One run, interleaved: every prompt goes to every method in turn (rotating order), each method in
its own worker process, same prompts, same max tokens, greedy, fixed CPU threads. Workers are
started with the `spawn` context (fork + exec of a fresh interpreter: nothing of the coordinator,
which has loaded the target to tokenize, is inherited), and each reports its own address space's
peak RSS (`methods.peak_rss_mb`: VmHWM, not `ru_maxrss`, which Linux carries over fork + exec and
so reported the coordinator's ~1830 MB for every method).
Workloads: code (HumanEval holdout split, the adapted draft never saw it), open-ended chat
(MT-Bench first turns) and math (GSM8K, English). Concurrency sweep (`concurrency` > 1): each
tidespec method serves max(c, prompts) prompts with c closed-loop clients in one engine
(continuous batching), methods rotated per pass, the suffix proposer's global tree reset before
every run; tokens/s = tokens / wall time of the run. HF rows run at concurrency 1 only
(transformers' assisted generation takes batch size 1). With `make vllm`'s venv, vLLM rows (a
real vLLM server per row, `methods.VLLMMethod`) run beside them at every level: no speculation,
n-gram, and EAGLE3 with the static and the adapted draft. Output: `<out>/engine.json`,
`<out>/engine.md` and, with a sweep, `<out>/engine-concurrency.png`.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import platform
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from ..assets import prompts
from ..models.chat import prompt_ids
from ..engine.calibration import cpu_model
from ..engine.stats import itl_percentiles
from ..models.load import get_target
from .methods import MethodSpec, TidespecMethod, worker


TREE = (4, 12)  # the tree methods' (eagle_topk, num_draft_tokens): up to 11 nodes, the policy sizes each step


VLLM_NGRAM_MAX = 4  # vLLM n-gram rows: prompt_lookup_max (min 2), the value vLLM's docs use


def default_methods(static: Path | None, adapted: Path | None, k: int, prompt_lookup: int,
                    vllm_python: str | None = None) -> list[MethodSpec]:
    """The rows: HF, tidespec (each proposer and policy), and with `vllm_python` (`make vllm`'s
    interpreter) a real vLLM server per row: none, n-gram, EAGLE3 static and adapted at fixed k."""
    m = [MethodSpec("hf_generate", "hf"),
         MethodSpec(f"hf_prompt_lookup_{prompt_lookup}", "hf", prompt_lookup=prompt_lookup),
         MethodSpec("tidespec_no_spec", "tidespec"),
         MethodSpec("tidespec_no_spec_capture", "tidespec", capture=True),
         MethodSpec("tidespec_suffix", "tidespec", suffix=True)]
    if static is not None:
        m.append(MethodSpec("tidespec_static_adaptive", "tidespec", draft=str(static)))
    tree = (TREE[0], max(TREE[1], k + 1))  # a tree verifies at least a chain of depth k
    if adapted is not None:
        m += [MethodSpec(f"tidespec_adapted_k{k}", "tidespec", draft=str(adapted), k=k),
              MethodSpec(f"tidespec_adapted_k{k}_capture", "tidespec", draft=str(adapted), k=k, capture=True),
              MethodSpec("tidespec_adapted_adaptive", "tidespec", draft=str(adapted)),
              MethodSpec("tidespec_adapted_tree_adaptive", "tidespec", draft=str(adapted), tree=tree),
              MethodSpec("tidespec_hybrid_adaptive", "tidespec", draft=str(adapted), suffix=True),
              MethodSpec("tidespec_hybrid_tree_adaptive", "tidespec", draft=str(adapted), suffix=True, tree=tree)]
    if vllm_python:
        m += [MethodSpec("vllm_no_spec", "vllm", python=vllm_python),
              MethodSpec(f"vllm_ngram_k{k}", "vllm", prompt_lookup=VLLM_NGRAM_MAX, k=k, python=vllm_python)]
        m += [MethodSpec(f"vllm_eagle3_{name}_k{k}", "vllm", draft=str(d), k=k, python=vllm_python)
              for name, d in (("static", static), ("adapted", adapted)) if d is not None]
    return m


WORKLOADS = ("code", "chat", "math")


def workload_prompts(tok, params, n: int) -> dict[str, list[tuple[str, list[int]]]]:
    """{"code": HumanEval holdout, "chat": MT-Bench turn 1, "math": GSM8K (English)}, n each, as
    (id, chat-templated ids)."""
    w = params.workload
    _, hold = prompts.split(prompts.load("humaneval"), w.holdout_fraction, w.seed)
    chat = [p for p in prompts.load("mtbench") if p.workload == "chat"]
    return {"code": [(p.id, prompt_ids(tok, p.text)) for p in hold[:n]],
            "chat": [(p.id, prompt_ids(tok, p.text)) for p in chat[:n]],
            "math": [(p.id, prompt_ids(tok, p.text)) for p in prompts.load("gsm-en")[:n]]}


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
        self.proc.join(60)  # a vLLM row stops its server first (SIGTERM, its grace period)
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
        methods: list[MethodSpec] | None = None, concurrency: tuple[int, ...] = (1,),
        vllm_skipped: str | None = None) -> dict:
    """Run the benchmark; writes `out/engine.json` and `out/engine.md`, returns the result dict.

    `passes` interleaved passes over the same prompts (each pass rotates the method order; the
    suffix proposer's global tree is reset at each pass start so a pass never sees the outputs of
    the pass before). Per pass, each method's tokens/s over no speculation gives one paired ratio;
    the report gives their median and range (`spread`) and flags a ratio whose range spans 1.0 as
    inside the noise. `methods`: default `default_methods`. `concurrency`: levels above 1 add the
    sweep (module docstring). `vllm_skipped`: why there are no vLLM rows (recorded in the report)."""
    threads = threads or torch.get_num_threads()
    _, tok = get_target(params)
    levels = sorted({c for c in concurrency if c > 1})
    wl_all = {k: v for k, v in workload_prompts(tok, params, max([n_prompts, *levels])).items() if k in workloads}
    wl = {k: v[:n_prompts] for k, v in wl_all.items()}
    k = params.engine.num_draft_tokens
    specs = methods or default_methods(static, adapted, k, prompt_lookup)
    if levels:  # the engine must admit the highest concurrency in one batch
        specs = [replace(s, max_batch=max(levels)) if s.kind in ("tidespec", "vllm") else s for s in specs]
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
        sweep_raw = _sweep(workers, wl_all, levels, n_prompts, max_new_tokens, passes, progress) if levels else {}
        info = {w.spec.name: w.call("info") for w in workers}
        # a vLLM row's memory is its server's (the worker is only its HTTP client)
        rss = {w.spec.name: info[w.spec.name].get("server_peak_rss_mb", w.rss) for w in workers}
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
    sweep = {str(c): sweep_summary(per, ref_name) for c, per in sweep_raw.items()}
    res = {"benchmark": "engine", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
                       "python": platform.python_version()},
           "setup": {"prompts_per_workload": n_prompts, "max_new_tokens": max_new_tokens, "greedy": True,
                     "dtype": params.target.dtype, "k": k, "prompt_lookup_num_tokens": prompt_lookup,
                     "static_draft": str(static) if static else None,
                     "adapted_draft": str(adapted) if adapted else None, "passes": passes,
                     "concurrency": [1, *levels], "wall_s": time.time() - t0, "vllm_skipped": vllm_skipped},
           "methods": [asdict(s) for s in specs], "results": rows, "info": info,
           "ratios": ratios(rows, k, prompt_lookup), "spread": spread, "concurrency": sweep}
    out.mkdir(parents=True, exist_ok=True)
    if sweep:
        from ..steps import plots  # matplotlib (the mlops extra) only when there is a sweep to draw
        fig = plots.tokens_per_s_by_concurrency(by_concurrency(res))
        fig.savefig(out / "engine-concurrency.png", dpi=120)
    (out / "engine.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / "engine.md").write_text(markdown(res, prof))
    return res


def _sweep(workers: list[_Worker], wl_all: dict, levels: list[int], n_prompts: int, max_new: int, passes: int,
           progress) -> dict:
    """{c: {method: {workload: [run per pass]}}} for the tidespec methods without capture and vLLM's."""
    ws = [w for w in workers if w.spec.kind in ("tidespec", "vllm") and not w.spec.capture]
    raw = {c: {w.spec.name: {name: [] for name in wl_all} for w in ws} for c in levels}
    for ps in range(passes):
        for ci, c in enumerate(levels):
            for name, ps_all in wl_all.items():
                r0 = (ps + ci) % len(ws)
                for w in ws[r0:] + ws[:r0]:
                    w.call("reset")  # the global suffix tree must not hold these prompts' outputs already
                    r = w.call("run_many", ps_all[:max(c, n_prompts)], max_new, name, c)
                    r["pass"] = ps
                    raw[c][w.spec.name][name].append(r)
                progress(f"sweep pass {ps + 1}/{passes} · concurrency {c} · {name}")
    return raw


def sweep_summary(per: dict, ref_name: str) -> dict:
    """One concurrency level: {method: {workload: tokens/s (median over passes), paired ratio to
    the reference per pass (median, min, max, inside_noise), τ, ITL p50/p99, identical share}}."""
    out: dict = {}
    for name, by_w in per.items():
        for w, runs in by_w.items():
            ref_runs = {r["pass"]: r for r in per[ref_name][w]}
            ref_tok = {x["id"]: x["tokens"] for x in per[ref_name][w][0]["results"]}
            tps = [sum(len(x["tokens"]) for x in r["results"]) / r["wall_s"] for r in runs]
            ratio = [t / (sum(len(x["tokens"]) for x in ref_runs[r["pass"]]["results"]) / ref_runs[r["pass"]]["wall_s"])
                     for t, r in zip(tps, runs)]
            xs = [x for r in runs for x in r["results"]]
            fwd = sum(x["forwards"] for x in xs)
            itl = [1000 * s / n for x in xs for s, n in x["steps"] for _ in range(n) if n]
            d = {"tokens_per_s": float(np.median(tps)), "per_pass_tokens_per_s": tps,
                 "tau": sum(len(x["tokens"]) for x in xs) / fwd if fwd else 0.0, **itl_percentiles(itl),
                 "identical_to_target_only": sum(x["tokens"] == ref_tok[x["id"]] for x in xs) / len(xs)}
            if name != ref_name:
                d["ratio"] = {"median": float(np.median(ratio)), "min": min(ratio), "max": max(ratio),
                              "per_pass": ratio, "inside_noise": min(ratio) <= 1.0 <= max(ratio)}
            out.setdefault(name, {})[w] = d
    return out


def by_concurrency(res: dict) -> dict:
    """{workload: {method: [(concurrency, tokens/s)]}}: concurrency 1 from the main rows, higher
    levels from the sweep (methods in the sweep only)."""
    out: dict = {}
    for name, per in res["concurrency"][next(iter(res["concurrency"]))].items():
        for w in per:
            pts = [(1, res["results"][name][w]["tokens_per_s"])]
            pts += [(int(c), lvl[name][w]["tokens_per_s"]) for c, lvl in res["concurrency"].items()]
            out.setdefault(w, {})[name] = pts
    return out


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


def _ratio(x: float | None) -> str:
    """A realized ÷ predicted ratio for the report ("–": no such step was seen)."""
    return "–" if x is None else f"{x:.2f}"


def _cpu() -> str:
    return cpu_model()


def ratios(rows: dict, k: int, pl: int) -> dict:
    """The goal figures (issue 3) as measured ratios of tokens/s (and ITL for capture)."""
    def tps(m, w):
        return rows.get(m, {}).get(w, {}).get("tokens_per_s")

    r = {}
    for w in WORKLOADS:
        base = tps("tidespec_no_spec", w)
        for m in (f"tidespec_adapted_k{k}", "tidespec_adapted_adaptive", "tidespec_adapted_tree_adaptive",
                  "tidespec_static_adaptive", "tidespec_suffix", "tidespec_hybrid_adaptive",
                  "tidespec_hybrid_tree_adaptive"):
            if base and tps(m, w):
                r[f"{w}: {m} / no_spec"] = tps(m, w) / base
        for m in ("tidespec_adapted_adaptive", "tidespec_adapted_tree_adaptive", "tidespec_hybrid_adaptive",
                  "tidespec_hybrid_tree_adaptive"):
            if tps(f"hf_prompt_lookup_{pl}", w) and tps(m, w):
                r[f"{w}: {m} / hf_prompt_lookup"] = tps(m, w) / tps(f"hf_prompt_lookup_{pl}", w)
        if tps("hf_generate", w) and base:
            r[f"{w}: tidespec_no_spec / hf_generate"] = base / tps("hf_generate", w)
        for m in [x for x in rows if x.startswith("vllm_") and x != "vllm_no_spec"]:
            if tps("vllm_no_spec", w) and tps(m, w):
                r[f"{w}: {m} / vllm_no_spec"] = tps(m, w) / tps("vllm_no_spec", w)
        if tps("vllm_no_spec", w) and base:
            r[f"{w}: tidespec_no_spec / vllm_no_spec"] = base / tps("vllm_no_spec", w)
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
    if any(x["kind"] == "vllm" for x in res.get("methods", ())):
        lines += [f"vllm_* rows: a vLLM {res['info'].get('vllm_no_spec', {}).get('vllm', '')} OpenAI server per row "
                  "(`make vllm`, same target dir, fp32, prefix caching off, same OMP threads), driven over HTTP "
                  "from the worker: token-id prompts, streamed, one chunk per engine step (τ = tokens per chunk); "
                  f"peak RSS = {'the sum of the server processes’ peaks (API server, engine core, worker)' if any('server_peak_rss_mb' in i for i in res['info'].values()) else 'the HTTP client’s only (this report predates measuring the server; a vLLM server of this target peaks at ~3.5–5 GB)'}. "
                  "Their times include the HTTP round trip and streaming that the in-process rows do not pay. "
                  f"n-gram: prompt_lookup_min 2, max {VLLM_NGRAM_MAX}. EAGLE3 in vLLM runs chains at fixed k.", ""]
    elif res["setup"].get("vllm_skipped"):
        lines += [f"No vllm_* rows: {res['setup']['vllm_skipped']}.", ""]
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
    if res.get("concurrency"):
        lines += sweep_markdown(res)
    ad = {n: i.get("adaptive") for n, i in res["info"].items() if i.get("adaptive")}
    if ad:
        lines += ["## Adaptive k (chosen per workload class at the end of the run)", ""]
        for n, rep in ad.items():
            for cls, v in rep.items():
                if cls in ("warmup", "profile"):
                    continue
                if "accepted_by_tree_size" in v:  # EAGLE-2 trees (engine.tree)
                    lines.append(f"- {n} / {cls} (trees): accepted tokens by tree size {v['accepted_by_tree_size']}, "
                                 f"conditional acceptance by depth {v['conditional_acceptance_by_depth']}")
                lines.append(f"- {n} / {cls}: k = {v['k']} alone (speculation {'on' if v['speculation'] else 'off'}), "
                             f"by batch size {v.get('k_by_batch', {})}, predicted speed-up alone "
                             f"{v['predicted_speedup']:.2f}×, conditional acceptance {v['conditional_acceptance']}, "
                             f"suffix correction {v.get('suffix_correction', 1.0)}, suffix proposals off "
                             f"at batch sizes {v.get('suffix_off_at_batch', [])}")
        for n, i in res["info"].items():
            if i.get("realized"):
                lines += [f"- {n} / {cls}: realized ÷ predicted tokens/ms (plain, speculative) and the margin a "
                          "plan must clear, by batch size: " + ", ".join(
                              f"{b}: {_ratio(v['plain'])}, {_ratio(v['speculative'])} → {100 * v['margin']:.0f} %"
                              for b, v in by_b.items()) for cls, by_b in i["realized"].items()]
        cal = max((i["calibration_ms"] for i in res["info"].values() if i.get("calibration_ms")),
                  key=lambda c: c["draft_step"])  # one with a draft, when any method has one
        lines += ["", f"Calibration (ms): target forward of 1..k+1 tokens {[round(x, 1) for x in cal['target']]}, "
                  f"draft step {cal['draft_step']:.2f}.", ""]
    if prof:
        lines += ["## Profile (one request, tidespec with draft, torch.profiler, top ops by self CPU time)", "",
                  "```", prof.strip(), "```", ""]
    return "\n".join(lines)


def sweep_markdown(res: dict) -> list[str]:
    """The concurrency sweep: paired ratio to no speculation per workload × concurrency, and tokens/s."""
    cs = ["1", *res["concurrency"]]
    ws = list(next(iter(res["concurrency"].values()))["tidespec_no_spec"])
    lines = ["## Concurrency: tokens/s over tidespec_no_spec at the same concurrency (median of the per-pass "
             "paired ratios, range; ~ = inside the noise). Concurrency 1: the rows above.", "",
             "| method | " + " | ".join(f"{w} c={c}" for w in ws for c in cs) + " |",
             "|---|" + "---|" * (len(ws) * len(cs))]
    for name in next(iter(res["concurrency"].values())):
        if name == "tidespec_no_spec":
            continue
        cells = []
        for w in ws:
            for c in cs:
                x = res["spread"].get(w, {}).get(name) if c == "1" else res["concurrency"][c][name][w].get("ratio")
                cells.append("-" if x is None else
                             f"{x['median']:.2f}× ({x['min']:.2f}–{x['max']:.2f}){' ~' if x['inside_noise'] else ''}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "| method | " + " | ".join(f"{w} c={c} tok/s · τ" for w in ws for c in cs) + " |",
              "|---|" + "---|" * (len(ws) * len(cs))]
    for name in next(iter(res["concurrency"].values())):
        cells = []
        for w in ws:
            for c in cs:
                r = res["results"][name][w] if c == "1" else res["concurrency"][c][name][w]
                cells.append(f"{r['tokens_per_s']:.1f} · {r['tau']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    ident = min(r["identical_to_target_only"] for lvl in res["concurrency"].values() for per in lvl.values()
                for r in per.values())
    lines += ["", f"Identical to target-only (greedy) across the sweep: {ident:.0%} of requests (lowest method).", ""]
    return lines
