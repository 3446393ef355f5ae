"""`tidespec bench adapt`: self-improvement over many cycles on one workload, then a switch and back
(TIDE, arXiv 2602.05145 §5, Fig. 3–5).

Fresh traffic of one workload per cycle, served with capture; each seal runs the real `tide_cycle`
flow. After every cycle the held-out prompts are measured at each concurrency: no speculation, the
static draft and the champion at fixed k, and the champion as `tidespec serve` runs it. Then cycles
on another workload and back (forgetting). Writes bench/results/<name>-<date>.{json,md} and PNGs;
`--quick` fits ~15 min on 2 cores. The protocol in full: docs/design/bench.md.
"""
from __future__ import annotations

import math
import queue
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

from ..adapters import orchestrate
from ..capture.writer import CaptureWriter
from ..config import Params
from ..engine.grammar_state import GrammarCompiler
from ..engine.stats import per_position, tau_standard_error
from ..models.load import runner_for
from ..workspace import Workspace, served_version
from . import shift, shift_report

ARMS = ("none", "static", "adapted", "default")  # measured per point; "default" = the hybrid as serve runs it
NOISE = 0.03  # "within noise" for τ changes between points (greedy τ is deterministic; tokens/s is not)


@dataclass(frozen=True)
class AdaptConfig:
    """Sizes of one run (times on 2 CPU cores, SmolLM2-135M fp32: full 90 min, quick ≈ 30)."""

    workload: str = "code"  # a `bench shift` phase: the workload adapted to over `cycles`
    switch_to: str = "chat"  # then this one for `switch_cycles` ("" = no switch), then back for `back_cycles`
    cycles: int = 6
    switch_cycles: int = 1
    back_cycles: int = 1
    concurrency: tuple[int, ...] = (1, 4, 8)  # measurement
    traffic_concurrency: int = 8  # requests served at once while capturing (data arrives faster at higher load)
    traffic_prompts: int = 15  # fresh prompts per cycle (HumanEval: 110 traffic prompts fit, 7 cycles × 15)
    eval_prompts: int = 8  # held out, measured after every cycle (>= max concurrency)
    max_new_tokens: int = 32  # per measured request
    traffic_max_new_tokens: int = 96
    max_prompt_tokens: int = 320
    cycle_eval_tokens: int = 48
    cycle_max_holdout: int = 12
    train_epochs: int | None = None
    passes: int = 2  # measurements per point (arms interleaved wave by wave): tokens/s is their median
    name: str = "adapt"
    seed: int = 0

    @classmethod
    def quick(cls) -> AdaptConfig:
        """`--quick`: 3 cycles of 8 prompts, concurrency 1 and 8, 2 passes per point, 3 epochs."""
        return cls(cycles=3, concurrency=(1, 8), traffic_prompts=8, eval_prompts=8, max_new_tokens=24,
                   traffic_max_new_tokens=64, cycle_eval_tokens=32, cycle_max_holdout=6, train_epochs=3,
                   passes=2, name="adapt-quick")

    def validate(self) -> AdaptConfig:
        """Raises ValueError naming the field for an unknown workload or sizes that cannot run."""
        for f, v in (("workload", self.workload), ("switch_to", self.switch_to)):
            if v and v not in shift.PHASE_TITLES:
                raise ValueError(f"{f} {v!r}: one of {', '.join(shift.PHASE_TITLES)}")
        if self.switch_to == self.workload:
            raise ValueError("switch_to must differ from workload (or be '' for no switch)")
        if self.cycles < 1 or self.traffic_prompts < 1 or self.passes < 1 or self.eval_prompts < max(self.concurrency):
            raise ValueError("cycles, traffic_prompts and passes must be >= 1 and eval_prompts >= the highest "
                             "concurrency")
        return self

    def as_shift(self) -> shift.ShiftConfig:
        """The `bench shift` sizes its helpers read (serving traffic, measuring, the cycle's params)."""
        return shift.ShiftConfig(phases=(self.workload,), concurrency=self.concurrency,
                                 eval_prompts=self.eval_prompts, traffic_prompts=self.traffic_prompts,
                                 max_new_tokens=self.max_new_tokens, traffic_max_new_tokens=self.traffic_max_new_tokens,
                                 max_prompt_tokens=self.max_prompt_tokens, cycle_eval_tokens=self.cycle_eval_tokens,
                                 cycle_max_holdout=self.cycle_max_holdout, train_epochs=self.train_epochs,
                                 seed=self.seed)

    def schedule(self) -> list[str]:
        """The workload of each cycle, in order."""
        sw = [self.switch_to] * self.switch_cycles + [self.workload] * self.back_cycles if self.switch_to else []
        return [self.workload] * self.cycles + sw


def chunks(params: Params, tok, cfg: AdaptConfig, compiler: GrammarCompiler | None) -> tuple[dict, dict]:
    """({workload: [traffic chunk per cycle]}, {workload: held-out prompts}): each workload's pool split
    once (held-out never served), its traffic cut into fresh chunks of `traffic_prompts`. Raises
    ValueError when a workload has too few prompts for its cycles."""
    need = {w: cfg.schedule().count(w) for w in set(cfg.schedule())}
    traffic, hold = {}, {}
    for w, n in need.items():
        sc = replace(cfg.as_shift(), traffic_prompts=n * cfg.traffic_prompts)
        tr, ho = shift.split_phase(shift.phase_prompts(w, params), tok, sc, params.workload.holdout_fraction, compiler)
        if len(tr) < n * cfg.traffic_prompts or len(ho) < cfg.eval_prompts:
            raise ValueError(f"{w}: {len(tr)} traffic / {len(ho)} held-out prompts fit, {n} cycles × "
                             f"{cfg.traffic_prompts} + {cfg.eval_prompts} needed; lower --traffic-prompts or --cycles")
        traffic[w] = [tr[i * cfg.traffic_prompts:(i + 1) * cfg.traffic_prompts] for i in range(n)]
        hold[w] = ho
    return traffic, hold


def seal_tokens(chunks_: list[list[dict]], max_new: int) -> int:
    """A workload's seal threshold: 60 % of a chunk's prompt + max completion tokens (mean over the
    workload's chunks) — each chunk seals about once even when completions stop early; what is left
    joins the next snapshot. Per workload: a chat chunk (short prompts) holds far fewer tokens than a
    HumanEval chunk and never reached a threshold sized on both."""
    return int(0.6 * sum(len(p["input_ids"]) + max_new for c in chunks_ for p in c) / max(1, len(chunks_)))


def point(arms_of, hold: list[dict], cfg: AdaptConfig, ref: dict | None) -> tuple[dict, dict]:
    """Measure the held-out prompts at each concurrency, `cfg.passes` times (`shift.measure`: arms
    interleaved wave by wave; each pass on fresh engines from `arms_of()`). Returns ({c: {arm: the
    first pass's metrics with tokens_per_s replaced by the median over passes, tokens_per_s_passes the
    list, mismatches summed}}, reference outputs)."""
    runs = []
    for _ in range(cfg.passes):
        m = shift.measure(arms_of(), hold, cfg.as_shift(), ref)
        ref = m["reference"] if ref is None else ref
        runs.append(m["by_concurrency"])
    out = {}
    for c, arms in runs[0].items():
        out[c] = {}
        for arm, r in arms.items():
            tps = [run[c][arm]["tokens_per_s"] for run in runs]
            out[c][arm] = dict(r, tokens_per_s=statistics.median(tps), tokens_per_s_passes=tps,
                               mismatches=sum(run[c][arm]["mismatches"] for run in runs))
    return out, ref


def ratio_spread(by_c: dict, num: str, den: str) -> dict[int, tuple[float, float, float]]:
    """Per concurrency, (median, min, max) of the paired per-pass tokens/s ratio num / den."""
    out = {}
    for c, arms in by_c.items():
        rs = [a / b for a, b in zip(arms[num].get("tokens_per_s_passes", [arms[num]["tokens_per_s"]]),
                                    arms[den].get("tokens_per_s_passes", [arms[den]["tokens_per_s"]])) if b]
        out[c] = (statistics.median(rs), min(rs), max(rs)) if rs else (0.0, 0.0, 0.0)
    return out


def run(params: Params, out: Path, work: Path, cfg: AdaptConfig, progress=print) -> dict:
    """The experiment; returns the report (also written to out/<name>-<date>.json/.md + PNGs)."""
    cfg.validate()
    t0 = time.perf_counter()
    sc = cfg.as_shift()
    base, params = (
        params,
        shift.bench_params(params, replace(sc, concurrency=(*cfg.concurrency, cfg.traffic_concurrency))),
    )
    with shift.experiment(base, params, work, "bench adapt") as (ws, uri, target, tok, static):
        rep = _cycles(params, ws, uri, target, tok, static, work, cfg, progress)
    rep["wall_s"] = time.perf_counter() - t0
    rep["summary"] = summarize(rep)
    rep["stem"] = f"{cfg.name}-{date.today().isoformat()}"
    write_report(rep, out, rep["stem"])
    return rep


def _cycles(params: Params, ws: Workspace, uri: str, target, tok, static: Path, work: Path, cfg: AdaptConfig,
            progress) -> dict:
    """The run inside `shift.experiment`: the first measurement, then per scheduled cycle its traffic
    served with capture (seals run `tide_cycle`) and the held-out measurement. Returns the report
    (without summary)."""
    tid = target.target_id
    sc = cfg.as_shift()
    traffic, hold = chunks(params, tok, cfg, GrammarCompiler.for_target(target, tok))
    static_runner = runner_for(static, target)

    def arms():
        a = shift._arms(target, params, {"none": None, "static": static_runner,
                                         "adapted": runner_for(ws.champion, target)}, ws.champion)
        a["default"] = a.pop("hybrid")
        return a

    flow = orchestrate.load_flow("tide_cycle")
    seals: queue.Queue = queue.Queue()
    refs: dict[str, dict] = {}
    rep = {"config": asdict(cfg), "params_sha": params.sha(), "target_id": tid, "k": params.engine.num_draft_tokens,
           "cpu_threads": shift._threads(), "points": [], "cycles": []}
    serve_s = 0.0
    rep["seal_min_tokens"] = thr = {w: seal_tokens(cs, cfg.traffic_max_new_tokens) for w, cs in traffic.items()}
    writer = CaptureWriter(ws.capture_dir(tid), tid, params.capture.model_copy(
        update={"seal_min_tokens": thr[cfg.workload]}), snapshots_root=ws.snapshots, on_seal=seals.put)
    try:
        for w in [cfg.workload, *([cfg.switch_to] if cfg.switch_to else [])]:
            m, refs[w] = point(arms, hold[w], cfg, None)
            rep["points"].append({"cycle": 0, "workload": w, "served_s": 0.0, "captured_tokens": 0,
                                  "champion_version": served_version(ws.champion), "by_concurrency": m})
        progress(f"start: {_brief(rep['points'][0]['by_concurrency'])}")
        used = {w: 0 for w in traffic}
        for i, w in enumerate(cfg.schedule(), start=1):
            chunk = traffic[w][used[w]]
            used[w] += 1
            writer.cfg = writer.cfg.model_copy(
                update={"seal_min_tokens": thr[w]}
            )  # one atomic store: the next flush reads it
            t = time.perf_counter()
            cyc = shift._serve_traffic(w, chunk, target, params, ws, writer, seals, flow, uri, tid, work,
                                       replace(sc, concurrency=(cfg.traffic_concurrency,)), progress)
            serve_s += time.perf_counter() - t
            tokens = writer.stats().tokens_total
            rep["cycles"] += [dict(c, cycle=i, workload=w) for c in cyc]
            for mw in ([cfg.workload] + ([w] if w != cfg.workload else [])):
                m, _ = point(arms, hold[mw], cfg, refs[mw])
                rep["points"].append({"cycle": i, "workload": mw, "served_s": serve_s, "captured_tokens": tokens,
                                      "champion_version": served_version(ws.champion), "by_concurrency": m})
            progress(f"cycle {i} ({w}): {[c.get('reason', c.get('skipped')) for c in cyc]} · "
                     f"{_brief(rep['points'][-1]['by_concurrency'])}")
    finally:
        writer.close()
    return rep


def _brief(by_c: dict) -> str:
    c = min(by_c)
    return ", ".join(f"{a} τ {r['acceptance_length']:.2f} {r['tokens_per_s']:.1f} tok/s" for a, r in by_c[c].items())


# -- summary, report, plots ----------------------------------------------------------------------------
def series(rep: dict, workload: str, arm: str, key: str, c: int) -> list[tuple[int, float]]:
    """(cycle, value) of one arm's metric at concurrency c on a workload's held-out prompts."""
    return [(p["cycle"], p["by_concurrency"][c][arm][key]) for p in rep["points"] if p["workload"] == workload]


def tau_se(m: dict) -> float:
    """Standard error of an arm's measured τ (`stats.tau_standard_error`, from its per-position
    acceptance and number of verify steps)."""
    return tau_standard_error(per_position(m), m.get("num_drafts", 0.0))


def summarize(rep: dict) -> dict:
    """The goals of issue 28 as figures: adapted (default config) / static tokens/s per concurrency at
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


FLAGS = (("workload", "--workload"), ("switch_to", "--switch-to"), ("cycles", "--cycles"),
         ("traffic_concurrency", "--traffic-concurrency"), ("traffic_prompts", "--traffic-prompts"),
         ("passes", "--passes"))


def command(cfg: dict) -> str:
    """The `tidespec bench adapt` command line that reproduces a run of config `cfg` (`asdict`)."""
    quick = cfg["name"].startswith("adapt-quick")
    base = asdict(AdaptConfig.quick() if quick else AdaptConfig())
    flags = [" --quick"] if quick else []
    flags += [f" {opt} {cfg[f] if cfg[f] != '' else repr('')}" for f, opt in FLAGS if f in cfg and cfg[f] != base[f]]
    return "tidespec bench adapt" + "".join(flags)


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
        for arm, style in (("none", ":"), ("static", "s--"), ("adapted", "o-"), ("default", "^-")):
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
    ax.plot([p["captured_tokens"] / 1000 for p in pts], [p["by_concurrency"][c0]["static"]["acceptance_length"]
                                                         for p in pts], "s--", label="static")
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
        "the champion alone at fixed k (τ); `static` = the generic bootstrap draft at fixed k.",
        "",
        "| cycle | workload measured | min served | captured tokens | champion | "
        + " | ".join(f"c={c} none / static / adapted / default tok/s" for c in cs)
        + " | τ static / adapted / default (c=1) |",
        "|---|---|---|---|---|" + "---|" * len(cs) + "---|",
    ]
    for p in rep["points"]:
        by = p["by_concurrency"]
        cells = [" / ".join(f"{by[c][a]['tokens_per_s']:.1f}" for a in ARMS) for c in cs]
        taus = " / ".join(f"{by[cs[0]][a]['acceptance_length']:.2f}" for a in ("static", "adapted", "default"))
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
    L += [f"![{k}]({v})" for k, v in figs.items()] + ["", f"Command: `{command(cfg)}`", ""]
    return "\n".join(L)
