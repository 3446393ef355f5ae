"""`tidespec bench engine`'s report: the per-method table, paired ratios with their spread, the concurrency sweep, the
policy's choices per class, the calibration, as markdown."""

from __future__ import annotations

from ..engine.calibration import cpu_model

REF = "tidespec_no_spec"  # every ratio's reference: target-only at params' precision
PRECISION_SUFFIXES = ("_fp32", "_bf16", "_int8", "_int4")  # rows at another precision than params'

WORKLOADS = ("code", "chat", "math")
VLLM_NGRAM_MAX = 4  # vLLM n-gram rows: prompt_lookup_max (min 2), the value vLLM's docs use


SERVER_RSS = "the sum of the server processes’ peaks (API server, engine core, worker)"
CLIENT_RSS = ("the HTTP client’s only (this report predates measuring the server; a vLLM server of this target "
              "peaks at ~3.5–5 GB)")


def _ratio(x: float | None) -> str:
    """A realized ÷ predicted ratio for the report ("–": no such step was seen)."""
    return "–" if x is None else f"{x:.2f}"


def _cpu() -> str:
    return cpu_model()


def ratios(rows: dict, k: int, pl: int) -> dict:
    """The goal figures as measured ratios of tokens/s (and ITL for capture)."""
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
        for m in [x for x in rows if x.startswith("tidespec_") and tps("llama_cpp_no_spec", w) and tps(x, w)]:
            if m in ("tidespec_no_spec", "tidespec_hybrid_adaptive") or m.endswith(PRECISION_SUFFIXES):
                r[f"{w}: {m} / llama_cpp_no_spec"] = tps(m, w) / tps("llama_cpp_no_spec", w)
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
        lines += [
            f"vllm_* rows: a vLLM {res['info'].get('vllm_no_spec', {}).get('vllm', '')} OpenAI server per row "
            "(`make vllm`, same target dir, fp32, prefix caching off, same OMP threads), driven over HTTP "
            "from the worker: token-id prompts, streamed, one chunk per engine step (τ = tokens per chunk); "
            f"peak RSS = {SERVER_RSS if any('server_peak_rss_mb' in i for i in res['info'].values()) else CLIENT_RSS}. "
            "Their times include the HTTP round trip and streaming that the in-process rows do not pay. "
            f"n-gram: prompt_lookup_min 2, max {VLLM_NGRAM_MAX}. EAGLE3 in vLLM runs chains at fixed k.",
            "",
        ]
    elif res["setup"].get("vllm_skipped"):
        lines += [f"No vllm_* rows: {res['setup']['vllm_skipped']}.", ""]
    lines += _precision_notes(res)
    for w in next(iter(res["results"].values())):
        lines += [f"## {w}", "", "| method | tokens/s | τ | accept rate | ITL p50 ms | ITL p99 ms | TTFT p50 ms "
                  f"| peak RSS MB | = target-only | = {REF} |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name, per in res["results"].items():
            r = per[w]
            ar = f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-"
            same = r.get("identical_to_reference_precision")
            tau = "-" if name.startswith("llama_cpp") else f"{r['tau']:.2f}"
            lines.append(f"| {name} | {r['tokens_per_s']:.2f} | {tau} | {ar} | {r['itl_ms_p50']:.1f} | "
                         f"{r['itl_ms_p99']:.1f} | {r['ttft_ms_p50']:.0f} | {r['peak_rss_mb']:.0f} | "
                         f"{r['identical_to_target_only']:.0%} | {'-' if same is None else f'{same:.0%}'} |")
        lines.append("")
    lines += ["## Ratios", ""] + [f"- {k}: {v:.3f}" for k, v in res["ratios"].items()] + [""]
    if res.get("spread"):
        lines += _spread_table(res, "spread", REF)
    if res.get("spread_vs_llama_cpp"):
        lines += _spread_table(res, "spread_vs_llama_cpp", "llama_cpp_no_spec")
    if res.get("concurrency"):
        lines += sweep_markdown(res)
    ad = {n: i.get("adaptive") for n, i in res["info"].items() if i.get("adaptive")}
    if ad:
        lines += ["## Adaptive k (chosen per workload class at the end of the run)", ""]
        for n, rep in ad.items():
            for workload, v in rep.items():
                if workload in ("warmup", "profile"):
                    continue
                if "accepted_by_tree_size" in v:  # EAGLE-2 trees (engine.tree)
                    lines.append(f"- {n} / {workload} (trees): accepted tokens by tree size "
                                 f"{v['accepted_by_tree_size']}, "
                                 f"conditional acceptance by depth {v['conditional_acceptance_by_depth']}")
                lines.append(f"- {n} / {workload}: k = {v['k']} alone "
                             f"(speculation {'on' if v['speculation'] else 'off'}), "
                             f"by batch size {v.get('k_by_batch', {})}, predicted speed-up alone "
                             f"{v['predicted_speedup']:.2f}×, conditional acceptance {v['conditional_acceptance']}, "
                             f"suffix correction {v.get('suffix_correction', 1.0)}, suffix proposals off "
                             f"at batch sizes {v.get('suffix_off_at_batch', [])}")
        for n, i in res["info"].items():
            if i.get("realized"):
                lines += [f"- {n} / {workload}: realized ÷ predicted tokens/ms (plain, speculative) and the margin a "
                          "plan must clear, by batch size: " + ", ".join(
                              f"{b}: {_ratio(v['plain'])}, {_ratio(v['speculative'])} → {100 * v['margin']:.0f} %"
                              for b, v in by_b.items()) for workload, by_b in i["realized"].items()]
        cal = max((i["calibration_ms"] for i in res["info"].values() if i.get("calibration_ms")),
                  key=lambda c: c["draft_step"])  # one with a draft, when any method has one
        lines += ["", f"Calibration (ms): target forward of 1..k+1 tokens {[round(x, 1) for x in cal['target']]}, "
                  f"draft step {cal['draft_step']:.2f}.", ""]
    if prof:
        lines += ["## Profile (one request, tidespec with draft, torch.profiler, top ops by self CPU time)", "",
                  "```", prof.strip(), "```", ""]
    return "\n".join(lines)


def _spread_table(res: dict, key: str, ref: str) -> list[str]:
    """Paired ratios of tokens/s to `ref` (`res[key]`: workload → method → median, range) as a table."""
    sp = res[key]
    lines = [f"## Paired ratios to {ref} over {res['setup'].get('passes', 1)} interleaved passes "
             "(median, range; ~ = the range spans 1.0: inside the noise)", "",
             "| method | " + " | ".join(sp) + " |", "|---|" + "---|" * len(sp)]
    for name in res["results"]:
        cells = []
        for w in sp:
            x = sp[w].get(name)
            cells.append("-" if x is None else
                         f"{x['median']:.2f}× ({x['min']:.2f}–{x['max']:.2f}){' ~' if x['inside_noise'] else ''}")
        if any(c != "-" for c in cells):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines + [""]


def _precision_notes(res: dict) -> list[str]:
    """What the precision and llama.cpp rows are (or why there are no llama.cpp rows)."""
    out = []
    if any(x.get("precision") for x in res.get("methods", ())):
        out += ["`_int8` / `_int4` / `_bf16` rows: the target at that precision (`target.quantization`, "
                "`target.dtype`); `= target-only`: equal to `tidespec_no_spec` at the same precision (lossless), "
                f"`= {REF}`: equal to params' precision's outputs (a near-tie flipped by rounding where not).", ""]
    if any(x["kind"] == "llama_cpp" for x in res.get("methods", ())):
        v = res["info"].get("llama_cpp_no_spec", {}).get("llama_cpp_python", "")
        out += [f"llama_cpp_* rows: llama-cpp-python {v} on the shipped GGUF (Q4_1 layers, Q8_0 embedding), "
                "greedy, same threads and token ids; `= target-only` compares with its own plain decoding; "
                "τ is not exposed.", ""]
    elif res["setup"].get("llama_cpp_skipped"):
        out += [f"No llama_cpp_* rows: {res['setup']['llama_cpp_skipped']}.", ""]
    return out


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
