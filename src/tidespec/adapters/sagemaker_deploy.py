"""Deploy the champion draft to a SageMaker real-time endpoint, blue/green.

Profiles (`deploy.sagemaker.profiles` in params.yaml):
  gpu   SGLang serving container (AWS SGLang DLC by default) on ml.g6e / ml.p5 (ml.g4dn/g5/g6/p4d
        accepted). The container turns each `SM_SGLANG_<FLAG>` variable into `--<flag> <value>` of
        `python -m sglang.launch_server`.
  trn2  vLLM with the Neuron plugin on ml.trn2.48xlarge; `SM_VLLM_<FLAG>` → `vllm serve --<flag>`
        (vLLM's examples/online_serving/sagemaker-entrypoint.sh convention, also
        infra/containers/vllm-neuron/sagemaker-entrypoint.sh); EAGLE3 via `--speculative-config`
        `{"method": "eagle3", "model": <draft dir>, "num_speculative_tokens": k}`.

One deploy (`deploy_endpoint`):
1. validate the draft dir (EAGLE3 layout; trained for this target) and upload config.json +
   model.safetensors to `<s3_prefix>/drafts/<sha256[:16]>/` (SSE-S3; content-addressed, so a
   re-deploy uploads nothing);
2. CreateModel: target weights as `ModelDataSource` (an uncompressed S3 prefix → /opt/ml/model) or a
   hub id the container downloads; the draft as `AdditionalModelDataSources` channel `draft`
   (→ /opt/ml/additional-model-data-sources/draft);
3. CreateEndpointConfig (one variant `AllTraffic`, instance type/count, startup and download
   timeouts);
4. PutMetricAlarm × 2 (Invocation5XXErrors, ModelLatency p99) — the auto-rollback alarms;
5. CreateEndpoint, or UpdateEndpoint with a BlueGreenUpdatePolicy (CANARY when the fleet has ≥ 2
   instances, else ALL_AT_ONCE with a baking period) and AutoRollbackConfiguration on the alarms;
6. poll DescribeEndpoint until InService on the new config. A rollback (alarm fired, or the new
   fleet failed its health checks) leaves the old config serving and raises SageMakerDeployFailed;
7. delete this endpoint's older models/configs beyond `keep_versions` (never the live one).

API calls go through `adapters.aws` (boto3 clients configured from the environment, AWS_ENDPOINT_URL
for moto in tests; SSE-S3 uploads with sha256 metadata; the polling loop); the params schemas live in
`tidespec.config.sagemaker`, the window each profile gets (τ(k) against its step cost) is chosen by the
register step (`tidespec.steps.tuning`) and read here from version.json. Request shapes: the SageMaker API reference (CreateModel,
CreateEndpointConfig, UpdateEndpoint `DeploymentConfig`) and botocore's sagemaker service model.
It stays one module (over 400 lines) because the request builders, the draft checks and
`deploy_endpoint` form one transaction whose create / roll-back / prune steps share names and state.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import tempfile
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from ..assets import sha256_file
from ..config import Params, TreeParams, tree_num_draft_tokens
from ..errors import TidespecError
from ..models.eagle3 import load_checkpoint
from ..config.sagemaker import CanaryParams, EndpointProfile, SageMakerDeployParams
from ..workspace import copy_engine_files, engine_dir, read_version
from . import aws
from .aws import NAME_RE, parse_s3_uri

log = logging.getLogger(__name__)

VARIANT = "AllTraffic"
DRAFT_CHANNEL = "draft"
MODEL_DIR = "/opt/ml/model"
DRAFT_DIR = f"/opt/ml/additional-model-data-sources/{DRAFT_CHANNEL}"
# AWS SGLang DLC for SageMaker (aws/deep-learning-containers release notes, sglang 0.5.x); the account
# 763104351884 hosts the DLCs in most regions. Pin your own tag in params for production.
SGLANG_DLC = "763104351884.dkr.ecr.{region}.amazonaws.com/sglang:0.5-gpu-py312-cu129-ubuntu22.04-sagemaker-v1"
TERMINAL_BAD = ("Failed", "UpdateRollbackFailed")


class SageMakerDeployFailed(TidespecError):
    """The endpoint did not end InService on the new config (failed, or rolled back to the old one)."""


@dataclass(frozen=True)
class DraftArtifact:
    """A draft checkpoint to serve: its dir, registry version (or None), sha256 of model.safetensors
    (the registry's `draft_sha256`) and of config.json, the per-profile window the register step
    tuned (from version.json). `key`: the S3 content address of both files."""

    path: Path
    version: str | None
    sha256: str
    config_sha256: str = ""
    tuned_k: tuple[tuple[str, int], ...] = ()  # (profile, k) the register step chose (0: speculation off)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.sha256}:{self.config_sha256}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DeployPlan:
    """Everything one deploy sends: names and the request bodies (kwargs of the boto3 calls)."""

    profile: str
    endpoint: str
    model: dict
    endpoint_config: dict
    alarms: tuple[dict, ...]
    draft_s3: str
    target_s3: str | None

    @property
    def model_name(self) -> str:
        return self.model["ModelName"]

    @property
    def config_name(self) -> str:
        return self.endpoint_config["EndpointConfigName"]

    def to_json(self) -> dict:
        return asdict(self)


# -- pure helpers -----------------------------------------------------------------------------------
def endpoint_name(sm_params: SageMakerDeployParams, target_id: str, profile: str) -> str:
    """The profile's `endpoint_name`, else `tidespec-<target_id[:12]>-<profile>`."""
    return sm_params.profiles[profile].endpoint_name or f"tidespec-{target_id[:12]}-{profile}"


def resource_name(endpoint: str, version: str | None, now: datetime | None = None) -> str:
    """Model / EndpointConfig name: `<endpoint>-v<version>-<UTC yyyymmddHHMMSS>` (≤ 63 chars)."""
    ts = f"{(now or datetime.now(UTC)):%Y%m%d%H%M%S}"
    v = f"v{re.sub(r'[^a-zA-Z0-9]', '', str(version))}" if version else "local"
    name = f"{endpoint}-{v}-{ts}"
    if not NAME_RE.fullmatch(name) or len(name) > 63:
        raise ValueError(f"resource name {name!r} too long or invalid: shorten the profile's endpoint_name")
    return name


def spec_settings(sm_params: SageMakerDeployParams, k: int, tree: TreeParams = TreeParams()) -> dict[str, int] | None:
    """SGLang EAGLE3 knobs {num_steps, eagle_topk, num_draft_tokens}; k: the window (the profile's
    tuned k, else engine.num_draft_tokens); `deploy.sagemaker.num_steps` overrides both. eagle_topk
    and num_draft_tokens: `deploy.sagemaker`'s, else `tree` (`engine.tree`: the tree the embedded
    engine verifies). None when k is 0 and nothing overrides: speculation off on that endpoint.
    Raises ValueError when the tree size does not fit the steps and topk (`config.tree_num_draft_tokens`)."""
    if not sm_params.num_steps and k == 0:
        return None
    steps = sm_params.num_steps or k
    topk = sm_params.eagle_topk or tree.eagle_topk
    n = sm_params.num_draft_tokens or (tree.num_draft_tokens if topk == tree.eagle_topk and topk > 1 else None)
    try:
        n = tree_num_draft_tokens(steps, topk, n)
    except ValueError as e:
        if sm_params.num_draft_tokens:
            raise ValueError(f"deploy.sagemaker.num_draft_tokens: {e}") from None
        most = 1 + topk + (steps - 1) * topk * topk  # engine.tree's size does not fit this profile's depth
        n0, n = n, min(max(n, steps + 1), most)
        log.warning("engine.tree.num_draft_tokens %d does not fit num_steps %d with topk %d; the endpoint verifies "
                    "%d (set deploy.sagemaker.num_draft_tokens to choose)", n0, steps, topk, n)
    return {"num_steps": steps, "eagle_topk": topk, "num_draft_tokens": n}


def container_env(profile: EndpointProfile, model_path: str, spec: Mapping[str, int],
                  draft: DraftArtifact) -> dict[str, str]:
    """Container environment of the Model. SGLang: SM_SGLANG_* (→ launch_server flags); vLLM-neuron:
    SM_VLLM_* with SPECULATIVE_CONFIG as JSON; `spec` None: no speculative settings (the tuned
    window found none that pays). Profile environment entries override."""
    if profile.engine == "sglang":
        env = {"SM_SGLANG_MODEL_PATH": model_path, "SM_SGLANG_TP_SIZE": str(profile.tensor_parallel_size)}
        if spec is not None:
            env |= {"SM_SGLANG_SPECULATIVE_ALGORITHM": "EAGLE3",
               "SM_SGLANG_SPECULATIVE_DRAFT_MODEL_PATH": DRAFT_DIR,
               "SM_SGLANG_SPECULATIVE_NUM_STEPS": str(spec["num_steps"]),
               "SM_SGLANG_SPECULATIVE_EAGLE_TOPK": str(spec["eagle_topk"]),
               "SM_SGLANG_SPECULATIVE_NUM_DRAFT_TOKENS": str(spec["num_draft_tokens"])}
    else:
        env = {"SM_VLLM_MODEL": model_path, "SM_VLLM_TENSOR_PARALLEL_SIZE": str(profile.tensor_parallel_size)}
        if spec is not None:
            cfg = {"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": spec["num_steps"]}
            env["SM_VLLM_SPECULATIVE_CONFIG"] = json.dumps(cfg, separators=(",", ":"))
    env |= {"TIDESPEC_DRAFT_VERSION": str(draft.version or ""), "TIDESPEC_DRAFT_SHA256": draft.sha256}
    return env | dict(profile.environment)


def image_uri(profile: EndpointProfile, region: str) -> str:
    """The profile's image URI, or the AWS SGLang DLC URI of `region` (e.g. "us-west-2")."""
    return profile.image_uri or SGLANG_DLC.format(region=region)


def _tags(sm_params: SageMakerDeployParams, endpoint: str, draft: DraftArtifact) -> list[dict]:
    own = {"project": "tidespec", "tidespec:endpoint": endpoint, "tidespec:draft_sha256": draft.sha256[:16]}
    if draft.version:
        own["tidespec:draft_version"] = str(draft.version)
    return [{"Key": k, "Value": v} for k, v in own.items()] + \
        [{"Key": k, "Value": v} for k, v in sm_params.tags if k not in own]


def model_request(name: str, sm_params: SageMakerDeployParams, profile: EndpointProfile, region: str,
                  target: str, draft_s3: str, spec: Mapping[str, int], draft: DraftArtifact,
                  endpoint: str) -> dict:
    """CreateModel kwargs. `target`: S3 prefix (mounted at /opt/ml/model) or a hub id."""
    container = {"Image": image_uri(profile, region), "Mode": "SingleModel",
                 "AdditionalModelDataSources": [{"ChannelName": DRAFT_CHANNEL, "S3DataSource": {
                     "S3Uri": draft_s3, "S3DataType": "S3Prefix", "CompressionType": "None"}}]}
    if target.startswith("s3://"):
        container["ModelDataSource"] = {"S3DataSource": {"S3Uri": target.rstrip("/") + "/",
                                                         "S3DataType": "S3Prefix", "CompressionType": "None"}}
        model_path = MODEL_DIR
    else:
        model_path = target
    container["Environment"] = container_env(profile, model_path, spec, draft)
    return {"ModelName": name, "ExecutionRoleArn": sm_params.role_arn, "PrimaryContainer": container,
            "Tags": _tags(sm_params, endpoint, draft)}


def data_capture_config(sm_params: SageMakerDeployParams) -> dict | None:
    """CreateEndpointConfig `DataCaptureConfig` from `deploy.sagemaker.data_capture` (None: off):
    request (Input) and response (Output) bodies, JSON content types as text, to the destination
    (default `<s3_prefix>/capture`)."""
    dc = sm_params.data_capture
    if not dc.enabled:
        return None
    out = {"EnableCapture": True, "InitialSamplingPercentage": dc.sampling_percentage,
           "DestinationS3Uri": dc.destination or f"{sm_params.s3_prefix.rstrip('/')}/capture",
           "CaptureOptions": [{"CaptureMode": "Input"}, {"CaptureMode": "Output"}],
           "CaptureContentTypeHeader": {"JsonContentTypes": list(dc.json_content_types)}}
    if dc.kms_key_id:
        out["KmsKeyId"] = dc.kms_key_id
    return out


def endpoint_config_request(name: str, model_name: str, profile: EndpointProfile,
                            sm_params: SageMakerDeployParams, draft: DraftArtifact, endpoint: str) -> dict:
    """CreateEndpointConfig kwargs: one variant `AllTraffic` on the profile's instances, plus
    `DataCaptureConfig` when `deploy.sagemaker.data_capture.enabled`."""
    capture = data_capture_config(sm_params)
    return ({"DataCaptureConfig": capture} if capture else {}) | {"EndpointConfigName": name,
            "ProductionVariants": [{"VariantName": VARIANT, "ModelName": model_name,
                                    "InstanceType": profile.instance_type,
                                    "InitialInstanceCount": profile.instance_count,
                                    "ContainerStartupHealthCheckTimeoutInSeconds": profile.startup_timeout_s,
                                    "ModelDataDownloadTimeoutInSeconds": profile.download_timeout_s}],
            "Tags": _tags(sm_params, endpoint, draft)}


def alarm_requests(endpoint: str, canary: CanaryParams) -> tuple[dict, ...]:
    """PutMetricAlarm kwargs of the auto-rollback alarms (AWS/SageMaker per-variant metrics, 1-min
    periods): 5xx count ≥ alarm_5xx, and ModelLatency p99 (µs) > alarm_p99_latency_ms."""
    dims = [{"Name": "EndpointName", "Value": endpoint}, {"Name": "VariantName", "Value": VARIANT}]
    base = endpoint if endpoint.startswith("tidespec-") else f"tidespec-{endpoint}"  # operator policy: alarm:tidespec-*
    out = [{"AlarmName": f"{base}-5xx", "Namespace": "AWS/SageMaker", "MetricName": "Invocation5XXErrors",
            "Dimensions": dims, "Statistic": "Sum", "Period": 60, "EvaluationPeriods": 1,
            "Threshold": float(canary.alarm_5xx), "ComparisonOperator": "GreaterThanOrEqualToThreshold",
            "TreatMissingData": "notBreaching",
            "AlarmDescription": "tidespec blue/green auto-rollback: 5xx from the endpoint"}]
    if canary.alarm_p99_latency_ms is not None:
        out.append({"AlarmName": f"{base}-p99-latency", "Namespace": "AWS/SageMaker",
                    "MetricName": "ModelLatency", "Dimensions": dims, "ExtendedStatistic": "p99", "Period": 60,
                    "EvaluationPeriods": 2, "Threshold": canary.alarm_p99_latency_ms * 1000.0,
                    "ComparisonOperator": "GreaterThanThreshold", "TreatMissingData": "notBreaching",
                    "AlarmDescription": "tidespec blue/green auto-rollback: ModelLatency p99 (µs)"})
    return tuple(out)


def update_request(endpoint: str, config_name: str, instance_count: int, canary: CanaryParams,
                   alarms: tuple[dict, ...]) -> dict:
    """UpdateEndpoint kwargs: blue/green with CANARY (`percent` of the new fleet, then the rest after
    `wait_s`) when instance_count ≥ 2, else ALL_AT_ONCE then a `wait_s` baking period; either way the
    alarms roll the endpoint back to the old config automatically."""
    if instance_count >= 2:
        routing = {"Type": "CANARY", "WaitIntervalInSeconds": canary.wait_s,
                   "CanarySize": {"Type": "CAPACITY_PERCENT", "Value": canary.percent}}
    else:
        routing = {"Type": "ALL_AT_ONCE", "WaitIntervalInSeconds": canary.wait_s}
    return {"EndpointName": endpoint, "EndpointConfigName": config_name, "RetainAllVariantProperties": False,
            "DeploymentConfig": {
                "BlueGreenUpdatePolicy": {"TrafficRoutingConfiguration": routing,
                                          "TerminationWaitInSeconds": canary.termination_wait_s,
                                          "MaximumExecutionTimeoutInSeconds": canary.max_execution_s},
                "AutoRollbackConfiguration": {"Alarms": [{"AlarmName": a["AlarmName"]} for a in alarms]}}}


def endpoint_outcome(desc: dict, config_name: str) -> bool:
    """True once DescribeEndpoint shows InService on `config_name`; False while Creating/Updating/
    SystemUpdating. Raises SageMakerDeployFailed on Failed / UpdateRollbackFailed, or InService on
    another config (rolled back) — with FailureReason and where the logs are."""
    name, status = desc["EndpointName"], desc["EndpointStatus"]
    live = desc.get("EndpointConfigName")
    logs = f"CloudWatch log group /aws/sagemaker/Endpoints/{name}"
    if status in TERMINAL_BAD:
        raise SageMakerDeployFailed(f"endpoint {name} {status}: {desc.get('FailureReason') or 'no reason given'}; "
                                    f"serving config {live}. Logs: {logs}")
    if status == "InService":
        if live == config_name:
            return True
        raise SageMakerDeployFailed(
            f"endpoint {name} rolled back to {live} (new config {config_name} not kept): "
            f"{desc.get('FailureReason') or 'an auto-rollback alarm fired or the new fleet failed health checks'}. "
            f"Logs: {logs}")
    return False


# -- draft ------------------------------------------------------------------------------------------
def check_draft(path: Path, target_id: str | None, version: str | None = None) -> DraftArtifact:
    """Validate a draft dir (a bundle or a flat checkpoint: config.json + model.safetensors in the
    EAGLE3 layout, trained for `target_id` when given) and hash it; the artifact's path is the engine dir. Raises FileNotFoundError / ValueError (as load_checkpoint)."""
    path = Path(path)
    try:
        load_checkpoint(path, target_id=target_id)
        meta = read_version(path) or {}
        version = meta.get("version") if version is None else version
    except (FileNotFoundError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 — corrupt safetensors / JSON, a dir where a file belongs
        raise ValueError(f"{path}: not a readable draft checkpoint ({type(e).__name__}: {e})") from None
    eng = engine_dir(path)  # a bundle's draft/ (what the endpoint loads); its version.json is beside it
    return DraftArtifact(eng, None if version is None else str(version), sha256_file(eng / "model.safetensors"),
                         sha256_file(eng / "config.json"), tuple(sorted(meta.get("tuned_k", {}).items())))


def private_copy(draft: DraftArtifact, dest: Path) -> DraftArtifact:
    """Copy the draft's files into `dest` and re-hash them there, so what is uploaded is what was
    checked even if the source dir is swapped meanwhile (a promotion, a rollback). Raises ValueError
    when the model bytes changed since `check_draft`."""
    dest = copy_engine_files(draft.path, dest)
    sha = sha256_file(dest / "model.safetensors")
    if sha != draft.sha256:
        raise ValueError(f"draft {draft.path} changed since it was checked (a promotion or rollback meanwhile?); "
                         "deploy again")
    return DraftArtifact(dest, draft.version, sha, sha256_file(dest / "config.json"), draft.tuned_k)


def upload_draft(s3, draft: DraftArtifact, s3_prefix: str) -> tuple[str, int]:
    """config.json + model.safetensors → `<s3_prefix>/drafts/<draft.key>/` (SSE-S3, sha256 in object
    metadata; objects already there with the same sha256 are kept). Returns (prefix URI, uploaded)."""
    files = [(draft.path / "config.json", "config.json", draft.config_sha256 or sha256_file(draft.path / "config.json")),
             (draft.path / "model.safetensors", "model.safetensors", draft.sha256)]
    return aws.upload_files(s3, files, f"{s3_prefix}/drafts/{draft.key}/")


def target_prefix(s3_prefix: str, target_id: str) -> str:
    """S3 prefix URI (ends with '/') a local target dir is uploaded to: keyed by its weights' id."""
    return f"{s3_prefix}/targets/{target_id[:16]}/"


def upload_target(s3, target_dir: Path, s3_prefix: str, target_id: str) -> tuple[str, int]:
    """A local HF target dir → `<s3_prefix>/targets/<target_id[:16]>/` (the id is the weights' sha256,
    so same-size objects are kept); hidden files and dirs (.git, .cache) are skipped. SSE-S3 and
    sha256 metadata on every object sent. Returns (prefix URI, uploaded). Raises FileNotFoundError
    without config.json."""
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").exists():
        raise FileNotFoundError(f"{target_dir} is not a HF model dir (no config.json)")
    return aws.upload_dir(s3, target_dir, target_prefix(s3_prefix, target_id), skip_hidden=True)


def resolve_target(params: Params, sm_params: SageMakerDeployParams) -> tuple[str, Path | None]:
    """(target URI or hub id, local dir to upload or None). Raises ValueError naming the fix when the
    target is the embedded GGUF (SageMaker containers load HF dirs)."""
    if sm_params.target_model:
        if sm_params.target_model.startswith("s3://"):
            parse_s3_uri(sm_params.target_model)
        return sm_params.target_model, None
    src = Path(params.target.source)
    if params.target.source != "smollm2" and src.is_dir():
        return "", src
    raise ValueError("deploy.sagemaker.target_model is not set and target.source is not a local HF dir: set it "
                     "to the S3 prefix of the target's HF model dir, or a hub id (e.g. "
                     "HuggingFaceTB/SmolLM2-135M-Instruct for the embedded SmolLM2)")


# -- plan / apply -----------------------------------------------------------------------------------
def region_of(sm_params: SageMakerDeployParams, sm=None) -> str:
    """deploy.sagemaker.region, else the client's, else boto3's default (AWS_REGION / profile).
    Raises ValueError naming the fix when none is set."""
    if sm_params.region:
        return sm_params.region
    if sm is not None and sm.meta.region_name:
        return sm.meta.region_name
    r = aws.default_region()
    if not r:
        raise ValueError("no AWS region: set deploy.sagemaker.region or AWS_REGION")
    return r


def plan(params: Params, sm_params: SageMakerDeployParams, profile_name: str, draft: DraftArtifact,
         target_id: str, target_uri: str, region: str, now: datetime | None = None) -> DeployPlan:
    """The requests of one deploy, without calling AWS (`--dry-run` prints this). `target_uri`: S3
    prefix or hub id (after any upload). Raises ValueError on a bad profile or name."""
    profile = sm_params.profile(profile_name)
    endpoint = endpoint_name(sm_params, target_id, profile_name)
    name = resource_name(endpoint, draft.version, now)
    draft_s3 = f"{sm_params.s3_prefix}/drafts/{draft.key}/"
    spec = spec_settings(sm_params, dict(draft.tuned_k).get(profile_name, params.engine.num_draft_tokens),
                         params.engine.tree)
    return DeployPlan(profile_name, endpoint,
                      model_request(name, sm_params, profile, region, target_uri, draft_s3, spec, draft, endpoint),
                      endpoint_config_request(name, name, profile, sm_params, draft, endpoint),
                      alarm_requests(endpoint, sm_params.canary), draft_s3,
                      target_uri if target_uri.startswith("s3://") else None)


def _describe(sm, endpoint: str) -> dict | None:
    """DescribeEndpoint, or None when the endpoint does not exist. Raises other ClientErrors."""
    try:
        return sm.describe_endpoint(EndpointName=endpoint)
    except Exception as e:
        err = getattr(e, "response", None) or {}
        if err.get("Error", {}).get("Code") == "ValidationException" and "not find" in str(e).lower():
            return None
        raise


def wait_endpoint(sm, endpoint: str, config_name: str, timeout_s: float, poll_s: float) -> dict:
    """Poll DescribeEndpoint every `poll_s` s until `endpoint_outcome` is True; returns the
    description. Raises SageMakerDeployFailed (failed / rolled back), aws.WaitTimeout (a
    TimeoutError) after `timeout_s` s (the update keeps going on AWS)."""
    return aws.wait_until(
        lambda: sm.describe_endpoint(EndpointName=endpoint), lambda d: endpoint_outcome(d, config_name),
        timeout_s, poll_s, what=f"endpoint {endpoint}", state=lambda d: d["EndpointStatus"],
        timeout_message=lambda d, t: (
            f"endpoint {endpoint} still {d['EndpointStatus']} after {t:g}s; the deployment continues on AWS "
            f"(watch `aws sagemaker describe-endpoint --endpoint-name {endpoint}`)"))


def prune(sm, endpoint: str, keep: int, live_config: str) -> list[str]:
    """Delete this endpoint's models/configs (names `<endpoint>-v…`/`<endpoint>-local…`) beyond the
    newest `keep`, never the live config or its model. Returns the deleted names."""
    prefix = f"{endpoint}-"
    own = re.compile(rf"^{re.escape(prefix)}(v[a-zA-Z0-9]+|local)-\d{{14}}$")
    configs = [c["EndpointConfigName"] for c in _paginate(sm.list_endpoint_configs, "EndpointConfigs",
                                                          NameContains=endpoint)]
    models = [m["ModelName"] for m in _paginate(sm.list_models, "Models", NameContains=endpoint)]
    deleted = []
    for names, kind in ((configs, "config"), (models, "model")):
        mine = sorted((n for n in names if own.match(n)), key=lambda n: n[-14:], reverse=True)
        for n in mine[keep:]:
            if n == live_config:
                continue
            if kind == "config":
                sm.delete_endpoint_config(EndpointConfigName=n)
            else:
                sm.delete_model(ModelName=n)
            deleted.append(n)
    return deleted


def _paginate(fn, key: str, **kw):
    token = None
    while True:
        page = fn(**kw, **({"NextToken": token} if token else {}))
        yield from page.get(key, [])
        token = page.get("NextToken")
        if not token:
            return


def deploy_endpoint(params: Params, profile_name: str, draft: DraftArtifact, target_id: str,
                    sm=None, s3=None, cw=None, wait: bool = True, now: datetime | None = None,
                    lock_dir: Path | None = None) -> dict:
    """Upload the draft (and a local target dir), create Model + EndpointConfig + alarms, create the
    endpoint or update it blue/green, wait, prune. Returns {"endpoint", "action" (create|update|
    unchanged), "model", "endpoint_config", "draft_s3", "previous_config", "status", "deleted"}.
    "unchanged": the live Model/EndpointConfig already equal the plan (same draft bytes, image,
    env, instances). Resources created by a deploy that fails before the endpoint takes them, or
    whose update rolled back, are deleted; the live endpoint is never touched then. `lock_dir`:
    serialise deploys of one endpoint from this machine (a lock file there). Raises ValueError
    (not configured, bad input, missing bucket, draft changed meanwhile), SageMakerDeployFailed
    (rolled back / failed / endpoint busy), TimeoutError, botocore errors."""
    sm_params = params.deploy.sagemaker
    if sm_params is None:
        raise ValueError("deploy.sagemaker is not configured in params.yaml (role_arn, s3_prefix, target_model; "
                         "see infra/README.md)")
    prof = sm_params.profile(profile_name)  # fail before any upload
    target_uri, local_target = resolve_target(params, sm_params)
    if local_target is not None:
        target_uri = target_prefix(sm_params.s3_prefix, target_id)
    region = region_of(sm_params, sm)
    sm, s3, cw = (sm or aws.client("sagemaker", region), s3 or aws.client("s3", region),
                  cw or aws.client("cloudwatch", region))
    endpoint = endpoint_name(sm_params, target_id, profile_name)
    with _endpoint_lock(lock_dir, endpoint), tempfile.TemporaryDirectory(prefix="tidespec-deploy-") as tmp:
        draft = private_copy(draft, Path(tmp) / "draft")
        p = plan(params, sm_params, profile_name, draft, target_id, target_uri, region, now)
        current = _describe(sm, endpoint)
        if current is not None and current["EndpointStatus"] in BUSY:
            raise SageMakerDeployFailed(f"endpoint {endpoint} is {current['EndpointStatus']}; wait for it to "
                                        "settle and deploy again")
        for a in p.alarms:  # idempotent; thresholds may change without a redeploy
            cw.put_metric_alarm(**a)
        if current is not None and current["EndpointStatus"] == "InService" and \
                live_matches(sm, current["EndpointConfigName"], p):
            return {"endpoint": endpoint, "action": "unchanged", "endpoint_config": current["EndpointConfigName"],
                    "status": "InService", "deleted": []}
        aws.check_bucket(s3, sm_params.s3_prefix, "deploy.sagemaker.s3_prefix")
        if local_target is not None:
            _, n = upload_target(s3, local_target, sm_params.s3_prefix, target_id)
            log.info("target %s → %s (%d files uploaded)", local_target, target_uri, n)
        draft_s3, n = upload_draft(s3, draft, sm_params.s3_prefix)
        log.info("draft v%s → %s (%d files uploaded)", draft.version, draft_s3, n)
        created: list[tuple[str, str]] = []
        try:
            sm.create_model(**p.model)
            created.append(("model", p.model_name))
            sm.create_endpoint_config(**p.endpoint_config)
            created.append(("config", p.config_name))
            if current is None or current["EndpointStatus"] == "Failed":
                if current is not None:  # a failed endpoint cannot be updated: replace it
                    sm.delete_endpoint(EndpointName=endpoint)
                    _wait_gone(sm, endpoint, sm_params.wait_timeout_s, sm_params.poll_s)
                sm.create_endpoint(EndpointName=endpoint, EndpointConfigName=p.config_name,
                                   Tags=p.endpoint_config["Tags"])
                action = "create"
            else:
                sm.update_endpoint(**update_request(endpoint, p.config_name, prof.instance_count, sm_params.canary,
                                                    p.alarms))
                action = "update"
        except BaseException:
            _delete(sm, created)
            raise
        out = {"endpoint": endpoint, "action": action, "model": p.model_name, "endpoint_config": p.config_name,
               "draft_s3": draft_s3, "previous_config": current and current.get("EndpointConfigName"),
               "status": "submitted", "deleted": []}
        if not wait:
            return out
        try:
            desc = wait_endpoint(sm, endpoint, p.config_name, sm_params.wait_timeout_s, sm_params.poll_s)
        except SageMakerDeployFailed:
            live = _describe(sm, endpoint)
            if action == "update" and live is not None and live.get("EndpointConfigName") != p.config_name:
                _delete(sm, created)  # rolled back: the new model/config serve nothing
            raise
        out["status"] = desc["EndpointStatus"]
        out["deleted"] = prune(sm, endpoint, sm_params.keep_versions, p.config_name)
        return out


BUSY = ("Creating", "Updating", "SystemUpdating", "RollingBack", "Deleting")  # UpdateRollbackFailed: an update repairs it


def live_matches(sm, config_name: str, p: DeployPlan) -> bool:
    """Whether the live EndpointConfig and its Model equal the plan (variant settings, role, image,
    model data sources, environment), ignoring names and tags."""
    cfg = sm.describe_endpoint_config(EndpointConfigName=config_name)
    if _capture_key(cfg.get("DataCaptureConfig")) != _capture_key(p.endpoint_config.get("DataCaptureConfig")):
        return False  # capture settings changed: a new config through the same update path
    variants = cfg.get("ProductionVariants", [])
    want = {k: v for k, v in p.endpoint_config["ProductionVariants"][0].items() if k != "ModelName"}
    if len(variants) != 1 or any(variants[0].get(k) != v for k, v in want.items()):
        return False
    m = sm.describe_model(ModelName=variants[0]["ModelName"])
    have = m.get("PrimaryContainer", {})
    return m.get("ExecutionRoleArn") == p.model["ExecutionRoleArn"] and all(
        have.get(k) == v for k, v in p.model["PrimaryContainer"].items() if k != "Mode")


def _capture_key(dc: dict | None) -> tuple:
    """What matters of a DataCaptureConfig for "unchanged" (absent or disabled → off)."""
    if not dc or not dc.get("EnableCapture"):
        return ()
    modes = tuple(sorted(o["CaptureMode"] for o in dc.get("CaptureOptions", [])))
    types = tuple(sorted((dc.get("CaptureContentTypeHeader") or {}).get("JsonContentTypes", [])))
    return (dc.get("InitialSamplingPercentage"), dc.get("DestinationS3Uri"), dc.get("KmsKeyId"), modes, types)


def _delete(sm, created: list[tuple[str, str]]) -> None:
    """Best-effort removal of what a failed deploy created (config before model)."""
    for kind, name in reversed(created):
        try:
            if kind == "config":
                sm.delete_endpoint_config(EndpointConfigName=name)
            else:
                sm.delete_model(ModelName=name)
        except Exception as e:  # noqa: BLE001 — cleanup must not mask the original error
            log.warning("could not delete %s %s: %s", kind, name, e)


@contextlib.contextmanager
def _endpoint_lock(lock_dir: Path | None, endpoint: str):
    """One deploy of `endpoint` at a time from this machine: an exclusive, non-blocking lock on
    `<lock_dir>/sagemaker-<endpoint>.lock` (flock through `filelock`, released on exit or process
    death). Raises SageMakerDeployFailed while another deploy holds it."""
    if lock_dir is None:
        yield
        return
    from filelock import FileLock, Timeout
    Path(lock_dir).mkdir(parents=True, exist_ok=True)
    path = Path(lock_dir) / f"sagemaker-{endpoint}.lock"
    lock = FileLock(path, timeout=0, thread_local=False, fallback_to_soft=False)
    try:
        lock.acquire()
    except Timeout:
        raise SageMakerDeployFailed(f"another deploy of endpoint {endpoint} is running (lock {path}); wait for "
                                    "it to finish") from None
    try:
        yield
    finally:
        lock.release(force=True)


def _wait_gone(sm, endpoint: str, timeout_s: float, poll_s: float) -> None:
    """Poll until the endpoint no longer exists. Raises aws.WaitTimeout after `timeout_s` s."""
    aws.wait_until(lambda: _describe(sm, endpoint), lambda d: d is None, timeout_s, poll_s,
                   what=f"endpoint {endpoint}", state=lambda d: d["EndpointStatus"],
                   timeout_message=lambda d, t: f"endpoint {endpoint} still deleting after {t:g}s")
