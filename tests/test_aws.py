"""tidespec.adapters.aws: validators, SSE + sha256 uploads (on the moto server), the wait loop, boto3 absent."""
import hashlib
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tidespec.adapters import aws

ACCOUNT = "123456789012"


@pytest.mark.parametrize("arn", [
    f"arn:aws:iam::{ACCOUNT}:role/tidespec-sagemaker",
    f"arn:aws:iam::{ACCOUNT}:role/service-role/AmazonSageMaker-ExecutionRole-2026",
    f"arn:aws:iam::{ACCOUNT}:role/a/b/c/My_Role+=,.@-x",
    f"arn:aws-us-gov:iam::{ACCOUNT}:role/gov-role",
    f"arn:aws-cn:iam::{ACCOUNT}:role/cn/path/role",
    f"arn:aws-iso-b:iam::{ACCOUNT}:role/r",
    f"arn:aws:iam::{ACCOUNT}:role/" + "r" * 64,
])
def test_role_arn_accepts(arn):
    assert aws.check_role_arn(arn) == arn


@pytest.mark.parametrize("arn", [
    "tidespec-sagemaker",
    f"arn:aws:iam::{ACCOUNT}:role/",  # no name
    f"arn:aws:iam::{ACCOUNT}:role/path/",  # a path, no name
    f"arn:aws:iam::{ACCOUNT}:role/" + "r" * 65,  # name > 64 chars
    f"arn:aws:iam::{ACCOUNT}:user/alice",
    f"arn:aws:iam::{ACCOUNT}:role/has space",
    f"arn:aws:iam::{ACCOUNT}:role/x\n",
    f"arn:aws:iam::{ACCOUNT}:role/nämé",
    "arn:aws:iam::12345:role/short-account",
    f"arn:aws:s3::{ACCOUNT}:role/x",
    f"arn:gcp:iam::{ACCOUNT}:role/x",
])
def test_role_arn_rejects(arn):
    with pytest.raises(ValueError, match="not an IAM role ARN"):
        aws.check_role_arn(arn)


def test_names_and_s3_uris():
    assert aws.is_name("tidespec-draft-1") and aws.is_name("a" * 63) and aws.is_name("a--b")
    for bad in ("-a", "a-", "a_b", "a" * 64, "a\n", ""):
        assert not aws.is_name(bad), bad
    assert aws.parse_s3_uri("s3://tide-bucket/a/b/") == ("tide-bucket", "a/b/")
    assert aws.parse_s3_uri("s3://tide-bucket") == ("tide-bucket", "")
    for bad in ("tide-bucket/x", "s3://Tide_Bucket/x", "s3://a..b/x", "https://tide-bucket.s3.amazonaws.com/x"):
        with pytest.raises(ValueError, match="not an S3 URI"):
            aws.parse_s3_uri(bad)


@pytest.mark.services
def test_upload_sse_sha256_and_skip_unchanged(aws_env, tmp_path):
    import boto3

    s3 = boto3.client("s3")
    bucket = f"tide-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "w.bin").write_bytes(b"\x00\x01" * 5000)
    (src / "config.json").write_text("{}")
    (src / ".git").mkdir()
    (src / ".git" / "config").write_text("[core]\n")
    uri, n = aws.upload_dir(s3, src, f"s3://{bucket}/p", skip_hidden=True)
    assert (uri, n) == (f"s3://{bucket}/p/", 2)
    for rel in ("config.json", "sub/w.bin"):
        head = s3.head_object(Bucket=bucket, Key=f"p/{rel}")
        assert head["ServerSideEncryption"] == "AES256"
        assert head["Metadata"]["sha256"] == hashlib.sha256((src / rel).read_bytes()).hexdigest()
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix="p/")["Contents"]}
    assert keys == {"p/config.json", "p/sub/w.bin"}  # hidden dirs skipped

    # same bytes again: nothing sent; a changed sha is re-sent; skip_unchanged=False sends everything
    sha = aws.sha256_file(src / "config.json")
    assert aws.upload_files(s3, [(src / "config.json", "config.json", sha)], uri) == (uri, 0)
    (src / "config.json").write_text("[]")  # same size, other bytes
    new = aws.sha256_file(src / "config.json")
    assert aws.upload_files(s3, [(src / "config.json", "config.json", new)], uri) == (uri, 1)
    assert s3.head_object(Bucket=bucket, Key="p/config.json")["Metadata"]["sha256"] == new
    assert aws.upload_dir(s3, src, uri, skip_unchanged=False) == (uri, 3)  # .git included without skip_hidden
    with pytest.raises(FileNotFoundError, match="no such file"):
        aws.upload_files(s3, [(src / "missing", "missing")], uri)

    with pytest.raises(ValueError, match="does not exist or is not accessible.*fix deploy.sagemaker.s3_prefix"):
        aws.check_bucket(s3, f"s3://tide-missing-{uuid.uuid4().hex[:8]}/x", "deploy.sagemaker.s3_prefix")
    aws.check_bucket(s3, uri)
    assert aws.head_object(s3, bucket, "p/nope") is None


def test_wait_until_returns_raises_and_times_out():
    states = iter(["Creating", "Creating", "InService"])
    calls = []

    def describe():
        calls.append(1)
        return {"status": next(states)}
    slept = []
    desc = aws.wait_until(describe, lambda d: d["status"] == "InService", timeout_s=10, poll_s=0.5,
                          sleep=slept.append)
    assert desc == {"status": "InService"} and len(calls) == 3 and slept == [0.5, 0.5]

    def failing(d):
        raise RuntimeError("job Failed: OOM")
    with pytest.raises(RuntimeError, match="job Failed: OOM"):  # done() errors propagate
        aws.wait_until(lambda: {"status": "Failed"}, failing, timeout_s=1, poll_s=0.01)

    n = []
    with pytest.raises(aws.WaitTimeout, match=r"training job j1 still InProgress after 0.05s") as e:
        aws.wait_until(lambda: n.append(1) or {"status": "InProgress"}, lambda d: False, timeout_s=0.05,
                       poll_s=0.01, what="training job j1", state=lambda d: d["status"])
    assert isinstance(e.value, TimeoutError) and len(n) >= 2
    with pytest.raises(TimeoutError, match="custom: Updating after 0s"):
        aws.wait_until(lambda: {"status": "Updating"}, lambda d: False, timeout_s=0, poll_s=0.01,
                       timeout_message=lambda d, t: f"custom: {d['status']} after {t:g}s")


def test_missing_boto3_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "boto3", None)
    with pytest.raises(aws.AWSUnavailable, match=r"pip install 'tidespec\[aws\]'") as e:
        aws.client("s3")
    assert isinstance(e.value, RuntimeError)
    with pytest.raises(aws.AWSUnavailable):
        aws.default_region()


def test_modules_import_without_boto3():
    code = ("import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
            "import tidespec.adapters.aws, tidespec.config.sagemaker, tidespec.config\n"
            "import tidespec.train.sagemaker, tidespec.adapters.sagemaker_train, tidespec.adapters.sagemaker_deploy\n"
            "print('ok')")
    env = os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
