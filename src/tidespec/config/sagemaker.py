"""The `train.sagemaker` and `deploy.sagemaker` sections of params.yaml (pydantic, strict).

Bottom layer: imports only `tidespec.config.strict` and pydantic, so config.py can use these schemas
without importing the SageMaker launcher, the deployer or the AWS adapter (no cycle). It also
defines the pure AWS identifier validators the schemas need (IAM role ARN, SageMaker resource
name, S3 URI; IAM User Guide "IAM identifiers", SageMaker API reference); `tidespec.adapters.aws`
re-exports them, so adapters take them from there.
Every model raises pydantic ValidationError on a bad value, naming the field and the fix.
Limits follow the SageMaker API reference (CreateTrainingJob, CreateModel, CreateEndpointConfig,
UpdateEndpoint) and botocore's sagemaker service model.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .strict import Strict as _Strict
from .strict import pairs

# IAM role ARN: partition aws[-cn|-us-gov|-iso|-iso-b|...], 12-digit account, optional path (ASCII
# ! .. ~, ends with '/', ≤ 512 chars with its leading '/'), name of ≤ 64 [\w+=,.@-]. Use fullmatch.
ROLE_ARN_RE = re.compile(r"arn:aws(?:-[a-z]+){0,3}:iam::\d{12}:role/(?:[!-~]{1,510}/)?[\w+=,.@-]{1,64}",
                         re.ASCII)
# SageMaker resource names (training jobs, models, endpoint configs, endpoints). Use fullmatch.
NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
S3_URI_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(.*))?$")
ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]{0,511}$")  # container Environment keys
MAX_TAGS, MAX_ENV_VALUE = 50, 512  # CreateTrainingJob: Tags, Environment values
GPU_FAMILIES = ("g4dn", "g5", "g6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en")
TRN2_FAMILIES = ("trn2",)


# -- AWS identifier validators (pure; re-exported by tidespec.adapters.aws) -------------------------
def check_role_arn(arn: str) -> str:
    """`arn` when it is an IAM role ARN (any partition, optional path). Raises ValueError."""
    if not isinstance(arn, str) or not ROLE_ARN_RE.fullmatch(arn):
        raise ValueError(f"{arn!r} is not an IAM role ARN (arn:aws:iam::<12-digit account>:role/<name>)")
    return arn


def is_name(name: str) -> bool:
    """Whether `name` is a valid SageMaker resource name (1..63 chars, letters, digits, inner '-')."""
    return isinstance(name, str) and NAME_RE.fullmatch(name) is not None


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/key/prefix` → (bucket, "key/prefix"); the key may be empty. Raises ValueError."""
    m = S3_URI_RE.match(uri)
    if not m or ".." in m.group(1):
        raise ValueError(f"{uri!r} is not an S3 URI of the form s3://bucket/prefix (lowercase bucket name)")
    return m.group(1), m.group(2) or ""


# -- params ---------------------------------------------------------------------------------------
class SageMakerTrainParams(_Strict):
    """`train.sagemaker` in params.yaml: where and how the draft trains on SageMaker.

    instance_type: GPU `ml.g5.*` (A10G 24 GB), `ml.p4d.*` (A100), `ml.p5.*` (H100), or Trainium
    `ml.trn1.*` / `ml.trn1n.*` (the image must then carry torch-neuronx). Times in seconds.
    use_spot: managed spot training; `max_wait_s` (>= max_runtime_s; None → max_runtime_s) bounds
    runtime plus waiting for spot capacity. distribution: `torch_distributed` trains as torchrun
    ranks across the instances (`train.nproc_per_node` per instance; node 0 is the rendezvous);
    instance_count > 1 needs it. Raises pydantic ValidationError on a bad value.
    """

    role_arn: str  # IAM execution role SageMaker assumes (S3 read/write on s3_prefix, CloudWatch logs)
    image_uri: str  # training image with tidespec installed (e.g. ECR, built from this project)
    instance_type: str = "ml.g5.2xlarge"
    instance_count: int = Field(1, ge=1)
    distribution: Literal["none", "torch_distributed"] = "none"  # torch_distributed: torchrun across instances
    volume_gb: int = Field(50, ge=1)  # EBS volume per instance (channels are copied onto it)
    max_runtime_s: int = Field(86400, ge=1)
    s3_prefix: str  # s3://bucket/prefix: inputs, checkpoints and outputs of every job go below it
    use_spot: bool = False
    max_wait_s: int | None = Field(None, ge=1)
    region: str | None = None  # None → the environment's (AWS_REGION / AWS_DEFAULT_REGION / profile)
    poll_s: float = Field(30, gt=0)  # DescribeTrainingJob interval
    # extra container env (values ≤512 chars) and job tags (≤49 besides project=tidespec): a mapping in
    # params.yaml, kept as (key, value) pairs so the frozen model stays hashable
    environment: tuple[tuple[str, str], ...] = ()
    tags: tuple[tuple[str, str], ...] = ()

    @field_validator("role_arn")
    @classmethod
    def _role(cls, v: str) -> str:
        return check_role_arn(v)

    @field_validator("image_uri")
    @classmethod
    def _image(cls, v: str) -> str:
        if not v.strip() or len(v) > 255:
            raise ValueError("image_uri must be a non-empty image reference of at most 255 chars")
        return v

    @field_validator("instance_type")
    @classmethod
    def _instance(cls, v: str) -> str:
        if not re.fullmatch(r"ml\.[a-z0-9-]+\.[a-z0-9]+", v):
            raise ValueError(f"{v!r} is not a SageMaker instance type (ml.<family>.<size>, e.g. ml.g5.2xlarge, "
                             "ml.trn1.2xlarge)")
        return v

    @field_validator("s3_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        parse_s3_uri(v)
        return v.rstrip("/")

    _pairs = field_validator("environment", "tags", mode="before")(classmethod(lambda cls, v: pairs(v)))

    @field_validator("environment")
    @classmethod
    def _env(cls, v: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        for k, val in v:
            if not ENV_KEY_RE.match(k) or len(val) > MAX_ENV_VALUE:
                raise ValueError(f"environment {k!r}: keys [a-zA-Z_][a-zA-Z0-9_]*, values ≤{MAX_ENV_VALUE} chars")
        return v

    @field_validator("tags")
    @classmethod
    def _tags(cls, v: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
        for k, val in v:
            if not 0 < len(k) <= 128 or len(val) > 256:
                raise ValueError(f"tag {k!r}: keys 1..128 chars, values ≤256 chars")
        return v

    @model_validator(mode="after")
    def _distribution(self):
        if self.instance_count > 1 and self.distribution != "torch_distributed":
            raise ValueError(f"instance_count {self.instance_count} without distribution: torch_distributed would "
                             "train the same draft on every instance alone; set distribution: torch_distributed")
        return self

    @model_validator(mode="after")
    def _spot(self):
        if self.max_wait_s is not None and not self.use_spot:
            raise ValueError("max_wait_s applies to spot training only: set use_spot: true or drop max_wait_s")
        if self.max_wait_s is not None and self.max_wait_s < self.max_runtime_s:
            raise ValueError(f"max_wait_s ({self.max_wait_s}) must be >= max_runtime_s ({self.max_runtime_s})")
        if len(self.tags) + 1 > MAX_TAGS:
            raise ValueError(f"at most {MAX_TAGS - 1} tags")
        return self

    @property
    def wait_limit_s(self) -> int:
        """The job's own time limit (s): MaxWaitTimeInSeconds with spot, else MaxRuntimeInSeconds."""
        return (self.max_wait_s or self.max_runtime_s) if self.use_spot else self.max_runtime_s


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
    # step cost relative to a 1-token target step, for choosing the window per endpoint:
    # cost(k) = 1 + verify_cost_per_token·k + draft_cost·k (the cost model of Leviathan et al.
    # 2023, arXiv 2211.17192 §3.4: c = draft/target step time; verifying k+1 tokens ≈ one target step
    # while decoding is memory-bound, as on GPUs at small batch). Defaults: 0.02 per verified token (a
    # margin over that idealisation) and 0.05 per draft step (an EAGLE3 head is one decoder layer + a
    # draft-vocab lm_head against the target's L = 30–80 layers). Measure yours (`tidespec bench engine`
    # measures the embedded engine's: 1-token 51–70 ms, 5-token verify 1.2–1.4×, draft step ~2.5 ms on CPU).
    verify_cost_per_token: float = Field(0.02, ge=0, le=10)
    draft_cost: float = Field(0.05, ge=0, le=10)

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


class DataCaptureParams(_Strict):
    """SageMaker Data Capture on the endpoint (`deploy.sagemaker.data_capture`): the endpoint logs
    request and response bodies as JSON Lines under `destination` (default `<s3_prefix>/capture`),
    one object per endpoint/variant/hour (AWS SageMaker Developer Guide, "Capture data from
    real-time endpoint"; API: CreateEndpointConfig `DataCaptureConfig`). This is the production
    traffic tidespec's capture flow reads back. sampling_percentage: 0–100 of requests;
    kms_key_id: KMS key for the captured objects (None: the bucket's default encryption);
    json_content_types: content types recorded as JSON text (others are base64)."""

    enabled: bool = False
    sampling_percentage: int = Field(100, ge=0, le=100)
    destination: str | None = None
    kms_key_id: str | None = Field(None, min_length=1)
    json_content_types: tuple[str, ...] = Field(("application/json",), min_length=1, max_length=10)

    @field_validator("destination")
    @classmethod
    def _s3(cls, v):
        if v is not None:
            parse_s3_uri(v)
        return v


class CanaryParams(_Strict):
    """Blue/green update knobs (UpdateEndpoint DeploymentConfig). percent: canary share of the new
    fleet's capacity (SageMaker takes ≤ 50 %; used when instance_count ≥ 2); wait_s: canary (or, with
    one instance, baking) period watched by the alarms; alarm_5xx: Invocation5XXErrors per minute that
    trips the rollback; alarm_p99_latency_ms: ModelLatency p99 that does (None: no latency alarm);
    alarm_acceptance: a third alarm on the new draft's live acceptance length, which the serving
    image publishes to CloudWatch (`backends.acceptance`; the images in infra/containers run
    it): two minutes below the τ its evaluation replayed at the served window, by more than 3
    standard errors over 100 drafts, trip the rollback."""

    percent: int = Field(10, ge=1, le=50)
    wait_s: int = Field(600, ge=0, le=3600)  # WaitIntervalInSeconds
    termination_wait_s: int = Field(600, ge=0, le=3600)  # blue fleet kept this long after the switch
    max_execution_s: int = Field(3600, ge=600, le=14400)  # MaximumExecutionTimeoutInSeconds
    alarm_5xx: int = Field(1, ge=1)
    alarm_p99_latency_ms: float | None = Field(30000, gt=0)
    alarm_acceptance: bool = False


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
    engine.num_draft_tokens steps and `engine.tree`'s topk and tree size, the numbers the embedded
    engine serves; vLLM's num_speculative_tokens = num_steps, chains). keep_versions: models/configs of this endpoint
    kept (for a manual rollback).
    Times in s.
    """

    role_arn: str
    s3_prefix: str
    target_model: str | None = None
    region: str | None = None
    profiles: dict[str, EndpointProfile] = Field(
        default_factory=lambda: {k: EndpointProfile(**v) for k, v in DEFAULT_PROFILES.items()})
    num_steps: int | None = Field(None, ge=1, le=16)
    eagle_topk: int | None = Field(None, ge=1, le=16)
    num_draft_tokens: int | None = Field(None, ge=2, le=64)
    canary: CanaryParams = CanaryParams()
    keep_versions: int = Field(2, ge=1)
    poll_s: float = Field(30, ge=0.01)
    wait_timeout_s: float = Field(5400, gt=0)
    data_capture: DataCaptureParams = DataCaptureParams()
    min_speedup: float = Field(1.05, ge=1.0)  # tuned window: speculate on an endpoint only if predicted ≥ this
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
        return check_role_arn(v)

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
        if (self.eagle_topk or 1) == 1 and self.num_steps and self.num_draft_tokens \
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
        if prof.engine == "vllm-neuron" and self.eagle_topk not in (None, 1):  # None: engine.tree is for SGLang
            raise ValueError(f"profile {name!r}: vLLM drafts a chain (eagle_topk 1), got eagle_topk {self.eagle_topk}")
        if prof.engine == "vllm-neuron" and not prof.image_uri:
            raise ValueError(f"profile {name!r} (vllm-neuron) needs image_uri: a vLLM-Neuron serving image in your "
                             f"ECR (deploy.sagemaker.profiles.{name}.image_uri; see infra/README.md, 'Images')")
        if self.canary.alarm_acceptance and not prof.image_uri:
            raise ValueError(f"deploy.sagemaker.canary.alarm_acceptance: profile {name!r} runs the AWS SGLang DLC, "
                             "which publishes no acceptance metric, so the alarm could never fire; build "
                             f"infra/containers/sglang on it and set deploy.sagemaker.profiles.{name}.image_uri, or "
                             "turn the alarm off")
        return prof
