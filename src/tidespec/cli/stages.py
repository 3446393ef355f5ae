"""`tidespec stage curate|train|evaluate|register|classes`: the DVC stages `dvc repro` runs (dvc.yaml)."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from .common import PARAMS, ROOT, console, stage_app, tracking_uri, ws_of

log = logging.getLogger(__name__)


@stage_app.command("curate")
def stage_curate(root: Path = ROOT, params: Path = PARAMS):
    """Curate data/snapshots/<target_id> → data/work/curated.json."""
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.cycle import step_curate
    p = load_params(params)
    console.print_json(json.dumps(step_curate(ws_of(root), p, target_id(p))))

@stage_app.command("train")
def stage_train(root: Path = ROOT, params: Path = PARAMS,
                dry_run: Annotated[bool, typer.Option("--dry-run", help="print where and how it would train (the "
                                                      "SageMaker request, the torchrun command); train nothing")]
                = False):
    """Train data/work/candidate from data/work/curated.json, warm-started from data/drafts/champion."""
    from ..config import load_params
    from ..steps.cycle import train_candidate, train_plan
    ws = ws_of(root)
    p = load_params(params)
    if dry_run:
        init = ws.champion if ws.champion.exists() else None
        console.print_json(json.dumps(train_plan(ws, p, ws.curated, init, ws.candidate)))
        return
    m = train_candidate(ws, p, ws.curated, ws.champion if ws.champion.exists() else None, ws.candidate,
                        params_path=params)
    if m.get("skipped"):
        console.print(f"[red]cycle skipped, champion untouched:[/red] {m['skipped']}")
        raise typer.Exit(3)
    console.print_json(json.dumps({k: v for k, v in m.items() if k != "train/loss"}))

@stage_app.command("evaluate")
def stage_evaluate(root: Path = ROOT, params: Path = PARAMS):
    """Replay data/work/holdout.jsonl (curated holdout traffic): target-only, champion, candidate →
    data/work/eval.json."""
    from ..config import load_params
    from ..steps.evaluate import step_evaluate
    ws = ws_of(root)
    rep = step_evaluate(ws, load_params(params), ws.candidate, ws.champion if ws.champion.exists() else None,
                        ws.eval_prompts, ws.eval_report)
    console.print(f"candidate τ {rep['candidate']['acceptance_length']:.3f}, lossless {rep['lossless']}")

@stage_app.command("register")
def stage_register(root: Path = ROOT, params: Path = PARAMS):
    """Register data/work/candidate in MLflow with data/work/eval.json and the curated set's lineage
    (DVC revs of its snapshots, params hash), apply the promotion gate → data/work/register.json.
    Deploying the champion is the next step (`tidespec deploy local`; make repro runs both). Needs
    MLFLOW_TRACKING_URI (make repro starts the services)."""
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.cycle import lineage
    from ..steps.register import step_register
    ws, p, uri = ws_of(root), load_params(params), tracking_uri()
    tid = target_id(p)
    for f in (ws.eval_report, ws.curated, ws.candidate / "train_metrics.json"):
        if not f.exists():
            raise FileNotFoundError(f"{f} missing: run the curate, train and evaluate stages first (dvc repro)")
    idx = json.loads(ws.curated.read_text())
    dec = step_register(p, tid, ws.candidate, json.loads(ws.eval_report.read_text()),
                        json.loads((ws.candidate / "train_metrics.json").read_text()), uri, lineage(ws.curated),
                        idx.get("workload_mix", {}), idx.get("drift_jsd"), trigger="dvc-repro")
    ws.register_report.write_text(json.dumps(dec, indent=2, default=str))
    console.print(f"version {dec['version']}: promoted={dec['promoted']} ({dec['reason']}); deploy the champion "
                  "with `tidespec deploy local`", highlight=False)

@stage_app.command("classes")
def stage_classes(root: Path = ROOT, params: Path = PARAMS):
    """The class drafts of `train.class_drafts` (`steps.classes`): each class's curated subset, candidate,
    evaluation and registration under data/work/classes/<class>/ → data/work/classes.json (the
    generalist's cycle is untouched by a class that fails). Needs MLFLOW_TRACKING_URI."""
    from ..config import load_params
    ws, p = ws_of(root), load_params(params)
    if not ws.curated.exists():
        raise FileNotFoundError(f"{ws.curated} missing: run the curate stage first (dvc repro)")
    res = {}
    if p.train.class_drafts:  # none: nothing to import (torch, MLflow) for a stage that does nothing
        from ..models.hf_files import target_id
        from ..steps.classes import class_cycles
        res = class_cycles(ws, p, target_id(p), tracking_uri(), trigger="dvc-repro", params_path=params)
    (ws.work / "classes.json").write_text(json.dumps(res, indent=2, default=str))
    for workload, r in res.items():
        what = r.get("error") or r.get("skipped") or r["register"]["reason"]
        console.print(f"class {workload}: {what}", highlight=False)
    if not res:
        console.print(f"train.class_drafts {p.train.class_drafts}: no class gets a draft of its own this cycle; "
                      "the generalist serves every class", highlight=False, soft_wrap=True)
