"""The Prefect adapter: deployments (prefect.yaml: tide-cycle, tide-train, tide-capture, tide-rollout), the flows
they run (loaded from the project's flows/ as a worker loads them: `load_flow`), events
(`tidespec.capture.threshold`, `tidespec.capture.text`, emitted only to the server in
PREFECT_API_URL), transient-failure retries, and training on another work pool. Flow runs pass
paths and URIs only. Prefect, MLflow and the HTTP clients are imported inside the functions that
use them. The deployments in full: docs/design/adapters.md.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from datetime import UTC
from pathlib import Path

import yaml

from ..errors import TidespecError

log = logging.getLogger(__name__)
CYCLE_DEPLOYMENT = "tide_cycle/tide-cycle"
TRAIN_DEPLOYMENT = "tide_train/tide-train"
CAPTURE_DEPLOYMENT = "tide_capture/tide-capture"
ROLLOUT_DEPLOYMENT = "tide_rollout/tide-rollout"
TRANSIENT_MLFLOW_CODES = {"TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED"}
CAPTURE_THRESHOLD = "tidespec.capture.threshold"
TEXT_CAPTURED = "tidespec.capture.text"  # text capture passed capture.seal_min_tokens: tide-capture runs
FLOW_NAMES = ("tide_cycle", "tide_train", "tide_capture", "tide_rollout")
CHECKOUT = Path(__file__).resolve().parents[3]  # the repository root when the package runs from a checkout


class OrchestrationError(TidespecError):
    """A deployment is missing, misconfigured or its run failed; the message names the fix."""


# -- retries ----------------------------------------------------------------------------------
def is_transient(exc: BaseException | None) -> bool:
    """True iff `exc` (or an exception it was raised from) is a failure worth retrying: a service
    unreachable or overloaded (connection refused/reset, timeout, HTTP 5xx/429, a client that gave
    up after retrying those). Bad data (ValueError, missing file, a registry rule, permissions) is
    never transient, even when raised while handling a connection error."""
    import httpx
    import requests
    import urllib3
    from mlflow.exceptions import MlflowException

    from .registry import RegistryError

    bad_data = (ValueError, TypeError, LookupError, FileNotFoundError, PermissionError, RegistryError,
                OrchestrationError)
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, bad_data):
            return False
        if isinstance(exc, (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout,
                            requests.exceptions.RetryError, urllib3.exceptions.MaxRetryError, httpx.TransportError)):
            return True
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(exc, (httpx.HTTPStatusError, requests.HTTPError)) and status and (status >= 500 or status == 429):
            return True
        if isinstance(exc, MlflowException) and exc.error_code in TRANSIENT_MLFLOW_CODES:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def retry_if_transient(task, task_run, state) -> bool:
    """Prefect `retry_condition_fn`: retry a failed task only for transient failures."""
    return is_transient(state.result(raise_on_failure=False) if state.is_failed() else None)


# -- flows ------------------------------------------------------------------------------------
def project_root(start: Path | None = None) -> Path:
    """The Prefect project: the directory holding prefect.yaml (its deployments' entrypoints are
    relative to it). `start` when given; else the working directory or the nearest parent with a
    prefect.yaml and a flows/ directory; else the checkout this package runs from (an editable
    install). Raises OrchestrationError naming the fix."""
    if start is not None:
        if not (Path(start) / "prefect.yaml").exists():
            raise OrchestrationError(f"no prefect.yaml in {start}: the project root holds prefect.yaml and flows/")
        return Path(start).resolve()
    cwd = Path.cwd().resolve()
    for d in (cwd, *cwd.parents, CHECKOUT):
        if (d / "prefect.yaml").exists() and (d / "flows").is_dir():
            return d
    raise OrchestrationError(f"no prefect.yaml with a flows/ directory in {cwd} or its parents, and this package "
                             "does not run from a tidespec checkout: run from the project root")


def yaml_deployments(project: Path) -> list[dict]:
    """The `deployments` entries of `project`/prefect.yaml ([] when it declares none). Raises
    FileNotFoundError without the file, yaml.YAMLError for a malformed one."""
    doc = yaml.safe_load((Path(project) / "prefect.yaml").read_text()) or {}
    return doc.get("deployments") or []


def entrypoint(name: str, project: Path) -> str:
    """The entrypoint (`<path>:<function>`, relative to `project`) of flow `name` as the deployments
    of `project`/prefect.yaml name it (the function is named like the flow). Raises
    OrchestrationError when no deployment runs that flow."""
    for d in yaml_deployments(project):
        ep = str(d.get("entrypoint", ""))
        if ep.rpartition(":")[2] == name:
            return ep
    raise OrchestrationError(f"no deployment in {Path(project) / 'prefect.yaml'} runs flow {name!r} "
                             f"(known: {', '.join(FLOW_NAMES)})")


def load_flow(name: str, project: Path | None = None):
    """Flow `name` (tide_cycle, tide_train, tide_capture, tide_rollout), loaded the way a Prefect worker loads a
    deployment's flow: `prefect.flows.load_flow_from_entrypoint` on the entrypoint prefect.yaml
    gives it, in `project_root(project)`. Each call runs the flow file anew (as each worker run
    does). Raises OrchestrationError (no project, no such deployment), prefect's ScriptError (the
    flow file failed to import)."""
    from prefect.flows import load_flow_from_entrypoint
    root = project_root(project)
    path, _, fn = entrypoint(name, root).rpartition(":")
    if not (root / path).is_file():
        raise OrchestrationError(f"{root / 'prefect.yaml'} names {path} for flow {name}, which does not exist")
    return load_flow_from_entrypoint(f"{root / path}:{fn}", use_placeholder_flow=False)


# -- events -----------------------------------------------------------------------------------
def emit(event: str, resource_id: str, payload: dict, labels: dict[str, str] | None = None,
         api_url: str | None = None, timeout_s: float = 10.0) -> str | None:
    """Send one event to the Prefect server at `api_url` (default: env PREFECT_API_URL) and wait
    (≤ `timeout_s` s) until the client has delivered it. Returns the event id, or None when no
    server is configured. The URL is applied as a temporary setting: a process whose Prefect
    settings were loaded earlier (without it) would otherwise start an ephemeral server."""
    api_url = api_url or os.environ.get("PREFECT_API_URL")
    if not api_url:
        log.warning("PREFECT_API_URL unset: event %s for %s not sent", event, resource_id)
        return None
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings
    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        ev = emit_event(event=event, resource={"prefect.resource.id": resource_id, **(labels or {})},
                        payload=payload)
        EventsWorker.drain_all(timeout=timeout_s)
    return str(ev.id) if ev else None


def capture_threshold(snapshot_id: str, target_id: str, payload: dict, api_url: str | None = None) -> str | None:
    """Emit `tidespec.capture.threshold` for a sealed snapshot (payload: trigger, snapshot_rev,
    tokens, drift...; prefect.yaml's trigger maps target_id, snapshot_rev, trigger to the
    tide-cycle run's parameters)."""
    return emit(CAPTURE_THRESHOLD, f"tidespec.snapshot.{snapshot_id}",
                {"snapshot_id": snapshot_id, "target_id": target_id, **payload},
                {"tidespec.target_id": target_id[:12]}, api_url=api_url)


def text_captured(target_id: str, tokens: int, directory: str, api_url: str | None = None) -> str | None:
    """Emit `tidespec.capture.text` (resource `tidespec.textcapture.<target_id[:12]>`): `tokens` more
    were text-captured in `directory`; prefect.yaml's tide-capture trigger ingests them."""
    return emit(TEXT_CAPTURED, f"tidespec.textcapture.{target_id[:12]}",
                {"target_id": target_id, "tokens": tokens, "directory": directory},
                {"tidespec.target_id": target_id[:12]}, api_url=api_url)


# -- deployments ------------------------------------------------------------------------------
@contextlib.contextmanager
def using_api(api_url: str):
    """Run flows called in-process inside this block against the Prefect server at `api_url`.
    Prefect reads PREFECT_API_URL into its settings when it is imported, so setting the environment
    afterwards is not enough (a flow would start a temporary server of its own)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    with temporary_settings({PREFECT_API_URL: api_url}):
        yield


def flush_logs(timeout_s: float = 5.0) -> None:
    """Block (≤ `timeout_s` s) until flow-run logs queued in this process have reached the Prefect
    server (`APILogWorker.drain_all`: what `APILogHandler.flush` does on an instance). Call before
    stopping a server this process started, or its last runs' logs are lost."""
    from prefect.logging.handlers import APILogWorker
    APILogWorker.drain_all(timeout=timeout_s)


def ensure_pools(api_url: str, names: list[str], pool_type: str = "process") -> list[str]:
    """Create the work pools in `names` that the server at `api_url` lacks (type `pool_type`);
    return the ones created. `prefect deploy --no-prompt` refuses a deployment on a missing pool."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    async def go(c):
        made = []
        for n in names:
            try:
                await c.read_work_pool(n)
            except ObjectNotFound:
                try:
                    await c.create_work_pool(WorkPoolCreate(name=n, type=pool_type))
                    made.append(n)
                except ObjectAlreadyExists:
                    pass
        return made
    return _call(api_url, go)


def _call(api_url: str, fn):
    """Run `await fn(client)` against the Prefect server at `api_url`."""
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def go():
        async with get_client() as c:
            return await fn(c)
    with temporary_settings({PREFECT_API_URL: api_url}):
        return asyncio.run(go())


def missing_deployments(api_url: str, project: Path) -> list[str] | None:
    """The deployments `project`/prefect.yaml declares that the Prefect server at `api_url` lacks
    (what `prefect deploy --all` there would create), by name, in the file's order; None when it
    declares none. A deployment counts as there when one of that name runs the same entrypoint (a
    namesake of another flow does not)."""
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    declared = [(str(d["name"]), d.get("entrypoint")) for d in yaml_deployments(project) if d.get("name")]
    if not declared:
        return None

    async def go(c):
        have = await c.read_deployments(deployment_filter=DeploymentFilter(
            name=DeploymentFilterName(any_=[n for n, _ in declared])))
        return {(d.name, d.entrypoint) for d in have}
    have = _call(api_url, go)
    return [n for n, entry in declared if (n, entry) not in have]


def yaml_pools(project: Path) -> list[str]:
    """Work pools named by the deployments in `project`/prefect.yaml."""
    return sorted({d["work_pool"]["name"] for d in yaml_deployments(project) if d.get("work_pool", {}).get("name")})


def deploy(project: Path, api_url: str, names: tuple[str, ...] = (), timeout_s: float = 300) -> str:
    """`prefect deploy` (all deployments of `project`/prefect.yaml, or `names`) against the server
    at `api_url`, run from `project` (it records `project` as the flow runs' working dir: the
    entrypoints `flows/*.py` are read from there).
    The work pools it names are created first when missing (process pools); every entrypoint file
    must be there. Returns the CLI output. Raises OrchestrationError with that output when it fails."""
    if not (Path(project) / "prefect.yaml").exists():
        raise OrchestrationError(f"no prefect.yaml in {project}: run from the tidespec project root")
    missing = sorted({p for d in yaml_deployments(project) if (p := str(d.get("entrypoint", "")).rpartition(":")[0])
                      and not (Path(project) / p).is_file()})
    if missing:
        raise OrchestrationError(f"prefect.yaml in {project} names flow files {missing} that are not there: copy the "
                                 "project's flows/ directory next to its prefect.yaml")
    ensure_pools(api_url, yaml_pools(project))
    exe = Path(sys.executable).with_name("prefect")
    sel = [a for n in names for a in ("--name", n)] or ["--all"]
    cmd = [str(exe) if exe.exists() else "prefect", "--no-prompt", "deploy", *sel]
    env = os.environ | {"PREFECT_API_URL": api_url}
    r = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise OrchestrationError(
            f"`prefect deploy` in {project} failed (rc {r.returncode}); is the Prefect "
            f"server at {api_url} up (tidespec services up)?\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
        )
    return r.stdout


async def _deployment(client, name: str):
    from prefect.exceptions import ObjectNotFound
    try:
        return await client.read_deployment_by_name(name)
    except ObjectNotFound:
        raise OrchestrationError(f"deployment {name} not found on the Prefect server; run `prefect deploy --all` "
                                 "in the project root (tidespec services up starts the server and worker)") from None


def crash_runs(api_url: str, pool: str, message: str) -> list[str]:
    """Set the Running/Pending flow runs of work pool `pool` to Crashed (`message`); returns their
    names. For runs whose worker is gone (services.down)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        WorkPoolFilter,
        WorkPoolFilterName,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    async def go(c):
        runs = await c.read_flow_runs(
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.RUNNING, StateType.PENDING]))),
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))
        for r in runs:
            await c.set_flow_run_state(r.id, Crashed(message=message), force=True)
        return [r.name for r in runs]
    return _call(api_url, go)


def _polling_workers(api_url: str, pool: str, within_s: float = 90) -> list[str]:
    """Names of workers that polled `pool` in the last `within_s` seconds."""
    from datetime import datetime, timedelta

    async def go(c):
        return await c.read_workers_for_work_pool(pool)
    cut = datetime.now(UTC) - timedelta(seconds=within_s)
    return [w.name for w in _call(api_url, go) if w.last_heartbeat_time and w.last_heartbeat_time >= cut]


def wait_for_run(api_url: str, deployment: str, parameters: dict, timeout_s: float = 1800, poll_s: float = 2.0,
                 on_poll=None):
    """Wait for a flow run of `deployment` whose parameters include `parameters` (e.g. the
    snapshot_rev an event carried) to reach a final state; return it (prefect FlowRun).
    `on_poll(run | None)` is called each poll (progress). Raises OrchestrationError when no such
    run ends within `timeout_s` seconds (naming the worker log to read)."""
    import time

    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    dep = _call(api_url, lambda c: _deployment(c, deployment))
    flt = DeploymentFilter(id=DeploymentFilterId(any_=[dep.id]))
    deadline = time.monotonic() + timeout_s
    run = None
    while time.monotonic() < deadline:
        runs = _call(api_url, lambda c: c.read_flow_runs(deployment_filter=flt))
        mine = [r for r in runs if all(r.parameters.get(k) == v for k, v in parameters.items())]
        run = max(mine, key=lambda r: r.created) if mine else None
        if on_poll:
            on_poll(run)
        if run is not None and run.state is not None and run.state.is_final():
            return run
        time.sleep(poll_s)
    state = run.state.name if run and run.state else "no run created (is the trigger deployed? prefect deploy --all)"
    raise OrchestrationError(f"no {deployment} run with {parameters} finished in {timeout_s:g} s (last: {state}); "
                             "see the worker log (tidespec services status) and the run in the Prefect UI")


def _await_worker(api_url: str, pool: str, wait_s: float) -> list[str]:
    """Polling workers on `pool`, waiting up to `wait_s` s for one: a worker that just started
    answers its healthcheck before its first heartbeat reaches the server."""
    import time
    deadline = time.monotonic() + wait_s
    while not (names := _polling_workers(api_url, pool)) and time.monotonic() < deadline:
        time.sleep(1.0)
    return names


def train_on_pool(pool: str, parameters: dict, out: Path, timeout_s: float | None = 86400,
                  worker_wait_s: float = 30) -> dict:
    """Run the train step as deployment `tide_train/tide-train` on work pool `pool` and wait.

    `parameters` are the tide_train flow's (root, params_path, curated, init, out: paths on a file
    system both pools see). Returns the trainer's metrics, read from the `out`/train_metrics.json
    that run writes (a stale one is removed first). Raises OrchestrationError when the deployment
    is missing, sits on another pool (the fix: deploy it on `pool` or set train.work_pool to its
    pool), no worker polls `pool` within `worker_wait_s` s, or its run does not complete or writes
    no metrics."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def check():
        async with get_client() as c:
            return await _deployment(c, TRAIN_DEPLOYMENT)
    dep = run_coro_as_sync(check())
    if dep.work_pool_name != pool:
        raise OrchestrationError(f"{TRAIN_DEPLOYMENT} is deployed on work pool {dep.work_pool_name!r}, "
                                 f"train.work_pool is {pool!r}: set train.work_pool to it, or change its "
                                 "work_pool in prefect.yaml and run `prefect deploy --all`")
    metrics = Path(out) / "train_metrics.json"
    metrics.unlink(missing_ok=True)
    from prefect.settings import PREFECT_API_URL
    if not _await_worker(PREFECT_API_URL.value(), pool, worker_wait_s):
        raise OrchestrationError(
            f"no worker polls work pool {pool!r} (waited {worker_wait_s:g} s): start one "
            f"(tidespec services up --pool {pool}) "
            "or unset train.work_pool to train in the cycle's own process"
        )
    run = run_deployment(TRAIN_DEPLOYMENT, parameters=parameters, timeout=timeout_s, as_subflow=True)
    if not (run.state and run.state.is_completed()):
        raise OrchestrationError(f"train run {run.name} on pool {pool} ended {run.state.name if run.state else None}: "
                                 f"{run.state.message if run.state else 'no state (timed out?)'}; see its logs "
                                 f"in the Prefect UI (is a worker polling {pool}? tidespec services up --pool {pool})")
    if not metrics.exists():
        raise OrchestrationError(f"train run {run.name} completed but wrote no {metrics}: the pool's workers must "
                                 "see the same project directory (a shared file system), or train on SageMaker")
    return json.loads(metrics.read_text())
