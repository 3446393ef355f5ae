"""Live acceptance behind a serving engine this process deployed (vLLM: `deploy.vllm`, SGLang:
`deploy.sglang`): the served version's live figures logged to the registry (`report_live`), and
acted on (`LiveGuard`: reload in place, then roll back), on a reporter thread (`LiveReporter`).

A deployment here is what both deploy modules build: `served` (a `ServedDraft`, replaced whole at
each swap, never changed in place, so a reader on another thread sees one consistent state; its
`url` is None while weights are being loaded in place), `scrape(url)` (the cumulative
`SpecDecodeCounters` of the server at `url`, None when it exports none) and `reload()`.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ...adapters import registry
from ...adapters.spec_counters import SpecDecodeCounters, live_below_replay
from ...errors import TidespecError
from ..tuning import live_windows

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServedDraft:
    """What an engine server serves now, as one value: `version` (the registry version; None: no
    draft, or not from the registry), `url` (the server's base URL; None: not started), `draft_dir`
    (the private copy of the draft's engine files loaded; None: the target alone) and
    `counters_base` (the server's cumulative counters when this version was loaded in place; None: a
    fresh server, whose counters are the version's alone)."""
    version: str | None = None
    url: str | None = None
    draft_dir: Path | None = None
    counters_base: SpecDecodeCounters | None = None

    def own(self, now: SpecDecodeCounters | None) -> SpecDecodeCounters | None:
        """`now` (the server's cumulative counters) less `counters_base`: this version's own drafts."""
        return now - self.counters_base if now is not None and self.counters_base is not None else now


class ServedDeployment:
    """What the deployments of an engine server (`deploy.vllm`, `deploy.sglang`) share: `served` (a
    `ServedDraft`) and its fields as the properties `serve.admin.ChampionWatcher` and the tests read,
    hiding it before an in-place load (`_hide`) and reading the counters at a swap (`_counters`).
    Subclasses set `served` and `engine` (its name, for logs) and define `scrape(url)`."""

    engine = "engine"
    served: ServedDraft

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None:
        raise NotImplementedError

    @property
    def draft_version(self) -> str | None:
        """The registry version served (None: no draft, or not from the registry)."""
        return self.served.version

    @property
    def draft_dir(self) -> Path | None:
        """The engine dir of the draft served now (None: the target alone)."""
        return self.served.draft_dir

    @property
    def counters_base(self) -> SpecDecodeCounters | None:
        """The server's counters when the served version was loaded in place (None: a fresh server)."""
        return self.served.counters_base

    def _hide(self) -> tuple[ServedDraft, SpecDecodeCounters | None]:
        """Before an in-place load: the served state and the server's counters now, the state
        published with url None meanwhile (no live figures while the weights change)."""
        served = self.served
        self.served = replace(served, url=None)
        return served, self._counters()

    def _counters(self) -> SpecDecodeCounters | None:
        """`scrape()`, None when the server does not answer: a metrics hiccup must not fail a swap
        (the counters read before the load stand in)."""
        try:
            return self.scrape()
        except TidespecError as e:
            log.warning("%s's counters unreadable at a swap: %s", self.engine, e)
            return None


def scrape_served(dep) -> tuple[ServedDraft, SpecDecodeCounters | None]:
    """`dep.served` and the counters of the server it names, read while it served that state
    (`dep.scrape(served.url)`): None while an in-place load runs (url None) or when a swap landed
    during the scrape (the state changed), never one version's drafts credited to another. Raises
    what `dep.scrape` raises (a blue server stopped by a blue/green swap)."""
    served = dep.served
    if served.url is None:
        return served, None
    now = dep.scrape(served.url)
    return served, (now if dep.served is served else None)


def report_live(dep, tracking_uri: str, target_id: str, sagemaker=None) -> dict | None:
    """Scrape the serving engine's counters (`dep.scrape()`) and log them as the served version's live figures (MLflow
    run metrics `live/*`, step = drafts so far). A version whose live τ is clearly below the τ its
    evaluation replayed (`spec_counters.live_below_replay`) gets tag `live_tau_below_replay` = both
    figures and a warning naming them. With `sagemaker` (`deploy.sagemaker`), each endpoint
    profile's window is tuned again from the measured per-position acceptance (`tuning.live_windows`,
    ≥ 100 drafts): tag `live_tuned_k.<profile>` (what `tidespec deploy sagemaker` then applies) and
    metric `live/predicted_speedup/<profile>`. Returns the logged metrics, or None when there is
    nothing to log: no registry version served, or no counters exported (live τ unknown, never 0)."""
    served, now = scrape_served(dep)
    version, live = served.version, served.own(now)  # loaded in place: the version's own drafts only
    if version is None or live is None or not live.num_drafts:
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


class LiveGuard:
    """Acts on live acceptance behind an engine server (vLLM, SGLang), one `check()` per round
    (`LiveReporter` calls it).

    Each round judges the served version's counters since the last judged window, once the window
    holds `min_drafts` drafts: clearly below the version's replayed τ (`replayed(version)`;
    `spec_counters.live_below_replay`, 3 SE) or not. Hysteresis: `confirm` windows in a row below
    trigger an action, any window not below resets the count, and each version gets each action
    once:
    1. **reload** the served draft in place (its own files again, prefix cache reset): what restores
       a draft that decayed or was corrupted while serving (vLLM #41838: acceptance decaying over
       hours, restored by a prefix-cache reset; SGLang PR #31674: draft weights lost after a memory
       release);
    2. still below after the reload: **roll back** — `rollback(version, reason)` (the server wires
       the registry: the champion alias moved back, the decision and reason recorded, the restored
       champion deployed, which the champion watcher then loads; it returns the restored version).
       A version restored by a rollback is never rolled back by this guard (no cascade).
    `rollback` None: reload only. Returns from `check()` the action taken ("reloaded",
    "rolled_back") or None."""

    def __init__(self, dep, replayed: Callable[[str], float | None],
                 rollback: Callable[[str, str], str | None] | None = None, min_drafts: int = 100,
                 confirm: int = 2):
        self.dep, self.replayed, self.rollback = dep, replayed, rollback
        self.min_drafts, self.confirm = min_drafts, confirm
        self._version: str | None = None
        self._start: SpecDecodeCounters | None = None
        self._below = 0
        self._reloaded: set[str] = set()
        self._rolled: set[str] = set()
        self._restored: set[str] = set()

    def check(self) -> str | None:
        served, now = scrape_served(self.dep)
        version = served.version
        if version is None or now is None:
            return None
        if version != self._version or self._start is None or now.num_drafts < self._start.num_drafts:
            self._version, self._start, self._below = version, now, 0  # a new version, or a new server
            return None
        window = now - self._start
        if window.num_drafts < self.min_drafts:
            return None
        self._start = now
        replay = self.replayed(version)
        if replay is None or not live_below_replay(window, replay, min_drafts=self.min_drafts):
            self._below = 0
            return None
        self._below += 1
        if self._below < self.confirm:
            return None
        self._below = 0
        reason = (f"live τ {window.acceptance_length:.3f} ± {window.acceptance_length_se:.3f} over the last "
                  f"{window.num_drafts} drafts, {self.confirm} windows in a row, clearly below its replayed τ "
                  f"{replay:.3f}")
        return self._act(version, reason)

    def _act(self, version: str, reason: str) -> str | None:
        if version not in self._reloaded:
            self._reloaded.add(version)
            self.dep.reload()
            log.warning("reloaded draft %s in place: %s", version, reason)
            return "reloaded"
        if self.rollback is None or version in self._rolled or version in self._restored:
            return None
        self._rolled.add(version)
        back = self.rollback(version, f"{reason}, after a reload")
        if back is not None:
            self._restored.add(str(back))
        log.warning("rolled back draft %s to %s: %s, after a reload", version, back, reason)
        return "rolled_back"


class LiveReporter:
    """Calls `report_live` and then `guard.check()` (a `LiveGuard`, or None) every `every_s` seconds
    on a daemon thread; errors are logged, never raised."""

    def __init__(self, dep, tracking_uri: str, target_id: str, every_s: float = 60.0,
                 sagemaker=None, guard: LiveGuard | None = None):
        self.args, self.every_s, self.guard = (dep, tracking_uri, target_id, sagemaker), every_s, guard
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidespec-live-acceptance", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                report_live(*self.args)
                if self.guard:
                    self.guard.check()
            except TidespecError as e:  # a server stopping (a swap, shutdown) between reading its URL and scraping it
                log.warning("live spec-decode figures not logged this time: %s", e)
            except Exception:  # a registry hiccup must not stop serving
                log.exception("live spec-decode figures not logged this time")

    def close(self) -> None:
        """Stop reporting (waits at most 5 s for a report in progress)."""
        self._stop.set()
        self._thread.join(5)
