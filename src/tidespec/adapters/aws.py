"""The one adapter between tidespec and AWS, shared by SageMaker training (`sagemaker_train`),
deployment (`sagemaker_deploy`) and the capture-object reader (`s3_capture`).

What it holds: boto3 client construction, S3 URI parsing, SSE-S3 uploads with sha256 metadata,
the poll-until-done loop of long-running SageMaker resources, and the validators of the names
both sides send (IAM role ARNs, SageMaker resource names).

AWS documentation followed:
- S3 PutObject / upload_file: `ServerSideEncryption: AES256` (SSE-S3) on every object; user
  metadata `x-amz-meta-sha256` (boto3 `Metadata={"sha256": ...}`) holds the hex sha256 of the bytes;
  HeadObject reads it back (404 / NoSuchKey / NotFound → absent).
- IAM ARN format (IAM User Guide, "IAM identifiers"): `arn:<partition>:iam::<12-digit account>:
  role/<path/><name>`; partition aws, aws-cn, aws-us-gov, aws-iso*, ...; path ≤ 512 chars of
  ASCII ! .. ~; role name ≤ 64 chars of [A-Za-z0-9_+=,.@-].
- SageMaker API reference: TrainingJobName / EndpointName / ModelName / EndpointConfigName match
  `^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$`; DescribeTrainingJob / DescribeEndpoint are polled (no push).

Clients: region and endpoint come from the environment (AWS_REGION / AWS_DEFAULT_REGION / the
profile; AWS_ENDPOINT_URL or AWS_ENDPOINT_URL_<SERVICE>, e.g. a moto server in tests) exactly as
boto3 resolves them; nothing is hard-coded. boto3 / botocore are imported lazily, inside the
functions that call AWS, so importing this module (and the SageMaker modules) works without them.

The pure identifier validators (ROLE_ARN_RE, NAME_RE, parse_s3_uri, check_role_arn, is_name) are
defined in `tidespec.config.sagemaker`, the bottom layer, so the params schemas use them without
importing this adapter; they are re-exported here, the one place callers take them from.

Errors raised: AWSUnavailable (a RuntimeError: boto3 not installed), ValueError (bad S3 URI, bad
ARN / name, missing bucket), FileNotFoundError (missing local dir or file), WaitTimeout (a
TimeoutError: a resource did not settle in time), botocore ClientError passed through otherwise.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..assets import sha256_file
from ..errors import Unavailable
from ..config.sagemaker import (  # noqa: F401 - the AWS identifier validators, re-exported here
    NAME_RE,
    ROLE_ARN_RE,
    S3_URI_RE,
    check_role_arn,
    is_name,
    parse_s3_uri,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

SSE = "AES256"
NOT_FOUND = ("404", "NoSuchKey", "NotFound")
INSTALL_HINT = "pip install 'tidespec[aws]'"


class AWSUnavailable(Unavailable):  # noqa: N818 — the name says what happened
    """boto3 is not installed; the message names the install command."""


class WaitTimeout(TimeoutError):  # noqa: N818
    """A polled AWS resource did not reach its done state within the timeout."""


# -- errors ---------------------------------------------------------------------------------------
def is_not_found(err: Exception) -> bool:
    """Whether a botocore ClientError is S3's "no such object" (404 / NoSuchKey / NotFound)."""
    resp = getattr(err, "response", None) or {}
    return resp.get("Error", {}).get("Code") in NOT_FOUND


# -- clients --------------------------------------------------------------------------------------
def _boto3():
    try:
        import boto3
    except ImportError as e:  # also when sys.modules["boto3"] is None
        raise AWSUnavailable(f"boto3 is not installed; the AWS features need it: {INSTALL_HINT}") from e
    return boto3


def client(service: str, region: str | None = None) -> Any:
    """A boto3 client for `service` ("s3", "sagemaker", "cloudwatch", ...). `region` None → the
    environment's (AWS_REGION / AWS_DEFAULT_REGION / profile); the endpoint comes from
    AWS_ENDPOINT_URL[_<SERVICE>] when set (as boto3 resolves it). Raises AWSUnavailable without boto3."""
    return _boto3().client(service, region_name=region)


def default_region() -> str | None:
    """The region boto3 would use (AWS_REGION / AWS_DEFAULT_REGION / profile), or None. Raises
    AWSUnavailable without boto3."""
    return _boto3().session.Session().region_name


# -- S3 -------------------------------------------------------------------------------------------
def dir_files(root: Path, skip_hidden: bool = False) -> Iterator[tuple[Path, str]]:
    """(path, posix path relative to `root`) of every file below `root`, symlinked dirs followed,
    sorted per dir; `skip_hidden` drops files under or named `.*` (.git, .cache)."""
    root = Path(root)
    for d, dirs, names in os.walk(root, followlinks=True):
        dirs.sort()
        if skip_hidden:
            dirs[:] = [x for x in dirs if not x.startswith(".")]
        for n in sorted(names):
            if skip_hidden and n.startswith("."):
                continue
            p = Path(d) / n
            yield p, p.relative_to(root).as_posix()


def head_object(s3, bucket: str, key: str) -> dict | None:
    """HeadObject's response, or None when the object does not exist. Raises other ClientErrors."""
    try:
        return s3.head_object(Bucket=bucket, Key=key)
    except Exception as e:
        if is_not_found(e):
            return None
        raise


def check_bucket(s3, s3_uri: str, setting: str = "s3_prefix") -> None:
    """Raise ValueError naming the fix (create it, or fix params `setting`) when the bucket of
    `s3_uri` is missing or not accessible with these credentials."""
    from botocore.exceptions import ClientError
    bucket, _ = parse_s3_uri(s3_uri)
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as e:
        raise ValueError(f"S3 bucket {bucket} does not exist or is not accessible with these credentials "
                         f"({e.response.get('Error', {}).get('Code')}): create it (infra/cloudformation/"
                         f"tidespec-sagemaker.yaml) or fix {setting}") from None


def upload_files(s3, files: Iterable[tuple[Path, str] | tuple[Path, str, str | None]], uri: str,
                 skip_unchanged: bool = True) -> tuple[str, int]:
    """Upload (local path, relative key[, hex sha256 or None]) below prefix `uri`, each object with
    SSE-S3 (AES256) and metadata sha256 = the file's hex sha256 (computed when not given).
    `skip_unchanged`: an object already there is kept when its sha256 metadata equals the given
    sha and its size the file's; without a given sha, when its size does (for prefixes whose key
    already names the content, e.g. a weights hash; nothing is hashed then). False: no HeadObject
    calls, everything is sent (a fresh prefix). Returns (prefix URI ending '/', files uploaded).
    Raises ValueError (bad URI), FileNotFoundError (missing file), botocore errors."""
    bucket, key = parse_s3_uri(uri)
    key = key.strip("/") + "/" if key.strip("/") else ""
    n = 0
    for item in files:
        path, rel = Path(item[0]), item[1]
        sha = item[2] if len(item) > 2 else None
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file to upload")
        if skip_unchanged:
            head = head_object(s3, bucket, key + rel)
            if head is not None and head.get("ContentLength") == path.stat().st_size \
                    and (sha is None or head.get("Metadata", {}).get("sha256") == sha):
                continue
        s3.upload_file(str(path), bucket, key + rel, ExtraArgs={
            "ServerSideEncryption": SSE, "Metadata": {"sha256": sha or sha256_file(path)}})
        n += 1
    return f"s3://{bucket}/{key}", n


def upload_dir(s3, local_dir: Path, uri: str, skip_hidden: bool = False,
               skip_unchanged: bool = True) -> tuple[str, int]:
    """Upload every file below `local_dir` (symlinked dirs followed) to prefix `uri`, keeping
    relative paths, as `upload_files`. Returns (prefix URI ending '/', files uploaded). Raises
    FileNotFoundError for a missing dir, ValueError for one without files or a bad URI."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise FileNotFoundError(f"input dir {local_dir} does not exist")
    files = list(dir_files(local_dir, skip_hidden))
    if not files:
        raise ValueError(f"input dir {local_dir} holds no files; nothing to upload")
    return upload_files(s3, files, uri, skip_unchanged)


# -- waiting --------------------------------------------------------------------------------------
def wait_until(describe: Callable[[], T], done: Callable[[T], bool], timeout_s: float, poll_s: float,
               what: str = "resource", state: Callable[[T], str] | None = None,
               timeout_message: Callable[[T, float], str] | None = None,
               sleep: Callable[[float], None] = time.sleep) -> T:
    """Call `describe()` every `poll_s` s until `done(desc)` is True; returns that description.
    `done` may raise (a failed job / endpoint) and that error propagates. `state(desc)` is logged
    (INFO, "<what>: <state>") when it changes. Gives up before a sleep that would end past
    `timeout_s` s: raises WaitTimeout with `timeout_message(last_desc, timeout_s)` (default names
    `what` and the last state); the resource itself keeps going on AWS."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        desc = describe()
        if done(desc):
            return desc
        now_state = state(desc) if state else None
        if now_state != last:
            last = now_state
            log.info("%s: %s", what, now_state)
        if time.monotonic() + poll_s > deadline:
            msg = (timeout_message(desc, timeout_s) if timeout_message
                   else f"{what} still {last or 'not done'} after {timeout_s:g}s")
            raise WaitTimeout(msg)
        sleep(poll_s)
