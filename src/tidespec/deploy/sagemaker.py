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

API calls go through boto3 clients configured from the environment (AWS_ENDPOINT_URL for moto in
tests). Request shapes: the SageMaker API reference (CreateModel, CreateEndpointConfig,
UpdateEndpoint `DeploymentConfig`) and botocore's sagemaker service model.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from ..assets import sha256_file
from ..strict import Strict as _Strict
from ..strict import pairs
from ..train.sagemaker import ENV_KEY_RE, parse_s3_uri

if TYPE_CHECKING:
    from ..config import Params

log = logging.getLogger(__name__)

ROLE_RE = re.compile(r"arn:aws[a-z\-]*:iam::\d{12}:role/[\w+=,.@\-/]{1,512}")
NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # EndpointName / ModelName / EndpointConfigName
VARIANT = "AllTraffic"
DRAFT_CHANNEL = "draft"
MODEL_DIR = "/opt/ml/model"
DRAFT_DIR = f"/opt/ml/additional-model-data-sources/{DRAFT_CHANNEL}"
DRAFT_FILES = ("config.json", "model.safetensors")
# AWS SGLang DLC for SageMaker (aws/deep-learning-containers release notes, sglang 0.5.x); the account
# 763104351884 hosts the DLCs in most regions. Pin your own tag in params for production.
SGLANG_DLC = "763104351884.dkr.ecr.{region}.amazonaws.com/sglang:0.5-gpu-py312-cu129-ubuntu22.04-sagemaker-v1"
GPU_FAMILIES = ("g4dn", "g5", "g6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en")
TRN2_FAMILIES = ("trn2",)
TERMINAL_BAD = ("Failed", "UpdateRollbackFailed")


class SageMakerDeployFailed(RuntimeError):
    """The endpoint did not end InService on the new config (failed, or rolled back to the old one)."""


class EndpointProfile(_Strict):
    """One serving profile. engine: `sglang` (GPU) or `vllm-neuron` (trn2). image_uri None → the
    AWS SGLang DLC of the region (sglang only; the Neuron image must be named). Timeouts in s
    (SageMaker allows 60..3600). environment: extra container env, e.g. SM_SGLANG_MEM_FRACTION_STATIC
    or SM_VLLM_MAX_MODEL_LEN (values ≤ 1024 chars)."""

    engine: Literal["sglang", "vllm-neuron"]
    instance_type: str
    instance_count: int = Field(1, ge=1)
    endpoint_name: str | None = None  # None → tidespec-<target_id[:12]>-<profile>
    image_uri: str | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    startup_timeout_s: int = Field(1800, ge=60, le=3600)  # ContainerStartupHealthCheckTimeoutInSeconds
    download_timeout_s: int = Field(1800, ge=60, le=3600)  # ModelDataDownloadTimeoutInSeconds
    environment: tuple[tuple[str, str], ...] = ()

    _env_in = field_validator("environment", mode="before")(classmethod(lambda cls, v: pairs(v)))

    @field_validator("environment")
    @classmethod
    def _env(cls, v):
        for k, val in v:
            if not ENV_KEY_RE.fullmatch(k) or len(val) > 1024:
                raise ValueError(f"environment {k!r}: keys [a-zA-Z_][a-zA-Z0-9_]*, values ≤1024 chars")
        return v

    @field_validator("endpoint_name")
    @classmethod
    def _endpoint(cls, v):
        if v is not None and (not NAME_RE.fullmatch(v) or len(v) > 40):
            raise ValueError(f"endpoint_name {v!r}: letters, digits and '-', at most 40 chars (model and "
                             "config names append a version and a timestamp)")
        return v

    @model_validator(mode="after")
    def _family(self):
        m = re.fullmatch(r"ml\.([a-z0-9]+)\.(?:\d*x?large|medium|small)", self.instance_type)
        fams = GPU_FAMILIES if self.engine == "sglang" else TRN2_FAMILIES
        if not m or m.group(1) not in fams:
            raise ValueError(f"instance_type {self.instance_type!r} does not fit engine {self.engine}: use "
                             + ", ".join(f"ml.{f}.*" for f in fams))
        return self


class CanaryParams(_Strict):
    """Blue/green update knobs (UpdateEndpoint DeploymentConfig). percent: canary share of the new
    fleet's capacity (SageMaker takes ≤ 50 %; used when instance_count ≥ 2); wait_s: canary (or, with
    one instance, baking) period watched by the alarms; alarm_5xx: Invocation5XXErrors per minute that
    trips the rollback; alarm_p99_latency_ms: ModelLatency p99 that does (None: no latency alarm)."""

    percent: int = Field(10, ge=1, le=50)
    wait_s: int = Field(600, ge=0, le=3600)  # WaitIntervalInSeconds
    termination_wait_s: int = Field(600, ge=0, le=3600)  # blue fleet kept this long after the switch
    max_execution_s: int = Field(3600, ge=600, le=14400)  # MaximumExecutionTimeoutInSeconds
    alarm_5xx: int = Field(1, ge=1)
    alarm_p99_latency_ms: float | None = Field(30000, gt=0)


# built-in profiles; a profile of the same name in params.yaml overrides these keys only
DEFAULT_PROFILES = {
    "gpu": {"engine": "sglang", "instance_type": "ml.g6e.2xlarge"},
    "trn2": {"engine": "vllm-neuron", "instance_type": "ml.trn2.48xlarge", "tensor_parallel_size": 64,
             "startup_timeout_s": 3600, "download_timeout_s": 3600},
}


class SageMakerDeployParams(_Strict):
    """`deploy.sagemaker` in params.yaml.

    target_model: where the endpoint gets the target's weights — an S3 prefix holding its HF model
    dir (uncompressed; → /opt/ml/model), or a Hugging Face hub id the container downloads (gated
    models need HF_TOKEN in the profile's environment). None: upload `target.source` when it is a
    local HF dir. num_steps / eagle_topk / num_draft_tokens: SGLang's --speculative-* (None:
    engine.num_draft_tokens steps, topk 1, steps+1 draft tokens; vLLM's num_speculative_tokens =
    num_steps). keep_versions: models/configs of this endpoint kept (for a manual rollback).
    """

    role_arn: str
    s3_prefix: str
    target_model: str | None = None
    region: str | None = None
    profiles: dict[str, EndpointProfile] = Field(
        default_factory=lambda: {k: EndpointProfile(**v) for k, v in DEFAULT_PROFILES.items()})
    num_steps: int | None = Field(None, ge=1, le=16)
    eagle_topk: int = Field(1, ge=1, le=16)
    num_draft_tokens: int | None = Field(None, ge=2, le=64)
    canary: CanaryParams = CanaryParams()
    keep_versions: int = Field(2, ge=1)
    poll_s: float = Field(30, ge=0.01)
    wait_timeout_s: float = Field(5400, gt=0)
    on_promote: tuple[str, ...] = ()  # profiles the cycle's deploy step updates after a promotion
    tags: tuple[tuple[str, str], ...] = ()

    _tags_in = field_validator("tags", mode="before")(classmethod(lambda cls, v: pairs(v)))

    @field_validator("profiles", mode="before")
    @classmethod
    def _merge(cls, v):
        v = dict(v or {})
        for name, d in DEFAULT_PROFILES.items():
            given = v.get(name, {})
            if isinstance(given, Mapping):
                v[name] = {**d, **given}
        return v

    @field_validator("role_arn")
    @classmethod
    def _role(cls, v):
        if not ROLE_RE.fullmatch(v):
            raise ValueError(f"{v!r} is not an IAM role ARN (arn:aws:iam::<12-digit account>:role/<name>)")
        return v

    @field_validator("s3_prefix")
    @classmethod
    def _prefix(cls, v):
        parse_s3_uri(v)
        return v.rstrip("/")

    @field_validator("tags")
    @classmethod
    def _tag_values(cls, v):
        for k, val in v:
            if not 0 < len(k) <= 128 or len(val) > 256 or k.lower().startswith("aws:"):
                raise ValueError(f"tag {k!r}: keys 1..128 chars (no aws: prefix), values ≤256 chars")
        if len(v) > 40:
            raise ValueError("at most 40 tags")
        return v

    @field_validator("target_model")
    @classmethod
    def _target(cls, v):
        if v is not None and (v.lower().startswith("s3:") or "://" in v):
            parse_s3_uri(v)  # an S3 URI must be a valid one (not silently a hub id)
        elif v is not None and not re.fullmatch(r"[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?", v):
            raise ValueError(f"target_model {v!r}: an s3://bucket/prefix URI or a hub id such as org/model")
        return v

    @model_validator(mode="after")
    def _check(self):
        for name in self.profiles:
            if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,15}", name):
                raise ValueError(f"profile name {name!r}: lowercase letters, digits and '-', at most 16 chars "
                                 "(it becomes part of the endpoint name)")
        named = [p.endpoint_name for p in self.profiles.values() if p.endpoint_name]
        if len(named) != len(set(named)):
            raise ValueError("two profiles name the same endpoint_name; each profile serves its own endpoint")
        if len(set(self.on_promote)) != len(self.on_promote):
            raise ValueError(f"on_promote lists a profile twice: {list(self.on_promote)}")
        if self.num_draft_tokens is not None and self.num_steps is None:
            raise ValueError("num_draft_tokens needs num_steps (SGLang requires both or neither)")
        for name in self.on_promote:
            if name not in self.profiles:
                raise ValueError(f"on_promote names profile {name!r}; defined: {sorted(self.profiles)}")
        if self.eagle_topk == 1 and self.num_steps and self.num_draft_tokens \
                and self.num_draft_tokens != self.num_steps + 1:
            raise ValueError("with eagle_topk 1, num_draft_tokens must be num_steps + 1 (a chain)")
        return self

    def profile(self, name: str) -> EndpointProfile:
        """The named profile, ready to deploy. Raises ValueError naming the defined profiles, or the
        missing image of a vllm-neuron profile."""
        if name not in self.profiles:
            raise ValueError(f"no SageMaker profile {name!r} in deploy.sagemaker.profiles; defined: "
                             f"{sorted(self.profiles)}")
        prof = self.profiles[name]
        if prof.engine == "vllm-neuron" and self.eagle_topk != 1:
            raise ValueError(f"profile {name!r}: vLLM drafts a chain (eagle_topk 1), got eagle_topk {self.eagle_topk}")
        if prof.engine == "vllm-neuron" and not prof.image_uri:
            raise ValueError(f"profile {name!r} (vllm-neuron) needs image_uri: a vLLM-Neuron serving image in your "
                             f"ECR (deploy.sagemaker.profiles.{name}.image_uri; see infra/README.md, 'Images')")
        return prof


@dataclass(frozen=True)
class DraftArtifact:
    """A draft checkpoint to serve: its dir, registry version (or None), sha256 of model.safetensors
    (the registry's `draft_sha256`) and of config.json. `key`: the S3 content address of both."""

    path: Path
    version: str | None
    sha256: str
    config_sha256: str = ""

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


def spec_settings(sm_params: SageMakerDeployParams, k: int) -> dict[str, int]:
    """SGLang EAGLE3 knobs {num_steps, eagle_topk, num_draft_tokens}; k = engine.num_draft_tokens."""
    steps = sm_params.num_steps or k
    topk = sm_params.eagle_topk
    return {"num_steps": steps, "eagle_topk": topk,
            "num_draft_tokens": sm_params.num_draft_tokens or (steps + 1 if topk == 1 else steps * topk + 1)}


def container_env(profile: EndpointProfile, model_path: str, spec: Mapping[str, int],
                  draft: DraftArtifact) -> dict[str, str]:
    """Container environment of the Model. SGLang: SM_SGLANG_* (→ launch_server flags); vLLM-neuron:
    SM_VLLM_* with SPECULATIVE_CONFIG as JSON. Profile environment entries override."""
    if profile.engine == "sglang":
        env = {"SM_SGLANG_MODEL_PATH": model_path,
               "SM_SGLANG_SPECULATIVE_ALGORITHM": "EAGLE3",
               "SM_SGLANG_SPECULATIVE_DRAFT_MODEL_PATH": DRAFT_DIR,
               "SM_SGLANG_SPECULATIVE_NUM_STEPS": str(spec["num_steps"]),
               "SM_SGLANG_SPECULATIVE_EAGLE_TOPK": str(spec["eagle_topk"]),
               "SM_SGLANG_SPECULATIVE_NUM_DRAFT_TOKENS": str(spec["num_draft_tokens"]),
               "SM_SGLANG_TP_SIZE": str(profile.tensor_parallel_size)}
    else:
        cfg = {"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": spec["num_steps"]}
        env = {"SM_VLLM_MODEL": model_path,
               "SM_VLLM_TENSOR_PARALLEL_SIZE": str(profile.tensor_parallel_size),
               "SM_VLLM_SPECULATIVE_CONFIG": json.dumps(cfg, separators=(",", ":"))}
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


def endpoint_config_request(name: str, model_name: str, profile: EndpointProfile,
                            sm_params: SageMakerDeployParams, draft: DraftArtifact, endpoint: str) -> dict:
    """CreateEndpointConfig kwargs: one variant `AllTraffic` on the profile's instances."""
    return {"EndpointConfigName": name,
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
    """Validate a draft dir (config.json + model.safetensors in the EAGLE3 layout, trained for
    `target_id` when given) and hash it. Raises FileNotFoundError / ValueError (as load_checkpoint)."""
    from ..models.eagle3 import load_checkpoint
    path = Path(path)
    try:
        load_checkpoint(path, target_id=target_id)
        if version is None and (path / "version.json").exists():
            meta = json.loads((path / "version.json").read_text())
            if not isinstance(meta, dict):
                raise ValueError(f"{path / 'version.json'}: expected an object with 'version'")
            version = meta.get("version")
    except (FileNotFoundError, ValueError):
        raise
    except Exception as e:  # noqa: BLE001 — corrupt safetensors / JSON, a dir where a file belongs
        raise ValueError(f"{path}: not a readable draft checkpoint ({type(e).__name__}: {e})") from None
    return DraftArtifact(path, None if version is None else str(version), sha256_file(path / "model.safetensors"),
                         sha256_file(path / "config.json"))


def private_copy(draft: DraftArtifact, dest: Path) -> DraftArtifact:
    """Copy the draft's files into `dest` and re-hash them there, so what is uploaded is what was
    checked even if the source dir is swapped meanwhile (a promotion, a rollback). Raises ValueError
    when the model bytes changed since `check_draft`."""
    import shutil
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in DRAFT_FILES:
        shutil.copyfile(draft.path / f, dest / f)
    sha = sha256_file(dest / "model.safetensors")
    if sha != draft.sha256:
        raise ValueError(f"draft {draft.path} changed since it was checked (a promotion or rollback meanwhile?); "
                         "deploy again")
    return DraftArtifact(dest, draft.version, sha, sha256_file(dest / "config.json"))


def _head(s3, bucket: str, key: str) -> dict | None:
    from botocore.exceptions import ClientError
    try:
        return s3.head_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def check_bucket(s3, s3_prefix: str) -> None:
    """Raise ValueError naming the fix when the prefix's bucket is missing or not accessible."""
    from botocore.exceptions import ClientError
    bucket, _ = parse_s3_uri(s3_prefix)
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as e:
        raise ValueError(f"S3 bucket {bucket} does not exist or is not accessible with these credentials "
                         f"({e.response.get('Error', {}).get('Code')}): create it (infra/cloudformation/"
                         "tidespec-sagemaker.yaml) or fix deploy.sagemaker.s3_prefix") from None


def upload_dir(s3, files: list[tuple[Path, str, str | None]], uri: str) -> tuple[str, int]:
    """Upload (local path, relative key, sha256 or None) below prefix `uri` with SSE-S3. An object
    already there is kept when its `sha256` metadata matches (or, without a sha, its size does).
    Returns (prefix URI ending '/', files uploaded)."""
    bucket, key = parse_s3_uri(uri)
    key = key.strip("/") + "/" if key.strip("/") else ""
    n = 0
    for path, rel, sha in files:
        head = _head(s3, bucket, key + rel)
        same = head is not None and (head.get("Metadata", {}).get("sha256") == sha if sha
                                     else head["ContentLength"] == path.stat().st_size)
        if not same:
            extra = {"ServerSideEncryption": "AES256"} | ({"Metadata": {"sha256": sha}} if sha else {})
            s3.upload_file(str(path), bucket, key + rel, ExtraArgs=extra)
            n += 1
    return f"s3://{bucket}/{key}", n


def upload_draft(s3, draft: DraftArtifact, s3_prefix: str) -> tuple[str, int]:
    """config.json + model.safetensors → `<s3_prefix>/drafts/<draft.key>/` (sha256 in object metadata)."""
    files = [(draft.path / "config.json", "config.json", draft.config_sha256 or sha256_file(draft.path / "config.json")),
             (draft.path / "model.safetensors", "model.safetensors", draft.sha256)]
    return upload_dir(s3, files, f"{s3_prefix}/drafts/{draft.key}/")


def target_prefix(s3_prefix: str, target_id: str) -> str:
    """S3 prefix URI (ends with '/') a local target dir is uploaded to: keyed by its weights' id."""
    return f"{s3_prefix}/targets/{target_id[:16]}/"


def upload_target(s3, target_dir: Path, s3_prefix: str, target_id: str) -> tuple[str, int]:
    """A local HF target dir → `<s3_prefix>/targets/<target_id[:16]>/` (the id is the weights' sha256,
    so same-size objects are kept); hidden files and dirs (.git, .cache) are skipped."""
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").exists():
        raise FileNotFoundError(f"{target_dir} is not a HF model dir (no config.json)")
    files = [(p, p.relative_to(target_dir).as_posix(), None) for p in sorted(target_dir.rglob("*"))
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(target_dir).parts)]
    return upload_dir(s3, files, target_prefix(s3_prefix, target_id))


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
    import boto3
    r = boto3.session.Session().region_name
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
    spec = spec_settings(sm_params, params.engine.num_draft_tokens)
    return DeployPlan(profile_name, endpoint,
                      model_request(name, sm_params, profile, region, target_uri, draft_s3, spec, draft, endpoint),
                      endpoint_config_request(name, name, profile, sm_params, draft, endpoint),
                      alarm_requests(endpoint, sm_params.canary), draft_s3,
                      target_uri if target_uri.startswith("s3://") else None)


def _describe(sm, endpoint: str) -> dict | None:
    from botocore.exceptions import ClientError
    try:
        return sm.describe_endpoint(EndpointName=endpoint)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") == "ValidationException" and "not find" in str(e).lower():
            return None
        raise


def wait_endpoint(sm, endpoint: str, config_name: str, timeout_s: float, poll_s: float) -> dict:
    """Poll DescribeEndpoint until `endpoint_outcome` is True; returns the description. Raises
    SageMakerDeployFailed (failed / rolled back), TimeoutError (the update keeps going on AWS)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        desc = sm.describe_endpoint(EndpointName=endpoint)
        if endpoint_outcome(desc, config_name):
            return desc
        if desc["EndpointStatus"] != last:
            last = desc["EndpointStatus"]
            log.info("endpoint %s: %s", endpoint, last)
        if time.monotonic() + poll_s > deadline:
            raise TimeoutError(f"endpoint {endpoint} still {desc['EndpointStatus']} after {timeout_s:g}s; the "
                               f"deployment continues on AWS (watch `aws sagemaker describe-endpoint "
                               f"--endpoint-name {endpoint}`)")
        time.sleep(poll_s)


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


def _clients(region: str, sm=None, s3=None, cw=None):
    import boto3
    return (sm or boto3.client("sagemaker", region_name=region), s3 or boto3.client("s3", region_name=region),
            cw or boto3.client("cloudwatch", region_name=region))


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
    sm, s3, cw = _clients(region, sm, s3, cw)
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
        check_bucket(s3, sm_params.s3_prefix)
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
    variants = cfg.get("ProductionVariants", [])
    want = {k: v for k, v in p.endpoint_config["ProductionVariants"][0].items() if k != "ModelName"}
    if len(variants) != 1 or any(variants[0].get(k) != v for k, v in want.items()):
        return False
    m = sm.describe_model(ModelName=variants[0]["ModelName"])
    have = m.get("PrimaryContainer", {})
    return m.get("ExecutionRoleArn") == p.model["ExecutionRoleArn"] and all(
        have.get(k) == v for k, v in p.model["PrimaryContainer"].items() if k != "Mode")


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
    if lock_dir is None:
        yield
        return
    import fcntl
    Path(lock_dir).mkdir(parents=True, exist_ok=True)
    path = Path(lock_dir) / f"sagemaker-{endpoint}.lock"
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SageMakerDeployFailed(f"another deploy of endpoint {endpoint} is running (lock {path}); wait for "
                                        "it to finish") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _wait_gone(sm, endpoint: str, timeout_s: float, poll_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _describe(sm, endpoint) is not None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"endpoint {endpoint} still deleting after {timeout_s:g}s")
        time.sleep(poll_s)
