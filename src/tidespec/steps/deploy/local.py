"""Local deploy: put the registry champion where the local engine serves from, atomically.

The serving directory is a draft bundle (`workspace.make_bundle`): `draft/` holds exactly what
vLLM and SGLang load (config.json + model.safetensors), the suffix corpus and a `version.json`
(which registry version it is) sit beside it. It is replaced by rename (never half-written:
`adapters.registry.follow`, which a replica following the registry uses too). A
running engine picks it up with `reload_if_changed`, between requests, so requests in flight finish on the old draft.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import httpx

from ...adapters import registry
from ...engine.build import install_draft
from ...workspace import served_version

log = logging.getLogger(__name__)


def deploy_champion(tracking_uri: str, target_id: str, dest: Path, workload: str = "") -> dict:
    """Download the champion's bundle (``workload``: that class's own) into `dest`, replacing it
    atomically (`registry.materialize_champion`). Returns {"version", "path"}; {"version": None,
    "path": None} when the registry has no such champion."""
    version = registry.materialize_champion(tracking_uri, target_id, Path(dest), workload)
    return {"version": version, "path": str(dest) if version is not None else None}


def deploy_class_champions(tracking_uri: str, target_id: str, root: Path) -> dict[str, str | None]:
    """Each workload class's own champion (registry alias `champion-<class>`) into `root/<class>`,
    skipped when it already holds that version; a class directory whose alias is gone (rolled back
    to the generalist) is removed, so the server falls back to the generalist
    (`registry.materialize_class_champions`). Returns {class: version deployed, None for a class removed}."""
    return registry.materialize_class_champions(tracking_uri, target_id, Path(root))


def reload_if_changed(engine, dest: Path) -> bool:
    """Swap the engine's draft (and, with the suffix proposer, the global suffix tree deployed with
    it) when `dest` holds another version. Returns True on a swap.

    A draft for another target or with wrong shapes raises ValueError and the old one keeps serving.
    """
    v = served_version(dest)
    if v is None or v == engine.draft_version:
        return False
    install_draft(engine, Path(dest), v)
    return True


SERVER_URL_ENV = "TIDESPEC_SERVER_URL"


def notify_server(dest: Path, url: str | None = None, token: str | None = None, timeout_s: float = 60.0) -> dict:
    """Tell a running `tidespec serve` (at `url`, default $TIDESPEC_SERVER_URL) to swap to the draft
    at `dest` (POST /admin/draft {"path": dest's name}, bearer $TIDESPEC_ADMIN_TOKEN); `dest` must be
    inside the server's drafts dir (data/drafts). Never raises: returns {"server": None} when no
    server is configured, {"status", "draft_version"} or {"error"}: a server that is down loads
    the champion from `dest` when it starts."""
    url = url or os.environ.get(SERVER_URL_ENV)
    if not url:
        return {"server": None}
    token = token or os.environ.get("TIDESPEC_ADMIN_TOKEN", "")
    try:
        r = httpx.post(f"{url.rstrip('/')}/admin/draft", json={"path": Path(dest).name},
                       headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        return {"server": url, "error": f"unreachable: {e}"}
    body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code != 200:
        err = body.get("error") if isinstance(body.get("error"), dict) else {}  # OpenAI's envelope
        return {"server": url, "status": r.status_code, "error": err.get("message") or r.text[:200]}
    return {"server": url, "status": 200, "draft_version": body.get("draft_version")}
