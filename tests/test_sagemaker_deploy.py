"""SageMaker deployer: request builders, the CLI end to end on a moto server, the blue/green update.

moto 5.2.5 implements CreateModel/EndpointConfig/Endpoint, Describe*, List*, Delete*, CloudWatch
alarms, CloudFormation, S3. It does not implement UpdateEndpoint (HTTP 500) and rejects the
instance types of the real profiles (ml.g6e, ml.p5, ml.trn2; it takes ml.g4dn). So:
- the end-to-end runs (CLI on moto, infra/ CloudFormation stack on moto) use a gpu profile on
  ml.g4dn.xlarge;
- the exact requests for the default profiles (ml.g6e.2xlarge SGLang, ml.trn2.48xlarge vLLM-neuron)
  and for UpdateEndpoint are checked with botocore's Stubber;
- the update path on moto sends UpdateEndpoint to a Stubber-checked client and applies its effect
  on moto by recreating the endpoint on the new config (what AWS does after a successful blue/green),
  so everything around it (alarms, waiting, pruning, idempotence) runs for real.
"""
import json
import os
import shutil
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import boto3
import pytest
from botocore.stub import ANY, Stubber
from pydantic import ValidationError

from conftest import random_draft
from tidespec.adapters import sagemaker_deploy as smd
from tidespec.assets import sha256_file
from tidespec.config import Params, TreeParams
from tidespec.config.sagemaker import CanaryParams
from tidespec.models.eagle3 import save_checkpoint

ROLE = "arn:aws:iam::123456789012:role/tidespec-sagemaker"
ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)


def _params(target_dir, **sm) -> Params:
    base = {"role_arn": ROLE, "s3_prefix": "s3://tide-deploy/tidespec", "region": "us-east-1", "poll_s": 0.05,
            "wait_timeout_s": 30}
    return Params.model_validate({"target": {"source": str(target_dir)}, "engine": {"num_draft_tokens": 3},
                                  "deploy": {"sagemaker": base | sm}})


@pytest.fixture(scope="module")
def draft_dirs(tiny_target, tmp_path_factory):
    """Two different drafts for the tiny target (v1, v2), with version.json as a local deploy writes."""
    out = []
    for v in (1, 2):
        d = save_checkpoint(random_draft(tiny_target, seed=v), tmp_path_factory.mktemp(f"draft-v{v}"))
        (d / "version.json").write_text(json.dumps({"version": str(v), "run_id": "r"}))
        out.append(d)
    return out


# -- pure --------------------------------------------------------------------------------------------
def test_profiles_merge_defaults_and_reject_bad_values(tiny_target_dir):
    p = _params(tiny_target_dir, profiles={"gpu": {"instance_count": 3}}).deploy.sagemaker
    gpu = p.profile("gpu")
    assert (gpu.engine, gpu.instance_type, gpu.instance_count) == ("sglang", "ml.g6e.2xlarge", 3)
    assert p.profiles["trn2"].instance_type == "ml.trn2.48xlarge"
    with pytest.raises(ValueError, match="needs image_uri"):
        p.profile("trn2")
    with pytest.raises(ValueError, match="no SageMaker profile 'tpu'"):
        p.profile("tpu")
    for bad, msg in [({"profiles": {"gpu": {"instance_type": "ml.trn2.48xlarge"}}}, "does not fit engine sglang"),
                     ({"profiles": {"trn2": {"instance_type": "ml.g6e.2xlarge"}}}, "does not fit engine vllm"),
                     ({"on_promote": ["tpu"]}, "on_promote names profile 'tpu'"),
                     ({"num_steps": 3, "num_draft_tokens": 6}, "num_steps \\+ 1"),
                     ({"role_arn": "tidespec"}, "not an IAM role ARN"),
                     ({"s3_prefix": "bucket/prefix"}, "not an S3 URI"),
                     ({"canary": {"percent": 80}}, "less than or equal to 50"),
                     ({"profiles": {"gpu": {"instnce_type": "ml.g5.xlarge"}}}, "instnce_type")]:
        with pytest.raises(ValidationError, match=msg):
            _params(tiny_target_dir, **bad)


def test_container_env_per_engine(tiny_target_dir, draft_dirs):
    p = _params(tiny_target_dir, profiles={"trn2": {"image_uri": "img:1"}}).deploy.sagemaker
    art = smd.check_draft(draft_dirs[0], None)
    spec = smd.spec_settings(p, 3)
    assert spec == {"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}
    env = smd.container_env(p.profile("gpu"), "/opt/ml/model", spec, art)
    assert env == {"SM_SGLANG_MODEL_PATH": "/opt/ml/model", "SM_SGLANG_SPECULATIVE_ALGORITHM": "EAGLE3",
                   "SM_SGLANG_SPECULATIVE_DRAFT_MODEL_PATH": "/opt/ml/additional-model-data-sources/draft",
                   "SM_SGLANG_SPECULATIVE_NUM_STEPS": "3", "SM_SGLANG_SPECULATIVE_EAGLE_TOPK": "1",
                   "SM_SGLANG_SPECULATIVE_NUM_DRAFT_TOKENS": "4", "SM_SGLANG_TP_SIZE": "1",
                   "TIDESPEC_DRAFT_VERSION": "1", "TIDESPEC_DRAFT_SHA256": art.sha256}
    env = smd.container_env(p.profile("trn2"), "/opt/ml/model", spec, art)
    assert json.loads(env["SM_VLLM_SPECULATIVE_CONFIG"]) == {
        "method": "eagle3", "model": "/opt/ml/additional-model-data-sources/draft", "num_speculative_tokens": 3}
    assert env["SM_VLLM_TENSOR_PARALLEL_SIZE"] == "64" and env["SM_VLLM_MODEL"] == "/opt/ml/model"
    assert smd.spec_settings(_params(tiny_target_dir, num_steps=5, eagle_topk=4,
                                     num_draft_tokens=8).deploy.sagemaker, 3) == \
        {"num_steps": 5, "eagle_topk": 4, "num_draft_tokens": 8}
    # engine.tree deploys to SGLang as it serves embedded; a size that cannot fit a shallower tuned
    # window is brought into range, not passed through
    tree = TreeParams(eagle_topk=4, num_draft_tokens=12)
    assert smd.spec_settings(p, 3, tree) == {"num_steps": 3, "eagle_topk": 4, "num_draft_tokens": 12}
    assert smd.spec_settings(p, 1, tree) == {"num_steps": 1, "eagle_topk": 4, "num_draft_tokens": 5}
    with pytest.raises(ValueError, match="eagle_topk 1"):  # an explicit SGLang size is checked, never changed
        smd.spec_settings(_params(tiny_target_dir, num_steps=3, num_draft_tokens=8).deploy.sagemaker, 3)


def test_names_alarms_update_and_outcome():
    assert smd.resource_name("tidespec-abc-gpu", "12", NOW) == "tidespec-abc-gpu-v12-20261130120000"
    with pytest.raises(ValueError, match="too long"):
        smd.resource_name("e" * 50, "12", NOW)
    canary = CanaryParams(percent=20, wait_s=300, alarm_p99_latency_ms=2000)
    alarms = smd.alarm_requests("ep", canary)
    assert [a["MetricName"] for a in alarms] == ["Invocation5XXErrors", "ModelLatency"]
    assert alarms[1]["Threshold"] == 2_000_000.0 and alarms[1]["ExtendedStatistic"] == "p99"  # µs
    two = smd.update_request("ep", "cfg", 2, canary, alarms)["DeploymentConfig"]
    assert two["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"] == {
        "Type": "CANARY", "WaitIntervalInSeconds": 300, "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": 20}}
    assert two["AutoRollbackConfiguration"] == {
        "Alarms": [{"AlarmName": "tidespec-ep-5xx"}, {"AlarmName": "tidespec-ep-p99-latency"}]
    }  # operator policy: alarm:tidespec-*
    one = smd.update_request("ep", "cfg", 1, canary, alarms)["DeploymentConfig"]["BlueGreenUpdatePolicy"]
    assert one["TrafficRoutingConfiguration"] == {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": 300}
    d = {"EndpointName": "ep", "EndpointConfigName": "new", "EndpointStatus": "Updating"}
    assert smd.endpoint_outcome(d, "new") is False
    assert smd.endpoint_outcome(d | {"EndpointStatus": "InService"}, "new") is True
    with pytest.raises(smd.SageMakerDeployFailed, match="rolled back to old.*alarm fired"):
        smd.endpoint_outcome(d | {"EndpointStatus": "InService", "EndpointConfigName": "old"}, "new")
    with pytest.raises(smd.SageMakerDeployFailed, match="Failed: CUDA OOM"):
        smd.endpoint_outcome(d | {"EndpointStatus": "Failed", "FailureReason": "CUDA OOM"}, "new")


def test_check_draft_refuses_other_target_and_broken_dirs(tiny_target, draft_dirs, tmp_path):
    art = smd.check_draft(draft_dirs[0], tiny_target.target_id)
    assert art.version == "1" and len(art.sha256) == 64
    with pytest.raises(ValueError, match="trained for target"):
        smd.check_draft(draft_dirs[0], "f" * 64)
    with pytest.raises(FileNotFoundError, match="not a draft checkpoint"):
        smd.check_draft(tmp_path, None)
    with pytest.raises(ValueError, match="target_model is not set"):
        smd.resolve_target(Params.model_validate({"deploy": {"sagemaker": {"role_arn": ROLE,
                                                                           "s3_prefix": "s3://tide-x/p"}}}),
                           Params.model_validate({"deploy": {"sagemaker": {"role_arn": ROLE, "s3_prefix":
                                                                           "s3://tide-x/p"}}}).deploy.sagemaker)


# -- exact requests (Stubber) for what moto does not take -------------------------------------------
def _arn(kind: str, name: str) -> str:
    return f"arn:aws:sagemaker:us-west-2:123456789012:{kind}/{name.lower()}"


def _stubbed_sm():
    sm = boto3.client("sagemaker", region_name="us-west-2", aws_access_key_id="x", aws_secret_access_key="x")
    return sm, Stubber(sm)


@pytest.mark.parametrize("profile", ["gpu", "trn2"])
def test_default_profiles_exact_create_requests(tiny_target, tiny_target_dir, draft_dirs, profile):
    """First deploy of the real profiles (ml.g6e.2xlarge / ml.trn2.48xlarge, which moto rejects):
    every SageMaker request checked field by field; S3/CloudWatch are not involved (plan only)."""
    params = _params(tiny_target_dir, region="us-west-2", target_model="s3://tide-deploy/targets/smol/",
                     profiles={"trn2": {"image_uri": "111122223333.dkr.ecr.us-west-2.amazonaws.com/vn:1"}})
    art = smd.check_draft(draft_dirs[0], tiny_target.target_id)
    plan = smd.plan(params, params.deploy.sagemaker, profile, art, tiny_target.target_id,
                    "s3://tide-deploy/targets/smol/", "us-west-2", NOW)
    ep = f"tidespec-{tiny_target.target_id[:12]}-{profile}"
    name = f"{ep}-v1-20261130120000"
    sm, stub = _stubbed_sm()
    image = (smd.SGLANG_DLC.format(region="us-west-2") if profile == "gpu"
             else "111122223333.dkr.ecr.us-west-2.amazonaws.com/vn:1")
    tags = [{"Key": "project", "Value": "tidespec"}, {"Key": "tidespec:endpoint", "Value": ep},
            {"Key": "tidespec:draft_sha256", "Value": art.sha256[:16]}, {"Key": "tidespec:draft_version", "Value": "1"}]
    stub.add_response("create_model", {"ModelArn": _arn("model", name)}, {
        "ModelName": name, "ExecutionRoleArn": ROLE, "Tags": tags,
        "PrimaryContainer": {
            "Image": image, "Mode": "SingleModel",
            "ModelDataSource": {"S3DataSource": {"S3Uri": "s3://tide-deploy/targets/smol/", "S3DataType": "S3Prefix",
                                                 "CompressionType": "None"}},
            "AdditionalModelDataSources": [{"ChannelName": "draft", "S3DataSource": {
                "S3Uri": f"s3://tide-deploy/tidespec/drafts/{art.key}/", "S3DataType": "S3Prefix",
                "CompressionType": "None"}}],
            "Environment": ANY}})
    it = "ml.g6e.2xlarge" if profile == "gpu" else "ml.trn2.48xlarge"
    timeout = 1800 if profile == "gpu" else 3600
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": _arn("endpoint-config", name)}, {
        "EndpointConfigName": name, "Tags": tags,
        "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": name, "InstanceType": it,
                                "InitialInstanceCount": 1, "ContainerStartupHealthCheckTimeoutInSeconds": timeout,
                                "ModelDataDownloadTimeoutInSeconds": timeout}]})
    stub.add_response("create_endpoint", {"EndpointArn": _arn("endpoint", ep)},
                      {"EndpointName": ep, "EndpointConfigName": name, "Tags": tags})
    with stub:  # the boto3 calls deploy_endpoint makes for a new endpoint, from the plan
        sm.create_model(**plan.model)
        sm.create_endpoint_config(**plan.endpoint_config)
        sm.create_endpoint(EndpointName=plan.endpoint, EndpointConfigName=plan.config_name,
                           Tags=plan.endpoint_config["Tags"])
    stub.assert_no_pending_responses()
    env = plan.model["PrimaryContainer"]["Environment"]
    key = "SM_SGLANG_SPECULATIVE_DRAFT_MODEL_PATH" if profile == "gpu" else "SM_VLLM_SPECULATIVE_CONFIG"
    assert "/opt/ml/additional-model-data-sources/draft" in env[key]


def test_update_exact_request_and_rollback(aws_env, tiny_target, tiny_target_dir, draft_dirs):
    """deploy_endpoint on an InService endpoint serving v1: S3 and CloudWatch on moto, SageMaker
    stubbed (UpdateEndpoint is not in moto). The alarm fires during the canary → AWS rolls back →
    the describe shows the old config: SageMakerDeployFailed, old config still live, nothing pruned."""
    bucket = f"tide-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    params = _params(tiny_target_dir, s3_prefix=f"s3://{bucket}/t", target_model="org/target",
                     profiles={"gpu": {"instance_count": 2}})
    tid = tiny_target.target_id
    ep, old = f"tidespec-{tid[:12]}-gpu", f"tidespec-{tid[:12]}-gpu-v1-20261129000000"
    new = f"{ep}-v2-20261130120000"
    sm, stub = _stubbed_sm()
    stub.add_response(
        "describe_endpoint",
        {
            "EndpointName": ep,
            "EndpointArn": _arn("endpoint", ep),
            "EndpointConfigName": old,
            "EndpointStatus": "InService",
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        },
        {"EndpointName": ep},
    )
    stub.add_response(
        "describe_endpoint_config",
        {
            "EndpointConfigName": old,
            "EndpointConfigArn": _arn("endpoint-config", old),
            "CreationTime": NOW,
            "ProductionVariants": [{"VariantName": "AllTraffic", "ModelName": old}],
        },
        {"EndpointConfigName": old},
    )
    stub.add_response("create_model", {"ModelArn": _arn("model", new)}, {"ModelName": new, "ExecutionRoleArn": ROLE,
                                                               "PrimaryContainer": ANY, "Tags": ANY})
    stub.add_response("create_endpoint_config", {"EndpointConfigArn": _arn("endpoint-config", new)},
                      {"EndpointConfigName": new, "ProductionVariants": ANY, "Tags": ANY})
    stub.add_response("update_endpoint", {"EndpointArn": _arn("endpoint", ep)}, {
        "EndpointName": ep, "EndpointConfigName": new, "RetainAllVariantProperties": False,
        "DeploymentConfig": {
            "BlueGreenUpdatePolicy": {
                "TrafficRoutingConfiguration": {"Type": "CANARY", "WaitIntervalInSeconds": 600,
                                                "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": 10}},
                "TerminationWaitInSeconds": 600, "MaximumExecutionTimeoutInSeconds": 3600},
            "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": f"{ep}-5xx"},
                                                     {"AlarmName": f"{ep}-p99-latency"}]}}})
    for status, cfg, reason in [("Updating", old, None), ("Updating", old, None),
                                ("InService", old, "Alarm tidespec-5xx in ALARM state"),
                                ("InService", old, "Alarm tidespec-5xx in ALARM state")]:
        resp = {
            "EndpointName": ep,
            "EndpointArn": _arn("endpoint", ep),
            "EndpointConfigName": cfg,
            "EndpointStatus": status,
            "CreationTime": NOW,
            "LastModifiedTime": NOW,
        }
        stub.add_response("describe_endpoint", resp | ({"FailureReason": reason} if reason else {}),
                          {"EndpointName": ep})
    # rolled back: the unused new config and model are deleted (never the live one), nothing pruned
    stub.add_response("delete_endpoint_config", {}, {"EndpointConfigName": new})
    stub.add_response("delete_model", {}, {"ModelName": new})
    art = smd.check_draft(draft_dirs[1], tid)
    with stub, pytest.raises(smd.SageMakerDeployFailed, match=f"rolled back to {old}.*tidespec-5xx"):
        smd.deploy_endpoint(params, "gpu", art, tid, sm=sm, now=NOW)
    stub.assert_no_pending_responses()
    alarms = boto3.client("cloudwatch").describe_alarms(AlarmNamePrefix=ep)["MetricAlarms"]
    assert {a["AlarmName"] for a in alarms} == {f"{ep}-5xx", f"{ep}-p99-latency"}
    head = boto3.client("s3").head_object(Bucket=bucket, Key=f"t/drafts/{art.key}/model.safetensors")
    assert head["ServerSideEncryption"] == "AES256" and head["Metadata"]["sha256"] == art.sha256


# -- end to end on moto -----------------------------------------------------------------------------
class _MotoWithUpdate:
    """The moto SageMaker client, except UpdateEndpoint: its request is validated by a Stubber-wrapped
    client (botocore's model checks), then applied on moto as the successful result of a blue/green
    update (the endpoint recreated on the new config)."""

    def __init__(self, sm):
        self._sm, self.updates = sm, []
        self._check = boto3.client("sagemaker", region_name=sm.meta.region_name, aws_access_key_id="x",
                                   aws_secret_access_key="x")

    def __getattr__(self, name):
        return getattr(self._sm, name)

    def update_endpoint(self, **req):
        with Stubber(self._check) as stub:
            stub.add_response("update_endpoint", {"EndpointArn": _arn("endpoint", req["EndpointName"])}, req)
            self._check.update_endpoint(**req)  # raises ParamValidationError on a malformed request
        self.updates.append(req)
        self._sm.delete_endpoint(EndpointName=req["EndpointName"])
        self._sm.create_endpoint(EndpointName=req["EndpointName"], EndpointConfigName=req["EndpointConfigName"])
        return {"EndpointArn": self._sm.describe_endpoint(EndpointName=req["EndpointName"])["EndpointArn"]}


def _stack(tmp_path) -> dict:
    """Deploy infra/cloudformation/tidespec-sagemaker.yaml on moto; returns its outputs."""
    cf = boto3.client("cloudformation")
    name = f"tidespec-{uuid.uuid4().hex[:8]}"
    cf.create_stack(StackName=name, TemplateBody=(ROOT / "infra/cloudformation/tidespec-sagemaker.yaml").read_text(),
                    Parameters=[{"ParameterKey": "BucketName", "ParameterValue": f"tide-{uuid.uuid4().hex[:12]}"},
                                {"ParameterKey": "RoleName", "ParameterValue": name}],
                    Capabilities=["CAPABILITY_NAMED_IAM"])
    st = cf.describe_stacks(StackName=name)["Stacks"][0]
    assert st["StackStatus"] == "CREATE_COMPLETE"
    return {o["OutputKey"]: o["OutputValue"] for o in st["Outputs"]}


def test_cli_deploys_to_moto_end_to_end(aws_env, tiny_target, tiny_target_dir, draft_dirs, tmp_path):
    """`tidespec deploy sagemaker --profile gpu` as a user runs it, against the infra/ stack on moto:
    target dir and draft uploaded (SSE), Model/EndpointConfig/alarms/endpoint created, InService;
    a second run is a no-op; v2 then goes through the blue/green path and v1's resources are pruned."""
    out = _stack(tmp_path)
    s3_prefix, role = out["S3Prefix"], out["ExecutionRoleArn"]
    (tmp_path / "data" / "drafts").mkdir(parents=True)
    champion = tmp_path / "data" / "drafts" / "champion"
    shutil.copytree(draft_dirs[0], champion)
    tdir = tmp_path / "target"
    shutil.copytree(tiny_target_dir, tdir)
    (tdir / ".git").mkdir()
    (tdir / ".git" / "config").write_text("[core]\n")
    (tmp_path / "params.yaml").write_text(json.dumps({
        "target": {"source": str(tdir)}, "engine": {"num_draft_tokens": 3},
        "deploy": {"sagemaker": {"role_arn": role, "s3_prefix": s3_prefix, "poll_s": 0.1, "wait_timeout_s": 60,
                                 "keep_versions": 1,
                                 "profiles": {"gpu": {"instance_type": "ml.g4dn.xlarge"}}}}}))
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}

    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "tidespec.cli", "deploy", "sagemaker", "--profile", "gpu",
                            "--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), *args],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        return r.stdout

    plan = json.loads(cli("--dry-run"))
    assert plan["endpoint_config"]["ProductionVariants"][0]["InstanceType"] == "ml.g4dn.xlarge"
    sm, s3 = boto3.client("sagemaker"), boto3.client("s3")
    assert sm.list_endpoints()["Endpoints"] == [] or all(
        e["EndpointName"] != plan["endpoint"] for e in sm.list_endpoints()["Endpoints"])  # dry run: nothing made

    res = json.loads(cli())
    ep = res["endpoint"]
    assert res["action"] == "create" and res["status"] == "InService"
    desc = sm.describe_endpoint(EndpointName=ep)
    assert desc["EndpointStatus"] == "InService" and desc["EndpointConfigName"] == res["endpoint_config"]
    model = sm.describe_model(ModelName=res["model"])
    c = model["PrimaryContainer"]
    art = smd.check_draft(champion, tiny_target.target_id)
    assert c["Environment"]["SM_SGLANG_SPECULATIVE_NUM_DRAFT_TOKENS"] == "4"
    assert c["Environment"]["TIDESPEC_DRAFT_SHA256"] == art.sha256
    assert c["Image"] == smd.SGLANG_DLC.format(region="us-east-1")
    assert model["ExecutionRoleArn"] == role
    # the draft and target bytes on S3 are the local ones (SSE-S3)
    bucket, key = c["AdditionalModelDataSources"][0]["S3DataSource"]["S3Uri"].removeprefix("s3://").split("/", 1)
    for f in ("config.json", "model.safetensors"):
        obj = s3.get_object(Bucket=bucket, Key=key + f)
        assert obj["Body"].read() == (champion / f).read_bytes() and obj["ServerSideEncryption"] == "AES256"
    tb, tk = c["ModelDataSource"]["S3DataSource"]["S3Uri"].removeprefix("s3://").split("/", 1)
    assert s3.get_object(Bucket=tb, Key=tk + "model.safetensors")["Body"].read() == \
        (Path(tiny_target_dir) / "model.safetensors").read_bytes()
    keys = {o["Key"][len(tk):] for o in s3.list_objects_v2(Bucket=tb, Prefix=tk)["Contents"]}
    local = {p.relative_to(tdir).as_posix() for p in tdir.rglob("*") if p.is_file()}
    assert ".git/config" in local and keys == local - {".git/config"}  # hidden dirs are not uploaded
    alarms = boto3.client("cloudwatch").describe_alarms(AlarmNamePrefix=ep)["MetricAlarms"]
    assert sorted(a["MetricName"] for a in alarms) == ["Invocation5XXErrors", "ModelLatency"]

    again = json.loads(cli())
    assert again["action"] == "unchanged" and again["endpoint_config"] == res["endpoint_config"]
    # same draft, another instance count: not "unchanged" (goes through the update path below)
    raw = json.loads((tmp_path / "params.yaml").read_text())
    target_uri = plan["model"]["PrimaryContainer"]["ModelDataSource"]["S3DataSource"]["S3Uri"]

    def plan_for(r):
        p = Params.model_validate(r)
        return smd.plan(p, p.deploy.sagemaker, "gpu", art, tiny_target.target_id, target_uri, "us-east-1")
    assert smd.live_matches(sm, res["endpoint_config"], plan_for(raw))
    raw["deploy"]["sagemaker"]["profiles"]["gpu"]["instance_count"] = 2
    assert not smd.live_matches(sm, res["endpoint_config"], plan_for(raw))
    # data capture switched on: not "unchanged" either; a live config with the same capture settings is
    raw["deploy"]["sagemaker"]["profiles"]["gpu"]["instance_count"] = 1
    raw["deploy"]["sagemaker"]["data_capture"] = {"enabled": True, "sampling_percentage": 50}
    cap = plan_for(raw)
    assert not smd.live_matches(sm, res["endpoint_config"], cap)
    sm.create_endpoint_config(**(cap.endpoint_config | {"EndpointConfigName": "cap-check", "ProductionVariants": [
        cap.endpoint_config["ProductionVariants"][0] | {"ModelName": res["model"]}]}))
    assert sm.describe_endpoint_config(EndpointConfigName="cap-check")["DataCaptureConfig"]["DestinationS3Uri"] == \
        f"{s3_prefix.rstrip('/')}/capture"
    assert smd.live_matches(sm, "cap-check", cap)
    raw["deploy"]["sagemaker"]["data_capture"]["sampling_percentage"] = 60
    assert not smd.live_matches(sm, "cap-check", plan_for(raw))
    sm.delete_endpoint_config(EndpointConfigName="cap-check")
    del raw["deploy"]["sagemaker"]["data_capture"]

    # v2 through the blue/green path (UpdateEndpoint validated, applied on moto), v1 pruned (keep 1)
    params = Params.model_validate(json.loads((tmp_path / "params.yaml").read_text()))
    moto_sm = _MotoWithUpdate(sm)
    art2 = smd.check_draft(draft_dirs[1], tiny_target.target_id)
    r2 = smd.deploy_endpoint(params, "gpu", art2, tiny_target.target_id, sm=moto_sm)
    assert r2["action"] == "update" and r2["previous_config"] == res["endpoint_config"]
    upd = moto_sm.updates[0]
    assert upd["EndpointConfigName"] == r2["endpoint_config"]
    assert upd["DeploymentConfig"]["BlueGreenUpdatePolicy"]["TrafficRoutingConfiguration"]["Type"] == "ALL_AT_ONCE"
    assert sm.describe_endpoint(EndpointName=ep)["EndpointConfigName"] == r2["endpoint_config"]
    assert set(r2["deleted"]) == {res["endpoint_config"], res["model"]}
    live = {m["ModelName"] for m in sm.list_models(NameContains=ep)["Models"] if m["ModelName"].startswith(ep)}
    assert live == {r2["model"]}


def test_data_capture_config_request(tiny_target_dir):
    """deploy.sagemaker.data_capture → CreateEndpointConfig DataCaptureConfig (AWS API shape); off by default."""
    from tidespec.config.sagemaker import DataCaptureParams
    assert smd.data_capture_config(_params(tiny_target_dir).deploy.sagemaker) is None
    p = _params(tiny_target_dir, data_capture={"enabled": True, "sampling_percentage": 25, "kms_key_id": "alias/k"})
    assert smd.data_capture_config(p.deploy.sagemaker) == {
        "EnableCapture": True, "InitialSamplingPercentage": 25, "DestinationS3Uri": "s3://tide-deploy/tidespec/capture",
        "CaptureOptions": [{"CaptureMode": "Input"}, {"CaptureMode": "Output"}],
        "CaptureContentTypeHeader": {"JsonContentTypes": ["application/json"]}, "KmsKeyId": "alias/k"}
    for bad in ({"sampling_percentage": 101}, {"destination": "bucket/prefix"}, {"json_content_types": []},
                {"enbled": True}):
        with pytest.raises(ValidationError):
            DataCaptureParams(**bad)


def test_cli_errors_name_the_fix(tmp_path):
    (tmp_path / "params.yaml").write_text("engine: {num_draft_tokens: 3}\n")
    r = subprocess.run([sys.executable, "-m", "tidespec.cli", "deploy", "sagemaker", "--profile", "gpu", "--params",
                        str(tmp_path / "params.yaml"), "--root", str(tmp_path)], capture_output=True, text=True,
                       env=os.environ | {"PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert r.returncode == 2 and "deploy.sagemaker is not configured" in r.stderr


def test_vllm_neuron_entrypoint_maps_env_to_flags(tmp_path):
    """infra/containers/vllm-neuron/sagemaker-entrypoint.sh: SM_VLLM_* → `vllm serve` flags, JSON intact."""
    show = tmp_path / "show.sh"
    show.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    show.chmod(0o755)
    spec = json.dumps({"method": "eagle3", "model": smd.DRAFT_DIR, "num_speculative_tokens": 4})
    env = {"PATH": os.environ["PATH"], "VLLM_CMD": f"{show} serve", "SM_VLLM_MODEL": "/opt/ml/model",
           "SM_VLLM_SPECULATIVE_CONFIG": spec, "SM_VLLM_ENABLE_PREFIX_CACHING": "", "OTHER": "x",
           "SM_VLLM_PORT": "9000", "SM_VLLM_": "y"}
    r = subprocess.run(["bash", str(ROOT / "infra/containers/vllm-neuron/sagemaker-entrypoint.sh"), "serve"],
                       capture_output=True, text=True, env=env, check=True)
    assert r.stdout.splitlines() == ["serve", "--port", "8080", "--host", "0.0.0.0", "--enable-prefix-caching",
                                     "--model", "/opt/ml/model", "--speculative-config", spec]


@pytest.mark.services
def test_cycle_deploy_step_updates_on_promote_profiles(aws_env, mlflow_server, tmp_path):
    """step_deploy with deploy.sagemaker.on_promote: registry champion → data/drafts/champion (local)
    → the gpu endpoint on moto serves the same draft bytes; a second run changes nothing."""
    from conftest import make_tiny_target
    from tidespec.adapters import registry
    from tidespec.models.target import load_target
    from tidespec.steps.cycle import Workspace, step_deploy
    # its own target (seed 11): a registry model no other test touches on the shared MLflow server
    tdir = make_tiny_target(tmp_path / "target", seed=11)
    target = load_target(tdir)[0]
    tid = target.target_id
    draft = save_checkpoint(random_draft(target), tmp_path / "draft")
    bucket = f"tide-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    ep = f"tide-{uuid.uuid4().hex[:8]}"
    params = _params(tdir, s3_prefix=f"s3://{bucket}/t", target_model="org/target", on_promote=["gpu"],
                     profiles={"gpu": {"instance_type": "ml.g4dn.xlarge", "endpoint_name": ep}})
    _, v = registry.log_candidate(mlflow_server, tid, draft, params={"k": 3},
                                  metrics={"acceptance_length": 2.0},
                                  tags={"snapshot_rev": f"s-{ep}", "lossless": "True",  # evaluated: promotable
                                        "tuned_k.gpu": "2"})  # the register step's window for this endpoint
    registry.promote(mlflow_server, tid, v, reason="test")
    ws = Workspace(tmp_path / "ws")
    dep = step_deploy(ws, mlflow_server, tid, params)
    sm_dep = dep["sagemaker"]["gpu"]
    assert dep["version"] == v and sm_dep["action"] in ("create", "update") and sm_dep["status"] == "InService"
    env = boto3.client("sagemaker").describe_model(ModelName=sm_dep["model"])["PrimaryContainer"]["Environment"]
    assert env["TIDESPEC_DRAFT_SHA256"] == sha256_file(ws.champion / "draft" / "model.safetensors")
    assert env["TIDESPEC_DRAFT_VERSION"] == str(v)
    assert (env["SM_SGLANG_SPECULATIVE_NUM_STEPS"], env["SM_SGLANG_SPECULATIVE_NUM_DRAFT_TOKENS"]) == ("2", "3")
    assert json.loads((ws.champion / "version.json").read_text())["tuned_k"] == {"gpu": 2}
    assert step_deploy(ws, mlflow_server, tid, params)["sagemaker"]["gpu"]["action"] == "unchanged"


def test_tuned_window_per_profile_and_speculation_off(tiny_target_dir, draft_dirs):
    """τ(k) from per-position acceptance, speed-up τ(k) / (1 + (verify + draft)·k): the best k per
    profile, 0 (no speculative settings at all) when none reaches min_speedup; the deploy applies it."""
    from tidespec.config.sagemaker import EndpointProfile
    from tidespec.engine.stats import tau_by_k
    from tidespec.steps.tuning import tune_windows, tuned_window
    per_pos = [0.6, 0.4, 0.2, 0.05]
    assert tau_by_k(per_pos) == pytest.approx([1.0, 1.6, 2.0, 2.2, 2.25])
    gpu = EndpointProfile(engine="sglang", instance_type="ml.g6e.2xlarge")  # 0.07 per step
    w = tuned_window(gpu, per_pos, 1.05)
    # speed-ups 1.6/1.07=1.495, 2.0/1.14=1.754, 2.2/1.21=1.818, 2.25/1.28=1.758 → k = 3
    assert w["k"] == 3 and w["predicted_speedup"] == pytest.approx(2.2 / 1.21)
    slow = EndpointProfile(engine="vllm-neuron", instance_type="ml.trn2.48xlarge", image_uri="x/y:1",
                           verify_cost_per_token=0.4, draft_cost=0.3)
    assert tuned_window(slow, per_pos, 1.05) == {"k": 0, "predicted_speedup": 1.0, "tau_k": tau_by_k(per_pos)}
    assert tuned_window(gpu, [0.02, 0.0], 1.05)["k"] == 0  # a draft that is never accepted: off
    # the plan: k from the draft's version.json per profile; 0 → no speculative env for either engine
    meta = json.loads((draft_dirs[0] / "version.json").read_text())
    (draft_dirs[0] / "version.json").write_text(json.dumps(meta | {"tuned_k": {"gpu": 0, "trn2": 2}}))
    try:
        art = smd.check_draft(draft_dirs[0], None)
    finally:
        (draft_dirs[0] / "version.json").write_text(json.dumps(meta))
    assert art.tuned_k == (("gpu", 0), ("trn2", 2))
    p = _params(tiny_target_dir, profiles={"trn2": {"image_uri": "123456789012.dkr.ecr.us-east-1.amazonaws.com/v:1"}})
    env = smd.plan(p, p.deploy.sagemaker, "gpu", art, "t" * 64, "org/m", "us-east-1").model["PrimaryContainer"][
        "Environment"]
    assert not any("SPECULATIVE" in k for k in env) and env["SM_SGLANG_MODEL_PATH"] == "org/m"
    env = smd.plan(p, p.deploy.sagemaker, "trn2", art, "t" * 64, "org/m", "us-east-1").model["PrimaryContainer"][
        "Environment"]
    assert json.loads(env["SM_VLLM_SPECULATIVE_CONFIG"])["num_speculative_tokens"] == 2
    # the register step's per-profile windows from the candidate's replay metrics
    wins = tune_windows(p, {f"accepted_per_pos/{i}": a for i, a in enumerate(per_pos)} | {"acceptance_length": 2.25})
    assert {k: w["k"] for k, w in wins.items()} == {"gpu": 3, "trn2": 3}
    assert tune_windows(Params(), {"accepted_per_pos/0": 0.6}) == {}  # no deploy.sagemaker: nothing to tune


def test_collisions_and_sloppy_values_are_refused(tiny_target_dir):
    for bad, msg in [
        (
            {
                "profiles": {
                    "gpu": {"endpoint_name": "app"},
                    "big": {"engine": "sglang", "instance_type": "ml.p5.48xlarge", "endpoint_name": "app"},
                }
            },
            "same endpoint_name",
        ),
        (
            {"profiles": {"gpu_small": {"engine": "sglang", "instance_type": "ml.g5.xlarge"}}},
            "profile name 'gpu_small'",
        ),
        ({"target_model": "s3:/bucket/x"}, "not an S3 URI"),
        ({"num_draft_tokens": 9}, "needs num_steps"),
        ({"on_promote": ["gpu", "gpu"]}, "twice"),
        ({"role_arn": ROLE + "\n"}, "not an IAM role ARN"),
        ({"profiles": {"gpu": {"instance_type": "ml.g6e.banana"}}}, "does not fit"),
        ({"tags": {"aws:owner": "me"}}, "no aws: prefix"),
    ]:
        with pytest.raises(ValidationError, match=msg):
            _params(tiny_target_dir, **bad)


def test_failed_create_leaves_nothing_behind(aws_env, tiny_target, tiny_target_dir, draft_dirs):
    """moto rejects ml.g5 in CreateEndpointConfig: the Model created just before is deleted again."""
    from botocore.exceptions import ClientError
    bucket = f"tide-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=bucket)
    ep = f"tidespec-{uuid.uuid4().hex[:8]}"
    params = _params(tiny_target_dir, s3_prefix=f"s3://{bucket}/t", target_model="org/target",
                     profiles={"gpu": {"instance_type": "ml.g5.xlarge", "endpoint_name": ep}})
    with pytest.raises(ClientError, match="instanceType"):
        smd.deploy_endpoint(params, "gpu", smd.check_draft(draft_dirs[0], tiny_target.target_id),
                            tiny_target.target_id)
    models = boto3.client("sagemaker").list_models(NameContains=ep)["Models"]
    assert [m["ModelName"] for m in models if m["ModelName"].startswith(ep)] == []  # (moto ignores NameContains)


def test_missing_bucket_and_swapped_draft_name_the_fix(aws_env, tiny_target, tiny_target_dir, draft_dirs, tmp_path):
    params = _params(tiny_target_dir, s3_prefix=f"s3://tide-missing-{uuid.uuid4().hex[:8]}/t",
                     target_model="org/target", profiles={"gpu": {"instance_type": "ml.g4dn.xlarge"}})
    art = smd.check_draft(draft_dirs[0], tiny_target.target_id)
    with pytest.raises(ValueError, match="does not exist or is not accessible"):
        smd.deploy_endpoint(params, "gpu", art, tiny_target.target_id)
    d = tmp_path / "champion"
    shutil.copytree(draft_dirs[0], d)
    checked = smd.check_draft(d, tiny_target.target_id)
    shutil.copyfile(draft_dirs[1] / "model.safetensors", d / "model.safetensors")  # a promotion swaps it
    with pytest.raises(ValueError, match="changed since it was checked"):
        smd.deploy_endpoint(params, "gpu", checked, tiny_target.target_id)


def test_live_per_position_acceptance_retunes_each_profiles_window():
    """Once the serving engine has counted ≥ 100 drafts, each profile's window is tuned again from
    the per-position acceptance it measured (`tuning.live_windows`), never past the k it served; the
    registry's `tuned_k` then prefers the live window to the register step's replayed one."""
    from tidespec.adapters.registry import tuned_k
    from tidespec.config.sagemaker import SageMakerDeployParams
    from tidespec.steps.tuning import LIVE_MIN_DRAFTS, live_windows, tuned_window
    sm = SageMakerDeployParams(role_arn="arn:aws:iam::123456789012:role/r", s3_prefix="s3://bucket/tidespec",
                               profiles={"gpu": {"engine": "sglang", "instance_type": "ml.g6e.2xlarge"}})
    replayed = [0.6, 0.4, 0.2, 0.05]  # k = 3 (test above)
    live = [0.3, 0.05, 0.01]  # served at k = 3, weaker on live traffic: 1.3/1.07=1.215, 1.35/1.14=1.184 → k = 1
    assert live_windows(sm, live, LIVE_MIN_DRAFTS - 1) == {}  # too few drafts: the replayed window stands
    assert live_windows(None, live, 10_000) == {}
    w = live_windows(sm, live, LIVE_MIN_DRAFTS)
    assert set(w) == set(sm.profiles) and w["gpu"] == tuned_window(sm.profiles["gpu"], live, sm.min_speedup)
    assert w["gpu"]["k"] == 1
    assert tuned_window(sm.profiles["gpu"], replayed, sm.min_speedup)["k"] == 3
    assert len(live_windows(sm, [0.99, 0.99], 500)["gpu"]["tau_k"]) == 3  # τ(0..2): k never above the served 2
    tags = {"tuned_k.gpu": "3", "tuned_k.trn2": "2", "live_tuned_k.gpu": "1"}
    assert tuned_k(tags) == {"gpu": 1, "trn2": 2}
