"""The OpenAI-compatible HTTP server over the embedded engine (FastAPI + uvicorn): `tidespec serve`
(`build_app`).

`POST /v1/completions`, `POST /v1/chat/completions` (streamed as SSE; every field honoured or
refused with a 400 naming it), `GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus, names
after vLLM's spec-decode metrics, prefix `tidespec:`), `POST /admin/draft` (bearer token: the draft
swapped between engine steps). With an API key the OpenAI routes take it (`serve.auth`). One
thread steps the engine; beyond `serve.max_queue` requests get 429; a request the engine fails gets
500 with its request id. Composes the rooms of `tidespec.serve`. More: docs/design/serve.md.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from fastapi import FastAPI

from ..capture.recent import RecentRecords
from ..config import ServeParams
from ..engine.speculative import Engine
from .admin import ADMIN_TOKEN_ENV, ChampionWatcher, ClassChampionWatcher, DraftInstaller, DraftPin, admin_router
from .auth import api_key_middleware
from .draft_health import EngineSource, HealthReport
from .engine_loop import EngineLoop
from .errors import install_error_handlers
from .guard import LiveGuard
from .judge import PairedJudge, TeacherForced
from .lifespan import closing
from .metrics import ServeMetrics, metrics_response
from .openai import openai_router
from .serving import OpenAIServing
from .textlog import TextLog

log = logging.getLogger(__name__)

__all__ = ["ADMIN_TOKEN_ENV", "build_app"]


def build_app(engine: Engine, tokenizer=None, serve: ServeParams | None = None, *, model: str = "tidespec",
              drafts_dir: Path | None = None, admin_token: str | None = None, api_key: str | None = None,
              load_version: Callable[[str], Path] | None = None, text_capture=None,
              watch_dir: Path | None = None, watch_s: float = 5.0, watch_classes_dir: Path | None = None,
              rollback: Callable[..., None] | None = None) -> FastAPI:
    """The FastAPI app. `tokenizer`: HF fast tokenizer (None: token-id prompts only, no chat, no stop strings); `serve`:
    the limits (max_queue, request_timeout_s in s, max_tokens: default and cap of a request's max_tokens, which must be
    resolved: `Params.serve_resolved()`; default_temperature; replica_id, the label on every series of /metrics:
    `serve.metrics.Labelled`); `model`: the served model id (a request naming another gets 404, as in vLLM);
    `drafts_dir`: `/admin/draft` paths must lie inside it; `admin_token`: bearer token for /admin (None: admin disabled,
    403); `api_key`: the key every other route takes as a bearer token, 401 otherwise (None: open; /health and /metrics
    stay open unless `serve.auth_health_metrics`: `serve.auth`); `load_version(v)`: registry version or alias → local
    checkpoint dir (raises LookupError for an unknown one); `text_capture`
    (`capture.text.TextCapture`, or a `serve.textlog.TextLog` over one, `capture.mode: text`): each
    finished request's request and response bodies are logged in the Data Capture format;
    `watch_dir` (the champion dir: data/drafts/champion, or a replica's copy of the registry's,
    `adapters.registry.follow`): every `watch_s` s the server
    installs the version the cycle's deploy step put there (`ChampionWatcher`), and the workload
    classes' own champions under `watch_classes_dir` (data/drafts/classes: `ClassChampionWatcher`);
    every `serve.health_check_s` s the draft-health report (`serve.draft_health`) and the live guard
    (`serve.guard.LiveGuard`) run; the guard reloads a draft below its own live acceptance (with
    `load_version`) and calls `rollback(version, reason, workload)` for a version clearly worse
    than its predecessor on the same recent traffic ("" the generalist; None: no rollback). At shutdown: the watcher
    stops, requests in flight finish, the engine's capture sink (if any) is flushed (its counters
    are served on /metrics), text capture is closed. Every error is answered in OpenAI's envelope
    (`serve.errors`). Raises ValueError for unresolved max_tokens, max_tokens ≥ the engine's
    max_seq_len, an empty `api_key`, or `serve.auth_health_metrics` without one."""
    cfg = serve or ServeParams()
    auth = api_key_middleware(api_key, cfg.auth_health_metrics)
    if cfg.max_tokens is None:
        raise ValueError("serve.max_tokens is unresolved: pass Params.serve_resolved() (engine.max_new_tokens)")
    if cfg.max_tokens >= engine.cfg.max_seq_len:
        raise ValueError(f"serve.max_tokens ({cfg.max_tokens}) must be < the engine's max_seq_len "
                         f"({engine.cfg.max_seq_len}): prompt and completion share the sequence")
    writer = engine.capture
    textlog = text_capture if isinstance(text_capture, TextLog) else TextLog(text_capture)
    loop, metrics = EngineLoop(engine), ServeMetrics(engine.cfg.num_draft_tokens, cfg.replica_id)
    metrics.set_drafts(engine.draft_versions)
    if writer is not None and hasattr(writer, "collector"):
        metrics.registry.register(writer.collector())
    install, pin = DraftInstaller(engine, metrics.set_drafts), DraftPin()
    watcher = (ChampionWatcher(watch_dir, watch_s, engine, install, pin) if watch_dir is not None and watch_s > 0
               else None)
    classes = (ClassChampionWatcher(watch_classes_dir, watch_s, engine, install)
               if watch_classes_dir is not None and watch_s > 0 else None)
    guard = HealthReport(engine, metrics, cfg.health_check_s,
                         _guard(engine, install, load_version, rollback if cfg.auto_rollback else None))
    app = FastAPI(title="tidespec", version="0.1", middleware=auth, lifespan=closing(
        watcher and watcher.close, classes and classes.close, guard.close, loop.close, getattr(writer, "flush", None),
        textlog.close))
    app.state.loop, app.state.metrics, app.state.guard = loop, metrics, guard
    app.include_router(openai_router(OpenAIServing(engine, loop, metrics, tokenizer, cfg, model, textlog)))
    app.include_router(admin_router(engine, install, drafts_dir, admin_token, load_version, pin))
    app.add_api_route("/metrics", lambda: metrics_response(metrics.registry, metrics.labels), methods=["GET"])
    install_error_handlers(app)
    return app


def _guard(engine, install, load_version, rollback) -> LiveGuard | None:
    """The live guard over the engine (`serve.guard.LiveGuard`, `serve.draft_health.EngineSource`),
    its evidence the same-traffic scoring (`serve.judge`) over the capture sink's recent records,
    with drafts from the registry; reload only (said once) when a rollback could not be judged: no
    hidden-state capture, or no registry; None without a registry (nothing to reload from)."""
    sink = engine.capture
    recent = sink if isinstance(sink, RecentRecords) else getattr(sink, "recent", None)
    if load_version is None:
        return None
    if recent is None and rollback is not None:
        log.info("draft health: automatic rollback needs hidden-state capture to score both versions on the "
                 "same traffic; without it the guard reloads a decayed draft but rolls nothing back")
    source = EngineSource(engine, load_version,
                          lambda path, v, workload: install(path, v, "the live guard", workload))
    evidence = TeacherForced(PairedJudge(engine, recent.records, load_version)) if recent is not None else None
    return LiveGuard(source, evidence, rollback)
