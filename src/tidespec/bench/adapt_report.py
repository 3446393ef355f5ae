"""`tidespec bench adapt`'s report: the summary against its goals, the markdown and the plots, from a
run's records (`bench.adapt.run` writes them; these functions read only the report dict)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from ..engine.stats import per_position, tau_standard_error
from . import shift_report

ARMS = ("none", "static", "in_domain", "adapted", "default")  # per point; "default" = the hybrid as serve runs it
STYLES = (("none", ":"), ("static", "s--"), ("in_domain", "d-."), ("adapted", "o-"), ("default", "^-"))  # matplotlib
NOISE = 0.03  # "within noise" for τ changes between points (greedy τ is deterministic; tokens/s is not)


def ratio_spread(by_c: dict, num: str, den: str) -> dict[int, tuple[float, float, float]]:
    """Per concurrency, (median, min, max) of the paired per-pass tokens/s ratio num / den."""
    out = {}
    for c, arms in by_c.items():
        rs = [a / b for a, b in zip(arms[num].get("tokens_per_s_passes", [arms[num]["tokens_per_s"]]),
                                    arms[den].get("tokens_per_s_passes", [arms[den]["tokens_per_s"]])) if b]
        out[c] = (statistics.median(rs), min(rs), max(rs)) if rs else (0.0, 0.0, 0.0)
    return out


def series(rep: dict, workload: str, arm: str, key: str, c: int) -> list[tuple[int, float]]:
    """(cycle, value) of one arm's metric at concurrency c on a workload's held-out prompts."""
    return [(p["cycle"], p["by_concurrency"][c][arm][key]) for p in rep["points"] if p["workload"] == workload]


def tau_se(m: dict) -> float:
    """Standard error of an arm's measured τ (`stats.tau_standard_error`, from its per-position
    acceptance and number of verify steps)."""
    return tau_standard_error(per_position(m), m.get("num_drafts", 0.0))


def summarize(rep: dict) -> dict:
    """The bench's goals as figures: adapted (default config) / static tokens/s per concurrency at
    the last cycle on the workload before the switch; τ trajectory and whether it still rises at the
    last such cycle (or where it saturated); promotions that lowered held-out τ; τ after the switch
    and back against its best before; outputs == target-only everywhere."""
    cfg = rep["config"]
    w, n = cfg["workload"], cfg["cycles"]
    cs = sorted({int(c) for p in rep["points"] for c in p["by_concurrency"]})
    c0 = cs[0]
    tau = dict(series(rep, w, "adapted", "acceptance_length", c0))
    before = [tau[i] for i in range(n + 1) if i in tau]
    best = max(before)
    last_pt = next(p for p in rep["points"] if p["workload"] == w and p["cycle"] == n)
    ratio = ratio_spread(last_pt["by_concurrency"], "default", "static")  # paired per pass: (median, min, max)
    vs_none = ratio_spread(last_pt["by_concurrency"], "default", "none")
    sw = [p for p in rep["points"] if p["workload"] == cfg["switch_to"] and p["cycle"] > n]
    sw_ratio = ratio_spread(sw[-1]["by_concurrency"], "default", "static") if sw else {}
    vs_in = ratio_spread(last_pt["by_concurrency"], "default", "in_domain")
    sw_in = ratio_spread(sw[-1]["by_concurrency"], "default", "in_domain") if sw else {}
    rising = len(before) >= 2 and before[-1] > max(before[:-1]) * (1 + NOISE / 3)
    gains = [b - a for a, b in zip(before, before[1:])]
    se = {p["cycle"]: tau_se(p["by_concurrency"][c0]["adapted"]) for p in rep["points"] if p["workload"] == w}
    worse = [c for c in rep["cycles"] if c.get("promoted") and tau.get(c["cycle"], 0) < tau.get(c["cycle"] - 1, 0)
             * (1 - NOISE) and c["workload"] == w]
    # a drop beyond the measurement's noise: more than 2 standard errors of the difference of two points
    worse_beyond = [c["cycle"] for c in worse if tau.get(c["cycle"] - 1, 0.0) - tau.get(c["cycle"], 0.0)
                    > 2 * math.hypot(se.get(c["cycle"], 0.0), se.get(c["cycle"] - 1, 0.0))]
    back = [tau[i] for i in sorted(tau) if i > n]
    mism = sum(r["mismatches"] for p in rep["points"] for by in p["by_concurrency"].values() for r in by.values())
    worst = {}  # workload → the lowest default / no-speculation ratio (paired median) over its points and loads
    for p in rep["points"]:
        for c, (med, lo, hi) in ratio_spread(p["by_concurrency"], "default", "none").items():
            if p["workload"] not in worst or med < worst[p["workload"]][0]:
                worst[p["workload"]] = (med, lo, hi, int(c), p["cycle"])
    return {"workload": w, "tau_by_cycle": {str(k): v for k, v in sorted(tau.items())},
            "default_over_static": {str(c): r[0] for c, r in ratio.items()},
            "default_over_static_range": {str(c): r[1:] for c, r in ratio.items()},
            "default_over_none": {str(c): r[0] for c, r in vs_none.items()},
            "switch_default_over_static": {str(c): r[0] for c, r in sw_ratio.items()},
            "default_over_in_domain": {str(c): r for c, r in vs_in.items()},
            "switch_default_over_in_domain": {str(c): r[0] for c, r in sw_in.items()},
            "tau_still_rising": rising, "tau_gains": gains, "tau_best_before_switch": best,
            "promoted_worse": [c["cycle"] for c in worse], "promoted_worse_beyond_noise": worse_beyond,
            "tau_se_by_cycle": {str(k): v for k, v in sorted(se.items())},
            "tau_after_back": back[-1] if back else None,
            "after_back_within_5pct": (back[-1] >= 0.95 * best) if back else None,
            "promotions": sum(bool(c.get("promoted")) for c in rep["cycles"]),
            "cycles_run": len(rep["cycles"]), "mismatches": mism,
            "default_over_none_worst": {w: {"ratio": m, "min": lo, "max": hi, "concurrency": c, "cycle": cy}
                                        for w, (m, lo, hi, c, cy) in worst.items()}}


def write_report(rep: dict, out: Path, stem: str) -> dict[str, Path]:
    """`out/<stem>.json`, `.md` and the plots; returns the plot paths."""
    return shift_report.write_report(rep, out, stem, plots, markdown)




def _range(s: dict, c: int) -> str:
    lo, hi = s.get("default_over_static_range", {}).get(str(c), (None, None))
    return f"{lo:.2f}–{hi:.2f}" if lo is not None else "one pass"


def plots(rep: dict, out: Path, stem: str) -> dict[str, Path]:
    """PNGs: tokens/s over wall time per concurrency (TIDE Fig. 4), τ over captured tokens (Fig. 5),
    default/static by concurrency after the cycles (Fig. 3), per-position acceptance per cycle."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    w = rep["config"]["workload"]
    pts = [p for p in rep["points"] if p["workload"] == w]
    cs = sorted({int(c) for p in pts for c in p["by_concurrency"]})
    paths = {}
    fig, axes = plt.subplots(1, len(cs), figsize=(4.2 * len(cs), 3.4), squeeze=False)
    xs = [p["served_s"] / 60 for p in pts]
    for ax, c in zip(axes[0], cs):
        for arm, style in STYLES:
            ax.plot(xs, [p["by_concurrency"][c][arm]["tokens_per_s"] for p in pts], style, label=arm, ms=4)
        ax.set_title(f"{w}, concurrency {c}")
        ax.set_xlabel("serving + cycle wall time (min)")
        ax.set_ylabel("tokens/s (held-out)")
    axes[0][0].legend(fontsize=7)
    paths["tokens_per_s"] = shift_report.save_png(fig, out / f"{stem}-tokens-per-s.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    c0 = cs[0]
    ax.plot([p["captured_tokens"] / 1000 for p in pts], [p["by_concurrency"][c0]["adapted"]["acceptance_length"]
                                                         for p in pts], "o-", label="adapted (champion)")
    for arm, style in (("static", "s--"), ("in_domain", "d-.")):
        ax.plot([p["captured_tokens"] / 1000 for p in pts], [p["by_concurrency"][c0][arm]["acceptance_length"]
                                                             for p in pts], style, label=arm)
    for p in pts:
        ax.annotate(str(p["cycle"]), (p["captured_tokens"] / 1000, p["by_concurrency"][c0]["adapted"]
                                      ["acceptance_length"]), fontsize=7, xytext=(2, 4), textcoords="offset points")
    ax.set_xlabel("captured tokens (thousands)")
    ax.set_ylabel(f"τ at k={rep['k']} (held-out)")
    ax.set_title(f"{w}: acceptance length over the run (cycle numbers)")
    ax.legend(fontsize=7)
    paths["tau"] = shift_report.save_png(fig, out / f"{stem}-tau.png")

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    r = rep["summary"]["default_over_static"]
    ax.bar([str(c) for c in cs], [r[str(c)] for c in cs])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("default / static tokens/s")
    ax.set_title(f"after {rep['config']['cycles']} cycles on {w}")
    paths["ratio"] = shift_report.save_png(fig, out / f"{stem}-ratio.png")

    fig, ax = plt.subplots(figsize=(5, 3.4))
    for p in pts:
        m = p["by_concurrency"][c0]["adapted"]
        acc = per_position(m)
        ax.plot(range(1, len(acc) + 1), acc, "o-", ms=3, label=f"cycle {p['cycle']}", alpha=0.4 + 0.6 * (
            p["cycle"] / max(1, pts[-1]["cycle"])))
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafts")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=6, ncol=2)
    paths["per_position"] = shift_report.save_png(fig, out / f"{stem}-per-position.png")
    return paths


def markdown(rep: dict, figs: dict[str, str]) -> str:
    """The report as markdown: one row per measured point (tokens/s of every arm per concurrency, τ at
    c = 1), the cycles and their gate decisions, the goals as figures; `figs` = plot name → file name."""
    cfg, s = rep["config"], rep["summary"]
    cs = sorted({int(c) for p in rep["points"] for c in p["by_concurrency"]})
    L = [
        f"# Self-improvement over {cfg['cycles']} cycles on {cfg['workload']}"
        + (f", then {cfg['switch_to']} and back" if cfg["switch_to"] else ""),
        "",
        f"SmolLM2-135M-Instruct fp32 target, greedy, k={rep['k']}, {rep['cpu_threads']} CPU threads; "
        f"{cfg['traffic_prompts']} fresh traffic prompts per cycle served {cfg['traffic_concurrency']} at a time "
        f"(≤{cfg['traffic_max_new_tokens']} tokens), {cfg['eval_prompts']} held-out prompts × ≤{cfg['max_new_tokens']} "
        f"tokens measured after every cycle ({cfg.get('passes', 1)} interleaved passes per point, tokens/s their "
        f"median); run wall time {rep['wall_s'] / 60:.1f} min. `default` = the champion as "
        "`tidespec serve` runs it (goodput policy + suffix proposer with the corpus deployed with it); `adapted` = "
        "the champion alone at fixed k (τ); `static` = "
        + (f"the static draft `{cfg['static']}` (the first champion) at fixed k" if cfg.get("static")
           else "the generic bootstrap draft (the first champion) at fixed k")
        + "; `in-domain` = the in-domain static: the first champion the loop promoted on "
        + (f"{cfg['workload']} (cycle {rep['in_domain_static']['cycle']}, v{rep['in_domain_static']['version']})"
           if rep.get("in_domain_static") else f"{cfg['workload']} (none promoted: the static)")
        + ", trained once on its first traffic and frozen, at fixed k.",
        "",
        "| cycle | workload measured | min served | captured tokens | champion | "
        + " | ".join(f"c={c} none / static / in-domain / adapted / default tok/s" for c in cs)
        + " | τ static / in-domain / adapted / default (c=1) |",
        "|---|---|---|---|---|" + "---|" * len(cs) + "---|",
    ]
    for p in rep["points"]:
        by = p["by_concurrency"]
        cells = [" / ".join(f"{by[c][a]['tokens_per_s']:.1f}" for a in ARMS) for c in cs]
        taus = " / ".join(f"{by[cs[0]][a]['acceptance_length']:.2f}" for a in ARMS[1:])
        L.append(f"| {p['cycle']} | {p['workload']} | {p['served_s'] / 60:.1f} | {p['captured_tokens']} | "
                 f"v{p['champion_version']} | " + " | ".join(cells) + f" | {taus} |")
    L += ["", "## Cycles", "", "| cycle | workload | snapshot tokens | cycle s | decision |", "|---|---|---|---|---|"]
    for c in rep["cycles"]:
        L.append(f"| {c['cycle']} | {c['workload']} | {c['snapshot_tokens']} | {c['cycle_s']:.0f} | "
                 f"{c.get('reason') or c.get('skipped')} |")
    L += [
        "",
        "## Goals",
        "",
        f"- default / static tokens/s after cycle {cfg['cycles']} (paired median over passes, range): "
        + ", ".join(f"c={c} {s['default_over_static'][str(c)]:.2f}× ({_range(s, c)})" for c in cs)
        + " (goal ≥ 1.5× on code, ≥ 1.2× on chat)"
        + (
            "; on {} after its cycle: {}".format(
                cfg["switch_to"], ", ".join(f"c={c} {r:.2f}×" for c, r in s["switch_default_over_static"].items())
            )
            if s.get("switch_default_over_static")
            else ""
        ),
        "- default / in-domain static tokens/s after cycle {} (paired median, range): {}".format(
            cfg["cycles"], ", ".join(f"c={c} {m:.2f}× ({lo:.2f}–{hi:.2f})"
                                     for c, (m, lo, hi) in s.get("default_over_in_domain", {}).items())),
        "- default / no speculation: " + ", ".join(f"c={c} {s['default_over_none'][str(c)]:.2f}×" for c in cs),
        f"- τ by cycle (adapted, fixed k): {', '.join(f'{k}: {v:.2f}' for k, v in s['tau_by_cycle'].items())}; "
        f"still rising at cycle {cfg['cycles']}: {s['tau_still_rising']}",
        f"- promoted cycles that lowered held-out τ (> {NOISE:.0%}): {s['promoted_worse'] or 'none'}; beyond the "
        f"noise (a drop > 2 standard errors of the difference; τ's SE per point "
        f"{min(s['tau_se_by_cycle'].values(), default=0):.2f}–{max(s['tau_se_by_cycle'].values(), default=0):.2f}): "
        f"{s['promoted_worse_beyond_noise'] or 'none'}",
        (
            f"- after the switch and back: τ {s['tau_after_back']:.2f} vs best before "
            f"{s['tau_best_before_switch']:.2f} "
            f"(within 5 %: {s['after_back_within_5pct']})"
        )
        if s["tau_after_back"] is not None
        else "- no switch",
        "- default / no speculation, worst cell per workload (paired median over passes, range): "
        + "; ".join(
            f"{w} {x['ratio']:.2f}× ({x['min']:.2f}–{x['max']:.2f}) at c={x['concurrency']} after cycle {x['cycle']}"
            for w, x in s.get("default_over_none_worst", {}).items()
        )
        + " (goal ≥ 0.98×)",
        f"- outputs == target-only: {s['mismatches']} mismatches",
        "",
    ]
    L += [f"![{k}]({v})" for k, v in figs.items()] + ["", f"Command: `{rep['command']}`", ""]
    return "\n".join(L)
