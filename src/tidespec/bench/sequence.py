"""`tidespec bench sequence`: drafts per workload class and the replay buffer over a traffic-shift
sequence, against one draft without replay, then throughput against a well-trained static draft.

The sequence (default code → chat → math-en → structured → code) is served with capture by two arms,
each in its own scratch workspace with the same traffic, every seal running the real `tide_cycle`:
`classes` = a draft per class of the sequence (`train.class_drafts`) + the replay buffer
(`curate.replay_fraction`, `replay_tokens`); `single` = the generalist alone, no replay. Both use
`curate.window` = 1: a cycle sees its own snapshot, and what it keeps of older traffic is the replay
buffer's (the question is what retraining keeps, not what a wide window hides). After each cycle, τ
per class at fixed k on every class's held-out prompts, greedy (deterministic), with the engine as
`tidespec serve` runs it (each class's own draft, else the generalist). Forgetting per class = (its
best τ − its τ after the last cycle) / best (Aurora, arXiv 2602.06932, measures adaptation under
shift; no forgetting figure is published). Then tokens/s at each concurrency of no speculation, a
static draft (fixed k), the in-domain statics (fixed k) and each arm's final champions as `tidespec
serve` runs them (goodput policy, suffix proposer, class drafts), waves interleaved, `passes` passes,
paired ratios with their range. The static is the one given (`static`: e.g. `bench static-general`'s
well-trained draft, which is then also both arms' first champion: the draft a team deployed, which the
loop adapts, as in `bench adapt`), else one trained once on as many ShareGPT tokens as the `classes` arm's drafts
processed in all (Σ over its cycles and classes of training tokens × epochs), never fewer than
`bootstrap.tokens` (cached). The in-domain statics: "train once on your own traffic" — for each class,
the `single` arm's champion right after that class's first phase, frozen from then on, each serving its
own class. Writes bench/results/<name>-<date>.{json,md}; rerun after an interruption, it keeps the arms
already finished (`finished_arms`). The protocol: docs/design/bench.md.
"""
from __future__ import annotations

import json
import queue
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

from ..adapters import orchestrate
from ..assets import cache_dir
from ..capture.writer import CaptureWriter
from ..config import Params
from ..engine.build import install_class_drafts, load_suffix_corpus, make_engine
from ..engine.grammar_state import GrammarCompiler
from ..engine.replay import replay
from ..models.load import runner_for
from ..steps.bootstrap import bootstrap_static
from ..workspace import DRAFT_FILES, Workspace, class_dirs, engine_dir, served, served_version
from . import shift
from .adapt import seal_tokens
from .adapt_report import ratio_spread
from .sequence_report import summarize, write_report

ARMS = ("single", "classes")


@dataclass(frozen=True)
class SequenceConfig:
    """Sizes of one run (2 idle CPU cores, SmolLM2-135M fp32: full ≈ 40 min as measured, quick about half)."""

    sequence: tuple[str, ...] = ("code", "chat", "math-en", "structured", "code")
    concurrency: tuple[int, ...] = (1, 4, 8)  # the throughput measurement
    traffic_prompts: int = 12  # fresh prompts per cycle
    traffic_concurrency: int = 8
    eval_prompts: int = 8  # held-out prompts per class (τ after every cycle; pooled for throughput)
    max_new_tokens: int = 32
    traffic_max_new_tokens: int = 96
    max_prompt_tokens: int = 320
    cycle_eval_tokens: int = 32
    cycle_max_holdout: int = 8
    train_epochs: int | None = 3
    replay_fraction: float = 0.25  # the classes arm's
    static_conversations: int = 8000  # ShareGPT records the well-trained static may read; chat traffic comes after
    passes: int = 2
    name: str = "sequence"
    seed: int = 0
    static: str = ""  # the first champion and the static arm: a draft dir or bundle ("" = the bootstrap static
    # starts the loop, the static arm is one trained on the classes arm's token count)
    class_drafts: str = "listed"  # the classes arm's train.class_drafts: every class of the sequence, or "auto"

    @classmethod
    def quick(cls) -> SequenceConfig:
        """`--quick`: code → chat → code, 8 prompts a cycle, concurrency 1 and 8, one pass, 2 epochs."""
        return cls(sequence=("code", "chat", "code"), concurrency=(1, 8), traffic_prompts=8, train_epochs=2,
                   passes=1, name="sequence-quick")

    def validate(self) -> SequenceConfig:
        """Raises ValueError naming the field for an unknown phase or sizes that cannot run."""
        bad = [p for p in self.sequence if p not in shift.PHASE_TITLES]
        if bad or not self.sequence:
            raise ValueError(f"sequence: phases of {', '.join(shift.PHASE_TITLES)}; got {list(self.sequence)}")
        if min(self.traffic_prompts, self.eval_prompts, self.passes) < 1:
            raise ValueError("traffic_prompts, eval_prompts and passes must be >= 1")
        if self.eval_prompts * len(self.classes) < max(self.concurrency):
            raise ValueError("eval_prompts × classes must be >= the highest concurrency (one full wave)")
        if self.class_drafts not in ("listed", "auto"):
            raise ValueError(f"--class-drafts {self.class_drafts!r}: listed (every class of the sequence) or auto")
        if self.static and not all((engine_dir(Path(self.static)) / f).is_file() for f in DRAFT_FILES):
            raise ValueError(f"--static {self.static}: not a draft dir (needs {' + '.join(DRAFT_FILES)} in it "
                             "or in its draft/)")
        return self

    @property
    def classes(self) -> tuple[str, ...]:
        """The workload classes of the sequence, first appearance order."""
        return tuple(dict.fromkeys(self.sequence))

    def as_shift(self) -> shift.ShiftConfig:
        return shift.ShiftConfig(phases=self.classes, concurrency=self.concurrency, eval_prompts=self.eval_prompts,
                                 traffic_prompts=self.traffic_prompts, max_new_tokens=self.max_new_tokens,
                                 traffic_max_new_tokens=self.traffic_max_new_tokens,
                                 max_prompt_tokens=self.max_prompt_tokens, cycle_eval_tokens=self.cycle_eval_tokens,
                                 cycle_max_holdout=self.cycle_max_holdout, train_epochs=self.train_epochs,
                                 seed=self.seed)


def arm_params(params: Params, cfg: SequenceConfig, arm: str) -> Params:
    """The run's params for one arm (module docstring): window 1; `classes` with a draft per class
    (`cfg.class_drafts`: every class of the sequence listed, or `auto`) and the replay buffer, `single`
    with neither."""
    classes = arm == "classes"
    sc = replace(cfg.as_shift(), concurrency=(*cfg.concurrency, cfg.traffic_concurrency))
    p = shift.bench_params(params, sc)
    return p.model_copy(update={
        "curate": p.curate.model_copy(update={"window": 1, "replay_fraction": cfg.replay_fraction if classes else 0.0}),
        "train": p.train.model_copy(update={"class_drafts": (
            ("auto" if cfg.class_drafts == "auto" else list(cfg.classes)) if classes else [])})})


def prompts(params: Params, tok, cfg: SequenceConfig, compiler) -> tuple[dict, dict]:
    """({class: [traffic chunk per cycle of it]}, {class: held-out prompts}), as `bench adapt` cuts them.
    Raises ValueError when a class has too few prompts."""
    need = {w: cfg.sequence.count(w) for w in cfg.classes}
    traffic, hold = {}, {}  # chat from ShareGPT records the static drafts never read
    params = params.model_copy(update={"bootstrap": params.bootstrap.model_copy(
        update={"conversations": max(params.bootstrap.conversations, cfg.static_conversations)})})
    for w, n in need.items():
        sc = replace(cfg.as_shift(), traffic_prompts=n * cfg.traffic_prompts)
        tr, ho = shift.split_phase(shift.phase_prompts(w, params), tok, sc, params.workload.holdout_fraction, compiler)
        if len(tr) < n * cfg.traffic_prompts or len(ho) < cfg.eval_prompts:
            raise ValueError(f"{w}: {len(tr)} traffic / {len(ho)} held-out prompts fit, {n * cfg.traffic_prompts} / "
                             f"{cfg.eval_prompts} needed; lower --traffic-prompts or the held-out prompts per class")
        traffic[w] = [tr[i * cfg.traffic_prompts:(i + 1) * cfg.traffic_prompts] for i in range(n)]
        hold[w] = ho
    return traffic, hold


def serving_engine(params: Params, target, champion: Path, class_root: Path | None, adaptive: bool):
    """The engine `tidespec serve` would run on the deployed champions: the generalist in `champion`
    (a draft dir or bundle), each class's own draft under `class_root` (`Workspace.class_champions`;
    None: no class drafts), and — `adaptive` — the goodput policy and the suffix proposer with the
    generalist's corpus (else fixed k, chains only, no grammar-forced tokens: the drafts' own τ)."""
    e = params.engine
    cfg = e.model_copy(update={"adaptive": True, "suffix": e.suffix.model_copy(update={"enabled": True})}) \
        if adaptive else e.fixed()
    eng = make_engine(cfg, target, runner_for(champion, target), **served(champion), forced_tokens=adaptive)
    if adaptive:
        load_suffix_corpus(eng, champion)
    if class_root is not None:
        install_class_drafts(eng, class_root)
    return eng


def tau_point(params: Params, target, champion: Path, class_root: Path | None, hold: dict, cfg: SequenceConfig,
              ref: dict) -> dict:
    """τ per class at fixed k (greedy, concurrency 1) on every class's held-out prompts, served from
    `champion` and `class_root` as `serving_engine`, its standard error (`tau_se`), and the mismatches
    against target-only outputs `ref` ({prompt id: tokens})."""
    eng = serving_engine(params, target, champion, class_root, adaptive=False)
    ps = [p for w in cfg.classes for p in hold[w]]
    configs = {"adapted": (eng, True)}
    if len(eng.draft_versions) > 1:  # class drafts serve: the generalist alone too, on every class
        configs["generalist"] = (make_engine(params.engine.fixed(), target, runner_for(champion, target),
                                             forced_tokens=False), True)
    runs = replay(configs, ps, cfg.max_new_tokens)
    tau = {name: {w: r["metrics"].get(f"acceptance_length/{w}") for w in cfg.classes} for name, r in runs.items()}
    return {"tau": tau["adapted"], "tau_generalist": tau.get("generalist", tau["adapted"]),
            "tau_se": {w: runs["adapted"]["metrics"].get(f"tau_se/{w}") for w in cfg.classes},
            "versions": eng.draft_versions,
            "mismatches": sum(ref[i] != t for r in runs.values() for i, t in r["outputs"].items())}


def static_tau(params: Params, cfg: SequenceConfig, drafts: dict[str, Path]) -> dict:
    """τ per class of each draft in `drafts` ({name: draft dir or bundle}) served alone at fixed k on the
    run's held-out prompts: the cycle-0 point `run_arm` measures for its first champion (same prompts,
    engine and tokens), without running the arms — so a static's figures sit beside a run's static arm.
    Returns {"tau": {name: {class: τ}}, "tau_se": {name: {class: SE}}, "mismatches": {name: outputs ≠
    target-only}, "prompt_ids": {class: [held-out prompt ids]}, "target_id"}. Raises, before measuring,
    ValueError for a class with too few prompts, a missing dir or another target's draft, FileNotFoundError
    for a dir without a checkpoint."""
    from ..models.load import get_target
    target, tok = get_target(params)
    for name, d in drafts.items():  # every draft checked before minutes of measuring
        if runner_for(engine_dir(Path(d)), target) is None:
            raise ValueError(f"draft {name}: {d} does not exist")
    _, hold = prompts(params, tok, cfg, GrammarCompiler.for_target(target, tok))
    p = arm_params(params, cfg, "single")
    ps = [x for w in cfg.classes for x in hold[w]]
    ref = replay({"none": (make_engine(p.engine.fixed(), target), False)}, ps, cfg.max_new_tokens)["none"]["outputs"]
    out: dict = {"tau": {}, "tau_se": {}, "mismatches": {}, "prompt_ids": {w: [x["id"] for x in hold[w]] for w in hold},
                 "target_id": target.target_id}
    for name, d in drafts.items():
        pt = tau_point(p, target, engine_dir(Path(d)), None, hold, cfg, ref)
        out["tau"][name], out["tau_se"][name], out["mismatches"][name] = pt["tau"], pt["tau_se"], pt["mismatches"]
    return out


def run_arm(base: Params, cfg: SequenceConfig, arm: str, work: Path, traffic: dict, hold: dict, progress) -> dict:
    """One arm's run (module docstring). Returns {"points": [{cycle, phase, tau, versions, mismatches}],
    "cycles": [...], "workspace"}; the `single` arm also {"in_domain": {class: {cycle, version, dir}}}: its
    champion after each class's first phase, frozen under `work/in-domain/<class>` (`in_domain_root`)."""
    params = arm_params(base, cfg, arm)
    sc = replace(cfg.as_shift(), concurrency=(cfg.traffic_concurrency,))
    first = engine_dir(Path(cfg.static)).resolve() if cfg.static else None  # else the bootstrap static
    with shift.experiment(base, params, work, f"bench sequence ({arm})", first) as (ws, uri, target, tok, _static):
        tid = target.target_id
        plain = make_engine(params.engine.fixed(), target)
        ps = [p for w in cfg.classes for p in hold[w]]
        ref = replay({"none": (plain, False)}, ps, cfg.max_new_tokens)["none"]["outputs"]
        rep = {"points": [dict(tau_point(params, target, ws.champion, ws.class_champions, hold, cfg, ref),
                               cycle=0, phase="")], "cycles": [],
               "workspace": str(work)}
        thr = {w: seal_tokens(cs, cfg.traffic_max_new_tokens) for w, cs in traffic.items()}
        seals: queue.Queue = queue.Queue()
        flow = orchestrate.load_flow("tide_cycle")
        writer = CaptureWriter(ws.capture_dir(tid), tid, params.capture.model_copy(
            update={"seal_min_tokens": thr[cfg.sequence[0]]}), snapshots_root=ws.snapshots, on_seal=seals.put)
        used = dict.fromkeys(cfg.classes, 0)
        try:
            for i, w in enumerate(cfg.sequence, start=1):
                chunk = traffic[w][used[w]]
                used[w] += 1
                writer.cfg = writer.cfg.model_copy(update={"seal_min_tokens": thr[w]})
                cyc = shift._serve_traffic(w, chunk, target, params, ws, writer, seals, flow, uri, tid, work, sc,
                                           progress)
                rep["cycles"] += [dict(c, cycle=i) for c in cyc]
                if arm == "single" and w not in rep.setdefault("in_domain", {}):  # promoted: trained on w's traffic
                    rep["in_domain"][w] = freeze_in_domain(ws.champion, in_domain_root(work), w, i) | {
                        "promoted": any(c.get("promoted") for c in cyc)}
                pt = dict(tau_point(params, target, ws.champion, ws.class_champions, hold, cfg, ref), cycle=i, phase=w)
                rep["points"].append(pt)
                progress(f"{arm}: cycle {i} ({w}): τ " + ", ".join(f"{c} {t:.2f}" for c, t in pt["tau"].items()
                                                                   if t is not None))
        finally:
            writer.close()
    return rep


def in_domain_root(arm_work: Path) -> Path:
    """Where the `single` arm's run in `arm_work` freezes its in-domain statics (a class-drafts root)."""
    return Path(arm_work) / "in-domain"


def freeze_in_domain(champion: Path, root: Path, workload: str, cycle: int) -> dict:
    """Copy the champion bundle `champion` to `root/<workload>` (a class champion `engine.build.
    install_class_drafts` serves; replaced if there). Returns {"cycle", "version", "dir"}."""
    import shutil
    dest = Path(root) / workload
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(champion, dest)
    return {"cycle": cycle, "version": served_version(dest), "dir": str(dest)}


def static_tokens(arm: dict) -> int:
    """Tokens the arm's drafts processed over the run: Σ over its cycles of the generalist's and each
    class draft's training tokens (the trainer's count, all epochs). Raises ValueError for none."""
    n = 0
    for c in arm["cycles"]:
        n += c.get("train_tokens") or 0
        n += sum(r.get("train_tokens") or 0 for r in (c.get("classes") or {}).values())
    if not n:
        raise ValueError("the classes arm trained nothing: no static baseline to size (see its cycles)")
    return int(n)


def throughput(params: Params, target, arms: dict[str, Workspace], static: Path, hold: dict,
               cfg: SequenceConfig, in_domain: Path | None = None) -> dict:
    """Tokens/s per concurrency of no speculation, the static draft (fixed k), the in-domain statics under
    `in_domain` (a class-drafts root; fixed k, each class its own — every held-out prompt has a class —;
    None or empty: no such arm), each arm as serve runs it and the classes arm's drafts alone at fixed k
    (`classes_drafts`, served as the statics are), on the pooled held-out prompts, waves
    interleaved, `cfg.passes` passes (fresh engines each). Returns {c: {arm: metrics with tokens_per_s
    the median, tokens_per_s_passes, mismatches}} and the code-only figures at concurrency 1 under "code"."""
    frozen = class_dirs(in_domain) if in_domain else {}
    ps = [p for w in cfg.classes for p in hold[w]]
    out: dict = {}
    for label, prompts_, cs in (("pooled", ps, cfg.concurrency), ("code", hold.get("code", []), (1,))):
        if not prompts_:
            continue
        runs = []
        for _ in range(cfg.passes):
            engines = {"none": (make_engine(params.engine.fixed(), target), False),
                       "static": (make_engine(params.engine.fixed(), target, runner_for(static, target)), True)}
            if frozen:
                eng = make_engine(params.engine.fixed(), target, runner_for(next(iter(frozen.values())), target))
                install_class_drafts(eng, in_domain)
                engines["in_domain"] = (eng, True)
            engines |= {a: (serving_engine(params, target, ws.champion, ws.class_champions, adaptive=True), True)
                        for a, ws in arms.items()}
            if "classes" in arms:  # its drafts alone at fixed k, served as the statics are: draft for draft
                engines["classes_drafts"] = (serving_engine(params, target, arms["classes"].champion,
                                                         arms["classes"].class_champions, adaptive=False), True)
            m = shift.measure(engines, prompts_, replace(cfg.as_shift(), concurrency=cs), None)
            runs.append(m["by_concurrency"])
        out[label] = {c: {a: dict(r, tokens_per_s=statistics.median(run[c][a]["tokens_per_s"] for run in runs),
                                  tokens_per_s_passes=[run[c][a]["tokens_per_s"] for run in runs],
                                  mismatches=sum(run[c][a]["mismatches"] for run in runs))
                          for a, r in runs[0][c].items()} for c in cs}
    return out


def command(cfg: dict) -> str:
    """The `tidespec bench sequence` command line that reproduces a run of config `cfg` (`asdict`)."""
    quick = cfg["name"].startswith("sequence-quick")
    base = SequenceConfig.quick() if quick else SequenceConfig()
    flags = [" --quick"] if quick else []
    if tuple(cfg["sequence"]) != base.sequence:
        flags.append(f" --sequence {','.join(cfg['sequence'])}")
    flags += [f" --{f.replace('_', '-')} {cfg[f]}" for f in ("traffic_prompts", "passes") if cfg[f] != getattr(base, f)]
    flags += [f" --static {shlex.quote(cfg['static'])}"] if cfg.get("static") else []
    flags += [" --class-drafts auto"] if cfg.get("class_drafts") == "auto" else []
    return "tidespec bench sequence" + "".join(flags)


def run(params: Params, out: Path, work: Path, cfg: SequenceConfig, progress=print, resume: bool = True) -> dict:
    """The experiment; returns the report (also written to out/<name>-<date>.{json,md}). After each arm
    the report so far goes to out/<name>.partial.json; with `resume`, a rerun keeps the arms an earlier
    run of the same config finished (`resumed_arms`), their workspaces under `work` intact."""
    cfg.validate()
    t0 = time.perf_counter()
    from ..models.load import get_target
    target, tok = get_target(params)
    if cfg.static:
        runner_for(engine_dir(Path(cfg.static)), target)  # a draft of another target fails now, not after the arms
    traffic, hold = prompts(params, tok, cfg, GrammarCompiler.for_target(target, tok))
    rep = {"config": asdict(cfg), "command": command(asdict(cfg)), "params_sha": params.sha(),
           "target_id": target.target_id,
           "k": params.engine.num_draft_tokens, "cpu_threads": shift._threads(), "arms": {}}
    partial = Path(out) / f"{cfg.name}.partial.json"
    done = finished_arms(partial, rep, work, progress) if resume else {}
    rep["resumed_arms"] = [a for a in ARMS if a in done]
    rep["arms"] = dict(done)
    _save_partial(partial, rep)  # before an arm's workspace is wiped: no report of a workspace about to go
    for arm in ARMS:
        if arm not in done:
            rep["arms"][arm] = run_arm(params, cfg, arm, work / arm, traffic, hold, progress)
            _save_partial(partial, rep)  # an arm's hour survives a later failure
    rep["arms"] = {a: rep["arms"][a] for a in ARMS}
    static = _static(params, cfg, rep, target, tok, progress)
    bp = arm_params(params, cfg, "classes")
    rep["throughput"] = throughput(bp, target, {a: Workspace(work / a) for a in ARMS}, static, hold, cfg,
                                   in_domain_root(work / "single"))
    rep["wall_s"] = time.perf_counter() - t0
    rep["summary"] = summarize(rep)
    rep["stem"] = f"{cfg.name}-{date.today().isoformat()}"
    write_report(rep, out, rep["stem"])
    partial.unlink(missing_ok=True)
    return rep


def _save_partial(partial: Path, rep: dict) -> None:
    """Write the report so far to `partial` atomically (a temporary file, then rename). Raises OSError."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial.with_name(f".{partial.name}.tmp")
    tmp.write_text(json.dumps(rep, indent=2, default=str))
    tmp.replace(partial)


def finished_arms(partial: Path, rep: dict, work: Path, progress=print) -> dict[str, dict]:
    """The arms an interrupted run left in `partial` (its report so far) that a rerun can keep: {arm:
    its report}, only when that run's config, params and target are `rep`'s, it ran in `work`, and the
    arm's workspace there still holds its champion (and, for `single`, every frozen in-domain static).
    Says what it keeps, and why it starts over, through `progress`."""
    try:
        old = json.loads(Path(partial).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        progress(f"{partial}: unreadable ({e}): starting over")
        return {}
    same = json.loads(json.dumps({k: rep[k] for k in ("config", "params_sha", "target_id")}))
    differ = [k for k, v in same.items() if old.get(k) != v]
    if differ:
        progress(f"{partial}: another run's ({', '.join(differ)} differ): starting over")
        return {}
    keep = {}
    for arm, r in (old.get("arms") or {}).items():
        dirs = [Workspace(Path(work) / arm).champion] + [Path(d["dir"]) for d in (r.get("in_domain") or {}).values()]
        if arm in ARMS and r.get("workspace") == str(Path(work) / arm) and all(d.is_dir() for d in dirs):
            keep[arm] = r
            progress(f"{arm}: kept from the interrupted run ({partial}; --no-resume reruns it)")
        else:
            progress(f"{arm}: its workspace is not under {work} any more: run again")
    return keep


def static_provenance(static: Path) -> dict | None:
    """What a given static's provenance.json (`bench static-general` writes one) says of its recipe:
    {tokens, epochs?, source?, command?, hardware?, date?, simulated_tau (its general holdout's, at
    k = train.ttt_steps; None when absent)}; None without a readable one that counts its tokens."""
    try:
        prov = json.loads((Path(static) / "provenance.json").read_text())
        out = {"tokens": int(prov["tokens"])}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    out |= {k: prov[k] for k in ("epochs", "source", "command", "hardware", "date")
            if isinstance(prov.get(k), (str, int))}
    metrics = prov.get("metrics")
    tau = metrics.get("simulated_acceptance_length") if isinstance(metrics, dict) else None
    return out | {"simulated_tau": tau if isinstance(tau, (int, float)) else None}


def _static(params: Params, cfg: SequenceConfig, rep: dict, target, tok, progress) -> Path:
    """The static arm's draft dir: `cfg.static` (its provenance.json's recipe, when it has one, in the
    report: `static_provenance`), else one trained on the classes arm's token count (module docstring, cached)."""
    if cfg.static:
        rep["static_dir"], rep["static_given"] = str(engine_dir(Path(cfg.static))), True
        rep["static_first_champion"] = True  # run_arm started both arms from it
        rep["static_provenance"] = static_provenance(Path(cfg.static))
        rep["static_tokens"] = (rep["static_provenance"] or {}).get("tokens")
        return Path(rep["static_dir"])
    rep["static_tokens_matched"] = static_tokens(rep["arms"]["classes"])
    n = rep["static_tokens"] = max(rep["static_tokens_matched"], params.bootstrap.tokens)  # never below today's static
    big = params.model_copy(update={"bootstrap": params.bootstrap.model_copy(
        update={"tokens": n, "epochs": 1, "conversations": cfg.static_conversations})})
    progress(f"static draft on {n} ShareGPT tokens (built once, cached)")
    rep["static_dir"] = str(bootstrap_static(big, target, tok, cache_dir(), say=progress))
    return Path(rep["static_dir"])


__all__ = ["SequenceConfig", "run", "ratio_spread", "static_tau"]
