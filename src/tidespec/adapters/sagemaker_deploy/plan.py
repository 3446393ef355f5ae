"""What a SageMaker deploy would send, computed without calling AWS: names, the model / endpoint config / alarm /
update requests, the container's speculative settings per engine (SGLang, vLLM-neuron), and the draft artifact checks
(`plan`: `tidespec deploy sagemaker --dry-run` prints it)."""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from ...assets import sha256_file
from ...config import Params, TreeParams, tree_num_draft_tokens
from ...config.sagemaker import CanaryParams, EndpointProfile, SageMakerDeployParams
from ...errors import TidespecError
from ...models.eagle3 import load_checkpoint
from ...workspace import copy_engine_files, engine_dir, read_version
from ..aws import NAME_RE, parse_s3_uri
from .acceptance import alarm_request as acceptance_alarm

log = logging.getLogger(__name__)


class SageMakerDeployFailed(TidespecError):
    """The endpoint did not end InService on the new config (failed, or rolled back to the old one)."""


VARIANT = "AllTraffic"
DRAFT_CHANNEL = "draft"
MODEL_DIR = "/opt/ml/model"
DRAFT_DIR = f"/opt/ml/additional-model-data-sources/{DRAFT_CHANNEL}"


# AWS SGLang DLC for SageMaker (aws/deep-learning-containers release notes, sglang 0.5.x); the account
# 763104351884 hosts the DLCs in most regions. Pin your own tag in params for production.
SGLANG_DLC = "763104351884.dkr.ecr.{region}.amazonaws.com/sglang:0.5-gpu-py312-cu129-ubuntu22.04-sagemaker-v1"
TERMINAL_BAD = ("Failed", "UpdateRollbackFailed")


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
    tau_k: tuple[float, ...] = ()  # τ(0..K) its evaluation replayed (the acceptance alarm's reference)

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
                  draft: DraftArtifact, endpoint: str = "", acceptance: bool = False) -> dict[str, str]:
    """Container environment of the Model. SGLang: SM_SGLANG_* (→ launch_server flags); vLLM-neuron:
    SM_VLLM_* with SPECULATIVE_CONFIG as JSON; `spec` None: no speculative settings (the tuned
    window found none that pays). `acceptance` (with `spec`): the image's acceptance publisher is
    told to run and what to label (`acceptance.main`), and SGLang to export its counters.
    Profile environment entries override."""
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
    if acceptance and spec is not None:
        engine = "sglang" if profile.engine == "sglang" else "vllm"
        env |= {"TIDESPEC_ACCEPTANCE": "1", "TIDESPEC_ENDPOINT_NAME": endpoint, "TIDESPEC_ENGINE": engine,
                "TIDESPEC_NUM_STEPS": str(spec["num_steps"])}
        if engine == "sglang":
            env["SM_SGLANG_ENABLE_METRICS"] = ""  # a bare --enable-metrics
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
    container["Environment"] = container_env(profile, model_path, spec, draft, endpoint,
                                             sm_params.canary.alarm_acceptance)
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


def alarm_requests(endpoint: str, canary: CanaryParams, draft: DraftArtifact | None = None,
                   spec: Mapping[str, int] | None = None) -> tuple[dict, ...]:
    """PutMetricAlarm kwargs of the auto-rollback alarms (AWS/SageMaker per-variant metrics, 1-min
    periods): 5xx count ≥ alarm_5xx, ModelLatency p99 (µs) > alarm_p99_latency_ms, and with
    canary.alarm_acceptance the draft's live acceptance length below its replayed τ at the served
    window (`acceptance.alarm_request`; none when `spec` is None: speculation off, nothing to
    accept). Raises ValueError when that alarm is asked for a draft without a replayed τ(k)."""
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
    if canary.alarm_acceptance and spec is not None:
        if draft is None or not draft.tau_k:
            raise ValueError(f"deploy.sagemaker.canary.alarm_acceptance: draft {draft.version if draft else None} "
                             "has no replayed τ(k) (version.json tau_k, written when a registry version is "
                             "downloaded, from its evaluation's per-position acceptance): deploy a version from the "
                             "registry (`tidespec deploy sagemaker --version N`), or turn the alarm off")
        out.append(acceptance_alarm(f"{base}-acceptance", endpoint, draft.version, draft.tau_k, spec["num_steps"]))
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
    EAGLE3 layout, trained for `target_id` when given) and hash it; the artifact's path is the engine dir. Raises
    FileNotFoundError / ValueError (as load_checkpoint)."""
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
                         sha256_file(eng / "config.json"), tuple(sorted(meta.get("tuned_k", {}).items())),
                         tuple(float(t) for t in meta.get("tau_k", ())))


def private_copy(draft: DraftArtifact, dest: Path) -> DraftArtifact:
    """Copy the draft's files into `dest` and re-hash them there, so what is uploaded is what was
    checked even if the source dir is swapped meanwhile (a promotion, a rollback). Raises ValueError
    when the model bytes changed since `check_draft`."""
    dest = copy_engine_files(draft.path, dest)
    sha = sha256_file(dest / "model.safetensors")
    if sha != draft.sha256:
        raise ValueError(f"draft {draft.path} changed since it was checked (a promotion or rollback meanwhile?); "
                         "deploy again")
    return DraftArtifact(dest, draft.version, sha, sha256_file(dest / "config.json"), draft.tuned_k, draft.tau_k)


def target_prefix(s3_prefix: str, target_id: str) -> str:
    """S3 prefix URI (ends with '/') a local target dir is uploaded to: keyed by its weights' id."""
    return f"{s3_prefix}/targets/{target_id[:16]}/"


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
                      alarm_requests(endpoint, sm_params.canary, draft, spec), draft_s3,
                      target_uri if target_uri.startswith("s3://") else None)
