"""The one process supervisor: launch a command in its own process group (environment, log file),
wait for its HTTP health URL, stop the whole group with a grace period.

`services` (the local Prefect, MLflow and moto servers, the Prefect workers), `sglang` and `vllm`
(engine servers, `ServerProcess`) start their servers through it. A server runs in its own session
(``start_new_session=True``), so its group id is its pid and stopping it reaches the workers it
forked, even after the leader died. Output goes to a log file opened for append; every failure to
become healthy names the log and its last lines.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import psutil

from ..errors import TidespecError

STOP_GRACE_S = 10.0
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_USABLE: set[tuple[str, str]] = set()  # (engine, interpreter) whose probe passed in this process


def probed(engine: str, python: str, probe: Callable[[str], str | None]) -> str | None:
    """`probe(python)` (why `engine` cannot run with that interpreter, or None), asked once per process
    for an interpreter it found usable (`tidespec serve` asks before its notes, the server's start
    asks again); a refusal is asked again every time. A path is keyed absolute, a bare name as given."""
    key = (engine, os.path.abspath(python) if os.sep in python else python)
    if key in _USABLE:
        return None
    reason = probe(python)
    if reason is None:
        _USABLE.add(key)
    return reason


def base_url(host: str, port: int) -> str:
    """http://host:port of a server (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def loopback(host: str) -> str:
    """`host` when it is a loopback address, else 127.0.0.1: where an engine server whose only
    client is this machine's front door (and its swap route) listens."""
    return host if host in LOOPBACK else "127.0.0.1"

# Popen handles of the processes this process launched, so they get reaped (no zombies).
_CHILDREN: dict[int, subprocess.Popen] = {}


class ProcessError(TidespecError):
    """A launched process exited early or did not become healthy in time; the message names its log."""


# ---------------------------------------------------------------- ports


def port_is_free(host: str, port: int) -> bool:
    """True iff `port` can be bound on `host` right now (IPv4 or IPv6)."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


_PICK_FROM = 20000  # free_port's candidates: [20000, first ephemeral port)
_BIND_LOST = ("address already in use", "errno 98", "eaddrinuse")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now, picked at random below the kernel's ephemeral range.

    Outside that range on purpose: a server that binds seconds after its port was picked (Prefect
    migrates its database first) would otherwise lose the port to the source port of any outbound
    connection in between (``[Errno 98] address already in use``, uvicorn exit 3). Random, not
    sequential, so concurrent pickers rarely meet; still racy by nature (`lost_port_race`). Falls
    back to a port the OS picks when no candidate below the range is free. Raises OSError when
    `host` cannot be bound at all (not a local address)."""
    low = _ephemeral_low()
    if low > _PICK_FROM + 1000:
        rng = random.SystemRandom()  # not the `random` module: a test seeding it would make workers agree
        for _ in range(64):
            port = rng.randrange(_PICK_FROM, low)
            if port_is_free(host, port):
                return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def lost_port_race(log: Path, offset: int = 0) -> bool:
    """True iff `log`, from byte `offset` on, says the server could not bind its port (another
    process took it between `free_port` and the bind): the caller may relaunch on a fresh port.
    False when the log cannot be read (never raises)."""
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace").lower()
    except OSError:
        return False
    return any(m in text for m in _BIND_LOST)


# ---------------------------------------------------------------- health / liveness


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True iff GET `url` answers 200 within `timeout_s` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def log_tail(log: Path, n: int = 20) -> str:
    """The last `n` lines of `log` ("(no log)" when it cannot be read)."""
    try:
        return "\n".join(Path(log).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def child(pid: int) -> subprocess.Popen | None:
    """The Popen handle of a process this process launched and has not reaped yet."""
    return _CHILDREN.get(pid)


def reap(pid: int) -> None:
    """Collect the exit status of a child we launched, so it does not linger as a zombie."""
    proc = _CHILDREN.get(pid)
    if proc is not None and proc.poll() is not None:
        _CHILDREN.pop(pid, None)


def alive(pid: int, create_time: float | None = None) -> bool:
    """True iff `pid` runs (not a zombie) and, if given, started at `create_time` (pid reuse guard)."""
    reap(pid)
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        return create_time is None or abs(p.create_time() - create_time) < 1.0
    except psutil.Error:
        return False


def group_alive(pgid: int) -> bool:
    """True iff any process is left in process group `pgid` that has not exited. A process whose
    main thread exited while others run shows as a zombie in /proc but lives on (waitpid does not
    report it): it counts as alive, so `stop` still kills it."""
    reap(pgid)
    own = _CHILDREN.get(pgid)
    if own is not None and own.poll() is None:
        return True
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid and (p.info["status"] != psutil.STATUS_ZOMBIE or p.num_threads() > 1):
                return True
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return False


# ---------------------------------------------------------------- launch / wait / stop


def launch(cmd: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path | None = None,
           unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start `cmd` in its own session (process group), stdin closed, stdout and stderr appended to
    `log` after a `=== <UTC time> <command>` line; `env` is added to this process's environment,
    the variables named in `unset` left out of it. Returns the Popen (its pid is the group id).
    Raises OSError when `cmd` cannot be started."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        fh.write(f"\n=== {datetime.now(UTC).isoformat()} {' '.join(cmd)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={k: v for k, v in os.environ.items() if k not in unset} | (env or {}),
                                start_new_session=True, cwd=cwd)
    _CHILDREN[proc.pid] = proc
    return proc


def poll_until(pred: Callable[[], object], timeout_s: float, what: str, proc: subprocess.Popen | None = None,
               log: Path | None = None, poll_s: float = 0.5, error: type[Exception] = ProcessError):
    """Call `pred()` every `poll_s` s until it returns something truthy, and return that. Raises
    `error` naming `what` (and the tail of `log`, when given) when `timeout_s` s pass first or `proc`
    (a server's Popen) exits meanwhile (its exit code)."""
    tail = f"; see {log}:\n{log_tail(log)}" if log is not None else ""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise error(f"server exited ({proc.returncode}) while waiting for {what}{tail}")
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise error(f"timed out after {timeout_s:g} s waiting for {what}{tail}")


def wait_healthy(proc: subprocess.Popen, health_url: str, timeout_s: float, log: Path, what: str,
                 error: type[Exception] = ProcessError, poll_s: float = 0.25, probe_timeout_s: float = 2.0,
                 ok: Callable[[str], bool] | None = None) -> None:
    """Poll `health_url` until it answers 200 (or `ok(url)` is true) while `proc` runs. Raises
    `error` naming `what`, the log and its tail when the process exits first (its exit code) or is
    not healthy within `timeout_s` seconds. Stops nothing: the caller decides (`stop`)."""
    ok = ok or (lambda u: http_ok(u, probe_timeout_s))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            _CHILDREN.pop(proc.pid, None)
            raise error(f"{what} exited with {proc.returncode} before becoming healthy; see {log}:\n"
                        f"{log_tail(log)}")
        if ok(health_url) and proc.poll() is None:
            return
        time.sleep(poll_s)
    raise error(f"{what} did not become healthy in {timeout_s:g} s; see {log} (raise the timeout on a slow "
                f"machine):\n{log_tail(log)}")


def stop(pid: int, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM process group `pid`, wait up to `grace_s` seconds, then SIGKILL what is left (and
    wait up to 5 s more). A group already gone is fine."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not group_alive(pid):
                reap(pid)
                return
            time.sleep(0.1)


class ServerProcess:
    """One supervised HTTP server (context manager): `start()` refuses a busy port (another server's
    health would pass for ours), launches `args` (`launch`), waits until `health_url` answers 200;
    `stop()` stops its process group. Used by the engine adapters (`sglang`, `vllm`,
    `llama_cpp`) and the benches' `tidespec serve` rows.

    what: how errors name it ("vLLM server"); error: the exception class raised (ProcessError's
    contract: the message names the log and its tail); env / unset / cwd: as `launch` takes them."""

    def __init__(self, args: list[str], host: str, port: int, health_url: str, log_path: Path, what: str,
                 error: type[Exception] = ProcessError, env: dict[str, str] | None = None,
                 ready_timeout_s: float = 600.0, grace_s: float = 30.0, poll_s: float = 1.0,
                 probe_timeout_s: float = 5.0, unset: tuple[str, ...] = (), cwd: Path | None = None):
        self.args, self.host, self.port, self.health_url = list(args), host, port, health_url
        self.log_path, self.what, self.error, self.env = Path(log_path), what, error, env
        self.unset, self.cwd = tuple(unset), cwd
        self.ready_timeout_s, self.grace_s, self.poll_s, self.probe_timeout_s = (
            ready_timeout_s,
            grace_s,
            poll_s,
            probe_timeout_s,
        )
        self.proc: subprocess.Popen | None = None

    def start(self) -> ServerProcess:
        """Raises `error` (port in use; exited early or not healthy in time, with the log tail);
        OSError when the command cannot be started. A failed start leaves nothing running."""
        if not port_is_free(self.host, self.port):
            raise self.error(f"port {self.port} on {self.host} is in use: stop what listens there or choose "
                             "another port")
        self.proc = launch(self.args, self.log_path, env=self.env, cwd=self.cwd, unset=self.unset)
        try:
            wait_healthy(self.proc, self.health_url, self.ready_timeout_s, self.log_path, self.what,
                         error=self.error, poll_s=self.poll_s, probe_timeout_s=self.probe_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def running(self) -> bool:
        """True while the launched process runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the whole process group (workers too, even when the main process already exited),
        SIGKILL what is left after `grace_s`. Idempotent."""
        if self.proc is not None:
            stop(self.proc.pid, self.grace_s)
            self.proc.poll()

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
