"""SageMaker training launcher against a real moto server (S3 + SageMaker API on 127.0.0.1).

moto 5.2.5 records CreateTrainingJob and marks the job Completed at once (ModelArtifacts at
<S3OutputPath>/<job>/output/model.tar.gz, nothing written there); it runs no container, drops
`Environment`, has no StopTrainingJob (HTTP 500) and never reports InProgress/Failed/Stopped.
So: the container is emulated as SageMaker local mode would run it (channels downloaded from moto
S3 into an /opt/ml-like tree, `container_main` run, model.tar.gz put where moto says); the
Stopped/Failed/InProgress paths of `wait` use the real moto client with a botocore `after-call`
handler rewriting the status of the parsed DescribeTrainingJob response (the only piece not served
by moto, named where used).
"""
import hashlib
import io
import json
import os
import re
import tarfile
import time
import uuid
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from pydantic import ValidationError

from conftest import make_tiny_workspace
from tidespec.adapters.aws import NAME_RE, WaitTimeout, upload_dir
from tidespec.adapters.sagemaker_train import (
    SageMakerTrainingFailed,
    TrainingJob,
    download_model,
    job_name,
    launch,
    train_on_sagemaker,
    training_job_request,
    wait,
)
from tidespec.config.sagemaker import SageMakerTrainParams
from tidespec.train.sagemaker import container_main

pytestmark = pytest.mark.services
ROLE = "arn:aws:iam::123456789012:role/tidespec-sagemaker"
IMAGE = "123456789012.dkr.ecr.us-east-1.amazonaws.com/tidespec-train:0.1.0"


def _params(bucket: str = "tide-bucket", **kw) -> SageMakerTrainParams:
    return SageMakerTrainParams(role_arn=ROLE, image_uri=IMAGE, s3_prefix=f"s3://{bucket}/drafts", **kw)


def _bucket() -> str:
    name = f"tide-{uuid.uuid4().hex[:12]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _split(uri: str) -> tuple[str, str]:
    b, _, k = uri.removeprefix("s3://").partition("/")
    return b, k


def _download_prefix(s3, uri: str, dest: Path) -> None:
    """What SageMaker does for a File-mode S3Prefix channel: every object below the prefix → dest."""
    bucket, prefix = _split(uri)
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for o in page.get("Contents", []):
            p = dest / o["Key"][len(prefix):]
            p.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, o["Key"], str(p))


def _put_tar(s3, uri: str, add) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        add(tar)
    s3.put_object(Bucket=_split(uri)[0], Key=_split(uri)[1], Body=buf.getvalue())


# -- request / config (pure) ---------------------------------------------------------------------
def test_request_gpu_exact():
    p = _params()
    req = training_job_request("tidespec-draft-1", p, {"curated": "s3://tide-bucket/drafts/j/input/curated/"},
                               {"params": "{}", "curated": "curated.json"}, "s3://tide-bucket/drafts/j/checkpoints/")
    assert req == {
        "TrainingJobName": "tidespec-draft-1",
        "AlgorithmSpecification": {"TrainingImage": IMAGE, "TrainingInputMode": "File"},
        "RoleArn": ROLE,
        "InputDataConfig": [{"ChannelName": "curated", "DataSource": {"S3DataSource": {
            "S3DataType": "S3Prefix", "S3Uri": "s3://tide-bucket/drafts/j/input/curated/",
            "S3DataDistributionType": "FullyReplicated"}}}],
        "OutputDataConfig": {"S3OutputPath": "s3://tide-bucket/drafts"},
        "ResourceConfig": {"InstanceType": "ml.g5.2xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50},
        "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
        "EnableManagedSpotTraining": False,
        "CheckpointConfig": {"S3Uri": "s3://tide-bucket/drafts/j/checkpoints/", "LocalPath": "/opt/ml/checkpoints"},
        "HyperParameters": {"params": "{}", "curated": "curated.json"},
        "Environment": {"PYTHONUNBUFFERED": "1"},
        "Tags": [{"Key": "project", "Value": "tidespec"}],
    }


def test_request_trn1_spot():
    p = _params(instance_type="ml.trn1.32xlarge", instance_count=2, distribution="torch_distributed",
                volume_gb=200, max_runtime_s=7200, use_spot=True, max_wait_s=10800,
                environment={"NEURON_CC_FLAGS": "--model-type=transformer"}, tags={"team": "spec"})
    req = training_job_request("j-2", p, {"curated": "s3://tide-bucket/a/", "init": "s3://tide-bucket/b/"},
                               {}, "s3://tide-bucket/c/")
    assert req["ResourceConfig"] == {"InstanceType": "ml.trn1.32xlarge", "InstanceCount": 2, "VolumeSizeInGB": 200}
    assert req["HyperParameters"] == {"distribution": "torch_distributed"}  # the container runs torchrun
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 10800}
    assert req["EnableManagedSpotTraining"] is True
    assert [c["ChannelName"] for c in req["InputDataConfig"]] == ["curated", "init"]
    assert req["Environment"] == {"PYTHONUNBUFFERED": "1", "NEURON_CC_FLAGS": "--model-type=transformer"}
    assert req["Tags"] == [{"Key": "project", "Value": "tidespec"}, {"Key": "team", "Value": "spec"}]
    # spot without max_wait_s: the wait bound is the runtime bound
    spot = training_job_request("j-3", _params(use_spot=True, max_runtime_s=600), {"c": "s3://tide-bucket/a/"},
                                {}, "s3://tide-bucket/c/")
    assert spot["StoppingCondition"] == {"MaxRuntimeInSeconds": 600, "MaxWaitTimeInSeconds": 600}


def test_the_shipped_params_fit_one_hyperparameter_and_come_back_for_training():
    """params.yaml as shipped travels as the `params` hyperparameter (≤ 2,500 characters a value):
    the sections a training job never reads (serve, deploy) stay behind, the rest comes back equal."""
    from tidespec.adapters.sagemaker_train import UNUSED_IN_TRAINING, params_json
    from tidespec.config import load_params
    from tidespec.train.sagemaker import container_params
    shipped = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    sent = params_json(shipped)
    assert len(sent) <= 2500 and not set(UNUSED_IN_TRAINING) & set(json.loads(sent)), len(sent)
    back = container_params({"params": sent}, None).model_dump(mode="json")
    want = shipped.model_dump(mode="json")
    for section in set(want) - set(UNUSED_IN_TRAINING) - {"train"}:
        assert back[section] == want[section], section
    assert {k: v for k, v in back["train"].items() if k != "sagemaker"} == \
        {k: v for k, v in want["train"].items() if k != "sagemaker"}


def test_hyperparameter_limits():
    p, ins, ck = _params(), {"curated": "s3://tide-bucket/a/"}, "s3://tide-bucket/c/"
    ok = training_job_request("j", p, ins, {"k" * 256: "v" * 2500}, ck)
    assert ok["HyperParameters"] == {"k" * 256: "v" * 2500}
    with pytest.raises(ValueError, match="hyperparameter 'params': value is 2501 chars.*at most 2500"):
        training_job_request("j", p, ins, {"params": "x" * 2501}, ck)
    with pytest.raises(ValueError, match="hyperparameter key 'kkkk.*1..256 chars"):
        training_job_request("j", p, ins, {"k" * 257: "v"}, ck)
    with pytest.raises(ValueError, match="hyperparameter 'epochs': value must be a str, got int"):
        training_job_request("j", p, ins, {"epochs": 3}, ck)
    with pytest.raises(ValueError, match="101 hyperparameters"):
        training_job_request("j", p, ins, {f"k{i}": "v" for i in range(101)}, ck)
    with pytest.raises(ValueError, match="channel name 'bad/name'"):
        training_job_request("j", p, {"bad/name": "s3://tide-bucket/a/"}, {}, ck)


@pytest.mark.parametrize("field,value,msg", [
    ("s3_prefix", "tide-bucket/drafts", "not an S3 URI"),
    ("s3_prefix", "s3://Tide_Bucket/drafts", "not an S3 URI"),
    ("s3_prefix", "https://tide-bucket.s3.amazonaws.com/x", "not an S3 URI"),
    ("instance_type", "g5.2xlarge", "not a SageMaker instance type"),
    ("instance_type", "ml.g5", "not a SageMaker instance type"),
    ("role_arn", "tidespec-role", "not an IAM role ARN"),
    ("instance_count", 0, "greater than or equal to 1"),
    ("max_wait_s", 100000, "applies to spot training only"),
    ("surprise", 1, "Extra inputs are not permitted"),
])
def test_params_validation(field, value, msg):
    kw = {"role_arn": ROLE, "image_uri": IMAGE, "s3_prefix": "s3://tide-bucket/drafts", field: value}
    with pytest.raises(ValidationError, match=msg):
        SageMakerTrainParams(**kw)


def test_params_spot_wait_and_normalisation():
    with pytest.raises(ValidationError, match=r"max_wait_s \(3600\) must be >= max_runtime_s \(7200\)"):
        _params(use_spot=True, max_runtime_s=7200, max_wait_s=3600)
    p = SageMakerTrainParams(role_arn=ROLE, image_uri=IMAGE, s3_prefix="s3://tide-bucket/drafts/")
    assert p.s3_prefix == "s3://tide-bucket/drafts" and p.instance_type == "ml.g5.2xlarge" and p.wait_limit_s == 86400
    assert _params(instance_type="ml.p5.48xlarge").instance_type == "ml.p5.48xlarge"
    from tidespec.config.strict import Strict
    assert SageMakerTrainParams.model_config == Strict.model_config  # same strictness as params.yaml's models
    q = _params(tags={"team": "spec"}, environment={"A": "1"})  # mappings in params.yaml, stored as pairs
    assert q.tags == (("team", "spec"),) and hash(q) == hash(
        SageMakerTrainParams.model_validate_json(q.model_dump_json())
    )
    with pytest.raises(ValidationError, match="environment 'bad-key'"):
        _params(environment={"bad-key": "1"})


def test_job_name():
    names = {job_name() for _ in range(50)}
    assert len(names) == 50
    assert all(NAME_RE.fullmatch(n) and n.startswith("tidespec-draft-") for n in names)
    odd = job_name("--My_Team's draft/" + "x" * 80)
    assert NAME_RE.fullmatch(odd) and len(odd) <= 63 and odd.startswith("My-Team-s-draft-")
    assert re.fullmatch(r"tidespec-draft-\d{8}-\d{6}-[0-9a-f]{6}", job_name())
    for bad in ("-lead", "trail-", "has_underscore", "x" * 64):
        with pytest.raises(ValueError, match="must match"):
            training_job_request(bad, _params(), {"c": "s3://tide-bucket/a/"}, {}, "s3://tide-bucket/c/")


# -- against moto ----------------------------------------------------------------------------------
def test_launch_uploads_and_creates_job(aws_env, tmp_path):
    bucket = _bucket()
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "snap" / "shards").mkdir(parents=True)
    (a / "curated.json").write_text('{"train": []}')
    (a / "snap" / "shards" / "000.bin").write_bytes(os.urandom(70000))
    b.mkdir()
    (b / "model.safetensors").write_bytes(os.urandom(1234))
    p = _params(bucket, instance_type="ml.trn1.2xlarge")
    job = launch(p, {"curated": a, "init": b}, {"params": '{"x":1}'})
    assert isinstance(job, TrainingJob) and NAME_RE.fullmatch(job.name)
    base = f"s3://{bucket}/drafts/{job.name}"
    assert job.checkpoint_s3 == f"{base}/checkpoints/" and job.output_s3 == f"{base}/output/model.tar.gz"

    sm, s3 = boto3.client("sagemaker"), boto3.client("s3")
    d = sm.describe_training_job(TrainingJobName=job.name)
    assert d["TrainingJobArn"] == job.arn and job.arn.endswith(f":training-job/{job.name}")
    assert d["ResourceConfig"] == {"InstanceType": "ml.trn1.2xlarge", "InstanceCount": 1, "VolumeSizeInGB": 50}
    assert d["AlgorithmSpecification"]["TrainingImage"] == IMAGE and d["RoleArn"] == ROLE
    assert {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in d["InputDataConfig"]} == {
        "curated": f"{base}/input/curated/", "init": f"{base}/input/init/"}
    assert d["HyperParameters"] == {"params": '{"x":1}'}
    assert d["CheckpointConfig"] == {"S3Uri": f"{base}/checkpoints/", "LocalPath": "/opt/ml/checkpoints"}
    assert d["ModelArtifacts"]["S3ModelArtifacts"] == job.output_s3  # moto: <S3OutputPath>/<job>/output/model.tar.gz

    for ch, local in (("curated", a), ("init", b)):
        prefix = f"drafts/{job.name}/input/{ch}/"
        keys = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"])
        want = _files(local)
        assert keys == sorted(prefix + k for k in want)
        for k, data in want.items():
            head = s3.head_object(Bucket=bucket, Key=prefix + k)
            assert head["ServerSideEncryption"] == "AES256"
            assert head["Metadata"]["sha256"] == hashlib.sha256(data).hexdigest()
            assert s3.get_object(Bucket=bucket, Key=prefix + k)["Body"].read() == data


def test_upload_dir_errors(aws_env, tmp_path):
    s3 = boto3.client("s3")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        upload_dir(s3, tmp_path / "nope", "s3://tide-bucket/x/")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        upload_dir(s3, tmp_path / "empty", f"s3://{_bucket()}/x/")


def test_train_on_sagemaker_end_to_end(aws_env, tmp_path, tiny_target_dir, monkeypatch):
    """Launch → (container emulated like local mode, from what moto stored) → wait → download."""
    from tidespec.steps.cycle import step_curate

    (tmp_path / "ws").mkdir()
    ws, params, target = make_tiny_workspace(tmp_path / "ws", tiny_target_dir, n_requests=6, champion=True)
    cur = step_curate(ws, params, target.target_id)
    assert cur["num_train"] > 0
    bucket = _bucket()
    s3 = boto3.client("s3")
    opt = tmp_path / "opt-ml"
    seen = {}

    def container(job: TrainingJob):
        d = boto3.client("sagemaker").describe_training_job(TrainingJobName=job.name)
        seen["channels"] = sorted(c["ChannelName"] for c in d["InputDataConfig"])
        for c in d["InputDataConfig"]:
            _download_prefix(s3, c["DataSource"]["S3DataSource"]["S3Uri"], opt / "input" / "data" / c["ChannelName"])
            monkeypatch.setenv(f"SM_CHANNEL_{c['ChannelName'].upper()}", str(opt / "input" / "data" / c["ChannelName"]))
        (opt / "input" / "config").mkdir(parents=True)
        (opt / "input" / "config" / "hyperparameters.json").write_text(json.dumps(d["HyperParameters"]))
        (opt / "checkpoints").mkdir()
        monkeypatch.delenv("SM_HPS", raising=False)
        for k, v in {"SM_INPUT_CONFIG_DIR": opt / "input" / "config", "SM_MODEL_DIR": opt / "model",
                     "SM_OUTPUT_DIR": opt / "output", "TIDESPEC_SM_CHECKPOINT_DIR": opt / "checkpoints"}.items():
            monkeypatch.setenv(k, str(v))
        seen["rc"] = container_main(["train"])
        _put_tar(s3, d["ModelArtifacts"]["S3ModelArtifacts"],
                 lambda tar: [tar.add(p, arcname=p.name) for p in sorted((opt / "model").iterdir())])

    out = tmp_path / "candidate"
    metrics = train_on_sagemaker(params, ws.curated, ws.champion, out, sm_params=_params(bucket, poll_s=0.2),
                                 on_launched=container)
    assert seen["rc"] == 0, (opt / "output" / "failure").read_text()
    assert seen["channels"] == ["curated", "init", "target"]  # tiny target is a local dir → shipped as a channel
    written = _files(opt / "model")
    assert {"config.json", "model.safetensors", "train_metrics.json"} <= set(written)
    assert _files(out) == written  # byte-identical to what the container wrote
    assert metrics == json.loads(written["train_metrics.json"])
    assert metrics["train_examples"] > 0 and metrics["resumed_from_step"] == 0 and len(metrics["train/loss"]) > 0
    warm = json.loads(written["config.json"])["tidespec"]["warm_start"]
    assert warm == str(opt / "input" / "data" / "init")  # warm-started from the init channel
    # the curated channel holds the index at its relative path, plus the snapshots it names, no holdout
    staged = opt / "input" / "data" / "curated"
    assert (staged / "work" / "curated.json").read_bytes() == ws.curated.read_bytes()
    assert not list(staged.rglob("holdout.jsonl"))
    idx = json.loads(ws.curated.read_text())
    assert all((staged / "work" / s).is_dir() for s in idx["snapshots"])
    assert not (opt / "checkpoints" / "model.train-state").exists()  # finished run: resume state cleared
    from tidespec.models.eagle3 import load_checkpoint
    assert load_checkpoint(out, target.embed, target.target_id) is not None


def test_container_failure_file(tmp_path, monkeypatch):
    (tmp_path / "curated").mkdir()
    (tmp_path / "curated" / "curated.json").write_text("{}")
    for k, v in {"SM_CHANNEL_CURATED": tmp_path / "curated", "SM_MODEL_DIR": tmp_path / "model",
                 "SM_OUTPUT_DIR": tmp_path / "output", "TIDESPEC_SM_CHECKPOINT_DIR": tmp_path / "none"}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.setenv("SM_HPS", json.dumps({"params": {"train": {"epochz": 1}}}))
    assert container_main([]) == 1
    failure = (tmp_path / "output" / "failure").read_text()
    assert failure.startswith("ValidationError") and "epochz" in failure
    monkeypatch.setenv("SM_HPS", json.dumps({"params": "{}", "curated": "../../etc/passwd"}))
    assert container_main(["train"]) == 1
    assert "not in channel" in (tmp_path / "output" / "failure").read_text()
    assert container_main(["serve"]) == 2


def _status_override(sm, status: str, reason: str | None = None):
    """Rewrite the parsed DescribeTrainingJob response of a real moto call (moto only reports Completed)."""
    calls = []

    def hook(parsed, **_):
        calls.append(parsed["TrainingJobName"])
        parsed.update(
            {"TrainingJobStatus": status, "SecondaryStatus": "Training" if status == "InProgress" else status}
        )
        parsed.pop("FailureReason", None)
        if reason:
            parsed["FailureReason"] = reason
    sm.meta.events.register("after-call.sagemaker.DescribeTrainingJob", hook)
    return calls


def _moto_job(tmp_path) -> tuple[TrainingJob, SageMakerTrainParams]:
    d = tmp_path / "in"
    d.mkdir(exist_ok=True)
    (d / "f").write_text("x")
    p = _params(_bucket())
    return launch(p, {"curated": d}, {}), p


def test_wait_completed_stopped_failed_timeout(aws_env, tmp_path):
    job, _ = _moto_job(tmp_path)
    assert wait(job, boto3.client("sagemaker"), timeout_s=5, poll_s=0.1)["TrainingJobStatus"] == "Completed"

    with pytest.raises(Exception, match="StopTrainingJob"):  # moto 5.2.5 has no StopTrainingJob (HTTP 500)
        boto3.client("sagemaker", config=Config(retries={"max_attempts": 1})).stop_training_job(
            TrainingJobName=job.name
        )

    sm = boto3.client("sagemaker")
    _status_override(sm, "Stopped")
    with pytest.raises(
        SageMakerTrainingFailed, match=rf"{job.name} Stopped.*StopTrainingJob.*/aws/sagemaker/TrainingJobs"
    ):
        wait(job, sm, timeout_s=5, poll_s=0.1)

    sm = boto3.client("sagemaker")
    _status_override(sm, "Failed", "AlgorithmError: CUDA out of memory")
    with pytest.raises(SageMakerTrainingFailed, match=rf"{job.name} Failed.*AlgorithmError: CUDA out of memory"):
        wait(job.name, sm, timeout_s=5, poll_s=0.1)

    sm = boto3.client("sagemaker")
    calls = _status_override(sm, "InProgress")
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout, match=rf"{job.name} still InProgress after 0.5s.*StopTrainingJob"):
        wait(job, sm, timeout_s=0.5, poll_s=0.1)
    # it waited the timeout out, polling the one job (how many polls fit depends on moto's speed: not asserted)
    assert 0.3 < time.monotonic() - t0 < 30 and len(calls) >= 1 and set(calls) == {job.name}


def test_download_model_missing_and_unsafe(aws_env, tmp_path):
    job, _ = _moto_job(tmp_path)
    s3, desc = boto3.client("s3"), boto3.client("sagemaker").describe_training_job(TrainingJobName=job.name)
    key = _split(job.output_s3)[1]
    with pytest.raises(FileNotFoundError, match=re.escape(key)):
        download_model(desc, s3, tmp_path / "dest")

    def evil(tar):
        for name in ("config.json", "../evil"):
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    _put_tar(s3, job.output_s3, evil)
    with pytest.raises(ValueError, match=r"unsafe member '\.\./evil'"):
        download_model(desc, s3, tmp_path / "dest")
    assert not (tmp_path / "evil").exists() and not (tmp_path / "dest" / "config.json").exists()

    def link(tar):
        info = tarfile.TarInfo("model.safetensors")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    _put_tar(s3, job.output_s3, link)
    with pytest.raises(ValueError, match="unsafe member 'model.safetensors'"):
        download_model(desc, s3, tmp_path / "dest")


def test_instances_need_torch_distributed():
    with pytest.raises(ValidationError, match="distribution: torch_distributed"):
        _params(instance_count=2)
    from tidespec.config import TrainParams
    with pytest.raises(ValidationError, match="instance_count"):
        TrainParams(nnodes=2, rdzv_endpoint="h:1",
                    sagemaker=_params(instance_count=2, distribution="torch_distributed"))


def test_two_instances_train_as_torchrun_ranks(tmp_path, tiny_target_dir):
    """Two emulated instances of one torch_distributed job (two container processes on this
    machine, each with its own /opt/ml and SageMaker's resourceconfig.json): the containers start
    torchrun over the job's hosts, global rank 0 (on the first host) writes the model, the other
    instance's model dir stays empty."""
    import subprocess
    import sys

    from tidespec.adapters.sagemaker_train import params_json, stage_curated
    from tidespec.steps.cycle import step_curate
    from tidespec.train.sagemaker import rank_command
    (tmp_path / "ws").mkdir()
    ws, params, target = make_tiny_workspace(tmp_path / "ws", tiny_target_dir, n_requests=8)
    step_curate(ws, params, target.target_id)
    rel = stage_curated(ws.curated, tmp_path / "curated")
    hosts = ["127.0.0.1", "localhost"]  # two names of this machine: two "instances"
    hps = {"params": params_json(params), "curated": rel, "distribution": "torch_distributed"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    for host in hosts:
        opt = tmp_path / f"opt-{host}"
        (opt / "config").mkdir(parents=True)
        (opt / "config" / "hyperparameters.json").write_text(json.dumps(hps))
        (opt / "config" / "resourceconfig.json").write_text(json.dumps({"current_host": host, "hosts": hosts}))
        e = env | {"SM_CHANNEL_CURATED": str(tmp_path / "curated"), "SM_INPUT_CONFIG_DIR": str(opt / "config"),
                   "SM_MODEL_DIR": str(opt / "model"), "SM_OUTPUT_DIR": str(opt / "output"),
                   "TIDESPEC_SM_CHECKPOINT_DIR": str(opt / "checkpoints"), "OMP_NUM_THREADS": "1"}
        (opt / "checkpoints").mkdir()
        cmd = rank_command(e, hps, params)
        assert cmd[cmd.index("--node-rank") + 1] == str(hosts.index(host))
        assert cmd[cmd.index("--master-addr") + 1] == "127.0.0.1" and cmd[cmd.index("--nnodes") + 1] == "2"
        procs.append(subprocess.Popen([sys.executable, "-m", "tidespec.train.sagemaker", "train"], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    lead, other = tmp_path / "opt-127.0.0.1" / "model", tmp_path / "opt-localhost" / "model"
    m = json.loads((lead / "train_metrics.json").read_text())
    assert m["train_world_size"] == 2 and m["train_examples"] > 0
    assert (lead / "model.safetensors").exists() and not (other.exists() and any(other.iterdir()))


def test_dry_run_prints_the_distributed_request_moto_accepts(aws_env, tmp_path, tiny_target_dir):
    """`tidespec stage train --dry-run` prints the CreateTrainingJob request (2 instances,
    torch_distributed) without uploading or calling anything; moto's SageMaker accepts it as is.
    Without train.sagemaker and with 2 ranks it prints the torchrun command instead."""
    import yaml
    from typer.testing import CliRunner

    from tidespec.cli import app
    from tidespec.steps.cycle import step_curate
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir, n_requests=6)
    step_curate(ws, params, target.target_id)
    bucket = _bucket()
    raw = yaml.safe_load((tmp_path / "params.yaml").read_text())
    raw["train"] |= {"nproc_per_node": 4, "sagemaker": {"role_arn": ROLE, "image_uri": IMAGE, "s3_prefix":
                     f"s3://{bucket}/drafts", "instance_count": 2, "distribution": "torch_distributed"}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    args = ["stage", "train", "--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"), "--dry-run"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    plan = json.loads(r.output)
    req = plan["request"]
    assert plan["route"] == "sagemaker" and req["ResourceConfig"]["InstanceCount"] == 2
    assert req["HyperParameters"]["distribution"] == "torch_distributed"
    assert json.loads(req["HyperParameters"]["params"])["train"]["nproc_per_node"] == 4
    assert not boto3.client("s3").list_objects_v2(Bucket=bucket).get("Contents")  # nothing uploaded
    sm = boto3.client("sagemaker")
    sm.create_training_job(**req)
    d = sm.describe_training_job(TrainingJobName=req["TrainingJobName"])
    assert d["ResourceConfig"]["InstanceCount"] == 2 and d["HyperParameters"]["distribution"] == "torch_distributed"
    del raw["train"]["sagemaker"]
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    plan = json.loads(CliRunner().invoke(app, args).output)
    assert plan["route"] == "torchrun" and plan["world_size"] == 4
    assert plan["command"][plan["command"].index("--nproc-per-node") + 1] == "4"
    assert not ws.candidate.exists()


def test_container_rank_command_cases(tmp_path):
    """The container's torchrun: none for one rank, for a rank itself or for SpecForge (which
    launches its own ranks); a restart budget valid for the job is valid in its container."""
    from tidespec.config import Params
    from tidespec.train.sagemaker import container_params, rank_command
    env = {"SM_HOSTS": '["algo-2", "algo-1"]', "SM_CURRENT_HOST": "algo-2"}
    dist = {"distribution": "torch_distributed"}
    sm = {"role_arn": ROLE, "image_uri": IMAGE, "s3_prefix": "s3://tide-bucket/p", "instance_count": 2,
          "distribution": "torch_distributed"}
    raw = {"target": {"source": "smollm2"}, "train": {"max_restarts": 2, "sagemaker": sm}}
    Params.model_validate(raw)  # the launcher's check: 2 instances, so restarts make sense
    p = container_params({"params": json.dumps(raw)}, None)
    assert p.train.max_restarts == 2 and p.train.sagemaker is None
    cmd = rank_command(env, dist, p)
    assert cmd[cmd.index("--node-rank") + 1] == "1" and cmd[cmd.index("--master-addr") + 1] == "algo-1"
    assert cmd[cmd.index("--max-restarts") + 1] == "2"
    assert rank_command(env | {"WORLD_SIZE": "2"}, dist, p) is None  # already a rank
    assert rank_command(env, {}, p) is None  # one instance, one rank: train in the process
    spec = p.model_copy(update={"train": p.train.model_copy(update={"backend": "specforge", "nproc_per_node": 4})})
    assert rank_command(env, dist, spec) is None
