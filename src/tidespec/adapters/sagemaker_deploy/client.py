"""Deploy the champion draft to a SageMaker real-time endpoint, blue/green (`deploy_endpoint`).

One deploy: check and upload the draft (content-addressed, SSE-S3), CreateModel (the target's
weights as ModelDataSource, the draft as an AdditionalModelDataSources channel), CreateEndpointConfig,
the two auto-rollback alarms (Invocation5XXErrors, ModelLatency p99), CreateEndpoint or UpdateEndpoint
with a blue/green policy (canary with ≥ 2 instances), wait until InService on the new config, prune
older configs. A rollback leaves the old config serving and raises SageMakerDeployFailed; a deploy
of an endpoint already busy waits (a file lock per endpoint). The requests themselves are
`plan`'s. Profiles, the container conventions and the API sources: docs/design/adapters.md.
"""
from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from datetime import datetime
from pathlib import Path

from ...assets import sha256_file
from ...config import Params
from ...config.sagemaker import SageMakerDeployParams
from .. import aws
from .plan import (
    DeployPlan,
    DraftArtifact,
    SageMakerDeployFailed,
    endpoint_name,
    endpoint_outcome,
    plan,
    private_copy,
    resolve_target,
    target_prefix,
    update_request,
)

log = logging.getLogger(__name__)



def upload_draft(s3, draft: DraftArtifact, s3_prefix: str) -> tuple[str, int]:
    """config.json + model.safetensors → `<s3_prefix>/drafts/<draft.key>/` (SSE-S3, sha256 in object
    metadata; objects already there with the same sha256 are kept). Returns (prefix URI, uploaded)."""
    files = [
        (draft.path / "config.json", "config.json", draft.config_sha256 or sha256_file(draft.path / "config.json")),
        (draft.path / "model.safetensors", "model.safetensors", draft.sha256),
    ]
    return aws.upload_files(s3, files, f"{s3_prefix}/drafts/{draft.key}/")


def upload_target(s3, target_dir: Path, s3_prefix: str, target_id: str) -> tuple[str, int]:
    """A local HF target dir → `<s3_prefix>/targets/<target_id[:16]>/` (the id is the weights' sha256,
    so same-size objects are kept); hidden files and dirs (.git, .cache) are skipped. SSE-S3 and
    sha256 metadata on every object sent. Returns (prefix URI, uploaded). Raises FileNotFoundError
    without config.json."""
    target_dir = Path(target_dir)
    if not (target_dir / "config.json").exists():
        raise FileNotFoundError(f"{target_dir} is not a HF model dir (no config.json)")
    return aws.upload_dir(s3, target_dir, target_prefix(s3_prefix, target_id), skip_hidden=True)


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


BUSY = (
    "Creating",
    "Updating",
    "SystemUpdating",
    "RollingBack",
    "Deleting",
)  # UpdateRollbackFailed: an update repairs it


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
        except Exception as e:  # noqa: BLE001 - best effort: a leftover resource costs nothing, the deploy stands
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
