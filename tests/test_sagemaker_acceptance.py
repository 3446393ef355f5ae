"""The SageMaker acceptance alarm (`deploy.sagemaker.canary.alarm_acceptance`,
`adapters.sagemaker_deploy.acceptance`): its threshold, how a deploy adds it beside the 5xx and
latency alarms of the blue/green update, what it refuses, and — on moto — that the publisher the
serving image runs puts its datapoints on exactly the metric the alarm watches. moto stores alarms
and datapoints but never evaluates an alarm (infra/README.md), so the breach itself is the
datapoint's value against the stored threshold."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import boto3
import pytest

from conftest import random_draft
from tidespec.adapters import sagemaker_deploy as smd
from tidespec.adapters.sagemaker_deploy import acceptance
from tidespec.config import Params
from tidespec.models.eagle3 import save_checkpoint
from tidespec.workspace import make_bundle, write_version

ROOT = Path(__file__).resolve().parents[1]
ROLE = "arn:aws:iam::123456789012:role/tidespec-sagemaker"
NOW = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)
TAU_K = [1.0, 1.6, 1.9, 2.1, 2.2]  # replayed τ at k = 0..4
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/tidespec-sglang:1"


def _params(target_dir, canary=None, sm=None, **gpu) -> Params:
    """deploy.sagemaker with the acceptance alarm on and the gpu profile on a tidespec image;
    `canary`, `sm` (deploy.sagemaker keys) and `gpu` (profile keys) override."""
    return Params.model_validate(_raw(target_dir, canary, sm, **gpu))


def _raw(target_dir, canary=None, sm=None, **gpu) -> dict:
    """`_params`'s params.yaml, as a dict."""
    sm = {"role_arn": ROLE, "s3_prefix": "s3://tide-acc/tidespec", "region": "us-east-1", "poll_s": 0.05,
          "wait_timeout_s": 30, "target_model": "org/target",
          "canary": {"alarm_acceptance": True} | (canary or {}),
          "profiles": {"gpu": {"instance_type": "ml.g4dn.xlarge", "image_uri": IMAGE} | gpu}} | (sm or {})
    return {"target": {"source": str(target_dir)}, "engine": {"num_draft_tokens": 4}, "deploy": {"sagemaker": sm}}


@pytest.fixture(scope="module")
def drafts(tiny_target, tmp_path_factory):
    """v7 with a replayed τ(k) (as the registry's download writes version.json), v8 without."""
    out = {}
    for v, tau_k in (("7", TAU_K), ("8", None)):
        root = tmp_path_factory.mktemp(f"acc-v{v}")
        b = make_bundle(save_checkpoint(random_draft(tiny_target, seed=int(v)), root / "ck"), root / "bundle")
        write_version(b, v, "run", tau_k=tau_k)
        out[v] = b
    return out


def test_threshold_is_the_replayed_tau_less_three_bhatia_davis_errors():
    """k = 4: τ = 2.2, μ = 1.2, Var ≤ μ(k−μ) = 3.36, SE(100 drafts) = sqrt(0.0336) = 0.1833 →
    2.2 − 0.5499 = 1.6501. k = 6 above the replayed K = 4: τ(4), wider bound μ(6−μ) = 5.76 → 1.48.
    k = 1: τ = 1.6, μ(1−μ) = 0.24 → 1.6 − 3·0.04899 = 1.4530."""
    assert acceptance.threshold(TAU_K, 4) == pytest.approx(2.2 - 3 * math.sqrt(0.0336), abs=1e-12)
    assert acceptance.threshold(TAU_K, 4) == pytest.approx(1.6501, abs=1e-4)
    assert acceptance.threshold(TAU_K, 6) == pytest.approx(1.48, abs=1e-12)
    assert acceptance.threshold(TAU_K, 1) == pytest.approx(1.4530, abs=1e-4)
    for bad, k in (([], 4), (TAU_K, 0), ([1.0, 5.0], 1), ([1.2, 1.6], 1), ([1.0, 1.9, 1.7], 2)):
        with pytest.raises(ValueError, match="threshold needs"):
            acceptance.threshold(bad, k)


def test_a_deploy_adds_the_alarm_to_the_update_and_refuses_one_that_could_not_fire(tiny_target, tiny_target_dir,
                                                                                 drafts):
    """With canary.alarm_acceptance the plan has a third alarm on the draft's live τ (the served
    window's threshold, the version's dimension), the blue/green update rolls back on it, and the
    Model's environment starts and labels the image's publisher. Refused, naming the fix: the plain
    SGLang DLC (publishes nothing), a draft without replayed τ(k). Speculation off: no alarm."""
    tid = tiny_target.target_id
    art = smd.check_draft(drafts["7"], tid)
    assert art.tau_k == tuple(TAU_K) and art.version == "7"
    p = _params(tiny_target_dir)
    plan = smd.plan(p, p.deploy.sagemaker, "gpu", art, tid, "org/target", "us-east-1", now=NOW)
    names = [a["AlarmName"] for a in plan.alarms]
    assert names == [f"{plan.endpoint}-5xx", f"{plan.endpoint}-p99-latency", f"{plan.endpoint}-acceptance"]
    acc = plan.alarms[2]
    assert (acc["Namespace"], acc["MetricName"], acc["ComparisonOperator"]) == (
        "tidespec/SpeculativeDecoding", "AcceptanceLength", "LessThanThreshold")
    assert acc["Threshold"] == pytest.approx(1.6501, abs=1e-4)  # k = engine.num_draft_tokens = 4
    assert acc["Dimensions"][2] == {"Name": "DraftVersion", "Value": "7"}
    upd = smd.update_request(plan.endpoint, plan.config_name, 2, p.deploy.sagemaker.canary, plan.alarms)
    assert [a["AlarmName"] for a in upd["DeploymentConfig"]["AutoRollbackConfiguration"]["Alarms"]] == names
    env = plan.model["PrimaryContainer"]["Environment"]
    assert {k: env[k] for k in ("TIDESPEC_ACCEPTANCE", "TIDESPEC_ENDPOINT_NAME", "TIDESPEC_ENGINE",
                                "TIDESPEC_NUM_STEPS", "TIDESPEC_DRAFT_VERSION", "SM_SGLANG_ENABLE_METRICS")} == {
        "TIDESPEC_ACCEPTANCE": "1", "TIDESPEC_ENDPOINT_NAME": plan.endpoint, "TIDESPEC_ENGINE": "sglang",
        "TIDESPEC_NUM_STEPS": "4", "TIDESPEC_DRAFT_VERSION": "7", "SM_SGLANG_ENABLE_METRICS": ""}
    two = _params(tiny_target_dir, sm={"num_steps": 2})
    a2 = smd.plan(two, two.deploy.sagemaker, "gpu", art, tid, "org/target", "us-east-1", now=NOW).alarms[2]
    assert a2["Threshold"] == pytest.approx(1.9 - 3 * math.sqrt(0.9 * 1.1 / 100), abs=1e-4)  # the served k = 2

    dlc = _params(tiny_target_dir, image_uri=None)
    with pytest.raises(ValueError, match="canary.alarm_acceptance: profile 'gpu' runs the AWS SGLang DLC.*image_uri"):
        smd.plan(dlc, dlc.deploy.sagemaker, "gpu", art, tid, "org/target", "us-east-1", now=NOW)
    old = smd.check_draft(drafts["8"], tid)
    with pytest.raises(ValueError, match="draft 8 has no replayed τ\\(k\\).*turn the alarm off"):
        smd.plan(p, p.deploy.sagemaker, "gpu", old, tid, "org/target", "us-east-1", now=NOW)
    off = smd.DraftArtifact(art.path, "7", art.sha256, art.config_sha256, (("gpu", 0),), art.tau_k)
    plan_off = smd.plan(p, p.deploy.sagemaker, "gpu", off, tid, "org/target", "us-east-1", now=NOW)
    assert len(plan_off.alarms) == 2 and "TIDESPEC_ACCEPTANCE" not in plan_off.model["PrimaryContainer"]["Environment"]
    plain = _params(tiny_target_dir, canary={"alarm_acceptance": False})
    plan_plain = smd.plan(plain, plain.deploy.sagemaker, "gpu", old, tid, "org/target", "us-east-1", now=NOW)
    assert len(plan_plain.alarms) == 2


def test_a_champion_from_before_tau_k_gets_its_alarm_from_the_registry(mlflow_server, tiny_target, tiny_target_dir,
                                                                       drafts, tmp_path):
    """`tidespec deploy sagemaker --dry-run` as a user runs it, with a champion installed before
    version.json carried τ(k): with MLFLOW_TRACKING_URI set, the deploy rebuilds τ(k) from its run's
    per-position acceptance (0.6, 0.3, 0.1, 0.05 → τ(0..4) = 1, 1.6, 1.9, 2.0, 2.05), and takes the
    profile's window from the version's tag (k = 3, not engine.num_draft_tokens' 4), so the alarm is
    planned at τ(3) − 3·sqrt(μ(3−μ)/100), μ = 1.0: 2.0 − 3·sqrt(0.02) = 1.5757. Without the registry
    the same champion's plan is refused (no τ(k))."""
    from tidespec.adapters import registry

    tid = tiny_target.target_id
    per_pos = {f"accepted_per_pos/{i}": a for i, a in enumerate((0.6, 0.3, 0.1, 0.05))}
    run_id, v = registry.log_candidate(mlflow_server, tid, drafts["8"], {}, per_pos,
                                       {"tuned_k.gpu": "3"})
    champion = tmp_path / "data" / "drafts" / "champion"
    shutil.copytree(drafts["8"], champion)
    write_version(champion, v, run_id)  # no tau_k, no tuned_k: as an older install wrote it
    params = tmp_path / "params.yaml"
    params.write_text(json.dumps(_raw(tiny_target_dir)))
    args = [sys.executable, "-m", "tidespec.cli", "deploy", "sagemaker", "--profile", "gpu", "--root", str(tmp_path),
            "--params", str(params), "--dry-run"]
    env = os.environ | {"PYTHONPATH": str(ROOT / "src"), "MLFLOW_TRACKING_URI": mlflow_server}
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr + r.stdout
    plan = json.loads(r.stdout[r.stdout.index("\n{\n") + 1:])  # after the notes: the plan, indented JSON
    (acc,) = [a for a in plan["alarms"] if a["AlarmName"].endswith("-acceptance")]
    assert acc["Threshold"] == pytest.approx(2.0 - 3 * math.sqrt(0.02), abs=5e-5)  # stored to 4 decimals
    assert f"windows of v{v} from the registry: {{'gpu': 3}}" in r.stdout
    with pytest.raises(ValueError, match=f"draft {v} has no replayed τ"):  # the same champion without the registry
        smd.plan(_params(tiny_target_dir), _params(tiny_target_dir).deploy.sagemaker, "gpu",
                 smd.check_draft(champion, tid), tid, "org/target", "us-east-1", now=NOW)


class _Metrics(BaseHTTPRequestHandler):
    """SGLang's /metrics as prometheus_client writes it, from the counters in `self.server.c`."""

    def do_GET(self):
        v, g, n = self.server.c["verify"], self.server.c["generated"], self.server.c["requests"]
        body = ("# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.\n"
                "# TYPE sglang:spec_verify_calls_total counter\n"
                f'sglang:spec_verify_calls_total{{model_name="m"}} {v}.0\n'
                "# HELP sglang:generation_tokens_total Number of generation tokens processed.\n"
                "# TYPE sglang:generation_tokens_total counter\n"
                f'sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} {g}.0\n'
                "# TYPE sglang:num_requests_total counter\n"
                f'sglang:num_requests_total{{is_streaming="false",model_name="m"}} {n}.0\n').encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


def test_published_acceptance_lands_on_the_alarms_metric_on_moto(aws_env, tiny_target, tiny_target_dir, drafts):
    """`tidespec deploy` (create path, moto) puts the acceptance alarm; the publisher, reading an
    SGLang's counters, puts a window's τ only from 100 drafts on, on the very metric the stored alarm
    watches (same namespace, name and dimensions: an alarm on another metric would never fire). A
    decayed window (τ 1.3) sits below the stored threshold, a healthy one (2.3) above."""
    bucket = f"tide-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    p = _params(tiny_target_dir, sm={"s3_prefix": f"s3://{bucket}/t"},  # moto is shared: names of its own
                endpoint_name=f"tidespec-acc-{uuid.uuid4().hex[:8]}")
    tid = tiny_target.target_id
    res = smd.deploy_endpoint(p, "gpu", smd.check_draft(drafts["7"], tid), tid, now=NOW)
    ep = res["endpoint"]
    cw = boto3.client("cloudwatch")
    (alarm,) = cw.describe_alarms(AlarmNames=[f"{ep}-acceptance"])["MetricAlarms"]

    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    srv.c = {"verify": 40, "generated": 110, "requests": 10}
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        from tidespec.backends.acceptance import engine_scrape
        pub = acceptance.Publisher(engine_scrape(f"http://127.0.0.1:{srv.server_port}", "sglang", 4), ep, "7",
                                   cloudwatch=cw)
        assert pub.publish_once() is None  # the first read opens the window
        srv.c = {"verify": 120, "generated": 250, "requests": 20}
        assert pub.publish_once() is None  # 80 drafts: too few for a datapoint
        srv.c = {"verify": 140, "generated": 250, "requests": 20}  # since the first read: 100 drafts, 140
        # tokens, 10 of them the prefills' → τ 1.3
        assert pub.publish_once() == pytest.approx(1.3)
        srv.c = {"verify": 340, "generated": 730, "requests": 40}  # 200 drafts, 480 tokens, 20 requests → τ 2.3
        assert pub.publish_once() == pytest.approx(2.3)
        srv.c = {"verify": 30, "generated": 70, "requests": 10}  # the engine restarted: counters went back
        assert pub.publish_once() is None  # a new window opens there, nothing negative is put
        srv.c = {"verify": 130, "generated": 250, "requests": 20}  # 100 drafts, 180 tokens, 10 requests → τ 1.7
        assert pub.publish_once() == pytest.approx(1.7)
    finally:
        srv.shutdown()
    listed = cw.describe_alarms_for_metric(MetricName=acceptance.METRIC, Namespace=acceptance.NAMESPACE,
                                           Dimensions=pub.dims)["MetricAlarms"]
    assert f"{ep}-acceptance" in [a["AlarmName"] for a in listed]  # moto filters by name and namespace only
    assert sorted(alarm["Dimensions"], key=lambda d: d["Name"]) == sorted(pub.dims, key=lambda d: d["Name"])
    metric = {"Namespace": acceptance.NAMESPACE, "MetricName": acceptance.METRIC, "Dimensions": pub.dims}
    got = cw.get_metric_data(MetricDataQueries=[
        {"Id": s.lower(), "MetricStat": {"Metric": metric, "Period": 60, "Stat": s}} for s in ("Minimum", "Maximum")],
        StartTime=datetime.now(UTC) - timedelta(minutes=10), EndTime=datetime.now(UTC) + timedelta(minutes=10),
    )["MetricDataResults"]
    low, high = (min(r["Values"]) if r["Id"] == "minimum" else max(r["Values"]) for r in got)
    assert (low, high) == (pytest.approx(1.3), pytest.approx(2.3))  # and 1.7 between them
    assert alarm["Threshold"] == pytest.approx(1.6501, abs=1e-4) and low < alarm["Threshold"] < high


def test_the_images_start_the_publisher_only_when_asked(tmp_path):
    """Both serving images' entrypoints start `python3 -m tidespec.backends.acceptance`
    beside the engine when TIDESPEC_ACCEPTANCE=1, and not otherwise; the SGLang wrapper then runs
    the DLC's own entrypoint with SageMaker's arguments."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    calls = tmp_path / "python3.calls"
    (bin_ / "python3").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_ / "python3").chmod(0o755)
    show = tmp_path / "show.sh"
    show.write_text('#!/bin/sh\necho "engine $*"\n')
    show.chmod(0o755)
    path = f"{bin_}{os.pathsep}{os.environ['PATH']}"
    for flag in ("0", "1"):
        calls.unlink(missing_ok=True)
        for script, env in (("vllm-neuron/sagemaker-entrypoint.sh", {"VLLM_CMD": str(show)}),
                            ("sglang/with-acceptance.sh", {"TIDESPEC_BASE_ENTRYPOINT": str(show)})):
            r = subprocess.run(["bash", str(ROOT / "infra/containers" / script), "serve"], capture_output=True,
                               text=True, env={"PATH": path, "TIDESPEC_ACCEPTANCE": flag} | env, check=True)
            assert r.stdout.startswith("engine ")  # vLLM's gets its flags, the DLC's SageMaker's `serve`
            assert ("--port 8080" if "vllm" in script else "engine serve") in r.stdout
        started = calls.read_text().splitlines() if calls.exists() else []
        for _ in range(50):  # the publisher runs in the background: give it a moment to write
            if flag == "0" or len(started) == 2:
                break
            threading.Event().wait(0.1)
            started = calls.read_text().splitlines() if calls.exists() else []
        assert started == ([] if flag == "0" else ["-m tidespec.backends.acceptance"] * 2)
    r = subprocess.run(["bash", str(ROOT / "infra/containers/sglang/with-acceptance.sh"), "serve"],
                       capture_output=True, text=True, env={"PATH": path})
    assert r.returncode == 2 and "BASE_ENTRYPOINT" in r.stderr
