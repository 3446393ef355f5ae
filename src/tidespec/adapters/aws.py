"""The one adapter between tidespec and AWS, shared by SageMaker training, deployment and the
capture-object reader: boto3 clients (region and endpoint from the environment as boto3 resolves
them: AWS_ENDPOINT_URL for a moto server), SSE-S3 uploads with sha256 metadata, the poll loop of
long-running SageMaker resources, and the identifier validators (re-exported from
`config.sagemaker`, where the params schemas use them). boto3 is imported inside the functions that
call AWS. Raises AWSUnavailable (no boto3), ValueError (a bad S3 URI, ARN or name),
FileNotFoundError, WaitTimeout; botocore's ClientError passes through. The AWS documentation
followed: docs/design/adapters.md.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ..assets import sha256_file
from ..config.sagemaker import (  # noqa: F401 - the AWS identifier validators, re-exported here
    NAME_RE,
    ROLE_ARN_RE,
    S3_URI_RE,
    check_role_arn,
    is_name,
    parse_s3_uri,
)
from ..errors import Unavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

SSE = "AES256"
NOT_FOUND = ("404", "NoSuchKey", "NotFound")
INSTALL_HINT = "pip install 'tidespec[aws]'"


class AWSUnavailable(Unavailable):
    """boto3 is not installed; the message names the install command."""


class WaitTimeout(TimeoutError):
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
