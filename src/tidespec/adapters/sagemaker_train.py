"""Train the draft as a SageMaker training job, the launcher side (`train_on_sagemaker`): stage the
curated index and the snapshots it references (and the warm-start draft, and a local target) to
`<s3_prefix>/<job>/input/`, CreateTrainingJob with a checkpoint channel (a spot interruption
resumes), poll it, download and unpack the draft. The container side is `train.sagemaker`, which
calls no AWS API. The S3 layout: docs/design/adapters.md.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from ..config import Params
from ..config.sagemaker import SageMakerTrainParams
from ..errors import TidespecError
from ..train.sagemaker import CHECKPOINT_LOCAL
from ..workspace import engine_dir
from . import aws
from .aws import NAME_RE, parse_s3_uri

log = logging.getLogger(__name__)

# CreateTrainingJob limits (botocore sagemaker service model)
CHANNEL_RE = re.compile(r"^[A-Za-z0-9.\-_]{1,64}$")
MAX_HPS, MAX_HP_KEY, MAX_HP_VALUE = 100, 256, 2500
MAX_CHANNELS = 20
TERMINAL = ("Completed", "Failed", "Stopped")
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
DEFAULT_PREFIX = "tidespec-draft"
WAIT_SLACK_S = 3600  # launcher-side wait beyond the job's own limit (provisioning, image pull, upload)


class SageMakerTrainingFailed(TidespecError):
    """A SageMaker training job ended Failed or Stopped."""


@dataclass(frozen=True)
class TrainingJob:
    """A launched job. output_s3: where SageMaker puts model.tar.gz; checkpoint_s3: CheckpointConfig.S3Uri."""

    name: str
    arn: str
    output_s3: str
    checkpoint_s3: str


# -- pure helpers -------------------------------------------------------------------------------
def job_name(prefix: str = DEFAULT_PREFIX) -> str:
    """A valid, unique training-job name: `<prefix>-<UTC yyyymmdd-HHMMSS>-<6 hex>` (≤63 chars).
    Characters outside [a-zA-Z0-9-] in `prefix` become '-'; the prefix is cut to fit."""
    p = re.sub(r"[^a-zA-Z0-9-]", "-", prefix).strip("-") or DEFAULT_PREFIX
    suffix = f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    name = f"{p[:63 - len(suffix) - 1].rstrip('-')}-{suffix}"
    assert NAME_RE.fullmatch(name), name
    return name


def job_layout(params: SageMakerTrainParams, name: str) -> dict[str, str]:
    """S3 URIs of one job: "input" (channels go below), "checkpoints", "output_path" (S3OutputPath),
    "model" (the model.tar.gz SageMaker writes: <S3OutputPath>/<job>/output/model.tar.gz)."""
    base = f"{params.s3_prefix}/{name}"
    return {"input": f"{base}/input", "checkpoints": f"{base}/checkpoints/", "output_path": params.s3_prefix,
            "model": f"{base}/output/model.tar.gz"}


def check_hyperparameters(hps: Mapping[str, Any]) -> dict[str, str]:
    """Hyperparameters as SageMaker takes them: ≤100 entries, str keys ≤256 chars, str values ≤2500
    chars. Returns a plain dict. Raises ValueError naming the offending key."""
    if len(hps) > MAX_HPS:
        raise ValueError(f"{len(hps)} hyperparameters; SageMaker takes at most {MAX_HPS}")
    for k, v in hps.items():
        if not isinstance(k, str) or not 0 < len(k) <= MAX_HP_KEY:
            raise ValueError(f"hyperparameter key {str(k)[:60]!r}: must be a str of 1..{MAX_HP_KEY} chars")
        if not isinstance(v, str):
            raise ValueError(f"hyperparameter {k!r}: value must be a str, got {type(v).__name__}")
        if len(v) > MAX_HP_VALUE:
            raise ValueError(f"hyperparameter {k!r}: value is {len(v)} chars; SageMaker allows at most "
                             f"{MAX_HP_VALUE} (ship large data in an input channel instead)")
    return dict(hps)


def training_job_request(job_name: str, params: SageMakerTrainParams, inputs: dict[str, str],
                         hyperparameters: dict[str, str], checkpoint_s3: str) -> dict:
    """The CreateTrainingJob request (kwargs for `sm.create_training_job`). `inputs`: channel name →
    S3 prefix URI (File mode, FullyReplicated: every instance gets all of it). Output path is
    `params.s3_prefix` (artifacts land at <s3_prefix>/<job>/output/model.tar.gz). With
    `distribution: torch_distributed` the `distribution` hyperparameter tells the container to run
    torchrun across the `instance_count` instances (`train.sagemaker.container_main`). Raises ValueError
    on an invalid job name, channel name, S3 URI or hyperparameter (named)."""
    if not NAME_RE.fullmatch(job_name):
        raise ValueError(f"job name {job_name!r} must match {NAME_RE.pattern} (use job_name())")
    if not 0 < len(inputs) <= MAX_CHANNELS:
        raise ValueError(f"{len(inputs)} input channels; SageMaker takes 1..{MAX_CHANNELS}")
    for ch, uri in inputs.items():
        if not CHANNEL_RE.match(ch):
            raise ValueError(f"channel name {ch!r} must match {CHANNEL_RE.pattern}")
        parse_s3_uri(uri)
    parse_s3_uri(checkpoint_s3)
    stop = {"MaxRuntimeInSeconds": params.max_runtime_s}
    if params.use_spot:
        stop["MaxWaitTimeInSeconds"] = params.wait_limit_s
    return {
        "TrainingJobName": job_name,
        "AlgorithmSpecification": {"TrainingImage": params.image_uri, "TrainingInputMode": "File"},
        "RoleArn": params.role_arn,
        "InputDataConfig": [{"ChannelName": ch, "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}}
            for ch, uri in inputs.items()],
        "OutputDataConfig": {"S3OutputPath": params.s3_prefix},
        "ResourceConfig": {"InstanceType": params.instance_type, "InstanceCount": params.instance_count,
                           "VolumeSizeInGB": params.volume_gb},
        "StoppingCondition": stop,
        "EnableManagedSpotTraining": params.use_spot,
        "CheckpointConfig": {"S3Uri": checkpoint_s3, "LocalPath": CHECKPOINT_LOCAL},
        "HyperParameters": check_hyperparameters(  # the container starts torchrun across the instances
            {**hyperparameters, "distribution": params.distribution} if params.distribution != "none"
            else hyperparameters),
        "Environment": {"PYTHONUNBUFFERED": "1", **dict(params.environment)},  # unbuffered: logs reach CloudWatch live
        "Tags": [{"Key": "project", "Value": "tidespec"}]
                + [{"Key": k, "Value": v} for k, v in params.tags if k != "project"],
    }


def job_outcome(desc: dict) -> bool:
    """True when a DescribeTrainingJob response is Completed, False while InProgress/Stopping.
    Raises SageMakerTrainingFailed (Failed/Stopped) with the job name, FailureReason and where the
    logs are."""
    name, status = desc["TrainingJobName"], desc["TrainingJobStatus"]
    if status == "Completed":
        return True
    if status in ("Failed", "Stopped"):
        reason = desc.get("FailureReason") or (
            "stopped (StopTrainingJob, or MaxRuntimeInSeconds / MaxWaitTimeInSeconds reached)"
            if status == "Stopped" else "no FailureReason reported")
        raise SageMakerTrainingFailed(
            f"SageMaker training job {name} {status} ({desc.get('SecondaryStatus', '?')}): {reason}. "
            f"Logs: CloudWatch log group {LOG_GROUP}, streams {name}/algo-*")
    return False


# -- model archive ------------------------------------------------------------------------------
def _safe_members(tar: tarfile.TarFile, archive: str) -> list[tarfile.TarInfo]:
    """Members of a model archive, refusing links, devices, absolute paths and '..' (ValueError)."""
    members = tar.getmembers()
    for m in members:
        p = PurePosixPath(m.name)
        if p.is_absolute() or ".." in p.parts or not (m.isfile() or m.isdir()):
            raise ValueError(f"{archive}: unsafe member {m.name!r} (absolute path, '..' or link); not extracted")
    return members


def download_model(job_description: dict, s3, dest: Path) -> Path:
    """Download ModelArtifacts.S3ModelArtifacts (model.tar.gz) and extract it into `dest` (created).
    Returns dest (a draft checkpoint dir: config.json, model.safetensors, train_metrics.json).
    Raises FileNotFoundError naming the S3 key when the archive is missing, ValueError for an
    unsafe member (nothing is extracted then)."""
    uri = job_description["ModelArtifacts"]["S3ModelArtifacts"]
    bucket, key = parse_s3_uri(uri)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".model-") as tmp:
        local = Path(tmp) / "model.tar.gz"
        try:
            s3.download_file(bucket, key, str(local))
        except Exception as e:
            if aws.is_not_found(e):
                raise FileNotFoundError(f"model archive s3://{bucket}/{key} of job "
                                        f"{job_description.get('TrainingJobName')} not found") from None
            raise
        with tarfile.open(local, "r:gz") as tar:
            members = _safe_members(tar, uri)
            dest.mkdir(parents=True, exist_ok=True)
            tar.extractall(dest, members=members, filter="data")
    return dest


# -- launch / wait --------------------------------------------------------------------------------
def _clients(params: SageMakerTrainParams, sm=None, s3=None):
    """(sagemaker, s3) clients: the given ones, else built for params.region. Raises AWSUnavailable."""
    return sm or aws.client("sagemaker", params.region), s3 or aws.client("s3", params.region)


def launch(params: SageMakerTrainParams, inputs: dict[str, Path], hyperparameters: dict[str, str],
           sm=None, s3=None, name: str | None = None) -> TrainingJob:
    """Upload each channel dir to `<s3_prefix>/<job>/input/<channel>/` and create the training job
    (name: `name` or `job_name()`). Clients default to boto3's, configured from the environment.
    Each channel is uploaded with SSE-S3 and sha256 metadata (`aws.upload_dir`). Raises as
    `training_job_request` / `aws.upload_dir` (FileNotFoundError: missing dir, ValueError: empty
    dir), AWSUnavailable without boto3, botocore ClientError from the API."""
    sm, s3 = _clients(params, sm, s3)
    name = name or job_name()
    if not NAME_RE.fullmatch(name):
        raise ValueError(f"job name {name!r} must match {NAME_RE.pattern} (use job_name())")
    lay = job_layout(params, name)
    check_hyperparameters(hyperparameters)  # fail before uploading anything
    uris = {ch: aws.upload_dir(s3, Path(d), f"{lay['input']}/{ch}/", skip_unchanged=False)[0]  # fresh prefix
            for ch, d in inputs.items()}
    req = training_job_request(name, params, uris, hyperparameters, lay["checkpoints"])
    arn = sm.create_training_job(**req)["TrainingJobArn"]
    log.info("SageMaker training job %s created on %s×%s", name, params.instance_count, params.instance_type)
    return TrainingJob(name, arn, lay["model"], lay["checkpoints"])


def wait(job: TrainingJob | str, sm=None, timeout_s: float = 86400 + WAIT_SLACK_S, poll_s: float = 30.0) -> dict:
    """Poll DescribeTrainingJob every `poll_s` s until Completed; returns the description.
    Raises SageMakerTrainingFailed (Failed/Stopped, with FailureReason and the CloudWatch log group),
    aws.WaitTimeout (a TimeoutError) after `timeout_s` s (the job keeps running: stop it with
    StopTrainingJob), AWSUnavailable without boto3 when no client is given."""
    sm = sm or aws.client("sagemaker")
    name = job.name if isinstance(job, TrainingJob) else job
    return aws.wait_until(
        lambda: sm.describe_training_job(TrainingJobName=name), job_outcome, timeout_s, poll_s,
        what=f"training job {name}", state=lambda d: f"{d['TrainingJobStatus']} / {d.get('SecondaryStatus')}",
        timeout_message=lambda d, t: (
            f"SageMaker training job {name} still {d['TrainingJobStatus']} after {t:g}s; it keeps "
            f"running (and billing): stop it with StopTrainingJob (`aws sagemaker stop-training-job "
            f"--training-job-name {name}`) or wait again; logs: CloudWatch {LOG_GROUP}"))


# -- launcher used by the cycle -------------------------------------------------------------------
def stage_curated(curated_json: Path, dest: Path) -> str:
    """Lay out curated.json and the snapshot dirs it references (snapshots, replay_snapshots and the
    train/val entries' dirs; not holdout.jsonl) under `dest` with the same relative layout, snapshot
    dirs symlinked (no copy). Returns curated.json's posix path relative to `dest`. Raises
    FileNotFoundError naming a missing snapshot dir."""
    curated_json = Path(os.path.abspath(curated_json))
    base = curated_json.parent
    idx = json.loads(curated_json.read_text())
    rels = list(idx.get("snapshots", [])) + list(idx.get("replay_snapshots", []))
    rels += [e["snapshot"] for e in idx.get("train", []) + idx.get("val", [])]
    snaps = sorted({os.path.normpath(base / r) for r in rels})
    for s in snaps:
        if not Path(s).is_dir():
            raise FileNotFoundError(f"snapshot {s} named by {curated_json} is missing (dvc pull it, or re-curate)")
    root = os.path.commonpath([str(base), *snaps])
    dest = Path(dest)
    rel_index = os.path.relpath(curated_json, root)
    (dest / rel_index).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(curated_json, dest / rel_index)
    for s in snaps:
        link = dest / os.path.relpath(s, root)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(s, target_is_directory=True)
    return PurePosixPath(*Path(rel_index).parts).as_posix()


UNUSED_IN_TRAINING = ("serve", "deploy")  # params sections a training job never reads


def params_json(params: Params) -> str:
    """Params as the `params` hyperparameter: compact JSON without `train.sagemaker` (the container
    trains in-process; this also keeps the role ARN out of the job's hyperparameters) and without the
    sections a training job never reads (`UNUSED_IN_TRAINING`: serving and deployment settings),
    which keeps it under SageMaker's 2,500 characters a value (`hyperparameters` refuses more)."""
    d = params.model_dump(mode="json")
    d.get("train", {}).pop("sagemaker", None)
    for section in UNUSED_IN_TRAINING:
        d.pop(section, None)
    return json.dumps(d, separators=(",", ":"), sort_keys=True)


def _job_inputs(params: Params, curated_json: Path, init: Path | None, stage: Path) -> tuple[dict, dict]:
    """(channel → local dir, hyperparameters) of the job: the curated set staged under `stage`,
    the warm start (when `init` holds a draft and train.warm_start), the target dir (a local
    target.source)."""
    rel = stage_curated(curated_json, stage)
    inputs = {"curated": stage}
    if init is not None and params.train.warm_start and (engine_dir(init) / "model.safetensors").exists():
        inputs["init"] = engine_dir(init)  # a bundle's draft/ (config.json + model.safetensors)
    if params.target.source != "smollm2" and Path(params.target.source).is_dir():
        inputs["target"] = Path(params.target.source)
    return inputs, {"params": params_json(params), "curated": rel}


def preview_request(params: Params, curated_json: Path, init: Path | None) -> dict:
    """The CreateTrainingJob request `train_on_sagemaker` would send, its channels' S3 URIs where
    `launch` would upload them; nothing is uploaded or called (`tidespec stage train --dry-run`).
    Raises ValueError when train.sagemaker is not set, FileNotFoundError for a missing snapshot."""
    sm_params = params.train.sagemaker
    if sm_params is None:
        raise ValueError("train.sagemaker is not configured in params.yaml (role_arn, image_uri, s3_prefix)")
    name = job_name()
    lay = job_layout(sm_params, name)
    with tempfile.TemporaryDirectory(prefix="tidespec-sm-") as tmp:
        inputs, hps = _job_inputs(params, Path(curated_json), init, Path(tmp) / "curated")
    uris = {ch: f"{lay['input']}/{ch}/" for ch in inputs}
    return training_job_request(name, sm_params, uris, hps, lay["checkpoints"])


def train_on_sagemaker(params: Params, curated_json: Path, init: Path | None, out: Path,
                       sm_params: SageMakerTrainParams | None = None, sm=None, s3=None,
                       on_launched: Callable[[TrainingJob], None] | None = None) -> dict:
    """Train a candidate on SageMaker: stage + upload the curated set (and the warm-start draft when
    `init` exists and train.warm_start, and the target dir when target.source is a local dir),
    create the job, wait, unpack the checkpoint into `out`. The caller has checked the set first
    (`train.entry.check`: nothing leaves for a set too small or another target's). Returns the
    trainer's metrics (out/train_metrics.json). `sm_params` None → params.train.sagemaker.
    `on_launched(job)` runs right after CreateTrainingJob (progress reporting; tests emulate the
    container there). Raises ValueError when SageMaker is not configured, FileNotFoundError for a
    missing snapshot (`stage_curated`), and as `launch` / `wait` / `download_model`."""
    sm_params = sm_params or getattr(params.train, "sagemaker", None)
    if sm_params is None:
        raise ValueError("train.sagemaker is not configured in params.yaml (role_arn, image_uri, s3_prefix)")
    sm, s3 = _clients(sm_params, sm, s3)
    with tempfile.TemporaryDirectory(prefix="tidespec-sm-") as tmp:
        inputs, hps = _job_inputs(params, Path(curated_json), init, Path(tmp) / "curated")
        job = launch(sm_params, inputs, hps, sm=sm, s3=s3)
    if on_launched:
        on_launched(job)
    desc = wait(job, sm, timeout_s=sm_params.wait_limit_s + WAIT_SLACK_S, poll_s=sm_params.poll_s)
    download_model(desc, s3, Path(out))
    return json.loads((Path(out) / "train_metrics.json").read_text())
