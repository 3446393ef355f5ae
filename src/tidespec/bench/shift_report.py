"""The workload-shift experiment's report (`tidespec bench shift`): the summary against its goals, the figures
(matplotlib), and the markdown."""

from __future__ import annotations

import json
from pathlib import Path

from ..engine.stats import per_position

NOISE_FLOOR = 0.97  # "never slower": a speed-up ≥ this counts as equal (run-to-run noise of one side-by-side pass)


# -- summary, report, plots ----------------------------------------------------------------------------
def summarize(rep: dict) -> dict:
    """Headline figures and the bench's goals vs where the run landed."""
    k = rep["k"]
    rows = []
    for ph in rep["phases"]:
        for c, arms in ph["after"].items():
            st, ad, hy = arms["static"], arms["adapted"], arms.get("hybrid")
            none = arms["none"]["tokens_per_s"]
            row = {"phase": ph["phase"], "concurrency": int(c), "tau_static": st["acceptance_length"],
                   "tau_adapted": ad["acceptance_length"], "tokens_per_s_none": none,
                   "tokens_per_s_static": st["tokens_per_s"], "tokens_per_s_adapted": ad["tokens_per_s"],
                   "adapted_over_static": ad["tokens_per_s"] / st["tokens_per_s"],
                   "mismatches": st.get("mismatches", 0) + ad.get("mismatches", 0) + (hy or {}).get("mismatches", 0)}
            if hy is not None:
                row |= {"tau_hybrid": hy["acceptance_length"], "tokens_per_s_hybrid": hy["tokens_per_s"],
                        "hybrid_over_static": hy["tokens_per_s"] / st["tokens_per_s"],
                        "hybrid_over_none": hy["tokens_per_s"] / none}
            rows.append(row)
    shifted = [r for r in rows if r["phase"] != rep["phases"][0]["phase"]]
    code = [r for r in rows if r["phase"] == "code"]
    cyc = [c["cycle_s"] for c in rep["cycles"] if not c.get("skipped")]
    open_ = rep.get("contrast", {}).get("open-ended")
    cost = rep.get("contrast", {}).get("_cost_model")
    goals = {
        "adapted_over_static_shifted_min": min((r["adapted_over_static"] for r in shifted), default=None),
        "adapted_over_static_shifted_max": max((r["adapted_over_static"] for r in shifted), default=None),
        "tau_code_k": k,
        "tau_code_adapted": code[0]["tau_adapted"] if code else None,
        "open_ended_speedup_vs_none": open_["speedup"] if open_ else None,
        "cycle_s_max": max(cyc) if cyc else None,
        "cycles_promoted": sum(bool(c.get("promoted")) for c in rep["cycles"]),
        "cycles": len(rep["cycles"]),
        "lossless": all(r["mismatches"] == 0 for r in rows),
        "breakeven_tau_k": cost["breakeven_tau"][k] if cost and k < len(cost["breakeven_tau"]) else None,
    }
    hyb = [r for r in rows if "hybrid_over_none" in r]
    if hyb:  # the adapting arm as served: champion draft + suffix proposer, goodput policy
        code_h = [r for r in hyb if r["phase"] == "code"]
        c1 = [r for r in hyb if r["concurrency"] == min(x["concurrency"] for x in hyb)
              and r["phase"] in ("code", "math-en")]
        goals |= {"hybrid_over_static_code_min": min((r["hybrid_over_static"] for r in code_h), default=None),
                  "hybrid_over_none_min": min(r["hybrid_over_none"] for r in hyb),
                  "hybrid_over_none_c1_code_math_min": min((r["hybrid_over_none"] for r in c1), default=None)}
    goals["met"] = {
        "adapted/static ≥ 1.5× on shifted phases": bool(goals["adapted_over_static_shifted_min"] and
                                                        goals["adapted_over_static_shifted_min"] >= 1.5),
        f"τ code ≥ 3.2 at k={k}": bool(goals["tau_code_adapted"] and goals["tau_code_adapted"] >= 3.2),
        "open-ended never slower than no speculation": bool(open_ and open_["speedup"] >= NOISE_FLOOR),
        "cycle ≤ 10 min": bool(cyc and max(cyc) <= 600)}
    if hyb:
        goals["met"] |= {
            "hybrid/static ≥ 1.5× on code at every concurrency": bool(goals["hybrid_over_static_code_min"] and
                                                                     goals["hybrid_over_static_code_min"] >= 1.5),
            "hybrid/no speculation ≥ 1.2× at the lowest concurrency on code and math":
                bool(goals["hybrid_over_none_c1_code_math_min"] and goals["hybrid_over_none_c1_code_math_min"] >= 1.2),
            "hybrid never slower than no speculation": goals["hybrid_over_none_min"] >= NOISE_FLOOR}
    return {"rows": rows, "goals": goals}


def write_report(rep: dict, out: Path, stem: str, draw=None, render=None) -> dict[str, Path]:
    """`out/<stem>.json`, `out/<stem>.md` and the PNGs of a summarised report; returns the plot paths.
    `draw(rep, out, stem)` → {name: path} and `render(rep, {name: file name})` → markdown: this
    experiment's `plots` and `markdown` unless given (`bench adapt` passes its own)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = (draw or plots)(rep, out, stem)
    (out / f"{stem}.json").write_text(json.dumps(rep, indent=2, default=str))
    (out / f"{stem}.md").write_text((render or markdown)(rep, {k: p.name for k, p in paths.items()}))
    return paths


def save_png(fig, path: Path) -> Path:
    """Lay out, write (110 dpi) and close a matplotlib figure; returns `path`."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SPEC_ARMS = (("static", "s--"), ("adapted", "o-"), ("hybrid", "^-"))  # speculating arms, matplotlib styles


def _plot_arms(ax, phases: list[dict], c, metric: str, arms: tuple[tuple[str, str], ...]) -> None:
    """One line per arm (name, matplotlib style) present at concurrency `c`: `metric` before and
    after each phase's cycle, in phase order."""
    for arm, style in arms:
        if arm in phases[0]["before"][c]:
            ax.plot([p[s][c][arm][metric] for p in phases for s in ("before", "after")], style, label=arm)


def plots(rep: dict, out: Path, stem: str) -> dict[str, Path]:
    """Three PNGs from an in-memory report (concurrency keys are ints): τ over the run (per phase,
    before/after its cycle, lowest concurrency), tokens/s (one panel per concurrency) and per-position
    acceptance before/after per phase. Returns {"tau", "tokens_per_s", "per_position"} → path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    phases = rep["phases"]
    cs = [int(c) for c in phases[0]["before"]] if phases else []
    xs = [f"{p['phase']}\n{s}" for p in phases for s in ("before", "after")]
    paths = {}
    fig, ax = plt.subplots(figsize=(max(6, len(xs) * 0.9), 3.6))
    c0 = min(cs, default=1)
    _plot_arms(ax, phases, c0, "acceptance_length", SPEC_ARMS)
    ax.set_xticks(range(len(xs)), xs, fontsize=8)
    ax.set_ylabel(f"τ (k={rep['k']})")
    ax.set_title("acceptance length over the shifting workload")
    ax.legend()
    paths["tau"] = save_png(fig, out / f"{stem}-tau.png")

    fig, axes = plt.subplots(1, len(cs), figsize=(max(6, len(xs) * 0.9) * max(1, len(cs)) / 1.6, 3.6), squeeze=False)
    for ax, c in zip(axes[0], cs):
        _plot_arms(ax, phases, c, "tokens_per_s", (("none", ":"), *SPEC_ARMS))
        ax.set_xticks(range(len(xs)), xs, fontsize=7)
        ax.set_title(f"concurrency {c}")
        ax.set_ylabel("tokens/s")
    axes[0][0].legend()
    paths["tokens_per_s"] = save_png(fig, out / f"{stem}-tokens-per-s.png")

    fig, axes = plt.subplots(1, len(phases), figsize=(3.2 * max(1, len(phases)), 3.2), squeeze=False)
    for ax, p in zip(axes[0], phases):
        for label, m, style in (("static", p["before"][c0]["static"], "s--"),
                                ("adapted before", p["before"][c0]["adapted"], "o:"),
                                ("adapted after", p["after"][c0]["adapted"], "o-")):
            acc = per_position(m)
            ax.plot(range(1, len(acc) + 1), acc, style, label=label)
        ax.set_title(p["phase"])
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1)
    axes[0][0].set_ylabel("accepted / drafts")
    axes[0][0].legend(fontsize=7)
    paths["per_position"] = save_png(fig, out / f"{stem}-per-position.png")
    return paths


def markdown(rep: dict, figs: dict[str, str]) -> str:
    """The report as markdown: tables after/before each cycle, cycles, contrast, step costs, goals;
    `figs` = plot name → file name (relative links)."""
    s, g = rep["summary"], rep["summary"]["goals"]
    L = [f"# Workload-shift experiment ({rep['config']['phases'][0]} → … → {rep['config']['phases'][-1]})", "",
         f"SmolLM2-135M-Instruct fp32 target, EAGLE3 drafts, greedy, k={rep['k']}, {rep['cpu_threads']} CPU threads; "
         f"{rep['config']['eval_prompts']} held-out prompts per phase × ≤{rep['config']['max_new_tokens']} tokens; "
         f"run wall time {rep['wall_s'] / 60:.1f} min. Every number below was produced by this run.", "",
         "## After each phase's cycle (held-out prompts of that phase)", "",
         "| phase | conc. | τ static | τ adapted | τ hybrid | tok/s none | tok/s static | tok/s adapted | tok/s hybrid "
         "| adapted/static | hybrid/static | hybrid/none | = target-only |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def h(r, key, fmt):
        return format(r[key], fmt) if key in r else "-"
    for r in s["rows"]:
        L.append(f"| {r['phase']} | {r['concurrency']} | {r['tau_static']:.2f} | {r['tau_adapted']:.2f} | "
                 f"{h(r, 'tau_hybrid', '.2f')} | {r['tokens_per_s_none']:.1f} | {r['tokens_per_s_static']:.1f} | "
                 f"{r['tokens_per_s_adapted']:.1f} | {h(r, 'tokens_per_s_hybrid', '.1f')} | "
                 f"{r['adapted_over_static']:.2f}× | {h(r, 'hybrid_over_static', '.2f')}× | "
                 f"{h(r, 'hybrid_over_none', '.2f')}× | {'yes' if r['mismatches'] == 0 else 'NO'} |")
    L += [
        "",
        "## Before each phase's cycle (champion of the previous phase on the new traffic)",
        "",
        "| phase | conc. | τ static | τ adapted | τ hybrid | tok/s none | tok/s static | tok/s adapted "
        "| tok/s hybrid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in rep["phases"]:
        for c, a in p["before"].items():
            hy = a.get("hybrid")
            L.append(
                f"| {p['phase']} | {c} | {a['static']['acceptance_length']:.2f} | "
                f"{a['adapted']['acceptance_length']:.2f} | "
                f"{hy['acceptance_length'] if hy else '-':{'.2f' if hy else ''}} | "
                f"{a['none']['tokens_per_s']:.1f} | {a['static']['tokens_per_s']:.1f} | "
                f"{a['adapted']['tokens_per_s']:.1f} | "
                f"{hy['tokens_per_s'] if hy else '-':{'.1f' if hy else ''}} |"
            )
    L += [
        "",
        "## Cycles (capture threshold → promoted draft deployed)",
        "",
        "| phase | snapshot tokens | cycle s | train s | drift JSD | cand. τ | champ. τ | decision |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in rep["cycles"]:
        if c.get("skipped"):
            L.append(
                f"| {c['phase']} | {c['snapshot_tokens']} | {c['cycle_s']:.0f} | | | | | skipped: {c['skipped']} |"
            )
            continue
        ct, dj = c.get("champion_tau"), c.get("drift_jsd")
        djs = "" if dj is None else f"{dj:.3f}"
        cts = "" if ct is None else f"{ct:.2f}"
        L.append(f"| {c['phase']} | {c['snapshot_tokens']} | {c['cycle_s']:.0f} | {c.get('train_s') or 0:.0f} | "
                 f"{djs} | {c['candidate_tau']:.2f} | {cts} | {'promoted' if c['promoted'] else 'rejected'} "
                 f"v{c['version']} |")
    if rep.get("contrast"):
        margin = (rep["contrast"].get("_cost_model") or {}).get("margin")
        L += ["", "## Structured vs open-ended (adaptive k per workload, final champion, concurrency 1)", "",
              "The policy (`engine.adaptive`) learns each group's per-position acceptance online and picks the k "
              "with the best predicted tokens/s; speculation stays off (k = 0, with a probe step every "
              "`adaptive_probe_every` steps) unless it is predicted to beat plain decoding"
              + (f" by {100 * margin:.0f} %" if margin is not None else "") + ".", "",
              "| group | structured | k chosen | predicted | τ | ITL p50 ms none | ITL p50 ms spec | tok/s none | "
              "tok/s spec | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
        for grp, c in rep["contrast"].items():
            if grp.startswith("_"):
                continue
            pred = c.get("predicted_speedup")
            L.append(f"| {grp} | {'yes' if c['structured'] else 'no'} | {c['k_chosen']} | "
                     f"{'' if pred is None else f'{pred:.2f}×'} | {c['tau']:.2f} | "
                     f"{c['itl_ms_p50_none']:.0f} | {c['itl_ms_p50_spec']:.0f} | {c['tokens_per_s_none']:.1f} | "
                     f"{c['tokens_per_s_spec']:.1f} | {c['speedup']:.2f}× |")
    cost = (rep.get("contrast") or {}).get("_cost_model")
    if cost:
        k = rep["k"]
        L += ["", "## The limit that binds: step cost vs τ (measured on this machine, batch 1)", "",
              f"One plain decode step costs {cost['step_ms'][0]:.0f} ms; a step with k drafts costs the verify of k+1 "
              f"tokens plus k draft steps ({cost['draft_ms']:.1f} ms each): " + ", ".join(
                  f"k={i}: {ms:.0f} ms" for i, ms in enumerate(cost["step_ms"])) + ". Speculation pays only when τ "
              "exceeds the cost ratio: break-even τ " + ", ".join(
                  f"k={i}: {b:.2f}" for i, b in enumerate(cost["breakeven_tau"]) if i) +
              f". At k={k} the drafts above need τ > {cost['breakeven_tau'][k]:.2f} to beat no speculation; the "
              "adapted τ per phase is in the tables."]
    L += ["", "## Goals and where this run landed", ""]
    for name, ok in g["met"].items():
        L.append(f"- {'met' if ok else 'NOT met'}: {name}")
    if g.get("hybrid_over_none_min") is not None:
        L += [
            "- hybrid (champion + suffix corpus, goodput policy) / no speculation: lowest "
            f"{g['hybrid_over_none_min']:.2f}×"
            f" over every phase and concurrency; on code and math at the lowest concurrency ≥ "
            f"{g['hybrid_over_none_c1_code_math_min'] or 0:.2f}×; hybrid/static on code ≥ "
            f"{g['hybrid_over_static_code_min'] or 0:.2f}×"
        ]
    L += [f"- adapted/static tokens/s on shifted phases: {g['adapted_over_static_shifted_min']:.2f}× – "
          f"{g['adapted_over_static_shifted_max']:.2f}×" if g["adapted_over_static_shifted_min"] else "",
          f"- τ on code at k={g['tau_code_k']}: {g['tau_code_adapted']:.2f}" if g["tau_code_adapted"] else "",
          f"- cycles: {g['cycles']} ({g['cycles_promoted']} promoted), longest {g['cycle_s_max']:.0f} s"
          if g["cycle_s_max"] else "", f"- lossless (every output = target-only): {g['lossless']}", ""]
    L += [
        f"![τ]({figs['tau']})",
        "",
        f"![tokens/s]({figs['tokens_per_s']})",
        "",
        f"![per-position]({figs['per_position']})",
        "",
    ]
    return "\n".join(x for x in L if x is not None) + "\n"
