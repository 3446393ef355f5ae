"""Draft hot-swap: `POST /admin/draft` (bearer token in $TIDESPEC_ADMIN_TOKEN) and the
`ChampionWatcher`, the two ways a live `tidespec serve` changes drafts. Both go through one
`DraftInstaller` (`engine.build.install_draft` under a lock, then /metrics' `draft_info`), which
logs every swap with the version now served. The engine swaps between steps: requests in flight
finish on the draft they started with. A draft an operator installs is pinned (`DraftPin`): the
watcher leaves it serving, and says so once, until `DELETE /admin/draft/pin`."""
from __future__ import annotations

import contextlib
import hmac
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Protocol

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..config.serve_launch import ADMIN_TOKEN_ENV
from ..engine.build import install_draft
from ..engine.speculative import Engine
from ..errors import TidespecError
from ..workspace import class_dirs, served_version
from .errors import OpenAIError
from .poller import Poller

log = logging.getLogger(__name__)


class DraftSwap(BaseModel):
    """`POST /admin/draft` body: exactly one of `path` (a draft checkpoint dir inside the server's
    drafts dir) or `version` (a registry version, 2 or "2", or an alias: "champion", "challenger")."""

    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    version: Annotated[int, Field(ge=1)] | str | None = None

    @field_validator("version")
    @classmethod
    def _as_text(cls, v):
        return None if v is None else str(v)


class DraftPin:
    """The version the champion watcher must leave serving (None: the server follows the champion):
    one an operator installed with `POST /admin/draft`, or one a live guard's switchback trial holds
    while it serves two versions in turn; `by` says which. Thread-safe."""

    def __init__(self):
        self._lock, self._version, self._by = threading.Lock(), None, "POST /admin/draft"
        self.swap = threading.Lock()  # held across "check the pin, install": an operator's swap and the watcher's

    @property
    def version(self) -> str | None:
        with self._lock:
            return self._version

    @property
    def by(self) -> str:
        """Who set the pin (a log line names it)."""
        with self._lock:
            return self._by

    def set(self, version: str | None, by: str = "POST /admin/draft") -> str | None:
        """Pin `version` (None: release) on behalf of `by`; returns the previous pin."""
        with self._lock:
            old, self._version, self._by = self._version, version, by
            return old


class DraftInstaller:
    """`installer(path, version, by, workload)`: the draft checkpoint at `path` into `engine`
    (`engine.build.install_draft`, one swap at a time; `workload` "" the generalist, else that class's
    own), then `on_installed(engine.draft_versions)` (/metrics). Returns {"draft_version",
    "suffix_corpus_tokens"}; raises ValueError or OSError for a draft the engine refuses (the old one
    keeps serving). `remove(workload)`: that class falls back to the generalist."""

    def __init__(self, engine: Engine, on_installed: Callable[[dict], None]):
        self.engine, self.on_installed = engine, on_installed
        self._lock = threading.Lock()

    def __call__(self, path: Path, version: str | None, by: str = "the champion watcher", workload: str = "") -> dict:
        with self._lock:
            old = self.engine.draft_versions.get(workload)
            out = install_draft(self.engine, path, version, workload)
            self.on_installed(self.engine.draft_versions)
        what = f"class {workload!r}'s draft" if workload else "draft"
        log.info("serving %s %s (was %s), installed by %s from %s", what, out["draft_version"], old, by, path)
        return out

    def remove(self, workload: str, by: str = "the class champion watcher") -> None:
        with self._lock:
            old = self.engine.draft_versions.get(workload)
            self.engine.set_draft(None, workload=workload)
            self.on_installed(self.engine.draft_versions)
        log.info("class %r's draft %s removed by %s: the generalist serves it", workload, old, by)


class ServesDraft(Protocol):
    """What the champion watcher watches: the embedded `Engine`, or any serving backend
    (`backends.base.Backend`: vLLM, SGLang). `draft_version`: the registry version served (None:
    none, or not from the registry)."""

    @property
    def draft_version(self) -> str | None: ...


class ChampionWatcher(Poller):
    """Polls `directory/version.json` every `every_s` s on a daemon thread and calls
    `install(directory, version)` when it names another version than the engine serves: how a
    running `tidespec serve` picks up the draft a `tide_cycle` run deployed (deploy.local writes the
    directory by rename, so a poll never sees half a draft; so does a replica's registry follower,
    `adapters.registry.follow`). A version the engine refuses is
    logged once and not retried until the directory changes again; an unreadable version.json is
    logged once and polling goes on (the next deploy's rename replaces it)."""

    what = "champion poll"

    def __init__(self, directory: Path, every_s: float, engine: ServesDraft, install: Callable[[Path, str], dict],
                 pin: DraftPin | None = None):
        self.directory, self.every_s, self.engine, self.install = Path(directory), every_s, engine, install
        self.pin = pin
        self._held: tuple | None = None  # (champion, pinned) last logged as held back by a pin
        self._refused: str | None = None
        self._unreadable: str | None = None  # the last error reading the directory's version.json
        self._start(every_s, "tidespec-champion-watch")

    def check(self) -> str | None:
        """One poll; returns the version installed now, or None."""
        try:
            v = served_version(self.directory)
        except (ValueError, OSError) as e:  # a malformed version.json: keep polling (a rename replaces it)
            if str(e) != self._unreadable:  # logged once per error
                self._unreadable = str(e)
                log.error("champion at %s unreadable, draft %s keeps serving: %s", self.directory,
                          self.engine.draft_version, e)
            return None
        self._unreadable = None
        if v is None or v == self.engine.draft_version or v == self._refused:
            return None
        with self.pin.swap if self.pin else contextlib.nullcontext():  # no operator's swap in between
            return self._install(v)

    def _install(self, v: str) -> str | None:
        pinned = self.pin.version if self.pin else None
        if pinned is not None:
            if self._held != (v, pinned):  # logged once per champion and pin
                self._held = (v, pinned)
                log.warning("champion %s at %s not installed: draft %s is pinned by %s "
                            "(DELETE /admin/draft/pin to follow the champion again)", v, self.directory, pinned,
                            self.pin.by)
            return None
        try:
            self.install(self.directory, v)
        except (ValueError, OSError, TidespecError) as e:
            self._refused = v
            log.error("champion %s at %s refused, draft %s keeps serving: %s", v, self.directory,
                      self.engine.draft_version, e)
            return None
        return v


class ClassChampionWatcher(Poller):
    """Polls `root` (data/drafts/classes: one champion bundle per workload class, written by
    `deploy.local.deploy_class_champions`, or a replica's copies the registry follower writes) every
    `every_s` s on a daemon thread: installs a class's draft when its directory names another
    version than the engine serves for it, and drops the draft of a class whose directory is gone
    (rolled back to the generalist). A version the engine refuses (wrong target, over
    `engine.draft_memory_mb`) is logged once per version and not retried."""

    what = "class champion poll"

    def __init__(self, root: Path, every_s: float, engine: Engine, install: DraftInstaller):
        self.root, self.every_s, self.engine, self.install = Path(root), every_s, engine, install
        self._refused: dict[str, str] = {}
        self._start(every_s, "tidespec-class-champion-watch")

    def check(self) -> dict[str, str | None]:
        """One poll; returns {class: version installed, None for a class dropped}."""
        out: dict[str, str | None] = {}
        dirs = class_dirs(self.root)
        served = self.engine.draft_versions
        for workload, d in dirs.items():
            try:
                v = served_version(d)
            except (ValueError, OSError) as e:
                log.error("class %r champion at %s unreadable: %s", workload, d, e)
                continue
            if v is None or v == served.get(workload) or self._refused.get(workload) == v:
                continue
            try:
                out[workload] = self.install(d, v, workload=workload)["draft_version"]
            except (ValueError, OSError, TidespecError) as e:
                self._refused[workload] = v
                log.error("class %r champion %s at %s refused, %s keeps serving it: %s", workload, v, d, workload,
                          served.get(workload) or "the generalist", e)
        for workload in set(served) - set(dirs) - {""}:
            self.install.remove(workload)
            out[workload] = None
        return out


def admin_router(engine: Engine, install: DraftInstaller, drafts_dir: Path | None, admin_token: str | None,
                 load_version: Callable[[str], Path] | None, pin: DraftPin | None = None) -> APIRouter:
    """`POST /admin/draft`: swap the served draft and pin it (the champion watcher leaves it
    serving); `DELETE /admin/draft/pin`: release the pin (the watcher installs the champion at its
    next poll). Errors (OpenAI's envelope): 403 when `admin_token` is None (admin disabled), 401
    for a missing or wrong bearer token, 400 naming the field for a bad body (neither or both
    fields; a path outside `drafts_dir`; a version with no registry, `load_version` None), 404 for a
    version `load_version` does not know (LookupError), 409 for a draft the engine refuses (the old
    one keeps serving). POST returns {"draft_version", "pinned"} (plus "suffix_corpus_tokens" when
    the engine has a suffix proposer); DELETE {"draft_version", "released"} (the pin it removed)."""
    router = APIRouter()
    pin = pin or DraftPin()

    @router.post("/admin/draft")
    def swap(body: DraftSwap, request: Request):
        authorize(request, admin_token)
        if (body.path is None) == (body.version is None):
            raise OpenAIError("send exactly one of path (a draft dir) or version (registry version or alias)",
                              param="path")
        if body.path is not None:
            path, version = inside(body.path, drafts_dir), Path(body.path).name
        else:
            path, version = _download(body.version, load_version), body.version
        with pin.swap:  # installed and pinned before the champion watcher looks again
            try:
                out = install(path, version, by="POST /admin/draft")
            except (ValueError, OSError) as e:
                raise OpenAIError(f"draft refused, the old one keeps serving: {e}", status=409,
                                  code="draft_refused") from None
            pin.set(out["draft_version"])
        if engine.suffix is None:  # tokens of the global suffix tree installed: only with the suffix proposer
            out.pop("suffix_corpus_tokens")
        return out | {"pinned": True}

    @router.delete("/admin/draft/pin")
    def unpin(request: Request):
        authorize(request, admin_token)
        old = pin.set(None)
        log.info("draft pin %s released: the server follows the champion again", old)
        return {"draft_version": engine.draft_version, "released": old}

    return router


def _download(version: str, load_version: Callable[[str], Path] | None) -> Path:
    if load_version is None:
        raise OpenAIError("this server has no registry (set MLFLOW_TRACKING_URI): swap by path", param="version")
    try:
        return load_version(version)
    except LookupError as e:
        raise OpenAIError(str(e), param="version", status=404, code="version_not_found") from None


def authorize(request: Request, token: str | None) -> None:
    """Raise OpenAIError 403 when admin is disabled (`token` None or empty), 401 unless the request
    carries `Authorization: Bearer <token>` (compared in constant time)."""
    if not token:
        raise OpenAIError(f"admin is disabled: start the server with {ADMIN_TOKEN_ENV} set", status=403)
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
        raise OpenAIError("missing or wrong bearer token", status=401, headers={"WWW-Authenticate": "Bearer"})


def inside(path: str, root: Path | None) -> Path:
    """`path` resolved against `root`; raises OpenAIError 400 (param "path") unless it lies inside
    `root` (no traversal, no symlink escape) or when there is no `root`."""
    if root is None:
        raise OpenAIError("this server allows no draft paths (no drafts dir configured): swap by version",
                          param="path")
    base = Path(root).resolve()
    p = (base / path).resolve() if not os.path.isabs(path) else Path(path).resolve()
    if p != base and base not in p.parents:
        raise OpenAIError(f"path {path!r} is outside the drafts dir {base}", param="path")
    return p
