"""Champions out of the registry into local directories, by rename: `materialize_champion` (the
champion alias, or one workload class's), `materialize_class_champions` (every class's, a class whose
alias is gone removed) — what the cycle's local deploy (`steps.deploy.local`) writes to data/drafts —
and `RegistryFollower`, the poller with which a replica on another machine keeps its own copies in
step with the registry (`serve.champion_source: registry`). A reader of a directory sees the old
bundle or the new one, never half of one."""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from ...serve.poller import Poller
from ...workspace import served_version
from .artifacts import download_champion
from .client import CANARY, CHAMPION, aliases, champion, class_champions

log = logging.getLogger(__name__)


def materialize_champion(tracking_uri: str, target_id: str, dest: Path, workload: str = "",
                         canary: bool = False) -> str | None:
    """Download the champion's bundle (``workload``: that class's own, alias ``champion-<class>``;
    ``canary``: the ``canary`` alias while one exists, what a canary replica serves) into ``dest``,
    replacing what is there by rename; scratch lives in a hidden directory beside it and is removed
    whatever happens (a failed download leaves ``dest`` as it was). Returns the version now at
    ``dest``; None when the registry has no such champion (``dest`` untouched).
    Raises MlflowException / OSError as the download does."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".deploy-", dir=dest.parent))
    try:
        got = download_champion(tracking_uri, target_id, tmp / "dl", workload, canary)
        if got is None:
            return None
        version = served_version(got)  # a bundle with version.json: draft/ (what engines load) + sidecars
        if dest.exists():
            os.replace(dest, tmp / "old")
        os.replace(got, dest)
        return version
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def materialize_class_champions(tracking_uri: str, target_id: str, root: Path,
                                known: dict[str, str] | None = None) -> dict[str, str | None]:
    """Each workload class's own champion (registry alias ``champion-<class>``) into ``root/<class>``
    (`materialize_champion`, skipped when it already holds that version); a class directory whose
    alias is gone (rolled back to the generalist) is removed (renamed away first), so the server
    falls back to the generalist. `known`: the model's aliases already read (`client.aliases`), else
    read here. Returns {class: version written, None for a class removed}."""
    want = class_champions(tracking_uri, target_id, known)
    root = Path(root)
    out: dict[str, str | None] = {}
    for workload, version in sorted(want.items()):
        if _held(root / workload) != version:
            out[workload] = materialize_champion(tracking_uri, target_id, root / workload, workload)
    for d in sorted(root.glob("*")) if root.exists() else []:
        if d.is_dir() and not d.name.startswith(".") and d.name not in want:
            trash = Path(tempfile.mkdtemp(prefix=".gone-", dir=root))
            os.replace(d, trash / d.name)
            shutil.rmtree(trash, ignore_errors=True)
            out[d.name] = None
    return out


def _held(draft_dir: Path) -> str | None:
    """The registry version `draft_dir` holds; None for none, or an unreadable version.json (a
    directory to write again)."""
    try:
        return served_version(draft_dir)
    except (ValueError, OSError):
        return None


class RegistryFollower(Poller):
    """Keeps `champion_dir` (the generalist's bundle) and `classes_dir/<class>` (each workload class's own;
    `classes_dir` None: the generalist alone, for a server with one draft) at the versions the
    registry's champion aliases of `target_id` name: every `every_s` s on a daemon thread (≤ 0: none;
    `check` runs a round) one round reads the aliases and downloads only what changed
    (`materialize_champion`) and removes the directory of a class whose alias is gone; a generalist
    alias that is gone leaves `champion_dir` as it is (its draft keeps serving). The server's champion
    watchers install from these directories. A registry that cannot be reached, or a download that
    fails, is logged (once per error) and retried at the next round: the directories are never
    half-written and what they held keeps serving. Rounds run one at a time (a rollback may call `check`
    beside the poll); `error` is the last round's failure (None after a round that reached the
    registry). `canary` (`serve.canary`): `champion_dir` holds the registry's `canary` alias while one
    exists, else the champion (`artifacts.served_by`): a canary rolled back or promoted is followed
    like any champion move."""

    what = "registry follow"

    def __init__(self, tracking_uri: str, target_id: str, champion_dir: Path, classes_dir: Path | None,
                 every_s: float, canary: bool = False):
        self.tracking_uri, self.target_id, self.canary = tracking_uri, target_id, canary
        self.champion_dir = Path(champion_dir)
        self.classes_dir = Path(classes_dir) if classes_dir is not None else None
        self.error: str | None = None
        self._lock = threading.Lock()
        self._start(every_s, "tidespec-registry-follow")

    def check(self) -> dict[str, str | None]:
        """One round; returns {workload: version downloaded now, None for a class removed} ("" the
        generalist; {} when nothing changed). Never raises: a failure is logged and kept in `error`,
        what the round wrote before it is returned."""
        out: dict[str, str | None] = {}
        with self._lock:
            try:
                self._round(out)
            except Exception as e:  # noqa: BLE001 - whatever the registry or the download raised: retried next round
                self._failed(f"{type(e).__name__}: {e}")
            else:
                if self.error is not None:
                    log.info("registry %s answers again: following %s's champions", self.tracking_uri,
                             self.target_id[:12])
                self.error = None
        for workload, v in out.items():
            d = self.classes_dir / workload if workload and self.classes_dir else self.champion_dir
            if v is None:
                log.info("registry: class %r has no champion of its own now, %s removed (the generalist serves it)",
                         workload, d)
            else:
                log.info("registry: %s v%s downloaded into %s", f"class {workload!r}'s champion" if workload
                         else "canary or champion" if self.canary else "champion", v, d)
        return out

    def first_round(self, timeout_s: float) -> bool:
        """One round (`check`) on a daemon thread, waited for at most `timeout_s` s: a server's start
        must not wait out MLflow's retries on a registry that does not answer. True when it finished
        in time (its outcome: `error`); the round that goes on writes by rename all the same."""
        t = threading.Thread(target=self.check, name="tidespec-registry-first", daemon=True)
        t.start()
        t.join(timeout_s)
        return not t.is_alive()

    def _round(self, out: dict[str, str | None]) -> None:
        # one registry call while nothing moves: the champion's alias alone, or every alias at once (a canary
        # replica's two, the class aliases) — `get_registered_model` reads every version row, so not for one alias
        known = None if self.classes_dir is None and not self.canary else aliases(self.tracking_uri, self.target_id)
        if known is None:
            info = champion(self.tracking_uri, self.target_id)
            version = info.version if info is not None else None
        else:
            version = (known.get(CANARY) if self.canary else None) or known.get(CHAMPION)  # `served_by`'s rule
        if version is not None and _held(self.champion_dir) != version:
            v = materialize_champion(self.tracking_uri, self.target_id, self.champion_dir, canary=self.canary)
            if v is not None:  # None: the alias went away meanwhile
                out[""] = v
        if self.classes_dir is not None:
            out.update(materialize_class_champions(self.tracking_uri, self.target_id, self.classes_dir, known))

    def _failed(self, error: str) -> None:
        if error != self.error:  # logged once per error
            log.warning("registry %s: following %s's champions failed, the drafts in %s keep serving (retried "
                        "every round): %s", self.tracking_uri, self.target_id[:12], self.champion_dir.parent, error)
        self.error = error
