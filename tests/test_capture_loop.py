"""The production loop end to end on real servers (Prefect server + process worker, MLflow, moto), the
tiny target with a word-level tokenizer: an endpoint deployed with data capture → capture objects in
its S3 prefix in the Data Capture format (moto runs no container: the test writes what the endpoint
would, incl. a BASE64 body, a streamed response and a truncated line) → the `tide-capture` deployment
runs on the worker → snapshot + DVC + event → the `tide-cycle` trigger runs the cycle on the worker →
a promoted champion with a tuned window per profile → the endpoint updated with that draft and k.
A second `tide-capture` run finds nothing new and does nothing."""
from __future__ import annotations

import base64
import json
import shutil
import uuid

import boto3
import pytest
import yaml

from conftest import add_tiny_word_tokenizer, copy_prefect_project, random_draft, tiny_params_yaml
from tidespec.config import EngineParams

pytestmark = pytest.mark.services
ROLE = "arn:aws:iam::123456789012:role/tidespec-sagemaker"


def _line(eid, request, response, enc="JSON", ctype="application/json") -> str:
    def body(x, mode):
        raw = x if isinstance(x, str) else json.dumps(x)
        return {"observedContentType": ctype if mode == "OUTPUT" else "application/json", "mode": mode,
                "data": base64.b64encode(raw.encode()).decode() if enc == "BASE64" else raw, "encoding": enc}

    return json.dumps(
        {
            "captureData": {"endpointInput": body(request, "INPUT"), "endpointOutput": body(response, "OUTPUT")},
            "eventMetadata": {"eventId": eid, "inferenceTime": "2026-11-30T12:00:00.000Z"},
            "eventVersion": "0",
        }
    )


def _traffic(target, tok, n: int) -> list[str]:
    """n chat exchanges whose responses are the target's own greedy outputs (what the endpoint served)."""
    from tidespec.engine.speculative import Engine
    from tidespec.models.chat import chat_ids
    eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    lines = []
    for i in range(n):
        msgs = [{"role": "user", "content": " ".join(f"t{6 + (7 * i + j) % 60}" for j in range(8))}]
        g = eng.generate(chat_ids(tok, msgs, True), 16, speculative=False)
        text = tok.decode(g.tokens, skip_special_tokens=True)
        req = {"model": "tidespec", "messages": msgs, "max_tokens": 16}
        if i % 5 == 1:  # streamed: the SSE text, BASE64 as Data Capture stores non-JSON content types
            chunks = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text},
                                                                       "finish_reason": None}]},
                      {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {},
                                                                       "finish_reason": g.finish_reason}]}]
            sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            lines.append(_line(f"ev{i}", req, sse, enc="BASE64", ctype="text/event-stream"))
        else:
            resp = {"object": "chat.completion", "model": "tidespec", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": g.finish_reason}]}
            lines.append(_line(f"ev{i}", req, resp))
    return lines


def test_endpoint_traffic_closes_the_loop(tmp_path, tiny_target_dir):
    from test_sagemaker_deploy import _MotoWithUpdate
    from tidespec.adapters import orchestrate, registry, services, versioning
    from tidespec.adapters import sagemaker_deploy as smd
    from tidespec.config import load_params
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.target import load_target
    from tidespec.steps.cycle import step_deploy
    from tidespec.workspace import Workspace, read_version

    # its own servers: the worker must carry moto's AWS env to its flow runs
    state = tmp_path / "services"
    svc = services.up(state, which=("prefect", "mlflow", "moto", "worker"))
    env = services.env_for(svc)
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    api = orchestrate.using_api(env["PREFECT_API_URL"])  # Prefect read its settings at import: point it here
    api.__enter__()
    try:
        proj = copy_prefect_project(tmp_path / "proj")  # prefect.yaml + the flows/ its entrypoints name
        tdir = proj / "target"
        shutil.copytree(tiny_target_dir, tdir)
        add_tiny_word_tokenizer(tdir)
        target, tok = load_target(tdir)
        tid = target.target_id
        bucket, ep = f"tide-{uuid.uuid4().hex[:10]}", f"ep-{uuid.uuid4().hex[:6]}"
        boto3.client("s3").create_bucket(Bucket=bucket)
        raw = yaml.safe_load(tiny_params_yaml(tdir))
        raw["capture"] |= {"seal_min_tokens": 300, "seal_max_age_s": None}  # the first object's records seal
        raw["deploy"] = {"sagemaker": {
            "role_arn": ROLE, "s3_prefix": f"s3://{bucket}/t", "target_model": "org/target", "region": "us-east-1",
            "poll_s": 0.05, "wait_timeout_s": 60, "data_capture": {"enabled": True},
            "profiles": {"gpu": {"instance_type": "ml.g4dn.xlarge", "endpoint_name": ep}}}}
        raw["ingest"] = {"served_model": "tidespec"}
        (proj / "params.yaml").write_text(yaml.safe_dump(raw))
        params = load_params(proj / "params.yaml")
        versioning.ensure_repo(proj, str(tmp_path / "dvc-remote"))
        # the first champion (a random draft), deployed with data capture on
        _, v1 = registry.log_candidate(env["MLFLOW_TRACKING_URI"], tid, save_checkpoint(
            random_draft(target, 64, seed=1), tmp_path / "d1"), params={}, metrics={}, tags={"role": "bootstrap"})
        registry.promote(env["MLFLOW_TRACKING_URI"], tid, v1, "first draft", allow_unevaluated=True)
        ws = Workspace(proj)
        step_deploy(ws, env["MLFLOW_TRACKING_URI"], tid, params)
        sm = boto3.client("sagemaker")
        first = smd.deploy_endpoint(params, "gpu", smd.check_draft(ws.champion, tid), tid, sm=sm)
        assert first["action"] == "create"
        dc = sm.describe_endpoint_config(EndpointConfigName=first["endpoint_config"])["DataCaptureConfig"]
        assert dc["EnableCapture"] and dc["DestinationS3Uri"] == f"s3://{bucket}/t/capture"
        # what the endpoint would write: one object per hour, a truncated last line in the second
        lines = _traffic(target, tok, 20)
        key = f"t/capture/{ep}/AllTraffic/2026/11/30"
        s3 = boto3.client("s3")
        s3.put_object(Bucket=bucket, Key=f"{key}/12/00-00-000-a.jsonl", Body=("\n".join(lines[:12]) + "\n").encode())
        s3.put_object(Bucket=bucket, Key=f"{key}/13/00-00-000-b.jsonl", Body=("\n".join(lines[12:]) + "\n"
                                                                              + lines[0][:50]).encode())
        orchestrate.deploy(proj, env["PREFECT_API_URL"])
        # the scheduled deployment, run now (the same deployment its hourly schedule starts)
        from prefect.deployments import run_deployment
        run = run_deployment(orchestrate.CAPTURE_DEPLOYMENT, parameters={}, timeout=600)
        assert run.state.is_completed(), run.state
        snaps = [p for p in (ws.snapshots / tid).iterdir() if p.is_dir()]
        assert len(snaps) == 1 and (snaps[0].parent / (snaps[0].name + ".dvc")).exists()  # sealed, DVC-tracked
        cyc = orchestrate.wait_for_run(env["PREFECT_API_URL"], orchestrate.CYCLE_DEPLOYMENT,
                                       {"target_id": tid}, timeout_s=900)
        assert cyc.state.is_completed(), cyc.state
        champ = registry.champion(env["MLFLOW_TRACKING_URI"], tid)
        assert champ.version != v1 and champ.tags["trigger"] == "tokens"  # promoted from the endpoint's traffic
        assert json.loads(champ.tags["snapshot_revs"]) == {snaps[0].name: versioning.snapshot_rev(proj, snaps[0])}
        k = int(champ.tags["tuned_k.gpu"])
        assert read_version(ws.champion)["tuned_k"]["gpu"] == k  # the local deploy carries the window
        tau_k = json.loads(champ.tags["tau_k"])  # τ(0..K) replayed: the acceptance alarm's reference
        assert tau_k[0] == 1.0 and tau_k == sorted(tau_k) and len(tau_k) == params.engine.num_draft_tokens + 1
        assert read_version(ws.champion)["tau_k"] == tau_k
        # the endpoint gets the new champion with its tuned window (moto lacks UpdateEndpoint: applied as
        # the blue/green update's result, the request validated by botocore's model)
        upd = smd.deploy_endpoint(params, "gpu", smd.check_draft(ws.champion, tid), tid, sm=_MotoWithUpdate(sm))
        assert upd["action"] == "update"
        menv = sm.describe_model(ModelName=upd["model"])["PrimaryContainer"]["Environment"]
        assert menv["TIDESPEC_DRAFT_VERSION"] == champ.version
        assert menv.get("SM_SGLANG_SPECULATIVE_NUM_STEPS") == (str(k) if k else None)
        # a second scheduled run: no new objects → nothing read, no new snapshot, no new cycle
        before = sorted(p.name for p in (ws.snapshots / tid).iterdir())
        again = run_deployment(orchestrate.CAPTURE_DEPLOYMENT, parameters={}, timeout=600)
        assert again.state.is_completed()
        assert sorted(p.name for p in (ws.snapshots / tid).iterdir()) == before
        from tidespec.adapters.s3_capture import default_sources
        from tidespec.capture.ingest import ledger_path, read_ledger
        (src,) = [s for s in default_sources(params, tid) if f"/{ep}/" in s]  # the gpu profile's endpoint
        assert sorted(read_ledger(ledger_path(ws, src))) == [f"{key}/12/00-00-000-a.jsonl",
                                                               f"{key}/13/00-00-000-b.jsonl"]
    finally:
        api.__exit__(None, None, None)
        mp.undo()
        services.down(state)
