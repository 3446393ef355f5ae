"""`tidespec bench adapt`: self-improvement over many cycles on one workload, then a switch and back
(TIDE, arXiv 2602.05145 §5, Fig. 3–5).

Fresh traffic of one workload per cycle, served with capture; each seal runs the real `tide_cycle`
flow. After every cycle the held-out prompts are measured at each concurrency: no speculation, the
static draft, the in-domain static (the first champion the loop promoted on the workload — trained
once on its first traffic, warm-started from the static — frozen from then on: "train once on your
own traffic") and the champion at fixed k, and the champion as `tidespec serve` runs it. Then cycles
on another workload and back (forgetting). Writes bench/results/<name>-<date>.{json,md} and PNGs;
`--quick` fits ~15 min on 2 cores. The protocol in full: docs/design/bench.md.
"""
from __future__ import annotations

import json
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
from ..models.load import runner_for
from ..workspace import DRAFT_FILES, Workspace, copy_engine_files, engine_dir, served_version
from . import shift
from .adapt_report import summarize, write_report


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
    static: str = ""  # the first champion and the `static` arm: a draft dir ("" = make demo's bootstrap static)

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
        if self.static and not all((engine_dir(Path(self.static)) / f).is_file() for f in DRAFT_FILES):
            raise ValueError(f"--static {self.static}: not a draft dir (needs {' + '.join(DRAFT_FILES)} in it "
                             "or in its draft/)")
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


def run(params: Params, out: Path, work: Path, cfg: AdaptConfig, progress=print) -> dict:
    """The experiment; returns the report (also written to out/<name>-<date>.json/.md + PNGs)."""
    cfg.validate()
    t0 = time.perf_counter()
    sc = cfg.as_shift()
    base, params = (
        params,
        shift.bench_params(params, replace(sc, concurrency=(*cfg.concurrency, cfg.traffic_concurrency))),
    )
    first = engine_dir(Path(cfg.static)).resolve() if cfg.static else None  # a bundle's draft/, or the dir
    with shift.experiment(base, params, work, "bench adapt", first) as (ws, uri, target, tok, static):
        rep = _cycles(params, ws, uri, target, tok, static, work, cfg, progress)
    rep["wall_s"] = time.perf_counter() - t0
    rep["summary"] = summarize(rep)
    rep["command"] = command(rep["config"])
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
    frozen = {"in_domain": static_runner}  # until the loop's first promotion on cfg.workload: then that champion
    first = served_version(ws.champion)

    def arms():
        a = shift._arms(target, params, {"none": None, "static": static_runner, "in_domain": frozen["in_domain"],
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
            if w == cfg.workload and frozen["in_domain"] is static_runner and served_version(ws.champion) != first:
                frozen["in_domain"] = runner_for(copy_engine_files(ws.champion, work / "in-domain-static"), target)
                rep["in_domain_static"] = {"cycle": i, "version": served_version(ws.champion)}
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


FLAGS = (("workload", "--workload"), ("switch_to", "--switch-to"), ("cycles", "--cycles"),
         ("traffic_concurrency", "--traffic-concurrency"), ("traffic_prompts", "--traffic-prompts"),
         ("passes", "--passes"), ("static", "--static"))


def command(cfg: dict) -> str:
    """The `tidespec bench adapt` command line that reproduces a run of config `cfg` (`asdict`)."""
    quick = cfg["name"].startswith("adapt-quick")
    base = asdict(AdaptConfig.quick() if quick else AdaptConfig())
    flags = [" --quick"] if quick else []
    flags += [f" {opt} {cfg[f] if cfg[f] != '' else repr('')}" for f, opt in FLAGS if f in cfg and cfg[f] != base[f]]
    return "tidespec bench adapt" + "".join(flags)


def static_label(static: Path) -> str:
    """A result name's mark for a given static draft: `static<N>k` from its provenance.json (`bench
    static-general` writes tokens), else `static-<dir name>`."""
    try:
        return f"static{json.loads((Path(static) / 'provenance.json').read_text())['tokens'] // 1000}k"
    except (OSError, ValueError, KeyError, TypeError):
        return f"static-{Path(static).name}"
