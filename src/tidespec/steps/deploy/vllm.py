"""Deploy the champion into vLLM: a vLLM server behind the front door, swapped blue/green.

vLLM v0.32 has no runtime update of a draft's weights (its `/collective_rpc`-driven weight updates
reach the target model's worker only, and a draft is loaded once when the engine is built), so a new
champion gets a new server: start *green* on a free port with the new draft (its own copy of the
engine dir, so a later deploy cannot change files under it), wait for `/health`, send a canary
completion, switch the front door to green, wait until the requests still running on *blue* have
finished (`Proxy.inflight`), stop blue. Any failure before the switch stops green and leaves blue
serving: nothing is dropped, and the error names the log. Costs one engine's memory more (~4 GB for
SmolLM2 on CPU) for the duration of a swap.

Each version runs in its own server, so that server's cumulative spec-decode counters are the
version's live figures: `report_live` logs them to the version's MLflow run (`live/acceptance_length`,
`live/accepted_per_pos/<i>`, ...) and flags a version whose live τ is clearly below its replayed τ.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from ...adapters import process, registry
from ...adapters.vllm import VLLMError, VLLMLaunch, VLLMServer, live_below_replay, scrape
from ...workspace import copy_engine_files, private_dir, served_version
from ..tuning import live_windows

log = logging.getLogger(__name__)


class VLLMDeployment:
    """The vLLM server(s) serving `launch.model_path` behind `proxy` (a `frontdoor.Proxy`; None: no
    front door yet, `url` says where vLLM is). `state_dir`: private copies of deployed drafts and the
    servers' logs. `draft_version`: the registry version served (None: no draft or not from the
    registry), as `serve.admin.ChampionWatcher` expects of an engine."""

    def __init__(self, launch: VLLMLaunch, state_dir: Path, proxy=None, ready_timeout_s: float = 600.0,
                 drain_timeout_s: float = 300.0):
        self.launch, self.state_dir, self.proxy = launch, Path(state_dir), proxy
        self.ready_timeout_s, self.drain_timeout_s = ready_timeout_s, drain_timeout_s
        self.server: VLLMServer | None = None
        self.draft_version: str | None = None
        self._swap = threading.Lock()
        self._n = 0

    @property
    def url(self) -> str | None:
        """Base URL of the vLLM server serving now (None before `start`)."""
        return self.server.url if self.server else None

    def start(self, bundle: Path | None) -> VLLMDeployment:
        """Start serving the draft in `bundle` (a draft bundle or flat checkpoint; None or missing:
        the target alone). Raises VLLMError / VLLMUnavailable; nothing is left running then."""
        self.server, self.draft_version = self._launch(bundle, self.launch.port)
        return self

    def install(self, bundle: Path, version: str | None = None) -> dict:
        """Blue/green swap to the draft in `bundle` (module docstring). Returns {"draft_version",
        "url", "drained"}: drained False when blue still had requests after drain_timeout_s (it is
        stopped anyway). Raises VLLMError (green refused the draft, died, failed the canary): blue
        keeps serving."""
        with self._swap:
            green, version = self._launch(bundle, process.free_port(self.launch.host), version)
            try:
                canary(green.url, self.launch.served_model_name or self.launch.model_path)
            except BaseException:
                green.stop()
                raise
            blue, old = self.server, self.proxy.switch(green.url) if self.proxy else None
            self.server, self.draft_version = green, version
            drained = self._drain(old) if old else True
            if blue:
                blue.stop()
            log.info(
                "vLLM now serves draft %s at %s (previous server stopped, drained=%s)", version, green.url, drained
            )
            return {"draft_version": version, "url": green.url, "drained": drained}

    def _launch(self, bundle: Path | None, port: int, version: str | None = None) -> tuple[VLLMServer, str | None]:
        self._n += 1
        draft = None
        if bundle is not None and Path(bundle).exists():
            version = served_version(Path(bundle)) or version
            draft = self._private_copy(Path(bundle), f"{self._n}-v{version or 'local'}")
        cfg = replace(self.launch, draft_path=str(draft) if draft else None, port=port)
        srv = VLLMServer(cfg, self.state_dir / "logs" / f"vllm-{self._n}.log", ready_timeout_s=self.ready_timeout_s)
        srv.start()
        return srv, version if draft else None

    def _private_copy(self, bundle: Path, name: str) -> Path:
        dest = private_dir(self.state_dir / "drafts") / name
        shutil.rmtree(dest, ignore_errors=True)
        try:
            return copy_engine_files(bundle, dest)
        except FileNotFoundError as e:
            raise VLLMError(f"{e}; deploy a registry version there") from None

    def _drain(self, url: str) -> bool:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.proxy.inflight(url) > 0:
            if time.monotonic() > deadline:
                log.warning("%d requests still on %s after %g s: stopping it anyway", self.proxy.inflight(url), url,
                            self.drain_timeout_s)
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        """Stop the serving vLLM server (its whole process group)."""
        if self.server:
            self.server.stop()


def canary(url: str, model: str, timeout_s: float = 120.0) -> None:
    """A 1-token greedy completion on the vLLM server at `url`; raises VLLMError unless it answers
    200 with one choice."""
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1,
                                                      "temperature": 0}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise VLLMError(f"canary to {url} failed: {e}") from None
    if r.status_code != 200 or len(r.json().get("choices", [])) != 1:
        raise VLLMError(f"canary to {url} answered {r.status_code}: {r.text[:300]}")


def report_live(dep: VLLMDeployment, tracking_uri: str, target_id: str, sagemaker=None) -> dict | None:
    """Scrape the serving vLLM's counters and log them as the served version's live figures (MLflow
    run metrics `live/*`, step = drafts so far). A version whose live τ is clearly below the τ its
    evaluation replayed (`adapters.vllm.live_below_replay`) gets tag `live_tau_below_replay` = both
    figures and a warning naming them. With `sagemaker` (`deploy.sagemaker`), each endpoint
    profile's window is tuned again from the measured per-position acceptance (`tuning.live_windows`,
    ≥ 100 drafts): tag `live_tuned_k.<profile>` (what `tidespec deploy sagemaker` then applies) and
    metric `live/predicted_speedup/<profile>`. Returns the logged metrics, or None when there is
    nothing to log: no registry version served, or no counters exported (live τ unknown, never 0)."""
    version, url = dep.draft_version, dep.url
    if version is None or url is None:
        return None
    live = scrape(url)
    if live is None or not live.num_drafts:
        return None
    m = {"acceptance_length": live.acceptance_length, "acceptance_rate": live.acceptance_rate,
         "num_drafts": live.num_drafts, "num_draft_tokens": live.num_draft_tokens,
         "num_accepted_tokens": live.num_accepted_tokens}
    m |= {f"accepted_per_pos/{i}": r for i, r in enumerate(live.per_position_rate)}
    windows = live_windows(sagemaker, live.per_position_rate, live.num_drafts)
    m |= {f"predicted_speedup/{p}": w["predicted_speedup"] for p, w in windows.items()}
    tags = {f"live_tuned_k.{p}": str(w["k"]) for p, w in windows.items()}
    replay_tau = registry.version_tags(tracking_uri, target_id, version).get("acceptance_length")
    if replay_tau is not None and live_below_replay(live, float(replay_tau)):
        tags["live_tau_below_replay"] = f"live {live.acceptance_length:.3f} < replayed {float(replay_tau):.3f}"
        log.warning("draft v%s: live τ %.3f (±%.3f, %d drafts) is clearly below its replayed τ %s", version,
                    live.acceptance_length, live.acceptance_length_se, live.num_drafts, replay_tau)
    registry.log_live(tracking_uri, target_id, version, m, live.num_drafts, tags)
    return m | {"flagged": "live_tau_below_replay" in tags, "live_tuned_k": {p: w["k"] for p, w in windows.items()}}


class LiveReporter:
    """Calls `report_live` every `every_s` seconds on a daemon thread; errors are logged, never raised."""

    def __init__(self, dep: VLLMDeployment, tracking_uri: str, target_id: str, every_s: float = 60.0,
                 sagemaker=None):
        self.args, self.every_s = (dep, tracking_uri, target_id, sagemaker), every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidespec-vllm-live", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                report_live(*self.args)
            except VLLMError as e:  # a server stopping (a swap, shutdown) between reading its URL and scraping it
                log.warning("live spec-decode figures not logged this time: %s", e)
            except Exception:  # a registry hiccup must not stop serving
                log.exception("live spec-decode figures not logged this time")

    def close(self) -> None:
        """Stop reporting (waits at most 5 s for a report in progress)."""
        self._stop.set()
        self._thread.join(5)
