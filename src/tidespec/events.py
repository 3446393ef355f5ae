"""Prefect events adapter: what tidespec tells the orchestrator (`prefect.events.emit_event`).

`tidespec.capture.threshold` (resource `tidespec.snapshot.<snapshot_id>`) is emitted when a
sealed snapshot should start a cycle: enough new tokens, or a workload drift above
`curate.drift_threshold`. A Prefect deployment trigger on that event name runs `tide_cycle`
(prefect.yaml). Events go only to the server in PREFECT_API_URL (never an ephemeral server).
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
CAPTURE_THRESHOLD = "tidespec.capture.threshold"


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
