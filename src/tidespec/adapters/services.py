"""Start/stop the local services tidespec talks to (Prefect server + a process worker, MLflow; moto
for S3/SageMaker) on 127.0.0.1.

Every server is launched by the process supervisor (`process`: its own process group, output
appended to ``<state_dir>/<name>.log``) and recorded in ``<state_dir>/<name>.json``
(``url``, ``port``, ``pid``, ``create_time``, ``started_at``, ``log``).
``down`` stops only the pids recorded there. Default state dir:
``<cwd>/.tidespec/services``.

Measured (2-core box): Prefect 3.9 healthy in ~13 s; MLflow 3.17 in ~7 s with
``--workers 1`` and ``MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false`` (without them it
forks ~15 processes / 3 GB). MLflow's file store is broken in >=3.13: sqlite only.

What is here: the state files (record, adopt, forget), the crash cases around them, one lock per
state dir (``filelock``), and a small launcher function per server.
"""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import psutil
from filelock import FileLock

from ..errors import TidespecError
from . import process
from .orchestrate import crash_runs
from .process import free_port  # noqa: F401 — part of this module's API (tests, bench, the SGLang tests)

HOST = "127.0.0.1"
NAMES = ("prefect", "mlflow", "worker")  # `up()` default; "moto" (S3 + SageMaker API emulator) is opt-in
ALL = (*NAMES, "moto")
POOL = "tidespec"  # the process work pool prefect.yaml's deployments use (the worker creates it)
WORKER_POLL_S = "2"  # worker polling interval (Prefect default 10 s): a triggered cycle starts in ~2 s
# moto accepts any credentials; clients still need some (and a region) to sign requests
MOTO_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
STOP_GRACE_S = process.STOP_GRACE_S


class ServiceError(TidespecError):
    """A service failed to start, answer or stop; the message names the fix."""


@dataclass
class Service:
    """A running server: ``url`` is what clients use (PREFECT_API_URL / MLFLOW_TRACKING_URI)."""

    name: str
    url: str
    pid: int
    log: Path


def default_state_dir() -> Path:
    """``<cwd>/.tidespec/services`` (not created)."""
    return Path.cwd() / ".tidespec" / "services"


def _bin(name: str) -> str:
    """The venv's console script ``name`` (next to sys.executable), else PATH."""
    exe = Path(sys.executable).parent / name
    if exe.exists():
        return str(exe)
    found = shutil.which(name)
    if not found:
        raise ServiceError(f"`{name}` not found next to {sys.executable} nor on PATH; install it in this venv")
    return found


def _health_url(url: str, name: str = "") -> str:
    # prefect: url is the API url (…/api) → …/api/health; mlflow, worker healthcheck: …/health; moto: its state API
    return f"{url}/moto-api/data.json" if name == "moto" else f"{url}/health"


# ---------------------------------------------------------------- state files


def _state_file(state_dir: Path, name: str) -> Path:
    return Path(state_dir) / f"{name}.json"


def _read_state(state_dir: Path, name: str) -> dict | None:
    f = _state_file(state_dir, name)
    try:
        return json.loads(f.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _write_state(state_dir: Path, svc: Service, port: int, extra: dict | None = None) -> None:
    rec = asdict(svc) | (extra or {}) | {
        "log": str(svc.log),
        "port": port,
        "create_time": psutil.Process(svc.pid).create_time(),
        "started_at": datetime.now(UTC).isoformat(),
    }
    f = _state_file(state_dir, svc.name)
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(f)


# ---------------------------------------------------------------- start / stop


@dataclass
class _Launch:
    """A server process started but not yet known healthy."""

    svc: Service
    proc: subprocess.Popen
    port: int
    state_dir: Path
    extra: dict | None = None  # recorded in the state file (the worker: the service URLs it was started with)
    log_offset: int = 0  # the log's size at launch: what this launch wrote starts there


def _launch(name: str, cmd: list[str], env_extra: dict[str, str], state_dir: Path,
            url: str, port: int, extra: dict | None = None) -> _Launch:
    """Start ``cmd`` through the supervisor (own process group, output appended to
    ``<state_dir>/<name>.log``, working dir ``state_dir``).

    The state file is written at once (not when healthy): if the caller dies while the server is
    starting (SIGKILL, a killed CI job), ``down`` still finds and stops it, and ``up`` reuses it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / f"{name}.log"
    offset = log.stat().st_size if log.exists() else 0
    proc = process.launch(cmd, log, env_extra, cwd=state_dir)
    ln = _Launch(Service(name=name, url=url, pid=proc.pid, log=log), proc, port, state_dir, extra, offset)
    try:
        _write_state(state_dir, ln.svc, port, extra)
    except BaseException:
        process.stop(proc.pid)
        raise
    return ln


def _await(ln: _Launch, timeout_s: float) -> Service:
    """Wait until the launched server's health answers 200, then record it as started.

    Raises ServiceError if the process exits early or is not healthy in ``timeout_s`` seconds
    (its process group is then stopped and its state file removed).
    """
    svc = ln.svc
    try:
        process.wait_healthy(ln.proc, _health_url(svc.url, svc.name), timeout_s, svc.log, f"{svc.name} server",
                             error=ServiceError)
    except ServiceError:
        process.stop(ln.proc.pid)
        _forget(ln)
        raise
    _write_state(ln.state_dir, svc, ln.port, ln.extra)
    return svc


def _forget(ln: _Launch) -> None:
    """Remove the state file of a launch that did not come up (only if it still names that pid)."""
    rec = _read_state(ln.state_dir, ln.svc.name)
    if rec and int(rec.get("pid", -1)) == ln.svc.pid:
        _state_file(ln.state_dir, ln.svc.name).unlink(missing_ok=True)


def _pick_port(state_dir: Path, name: str, port: int | None) -> int:
    """``port`` if given; else the port of the previous run if still free (stable URLs); else a free one."""
    if port:
        return port
    prev = _read_state(state_dir, name)
    if prev and prev.get("port") and process.port_is_free(HOST, int(prev["port"])):
        return int(prev["port"])
    return process.free_port(HOST)


def _launch_prefect(state_dir: Path, port: int | None = None) -> _Launch:
    state_dir = Path(state_dir).resolve()
    home = state_dir / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    port = _pick_port(state_dir, "prefect", port)
    url = f"http://{HOST}:{port}/api"
    env = {
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": url,
    }
    cmd = [_bin("prefect"), "server", "start", "--host", HOST, "--port", str(port)]
    return _launch("prefect", cmd, env, state_dir, url, port)


def _launch_mlflow(state_dir: Path, port: int | None = None, artifacts: str | None = None) -> _Launch:
    state_dir = Path(state_dir).resolve()
    home = state_dir / "mlflow"
    home.mkdir(parents=True, exist_ok=True)
    port = _pick_port(state_dir, "mlflow", port)
    dest = artifacts or (home / "artifacts").as_uri()
    cmd = [_bin("mlflow"), "server",
           "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
           "--serve-artifacts", "--artifacts-destination", dest,
           "--host", HOST, "--port", str(port), "--workers", "1"]
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    return _launch("mlflow", cmd, env, state_dir, f"http://{HOST}:{port}", port)


def _launch_moto(state_dir: Path, port: int | None = None) -> _Launch:
    state_dir = Path(state_dir).resolve()
    port = _pick_port(state_dir, "moto", port)
    cmd = [_bin("moto_server"), "-H", HOST, "-p", str(port)]
    return _launch("moto", cmd, MOTO_ENV, state_dir, f"http://{HOST}:{port}", port)


def _launch_worker(state_dir: Path, deps: dict[str, Service], pool: str = POOL, port: int | None = None) -> _Launch:
    """A Prefect process worker polling ``pool`` (created as a process pool if missing). Its flow
    runs inherit its env: the service URLs in ``deps`` (PREFECT_API_URL, MLFLOW_TRACKING_URI, moto's
    AWS_ENDPOINT_URL). Health: the worker's own healthcheck server on ``port`` (``/health``)."""
    state_dir = Path(state_dir).resolve()
    name = "worker" if pool == POOL else f"worker-{pool}"
    home = state_dir / name
    home.mkdir(parents=True, exist_ok=True)
    port = _pick_port(state_dir, name, port)
    env = env_for(deps) | {
        "PREFECT_HOME": str(home),
        "PREFECT_WORKER_WEBSERVER_HOST": HOST,
        "PREFECT_WORKER_WEBSERVER_PORT": str(port),
        "PREFECT_WORKER_QUERY_SECONDS": WORKER_POLL_S,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }
    cmd = [_bin("prefect"), "worker", "start", "--pool", pool, "--type", "process", "--name", f"tidespec-{name}",
           "--with-healthcheck"]
    return _launch(name, cmd, env, state_dir, f"http://{HOST}:{port}", port, {"pool": pool, "deps": env_for(deps)})


_LAUNCHERS = {"prefect": _launch_prefect, "mlflow": _launch_mlflow, "moto": _launch_moto}  # workers: after these


# ---------------------------------------------------------------- public: up / down / status


def _reusable(state_dir: Path, name: str, timeout_s: float) -> Service | None:
    """The recorded service if its pid is alive and it answers health (waits ``timeout_s`` if starting)."""
    rec = _read_state(state_dir, name)
    if not rec or "create_time" not in rec:  # no record, or one we cannot tell from a reused pid
        return None
    if not process.alive(int(rec["pid"]), rec["create_time"]):
        if process.group_alive(int(rec["pid"])):  # the main process died, its children (e.g. uvicorn) did not
            process.stop(int(rec["pid"]))
        return None
    svc = Service(name=name, url=rec["url"], pid=int(rec["pid"]), log=Path(rec["log"]))
    deadline = time.monotonic() + timeout_s
    while True:
        if process.http_ok(_health_url(svc.url, name)):
            return svc
        if time.monotonic() > deadline or not process.alive(svc.pid, rec.get("create_time")):
            process.stop(svc.pid)  # alive but unhealthy: replace it
            return None
        time.sleep(0.25)


def _locked(state_dir: Path) -> FileLock:
    """Exclusive lock on ``<state_dir>/.lock`` (flock through ``filelock``; released on exit or
    process death): one ``up``/``down`` at a time per state dir, so two concurrent ``up`` calls never
    start two servers. Blocks until it is free."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return FileLock(state_dir / ".lock", thread_local=False, fallback_to_soft=False)


def up(state_dir: Path | None = None, which: tuple[str, ...] = NAMES,
       timeout_s: float = 90, pools: tuple[str, ...] = ()) -> dict[str, Service]:
    """Ensure the services in ``which`` run; idempotent (a healthy recorded server is reused).

    Missing servers are launched together, then awaited (``timeout_s`` seconds each); then the
    worker (pool ``POOL``) and one more worker per extra work pool in ``pools`` (named
    ``worker-<pool>``, e.g. the pool ``train.work_pool`` names). A worker started against other
    server URLs than the current ones is restarted.
    Raises ServiceError (unknown name, start failure; servers already launched are stopped).
    """
    state_dir = Path(state_dir or default_state_dir()).resolve()
    with _locked(state_dir):
        return _up(state_dir, which, timeout_s, pools)


def _up(state_dir: Path, which: tuple[str, ...], timeout_s: float, pools: tuple[str, ...]) -> dict[str, Service]:
    unknown = [n for n in which if n not in ALL]
    if unknown:
        raise ServiceError(f"unknown service(s) {unknown}; choose from {list(ALL)}")
    if "worker" in which and "prefect" not in which:
        raise ServiceError("the worker needs the Prefect server: start both (which=('prefect', 'worker', ...))")
    bad = [p for p in pools if not p or not all(ch.isalnum() or ch in "-_." for ch in p)]
    if bad:
        raise ServiceError(f"work pool names {bad} are not valid: use letters, digits, '-', '_' or '.'")
    out: dict[str, Service] = {}
    servers = [n for n in which if n in _LAUNCHERS]
    for name in servers:  # workers after: one cannot be healthy while its server is down
        if (svc := _reusable(state_dir, name, timeout_s)) is not None:
            out[name] = svc
    _start(state_dir, [functools.partial(_LAUNCHERS[n], state_dir) for n in servers if n not in out], out, timeout_s)
    deps = {n: out[n] for n in servers}
    if pools and "prefect" not in deps:
        raise ServiceError("extra pool workers need the Prefect server: include 'prefect' in which")
    wanted = {**({"worker": POOL} if "worker" in which else {}), **{f"worker-{p}": p for p in pools if p != POOL}}
    for name in wanted:
        if name not in out and (svc := _reusable(state_dir, name, timeout_s)) is not None:
            out[name] = svc
        if name in out and (_read_state(state_dir, name) or {}).get("deps") != env_for(deps):
            process.stop(out.pop(name).pid)  # started against other server URLs: restart it
    _start(
        state_dir,
        [functools.partial(_launch_worker, state_dir, deps, p) for n, p in wanted.items() if n not in out],
        out,
        timeout_s,
    )
    return {n: out[n] for n in (*which, *wanted) if n in out}


def _crash_orphans(rec: dict) -> None:
    """Mark the flow runs a stopped worker was running as Crashed (they died with it; left
    Running they would hold the deployment's concurrency slot until its lease expires)."""
    api, pool = rec.get("deps", {}).get("PREFECT_API_URL"), rec.get("pool")
    if not (api and pool):
        return
    try:
        crash_runs(api, pool, f"worker on pool {pool} stopped by tidespec services down")
    except Exception as e:  # noqa: BLE001  (the server may be down too; nothing to mark then)
        print(f"warning: could not mark runs of pool {pool} crashed: {e}", file=sys.stderr)


def recorded(state_dir: Path | None = None) -> list[str]:
    """Names with a state file under ``state_dir``: the fixed services, then ``worker-<pool>`` ones."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    extra = sorted(f.stem for f in state_dir.glob("worker-*.json")) if state_dir.is_dir() else []
    return [n for n in ALL if _state_file(state_dir, n).exists()] + extra


BIND_ATTEMPTS = 3  # launches of one server when another process keeps taking its port before it binds


def _start(state_dir: Path, launchers: list, out: dict[str, Service], timeout_s: float) -> None:
    """Call ``launchers`` (each starts one server, returns its _Launch), then await them into
    ``out``; a server that exits because another process took its port before it bound
    (`process.lost_port_race`) is launched again on a fresh port, ``BIND_ATTEMPTS`` times in all.
    On any other failure (or Ctrl-C), launching or awaiting, stop and forget every one of them not
    yet healthy (a half-started set is never left behind), re-raise."""
    launches: list[_Launch] = []
    try:
        for start in launchers:
            launches.append(start())
        for i, start in enumerate(launchers):
            for attempt in range(1, BIND_ATTEMPTS + 1):
                try:
                    out[launches[i].svc.name] = _await(launches[i], timeout_s)
                    break
                except ServiceError as e:
                    if not _lost_port(launches[i]):
                        raise
                    if attempt == BIND_ATTEMPTS:
                        raise ServiceError(f"{launches[i].svc.name} server: another process took its port before "
                                           f"it bound, {BIND_ATTEMPTS} launches in a row (free ports: is the "
                                           f"machine out of them?); last error: {e}") from e
                    launches[i] = start()  # its state file is gone: a fresh port
    except BaseException:
        for ln in launches:
            if ln.svc.name not in out:
                process.stop(ln.proc.pid)
                _forget(ln)
        raise


def _lost_port(ln: _Launch) -> bool:
    """The launch exited, its log saying its port was taken before it bound."""
    return ln.proc.poll() is not None and process.lost_port_race(ln.svc.log, ln.log_offset)


def down(state_dir: Path | None = None, which: tuple[str, ...] | None = None) -> list[str]:
    """Stop the recorded servers in ``which`` (default: every one recorded; only pids from state
    files) and remove their state files. Workers stop first. Returns the names that were running.
    """
    state_dir = Path(state_dir or default_state_dir()).resolve()
    if not state_dir.is_dir():
        return []
    with _locked(state_dir):
        return _down(state_dir, which)


def _down(state_dir: Path, which: tuple[str, ...] | None) -> list[str]:
    stopped = []
    which = recorded(state_dir) if which is None else which
    for name in sorted(which, key=lambda n: not n.startswith("worker")):  # workers first: they talk to the servers
        rec = _read_state(state_dir, name)
        if rec is None:
            continue
        pid = int(rec["pid"])
        if "create_time" in rec and (process.alive(pid, rec["create_time"]) or process.group_alive(pid)):
            process.stop(pid)  # the whole process group: a server's children outlive a killed parent
            stopped.append(name)
            if name.startswith("worker"):
                _crash_orphans(rec)
        _state_file(state_dir, name).unlink(missing_ok=True)
    return stopped


def status(state_dir: Path | None = None) -> dict[str, dict]:
    """``{name: record + {"alive": bool, "healthy": bool}}`` for each state file present (the worker's
    record adds ``pool``)."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    out = {}
    for name in recorded(state_dir):
        rec = _read_state(state_dir, name)
        if rec is None:
            continue
        alive = process.alive(int(rec["pid"]), rec.get("create_time"))
        rec["alive"] = alive
        rec["healthy"] = alive and process.http_ok(_health_url(rec["url"], name))
        out[name] = rec
    return out


def env_for(services: dict[str, Service]) -> dict[str, str]:
    """Client env for ``services``: PREFECT_API_URL, MLFLOW_TRACKING_URI, and for moto
    AWS_ENDPOINT_URL + test credentials/region (workers add nothing)."""
    keys = {"prefect": "PREFECT_API_URL", "mlflow": "MLFLOW_TRACKING_URI", "moto": "AWS_ENDPOINT_URL"}
    env = {keys[n]: s.url for n, s in services.items() if n in keys}
    return env | (MOTO_ENV if "moto" in services else {})
