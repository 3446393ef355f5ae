"""`tidespec bench engine`: the engine against what a user would otherwise run, side by side (`run`).

One interleaved run: every prompt to every method in turn, each method in its own worker process
(spawned fresh; each reports its own peak RSS), greedy, fixed threads, on code, chat and math. A
concurrency sweep runs the tidespec methods (and vLLM's, with `make vllm`) with c closed-loop
clients; HF rows at concurrency 1. Paired ratios with their spread. Output: `<out>/engine.json`,
`.md` and, with a sweep, `engine-concurrency.png`. The design choices: docs/design/bench.md.
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
from ..engine.stats import itl_percentiles
from ..models.chat import prompt_ids
from ..models.load import get_target
from ..models.precision import precision_name
from .engine_report import REF, VLLM_NGRAM_MAX, WORKLOADS, _cpu, markdown, ratios
from .methods import PRECISIONS, MethodSpec, TidespecMethod, worker

TREE = (4, 12)  # the tree methods' (eagle_topk, num_draft_tokens): up to 11 nodes, the policy sizes each step
LLAMA_CPP_REF = "llama_cpp_no_spec"


def reference_of(spec: MethodSpec) -> str:
    """The row whose outputs `spec`'s must equal (lossless: target-only decoding on the same weights at
    the same precision): tidespec at another precision → its own no-speculation row; llama.cpp →
    llama.cpp without speculation; every other row → tidespec_no_spec."""
    if spec.kind == "llama_cpp":
        return LLAMA_CPP_REF
    if spec.kind == "tidespec" and spec.precision is not None:
        return f"{REF}_{spec.precision}"
    return REF




def default_methods(static: Path | None, adapted: Path | None, k: int, prompt_lookup: int,
                    vllm_python: str | None = None, precisions: tuple[str, ...] = (),
                    llama_cpp: bool = False) -> list[MethodSpec]:
    """The rows: HF, tidespec (each proposer and policy), and with `vllm_python` (`make vllm`'s
    interpreter) a real vLLM server per row: none, n-gram, EAGLE3 static and adapted at fixed k.
    Per precision of `precisions` (methods.PRECISIONS names): tidespec without speculation and in
    the default configuration (the adapted draft + suffix, goodput policy), `<row>_<precision>`.
    `llama_cpp`: llama.cpp on the GGUF, without speculation and with its prompt lookup at k."""
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
    for p in precisions:
        m.append(MethodSpec(f"tidespec_no_spec_{p}", "tidespec", precision=p))
        if adapted is not None:
            m.append(MethodSpec(f"tidespec_hybrid_adaptive_{p}", "tidespec", draft=str(adapted), suffix=True,
                                precision=p))
    if llama_cpp:
        m += [MethodSpec(LLAMA_CPP_REF, "llama_cpp"),
              MethodSpec(f"llama_cpp_prompt_lookup_{k}", "llama_cpp", prompt_lookup=k)]
    if vllm_python:
        m += [MethodSpec("vllm_no_spec", "vllm", python=vllm_python),
              MethodSpec(f"vllm_ngram_k{k}", "vllm", prompt_lookup=VLLM_NGRAM_MAX, k=k, python=vllm_python)]
        m += [MethodSpec(f"vllm_eagle3_{name}_k{k}", "vllm", draft=str(d), k=k, python=vllm_python)
              for name, d in (("static", static), ("adapted", adapted)) if d is not None]
    return m




def select_methods(params, static: Path | None, adapted: Path | None, prompt_lookup: int, vllm_python: str | None,
                   precisions: list[str], llama_skipped: str | None, only: list[str]) -> list[MethodSpec]:
    """`default_methods` as `tidespec bench engine`'s options say: `precisions` (methods.PRECISIONS
    names; params' own is the reference rows' and is not repeated), llama.cpp rows unless
    `llama_skipped` says why not, `only` these rows (empty: all) plus each one's reference
    (`reference_of`) and tidespec_no_spec. Raises ValueError naming an unknown precision or row."""
    bad = sorted(set(precisions) - set(PRECISIONS))
    if bad:
        raise ValueError(f"--precision {', '.join(bad)}: choose from {', '.join(PRECISIONS)}")
    own = precision_name(getattr(torch, params.target.dtype), params.target.quantization)
    specs = default_methods(static, adapted, params.engine.num_draft_tokens, prompt_lookup, vllm_python,
                            tuple(dict.fromkeys(x for x in precisions if x != own)), not llama_skipped)
    if not only:
        return specs
    names = [s.name for s in specs]
    bad = sorted(set(only) - set(names))
    if bad:
        why = f" ({llama_skipped})" if llama_skipped and any(m.startswith("llama_cpp") for m in bad) else ""
        raise ValueError(f"unknown method(s) {bad}{why}; choose from {names}")
    keep = set(only) | {reference_of(s) for s in specs if s.name in only} | {REF}
    return [s for s in specs if s.name in keep]


def workload_prompts(tok, params, n: int, prompts_file: Path | None = None) -> dict[str, list[tuple[str, list[int]]]]:
    """{"code": HumanEval holdout, "chat": MT-Bench turn 1, "math": GSM8K (English)}, n each, as
    (id, chat-templated ids); with `prompts_file`, the file's prompts per its workloads instead
    (`assets.prompts.from_file`, raising its ValueError)."""
    if prompts_file is not None:
        out: dict[str, list[tuple[str, list[int]]]] = {}
        for p in prompts.from_file(prompts_file, WORKLOADS):
            out.setdefault(p.workload, []).append((p.id, prompt_ids(tok, p.text)))
        return {k: v[:n] for k, v in out.items()}
    w = params.workload
    _, hold = prompts.split(prompts.load("humaneval"), w.holdout_fraction, w.seed)
    chat = [p for p in prompts.load("mtbench") if p.workload == "chat"]
    return {"code": [(p.id, prompt_ids(tok, p.text)) for p in hold[:n]],
            "chat": [(p.id, prompt_ids(tok, p.text)) for p in chat[:n]],
            "math": [(p.id, prompt_ids(tok, p.text)) for p in prompts.load("gsm-en")[:n]]}


def file_workloads(prompts_file: Path, wanted) -> list[str]:
    """The workloads of `wanted` that `prompts_file` holds (`assets.prompts.from_file`, raising its
    ValueError); ValueError when it holds none of them."""
    have = {p.workload for p in prompts.from_file(prompts_file, WORKLOADS)}
    if not (keep := [w for w in wanted if w in have]):
        raise ValueError(f"{prompts_file} holds workloads {sorted(have)}, none of --workload's: name one of them")
    return keep


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
        vllm_skipped: str | None = None, llama_cpp_skipped: str | None = None,
        prompts_file: Path | None = None) -> dict:
    """Run the benchmark; writes `out/engine.json` and `out/engine.md`, returns the result dict.

    `passes` interleaved passes over the same prompts (each pass rotates the method order; the
    suffix proposer's global tree is reset at each pass start so a pass never sees the outputs of
    the pass before). Per pass, each method's tokens/s over no speculation gives one paired ratio;
    the report gives their median and range (`spread`) and flags a ratio whose range spans 1.0 as
    inside the noise. `methods`: default `default_methods`. `concurrency`: levels above 1 add the
    sweep (module docstring). `vllm_skipped` / `llama_cpp_skipped`: why there are no vLLM / llama.cpp
    rows (recorded in the report). `prompts_file`: the prompts a user brings (`workload_prompts`) in
    place of the built-in sets; `workloads` are then the file's. Each row's outputs are compared with its reference's
    (`reference_of`: lossless at its precision) and with params' precision's
    (`identical_to_reference_precision`)."""
    threads = threads or torch.get_num_threads()
    _, tok = get_target(params)
    levels = sorted({c for c in concurrency if c > 1})
    wl_all = {k: v for k, v in workload_prompts(tok, params, max([n_prompts, *levels]), prompts_file).items()
              if k in workloads}
    wl = {k: v[:n_prompts] for k, v in wl_all.items()}
    k = params.engine.num_draft_tokens
    specs = methods or default_methods(static, adapted, k, prompt_lookup)
    missing = sorted({reference_of(s) for s in specs} - {s.name for s in specs})
    if missing:
        raise ValueError(f"rows {missing} are the references of other rows: add them to the methods")
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
    ref_name = REF
    missing = sorted({reference_of(s) for s in specs} - set(raw))
    if missing:  # checked before the run too (below); a row is only judged against its own reference
        raise ValueError(f"rows {missing} are the references of other rows: add them to the methods")
    rows = {}
    for s in specs:
        rows[s.name] = {}
        for name in wl:
            ref = {r["id"]: r["tokens"] for r in raw[reference_of(s)][name]}
            fp32 = {r["id"]: r["tokens"] for r in raw[REF][name]}  # params' precision: the reference outputs
            rows[s.name][name] = summarize(raw[s.name][name], ref) | {"peak_rss_mb": rss[s.name]} | {
                "identical_to_reference_precision": sum(r["tokens"] == fp32[r["id"]] for r in raw[s.name][name])
                / len(raw[s.name][name])}
    spread = pass_ratios(raw, ref_name, passes)
    spread_llama = pass_ratios(raw, LLAMA_CPP_REF, passes) if LLAMA_CPP_REF in raw else {}
    sweep = {str(c): sweep_summary(per, ref_name) for c, per in sweep_raw.items()}
    res = {"benchmark": "engine", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
                       "python": platform.python_version()},
           "setup": {"prompts_per_workload": n_prompts, "max_new_tokens": max_new_tokens, "greedy": True,
                     "dtype": params.target.dtype, "quantization": params.target.quantization, "k": k,
                     "prompt_lookup_num_tokens": prompt_lookup,
                     "prompts": str(prompts_file) if prompts_file else "built-in sets",
                     "static_draft": str(static) if static else None,
                     "adapted_draft": str(adapted) if adapted else None, "passes": passes,
                     "concurrency": [1, *levels], "wall_s": time.time() - t0, "vllm_skipped": vllm_skipped,
                     "llama_cpp_skipped": llama_cpp_skipped},
           "methods": [asdict(s) for s in specs], "results": rows, "info": info,
           "ratios": ratios(rows, k, prompt_lookup), "spread": spread, "spread_vs_llama_cpp": spread_llama,
           "concurrency": sweep}
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
    ws = [w for w in workers if w.spec.kind in ("tidespec", "vllm") and not w.spec.capture
          and w.spec.precision is None]  # the sweep's identical share is against tidespec_no_spec's outputs
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


