"""OpenAI-compatible HTTP server over the embedded engine (FastAPI + uvicorn): `tidespec serve`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI request/response shapes,
`stream: true` as server-sent events), `GET /health`, `GET /metrics` (Prometheus, spec-decode names after
vLLM `vllm/v1/spec_decode/metrics.py` and `vllm/v1/metrics/loggers.py`, prefix `tidespec:`),
`POST /admin/draft` (bearer token: swap the draft between engine steps; requests in flight
finish on the draft they started with). One background thread steps the engine (continuous
batching); requests beyond `serve.max_queue` waiting get 429. Capture is the engine's own hook
(`Engine(capture=writer)`): the server only exposes the writer's counters on /metrics and flushes
it on shutdown. Limits come from `config.ServeParams` (params.yaml `serve:`), the one serve config.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field

from .bootstrap import chat_ids
from .config import ServeParams
from .engine.sampling import SamplingParams
from .engine.speculative import Engine, Generation
from .engine.speculative import Request as EngineRequest
from .runtime import runner_for
from .workspace import served_version

log = logging.getLogger(__name__)
ADMIN_TOKEN_ENV = "TIDESPEC_ADMIN_TOKEN"
DEFAULT_WORKLOAD = "default"


class EngineLoop:
    """Steps the engine on one background thread while it has requests; `submit` is thread-safe."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tidespec-engine", daemon=True)
        self._thread.start()

    def submit(self, req: EngineRequest) -> Future:
        """Queue `req` and wake the stepping thread; the Future resolves to its Generation.
        Raises ValueError for a request the engine refuses (`Engine.validate`)."""
        fut = self.engine.submit(req)
        with self._wake:
            self._wake.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and self.engine.num_unfinished == 0:
                    self._wake.wait(0.5)
                if self._stop and self.engine.num_unfinished == 0:
                    return
            self.engine.step()

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the requests in flight, then stop the thread."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout_s)


class Metrics:
    """Prometheus series of the server (own registry: several servers per process in tests)."""

    def __init__(self, k: int):
        r = self.registry = CollectorRegistry()
        p = "tidespec:"
        self.num_drafts = Counter(f"{p}spec_decode_num_drafts", "Draft-verify steps.", registry=r)
        self.num_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted = Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.",
                               ["position"], registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(f"{p}request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.rejected = Counter(f"{p}request_rejected", "Requests refused (queue full).", registry=r)
        self.itl = Histogram(f"{p}inter_token_latency_seconds", "Time between emitted tokens.", registry=r,
                             buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5))
        self.running = Gauge(f"{p}num_requests_running", "Requests waiting or running in the engine.", registry=r)
        self.draft_info = Gauge(f"{p}draft_info", "The served draft (value 1).", ["version"], registry=r)
        for i in range(k):
            self.per_pos.labels(position=str(i))

    def observe(self, g: Generation) -> None:
        """Add one finished request: its spec-decode counters, tokens, finish reason, ITLs (s)."""
        st = g.stats
        self.num_drafts.inc(st.num_drafts)
        self.num_draft_tokens.inc(st.num_draft_tokens)
        self.num_accepted.inc(st.num_accepted_tokens)
        for i, n in enumerate(st.num_accepted_tokens_per_pos):
            self.per_pos.labels(position=str(i)).inc(n)
        self.prompt_tokens.inc(g.prompt_len)
        self.generation_tokens.inc(len(g.tokens))
        self.success.labels(finished_reason=g.finish_reason).inc()
        for ms in g.timing.itl_ms():
            self.itl.observe(ms / 1000)

    def set_draft(self, version: str | None) -> None:
        self.draft_info.clear()
        self.draft_info.labels(version=str(version)).set(1)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (n=1, logprobs...)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stream: bool = False
    workload: str | None = None  # tidespec extension: the workload class (adaptive k, capture tag)


class CompletionRequest(_Sampling):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class DraftSwap(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None  # a draft checkpoint dir inside the server's drafts_dir
    version: str | None = None  # a registry version, or an alias ("champion", "challenger")


def build_app(engine: Engine, tokenizer=None, serve: ServeParams | None = None, *, model: str = "tidespec",
              drafts_dir: Path | None = None, admin_token: str | None = None,
              load_version: Callable[[str], Path] | None = None, text_capture=None) -> FastAPI:
    """The FastAPI app. `tokenizer`: HF tokenizer (None: token-id prompts only, no chat); `serve`:
    the limits (max_queue, request_timeout_s in s, max_tokens: default and cap of a request's
    max_tokens, which must be resolved: `Params.serve_resolved()`); `model`: the served model id;
    `drafts_dir`: `/admin/draft` paths must lie inside it; `admin_token`: bearer token for /admin
    (None: admin disabled, 403); `load_version(v)`: registry version or alias → local checkpoint dir
    (raises LookupError for an unknown one); `text_capture` (`capture.text.TextCapture`,
    `capture.mode: text`): each finished request's request and response bodies are logged in the
    Data Capture format. The engine's capture sink (if any) is flushed on shutdown and its counters
    are served on /metrics. Raises ValueError for unresolved max_tokens."""
    cfg = serve or ServeParams()
    if cfg.max_tokens is None:
        raise ValueError("serve.max_tokens is unresolved: pass Params.serve_resolved() (engine.max_new_tokens)")
    writer = engine.capture
    loop = EngineLoop(engine)
    metrics = Metrics(engine.k)
    metrics.set_draft(engine.draft_version)
    if writer is not None and hasattr(writer, "collector"):
        metrics.registry.register(writer.collector())
    app = FastAPI(title="tidespec", version="0.1")
    app.state.loop, app.state.metrics = loop, metrics

    @app.on_event("shutdown")
    def _shutdown():  # finish in-flight requests, then flush capture
        loop.close()
        if writer is not None and hasattr(writer, "flush"):
            writer.flush()
        if text_capture is not None:
            text_capture.close()

    def sampling(body: _Sampling) -> SamplingParams:
        try:
            return SamplingParams(body.temperature, body.top_p, body.top_k, body.seed)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None

    def admit(prompt_ids: list[int], body: _Sampling, on_tokens=None) -> tuple[EngineRequest, Future]:
        """Queue the request (429 when full, 400 for bad input)."""
        if engine.num_unfinished >= cfg.max_queue:
            metrics.rejected.inc()
            raise HTTPException(429, f"{engine.num_unfinished} requests queued (max {cfg.max_queue}); retry later",
                                headers={"Retry-After": "1"})
        n = min(body.max_tokens or cfg.max_tokens, cfg.max_tokens)
        req = EngineRequest(prompt_ids, n, request_id=uuid.uuid4().hex, sampling=sampling(body),
                            workload=body.workload or DEFAULT_WORKLOAD, on_tokens=on_tokens)
        try:
            fut = loop.submit(req)
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        metrics.running.set(engine.num_unfinished)
        return req, fut

    def finished(req: EngineRequest, g: Generation) -> None:
        metrics.observe(g)
        metrics.running.set(engine.num_unfinished)

    async def run(prompt_ids: list[int], body: _Sampling) -> Generation:
        req, fut = admit(prompt_ids, body)
        try:
            g = await asyncio.wait_for(asyncio.wrap_future(fut), cfg.request_timeout_s)
        except asyncio.TimeoutError:
            fut.cancel()  # dropped if it had not started; a running one finishes, unreported
            raise HTTPException(504, f"request took longer than {cfg.request_timeout_s:g} s") from None
        finished(req, g)
        return g

    def stream(prompt_ids: list[int], body: _Sampling, obj: str, choice: Callable[[str, str | None], dict]
               ) -> StreamingResponse:
        """Server-sent events (OpenAI streaming): one `data: {chunk}` per engine step with new
        tokens, a last chunk with finish_reason and usage, then `data: [DONE]`. `obj`: the chunk
        object name; `choice(delta_text, finish_reason)`: the chunk's choice."""
        cid, now = f"{'chatcmpl' if obj.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

        def chunk(choice_: dict, extra: dict) -> str:
            env = {"id": cid, "object": obj, "created": now, "model": model, "choices": [choice_]}
            return f"data: {json.dumps(env | extra)}\n\n"
        aio = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        req, fut = admit(prompt_ids, body, on_tokens=lambda t: aio.call_soon_threadsafe(q.put_nowait, t))
        fut.add_done_callback(lambda f: aio.call_soon_threadsafe(q.put_nowait, None))

        async def events():
            toks, said, sent = [], "", []
            deadline = time.monotonic() + cfg.request_timeout_s
            while True:
                try:
                    new = await asyncio.wait_for(q.get(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    fut.cancel()
                    yield f"data: {json.dumps({'error': {'message': 'request timed out', 'code': 504}})}\n\n"
                    return
                if new is None:
                    break
                toks += new
                full = text(toks)  # decode the whole prefix: multi-token characters come out whole
                sent.append(chunk(choice(full[len(said):], None), {"tidespec": {"token_ids": new}}))
                yield sent[-1]
                said = full
            exc = fut.exception()
            if exc is not None:
                yield f"data: {json.dumps({'error': {'message': str(exc), 'code': 500}})}\n\n"
                return
            g = fut.result()
            finished(req, g)
            sent += [chunk(choice("", g.finish_reason), {"usage": usage(g), "tidespec": ext(g)}), "data: [DONE]\n\n"]
            yield sent[-2]
            yield sent[-1]
            log_text(body, "".join(sent), g.request_id)
        return StreamingResponse(events(), media_type="text/event-stream")

    def log_text(body: _Sampling, response: dict | str, request_id: str) -> None:
        if text_capture is not None:  # never fails a request: a full disk is logged, the answer still goes out
            try:
                text_capture.log(request_id, body.model_dump(exclude_none=True), response)
            except OSError:
                log.exception("text capture of request %s failed", request_id)

    def usage(g: Generation) -> dict:
        return {"prompt_tokens": g.prompt_len, "completion_tokens": len(g.tokens),
                "total_tokens": g.prompt_len + len(g.tokens)}

    def ext(g: Generation) -> dict:
        return {"token_ids": g.tokens, "draft_version": g.draft_version,
                "acceptance_length": g.stats.acceptance_length, "num_drafts": g.stats.num_drafts}

    def text(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else ""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if isinstance(body.prompt, str):
            if tokenizer is None:
                raise HTTPException(400, "this server has no tokenizer: send the prompt as a list of token ids")
            ids = tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
        else:
            ids = list(body.prompt)
        if body.stream:
            return stream(ids, body, "text_completion",
                          lambda d, r: {"index": 0, "text": d, "finish_reason": r, "logprobs": None})
        g = await run(ids, body)
        resp = {"id": f"cmpl-{g.request_id}", "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": [{"index": 0, "text": text(g.tokens), "finish_reason": g.finish_reason,
                                             "logprobs": None}],
                "usage": usage(g), "tidespec": ext(g)}
        log_text(body, resp, g.request_id)
        return resp

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise HTTPException(400, "this server's target has no chat template: use /v1/completions")
        ids = chat_ids(tokenizer, [m.model_dump() for m in body.messages], True)
        if body.stream:
            first = [True]

            def choice(d, r):  # the role goes in the first delta only
                delta = {} if r else {"content": d} | ({"role": "assistant"} if first[0] else {})
                first[0] = False
                return {"index": 0, "delta": delta, "finish_reason": r}
            return stream(ids, body, "chat.completion.chunk", choice)
        g = await run(ids, body)
        resp = {"id": f"chatcmpl-{g.request_id}", "object": "chat.completion", "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text(g.tokens)},
                             "finish_reason": g.finish_reason}],
                "usage": usage(g), "tidespec": ext(g)}
        log_text(body, resp, g.request_id)
        return resp

    @app.get("/health")
    def health():
        return {"status": "ok", "draft_version": engine.draft_version, "requests": engine.num_unfinished}

    @app.get("/metrics")
    def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/draft")
    def swap(body: DraftSwap, request: Request):
        _authorize(request, admin_token)
        if (body.path is None) == (body.version is None):
            raise HTTPException(400, "send exactly one of path (a draft dir) or version (registry version or alias)")
        if body.path is not None:
            path, version = _inside(body.path, drafts_dir), Path(body.path).name
        else:
            if load_version is None:
                raise HTTPException(400, "this server has no registry (set MLFLOW_TRACKING_URI): swap by path")
            try:
                path = load_version(body.version)
            except LookupError as e:
                raise HTTPException(404, str(e)) from None
            version = body.version
        version = served_version(path) or version
        try:
            runner = runner_for(path, engine.target)
            if runner is None:
                raise ValueError(f"no draft checkpoint at {body.path or body.version}")
            engine.set_draft(runner, version)
        except (ValueError, FileNotFoundError, OSError) as e:
            raise HTTPException(409, f"draft refused, the old one keeps serving: {e}") from None
        metrics.set_draft(version)
        return {"draft_version": version}

    @app.exception_handler(ValueError)
    async def _bad(_, e: ValueError):
        return JSONResponse({"detail": str(e)}, status_code=400)

    return app


def _authorize(request: Request, token: str | None) -> None:
    if not token:
        raise HTTPException(403, f"admin is disabled: start the server with {ADMIN_TOKEN_ENV} set")
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
        raise HTTPException(401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})


def _inside(path: str, root: Path | None) -> Path:
    """`path` resolved, refused (400) unless it lies inside `root` (no traversal, no symlink escape)."""
    if root is None:
        raise HTTPException(400, "this server allows no draft paths (no drafts dir configured): swap by version")
    base = Path(root).resolve()
    p = (base / path).resolve() if not os.path.isabs(path) else Path(path).resolve()
    if p != base and base not in p.parents:
        raise HTTPException(400, f"path {path!r} is outside the drafts dir {base}")
    return p
