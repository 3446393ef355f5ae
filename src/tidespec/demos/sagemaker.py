"""`tidespec demo --sagemaker` (`make demo-sagemaker`): the production loop on a local moto server.

1. a moto server (S3 + SageMaker API) beside Prefect and MLflow; the static draft (cached by `make
   demo`) becomes champion and is deployed to a SageMaker endpoint with data capture on;
2. the endpoint's traffic: moto runs no container, so the target serves HumanEval prompts greedily
   here and the demo writes what SageMaker Data Capture would (JSON Lines in the capture prefix);
3. `tide_capture` ingests it (parse → chat template → one prefill per exchange → capture writer →
   snapshot), `tide_cycle` runs on that snapshot (curate → train → evaluate → register with a tuned
   window per deploy profile → local deploy);
4. prints τ before/after, the chosen window and the endpoint settings `tidespec deploy sagemaker`
   applies (moto has no UpdateEndpoint: the update itself is shown as its planned request).
Workspace: `.tidespec/demo-sagemaker/` (wiped at start). Sizes: `bench`-like knobs below.
"""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from .. import assets
from ..adapters import aws, orchestrate, registry, services
from ..adapters import sagemaker_deploy as smd
from ..assets import prompts
from ..capture.snapshots import seal
from ..capture.text import capture_line
from ..config import load_params
from ..engine.build import make_engine
from ..engine.speculative import Request
from ..models.chat import prompt_ids
from ..models.load import get_target
from ..steps.bootstrap import bootstrap_static
from ..steps.cycle import step_deploy
from ..workspace import Workspace, read_version
from .demo import result_rows
from .progress import Reporter

console = Console(width=None if Console().is_terminal else 120)
ROLE = "arn:aws:iam::123456789012:role/tidespec-sagemaker"  # moto checks no IAM
N_PROMPTS = 32  # endpoint exchanges; each ≤ engine.max_new_tokens (80) tokens


def capture_objects(served: list[tuple[str, str, str, str]], prefix: str, max_new: int) -> dict[str, str]:
    """What Data Capture writes for these exchanges (event id, user text, response text, finish reason):
    two hourly objects of JSON Lines (`capture.text.capture_line` is the same layout)."""
    lines = []
    for eid, text, reply, finish in served:
        req = {"model": "tidespec", "messages": [{"role": "user", "content": text}], "max_tokens": max_new}
        resp = {"object": "chat.completion", "model": "tidespec", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": finish}]}
        lines.append(capture_line(eid, req, resp, datetime.now(UTC)))
    half = len(lines) // 2
    return {f"{prefix}/AllTraffic/2026/11/30/12/00-00-000-a.jsonl": "\n".join(lines[:half]) + "\n",
            f"{prefix}/AllTraffic/2026/11/30/13/00-00-000-b.jsonl": "\n".join(lines[half:]) + "\n"}


def run_demo_sagemaker(root: Path, params_path: Path) -> dict:
    t0 = time.perf_counter()
    base = load_params(params_path)
    ws = Workspace((Path(root) / ".tidespec" / "demo-sagemaker").resolve())
    shutil.rmtree(ws.root, ignore_errors=True)
    ws.root.mkdir(parents=True)
    with console.status("fetching assets; starting Prefect, MLflow and moto on 127.0.0.1"):
        assets.fetch_all()
        svc = services.up(ws.state / "services", which=("prefect", "mlflow", "moto"))
    env = services.env_for(svc)
    os.environ.update(env)
    try:
        out = _loop(ws, env, base)
    finally:  # the servers this demo started stop whatever happened (their logs flushed first)
        orchestrate.flush_logs()
        services.down(ws.state / "services")
    out["wall_s"] = time.perf_counter() - t0
    console.print(f"τ {out['tau_before']:.2f} → {out['tau_after']:.2f}; wall {out['wall_s'] / 60:.1f} min")
    return out


def _loop(ws: Workspace, env: dict, base) -> dict:
    """Steps 1-4 of the module docstring against the started services (`env`). Returns the summary."""
    uri = env["MLFLOW_TRACKING_URI"]
    bucket, ep = f"tidespec-demo-{uuid.uuid4().hex[:6]}", "tidespec-demo-gpu"
    aws.client("s3").create_bucket(Bucket=bucket)
    raw = base.model_dump(mode="json")
    raw["deploy"]["sagemaker"] = {"role_arn": ROLE, "s3_prefix": f"s3://{bucket}/tidespec", "region": "us-east-1",
                                  "target_model": "HuggingFaceTB/SmolLM2-135M-Instruct", "poll_s": 0.1,
                                  "wait_timeout_s": 120, "data_capture": {"enabled": True},
                                  "profiles": {"gpu": {"instance_type": "ml.g4dn.xlarge", "endpoint_name": ep}}}
    max_new = base.engine.max_new_tokens
    raw["ingest"] = {"served_model": "tidespec", "sources": [], "max_new_tokens": max_new, "workload": "code"}
    raw["capture"]["seal_min_tokens"] = 10 ** 9  # the ingest's records are sealed once, below
    pp = ws.root / "params.yaml"
    pp.write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(pp)
    target, tok = get_target(params)
    tid = target.target_id
    with Reporter(console) as report:  # keyed by the unmodified params
        static = bootstrap_static(base, target, tok, assets.cache_dir(), report, say=console.print)
    _, v1 = registry.log_candidate(uri, tid, static, params.model_dump(mode="json"), {}, {"role": "static-bootstrap"},
                                   run_name="static-bootstrap")
    registry.promote(uri, tid, v1, "demo-sagemaker: the static draft is the first champion", allow_unevaluated=True)
    step_deploy(ws, uri, tid)
    first = smd.deploy_endpoint(params, "gpu", smd.check_draft(ws.champion, tid), tid, lock_dir=ws.state)
    console.print(f"endpoint {ep}: {first['action']} {first['status']} with data capture → "
                  f"s3://{bucket}/tidespec/capture/{ep}/")
    # the endpoint's traffic (served here: moto runs no container)
    w = params.workload
    eng = make_engine(params.engine.fixed(max_batch=8), target)
    fits = [(p, ids) for p in prompts.split(prompts.load(w.prompts), w.holdout_fraction, w.seed)[0]
            if len(ids := prompt_ids(tok, p.text)) + max_new <= eng.cfg.max_seq_len][:N_PROMPTS]
    with console.status(f"the endpoint serves {len(fits)} {w.prompts} prompts (target, greedy, ≤{max_new} tokens)"):
        gens = eng.generate_batch([Request(ids, max_new, speculative=False) for _, ids in fits])
    served = [(f"ev-{p.id}", p.text, tok.decode(g.tokens, skip_special_tokens=True), g.finish_reason)
              for (p, _), g in zip(fits, gens)]
    s3 = aws.client("s3")
    for key, body in capture_objects(served, f"tidespec/capture/{ep}", max_new).items():
        s3.put_object(Bucket=bucket, Key=key, Body=body.encode())
    tide_capture, tide_cycle = orchestrate.load_flow("tide_capture"), orchestrate.load_flow("tide_cycle")
    with console.status("tide_capture: Data Capture objects → rehydrated records"), \
            orchestrate.using_api(env["PREFECT_API_URL"]):
        cap = tide_capture(root=str(ws.root), params_path=str(pp), publish=False)
    (src,) = [s for s in cap["sources"] if f"/{ep}/" in s["source"]]
    snap = seal(ws.ingest_dir(tid), ws.snapshots, tid, "demo")
    console.print(f"ingested {src['records']} exchanges from {src['objects']} objects (skipped {src['skipped']}); "
                  f"snapshot {snap.snapshot_id}: {snap.num_tokens} tokens")
    with console.status("tide_cycle: curate → train → evaluate → register (tuned window) → deploy"), \
            orchestrate.using_api(env["PREFECT_API_URL"]):
        res = tide_cycle(root=str(ws.root), params_path=str(pp), target_id=tid, tracking_uri=uri,
                         trigger="demo-sagemaker", force=True)
    if res.get("skipped"):
        raise RuntimeError(f"cycle skipped: {res['skipped']}")
    rep, dec = res["evaluate"], res["register"]
    table = Table(title=f"endpoint traffic holdout: {rep['num_prompts']} prompts, k={rep['num_draft_tokens']}")
    rows = result_rows(rep)
    for c in rows[0]:
        table.add_column(c)
    for r in rows:
        table.add_row(*r.values())
    console.print(table)
    k = (read_version(ws.champion) or {}).get("tuned_k", {}).get("gpu") if dec["promoted"] else None
    plan = smd.plan(params, params.deploy.sagemaker, "gpu", smd.check_draft(ws.champion, tid), tid,
                    "HuggingFaceTB/SmolLM2-135M-Instruct", "us-east-1")
    spec_env = {k2: v for k2, v in plan.model["PrimaryContainer"]["Environment"].items() if "SPECULATIVE" in k2}
    console.print(f"version {dec['version']}: promoted={dec['promoted']} ({dec['reason']}); tuned window for "
                  f"profile gpu: k={dec['tuned_k'].get('gpu')} (0 = speculation off); the update "
                  f"`tidespec deploy sagemaker --profile gpu` applies: {json.dumps(spec_env)}", highlight=False)
    return {"tau_before": rep["champion"]["acceptance_length"] if rep["champion"] else None,
            "tau_after": rep["candidate"]["acceptance_length"], "tuned_k": dec["tuned_k"], "promoted": dec["promoted"],
            "served_k": k, "ingest": src}
