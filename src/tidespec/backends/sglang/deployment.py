"""Deploy the champion into an SGLang server this process started: in place, never a second server.

SGLang runs the target on a GPU node at `mem_fraction_static`, where a second server with its own
copy of the target does not fit, so a new champion is loaded into the running server's draft
(`backends.sglang.load_draft_in_place`: SGLang's draft-only weight update inside a pause of its
scheduler; running requests are retracted and resume, none fails). Refused, with the reason, when
the new draft's config differs from the served one's (shapes, vocabulary size, aux layers: SGLang
sized its buffers for the first) or its draft→target vocabulary map does (SGLang's EAGLE worker
reads it once at start), or the server runs no draft: the served draft keeps serving, and
restarting `tidespec serve --backend sglang` serves the new one. The swap script refuses, before
touching the server, tensors whose names or shapes differ from the served draft's files (SGLang
0.5.23 does not catch a loader error in its tensor update: its scheduler, and the server, would
die). A load that fails part-way loads the served draft's files again.

Live figures per version: SGLang's counters (`backends.sglang.metrics`) less those at the load
(`counters_base`), which `backends.live` logs and acts on, as behind vLLM; what serves is one
`backends.base.ServedDraft`, replaced whole at a swap.
"""
from __future__ import annotations

import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path

from ...engine.spec_counters import SpecDecodeCounters
from ...workspace import copy_engine_files, private_dir, served_version
from .. import sglang
from ..base import ServedDeployment, ServedDraft
from ..vllm.deployment import config_change

log = logging.getLogger(__name__)


class SGLangDeployment(ServedDeployment):
    """The SGLang server serving `launch.model_path` with the champion as its EAGLE3 draft.
    `state_dir`: private copies of deployed drafts and the server's log. `served`: what serves now
    (`backends.base.ServedDraft`); `draft_version`: its registry version, as
    `serve.admin.ChampionWatcher` expects of an engine."""

    def __init__(self, launch: sglang.SGLangLaunch, state_dir: Path, ready_timeout_s: float = 900.0):
        self.launch, self.state_dir, self.ready_timeout_s = launch, Path(state_dir), ready_timeout_s
        self.server: sglang.SGLangServer | None = None
        super().__init__("SGLang")

    @property
    def url(self) -> str | None:
        """Base URL of the SGLang server (None before `start`)."""
        return self.server.cfg.url if self.server else None

    def start(self, bundle: Path | None) -> SGLangDeployment:
        """Start SGLang with the draft in `bundle` (a draft bundle or flat checkpoint; None or
        missing: the target alone). Raises SGLangUnavailable (with the fix) / SGLangError."""
        draft, version = None, None
        if bundle is not None and Path(bundle).exists():
            version = served_version(Path(bundle))
            draft = self._private_copy(Path(bundle), version)
        cfg = replace(self.launch, draft_path=str(draft) if draft else None)
        self.server = sglang.SGLangServer(cfg, self.state_dir / "logs" / "sglang.log",
                                          ready_timeout_s=self.ready_timeout_s).start()
        self.served = ServedDraft(version if draft else None, cfg.url, draft)
        log.info("SGLang serves draft %s at %s", self.draft_version, cfg.url)
        return self

    def install(self, bundle: Path, version: str | None = None) -> dict:
        """Load the draft in `bundle` into the running server. Returns {"draft_version", "url",
        "mode": "in_place", "seconds", "load_seconds", "flushed", "devices" (one per TP rank)}.
        Raises SGLangError naming why it cannot go in place (SGLangRefused: stopped before any
        change), or what SGLang answered: the served draft keeps serving."""
        with self._swap:
            t0 = time.perf_counter()
            version = served_version(Path(bundle)) or version
            if self.server is None or self.draft_dir is None:
                raise sglang.SGLangError("the SGLang server runs no draft (started on the target alone): restart "
                                         "`tidespec serve --backend sglang` to serve one")
            draft = self._private_copy(Path(bundle), version)
            why = config_change(self.draft_dir, draft) or sglang.vocab_map_change(self.draft_dir, draft)
            if why:
                shutil.rmtree(draft, ignore_errors=True)
                raise sglang.SGLangError(f"draft {version} cannot be loaded in place: {why}; restart `tidespec "
                                         "serve --backend sglang` to serve it")
            served, before = self._hide()
            try:
                res = self._load(draft, served)
            except BaseException:
                self.served = served
                shutil.rmtree(draft, ignore_errors=True)  # not served: the served draft's own copy stays
                raise
            self.served = ServedDraft(version, served.url, draft, self._counters() or before)
            log.info("SGLang now serves draft %s, loaded in place in %.3f s (radix cache flushed: %s)", version,
                     res["load_seconds"], res["flushed"])
            return {"draft_version": version, "url": self.url, "mode": "in_place",
                    "seconds": time.perf_counter() - t0, "load_seconds": res["load_seconds"],
                    "flushed": res["flushed"], "devices": res["devices"]}

    def reload(self) -> dict:
        """Load the served draft's own files again, in place. Raises SGLangError."""
        with self._swap:
            if self.server is None or self.draft_dir is None:
                raise sglang.SGLangError("no draft served to reload")
            served, before = self._hide()
            try:
                res = self._load(served.draft_dir, served)
            except BaseException:
                self.served = served
                raise
            self.served = replace(served, counters_base=self._counters() or before)
            log.info("SGLang reloaded draft %s in place in %.3f s", self.draft_version, res["load_seconds"])
            return res

    def _load(self, draft: Path, served: ServedDraft) -> dict:
        cfg = self.server.cfg
        try:
            return sglang.load_draft_in_place(cfg.url, draft, cfg.python)
        except sglang.SGLangRefused:  # nothing changed: the served draft still serves
            raise
        except sglang.SGLangError as e:  # maybe partly loaded: put the served draft's weights back
            if draft == served.draft_dir:
                raise
            try:
                sglang.load_draft_in_place(cfg.url, served.draft_dir, cfg.python)
            except sglang.SGLangError as again:
                raise sglang.SGLangError(f"{e}; loading the served draft {served.version} again failed too "
                                         f"({again}): restart the server") from None
            raise sglang.SGLangError(f"{e}; the served draft {served.version} was loaded again") from None

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None:
        """The cumulative spec-decode counters of the server at `url` (default: this one's; None:
        none exported, or no server). Raises SGLangError when it does not answer."""
        if self.server is None:
            return None
        return sglang.scrape(url or self.server.cfg.url, self.server.cfg.num_steps)

    def _private_copy(self, bundle: Path, version: str | None) -> Path:
        self._n += 1
        dest = private_dir(self.state_dir / "drafts") / f"{self._n}-v{version or 'local'}"
        shutil.rmtree(dest, ignore_errors=True)
        try:
            return copy_engine_files(bundle, dest)
        except FileNotFoundError as e:
            raise sglang.SGLangError(f"{e}; deploy a registry version there") from None

    def close(self) -> None:
        """Stop the SGLang server (its whole process group)."""
        if self.server:
            self.server.stop()
