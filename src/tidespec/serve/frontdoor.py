"""The OpenAI front door before an engine server: vLLM, SGLang or llama.cpp, which `tidespec serve
--backend vllm|sglang|llama-cpp` starts and supervises, or your own SGLang (`--backend sglang
--sglang-url URL`).

It forwards `/v1/completions`, `/v1/chat/completions` and `/v1/models` unchanged (bodies as sent,
responses and SSE streams byte for byte, the backend's status codes and errors) and adds what the
loop needs: text capture of each successful exchange (Data Capture format) and Prometheus metrics.
An unreachable backend is 502 (503 on /health), a slow one 504, in OpenAI's envelope. The backend
can be switched while serving (`Proxy.switch`: blue/green); a request goes wholly to the backend
that was current when it arrived. With an API key the front door checks it itself (`serve.auth`) and
talks to its engine server, on loopback, without one. More: docs/design/serve.md.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .auth import api_key_middleware
from .errors import OpenAIError, install_error_handlers
from .lifespan import closing
from .metrics import FrontdoorMetrics, metrics_response
from .textlog import TextLog

ROUTES = ("/v1/completions", "/v1/chat/completions")
JSON = {"content-type": "application/json"}
Refusal = Callable[[dict], "tuple[str, str] | None"]  # request body → (field, why it is refused) or None


def build_frontdoor(backend_url: str, text_capture=None, timeout_s: float = 300.0, on_close=None,
                    info=None, textlog: TextLog | None = None, api_key: str | None = None,
                    auth_health_metrics: bool = False, replica_id: str | None = None,
                    refuse: Refusal | None = None) -> FastAPI:
    """The FastAPI app in front of `backend_url` (e.g. http://127.0.0.1:30000). `text_capture`: a
    `capture.text.TextCapture` (None: no capture); `timeout_s`: per backend request, s (504 after).
    At shutdown the backend client and the text capture are closed, then `on_close()` runs (e.g.
    stopping the engine server). `info()`: a dict /health adds (e.g. the served draft_version).
    `textlog`: the text log to use (e.g. with a token threshold), instead of one over `text_capture`.
    The `Proxy` is `app.state.proxy` (to switch backends). `/metrics` is the front door's own
    metrics followed by the backend's `/metrics` (vLLM's `vllm:*`, SGLang's `sglang:*`: the engine's
    own spec-decode counters), so one scrape sees both; the front door's own series carry
    `replica_id` as a label (None: none), the backend's are as it writes them (Prometheus' target
    labels tell the scrape apart). `api_key`: the key every route takes as a
    bearer token, 401 otherwise (None: open; /health and /metrics stay open unless
    `auth_health_metrics`: `serve.auth`); the backend is called without it. `refuse(body)`: a
    request the backend cannot honour as asked, as (the field, why), answered 400 before it is
    forwarded (None: forwarded; e.g. `backends.llama_cpp.request_refusal`). Raises ValueError for an
    empty `api_key`, or `auth_health_metrics` without one."""
    auth = api_key_middleware(api_key, auth_health_metrics)
    proxy = Proxy(backend_url, httpx.AsyncClient(timeout=timeout_s), timeout_s, FrontdoorMetrics(replica_id),
                  textlog or TextLog(text_capture), info, refuse)
    app = FastAPI(title="tidespec front door", version="0.1", middleware=auth,
                  lifespan=closing(proxy.client.aclose, proxy.textlog.close, on_close))
    app.state.proxy = proxy
    for route in ROUTES:
        app.add_api_route(route, proxy.forwarder(route), methods=["POST"])
    app.add_api_route("/v1/models", proxy.models, methods=["GET"])
    app.add_api_route("/health", proxy.health, methods=["GET"])
    app.add_api_route("/metrics", proxy.all_metrics, methods=["GET"])
    install_error_handlers(app)
    return app


class Proxy:
    """Forwards requests to the backend at `base` with `client`, counting and capturing them."""

    def __init__(self, base: str, client: httpx.AsyncClient, timeout_s: float, metrics: FrontdoorMetrics,
                 textlog: TextLog, info=None, refuse: Refusal | None = None):
        self.base, self.client, self.timeout_s = base.rstrip("/"), client, timeout_s
        self.metrics, self.textlog, self.info, self.refuse = metrics, textlog, info, refuse
        self._lock, self._inflight = threading.Lock(), Counter()

    def switch(self, url: str) -> str:
        """Send new requests to `url` from now on; returns the previous backend URL (its requests in
        flight finish there: `inflight`)."""
        with self._lock:
            old, self.base = self.base, url.rstrip("/")
        return old

    def inflight(self, url: str) -> int:
        """Requests forwarded to `url` whose answer (or stream) has not ended yet."""
        with self._lock:
            return self._inflight[url.rstrip("/")]

    def _enter(self) -> str:
        with self._lock:
            self._inflight[self.base] += 1
            return self.base

    def _leave(self, base: str) -> None:
        with self._lock:
            self._inflight[base] -= 1

    def forwarder(self, route: str):
        """The endpoint of POST `route`."""
        async def endpoint(request: Request) -> Response:
            return await self.forward(route, request)
        return endpoint

    async def forward(self, route: str, request: Request) -> Response:
        """POST the request's body to the backend's `route` as sent; its answer back unchanged (a
        stream relayed chunk by chunk). A successful exchange is text-captured. Returns 400 (a
        request `refuse` names), 502 (backend unreachable) or 504 (no answer within timeout_s) in
        OpenAI's envelope."""
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = None
        refused = self.refuse(body) if self.refuse is not None and isinstance(body, dict) else None
        if refused is not None:
            self.metrics.count(route, 400)
            return OpenAIError(refused[1], param=refused[0]).response()
        t0 = time.perf_counter()
        streaming = isinstance(body, dict) and bool(body.get("stream"))
        base = self._enter()
        relaying = False
        try:
            try:
                if streaming:
                    resp = await self.client.send(self.client.build_request("POST", base + route, content=raw,
                                                                            headers=JSON), stream=True)
                else:
                    resp = await self.client.post(base + route, content=raw, headers=JSON)
            except httpx.TimeoutException:
                return self._down(route, 504, f"backend {base} did not answer within {self.timeout_s:g} s")
            except httpx.HTTPError as e:
                return self._down(route, 502, f"backend {base} unreachable: {e}")
            if not streaming:
                return self._whole(route, body, resp, t0)
            if resp.status_code != 200:
                data = await resp.aread()
                self.metrics.observe(route, resp.status_code, time.perf_counter() - t0, None)
                return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type"))
            relaying = True
            return StreamingResponse(self._relay(route, body, resp, t0, base), media_type="text/event-stream")
        finally:
            if not relaying:
                self._leave(base)

    def _whole(self, route: str, body, resp: httpx.Response, t0: float) -> Response:
        try:
            out = json.loads(resp.content)
        except json.JSONDecodeError:
            out = None
        self.metrics.observe(route, resp.status_code, time.perf_counter() - t0,
                             out.get("usage") if isinstance(out, dict) else None)
        if resp.status_code == 200 and isinstance(out, dict) and _stored(body):
            self.textlog.log(out.get("id") or uuid.uuid4().hex, body, out)
        return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    async def _relay(self, route: str, body, resp: httpx.Response, t0: float, base: str) -> AsyncIterator[bytes]:
        sent = []
        try:
            async for chunk in resp.aiter_bytes():
                sent.append(chunk)
                yield chunk
        finally:
            await resp.aclose()
            self._leave(base)
        text = b"".join(sent).decode("utf-8", "replace")
        self.metrics.observe(route, 200, time.perf_counter() - t0, usage_from_sse(text))
        if text.rstrip().endswith("[DONE]") and _stored(body):  # a complete stream only
            self.textlog.log(uuid.uuid4().hex, body, text)

    def _down(self, route: str, status: int, message: str) -> JSONResponse:
        self.metrics.count(route, status)
        return backend_error(status, message).response()

    async def _get(self, path: str, down_status: int) -> tuple[httpx.Response | None, JSONResponse | None]:
        """GET `path` on the backend: (response, None), or (None, the error reply with `down_status`)."""
        try:
            return await self.client.get(self.base + path), None
        except httpx.HTTPError as e:
            return None, backend_error(down_status, f"backend {self.base} unreachable: {e}").response()

    async def models(self) -> Response:
        """GET /v1/models: the backend's answer (502 when it is down)."""
        r, err = await self._get("/v1/models", 502)
        return err or Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    async def health(self) -> JSONResponse:
        """GET /health: 200 when the backend's /health is, else 503 with its status."""
        r, err = await self._get("/health", 503)
        if err:
            return err
        ok = r.status_code == 200
        return JSONResponse({"status": "ok" if ok else "backend unhealthy", "backend": self.base,
                             "backend_status": r.status_code} | (self.info() if self.info else {}),
                            status_code=200 if ok else 503)

    async def all_metrics(self) -> Response:
        """GET /metrics: the front door's registry, then the backend's /metrics text when it answers
        (a comment line says when it did not)."""
        own = metrics_response(self.metrics.registry, self.metrics.labels)
        r, err = await self._get("/metrics", 502)
        tail = r.content if r is not None and r.status_code == 200 else \
            f"# backend {self.base} /metrics unavailable\n".encode()
        return Response(own.body + tail, media_type=own.media_type)


def _stored(body) -> bool:
    """Whether an exchange may be captured: a JSON object request not sent with `"store": false`
    (OpenAI's field; evaluation traffic and probes opt out of becoming training data)."""
    return isinstance(body, dict) and body.get("store") is not False


def backend_error(status: int, message: str) -> OpenAIError:
    """The front door's own error: the backend is down (502, 503) or slow (504)."""
    return OpenAIError(message, status=status, code="backend_timeout" if status == 504 else "backend_unreachable",
                       type="backend_error")


def usage_from_sse(text: str) -> dict:
    """The last `usage` object of an SSE stream (present when the client asked for include_usage)."""
    usage = {}
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                usage = json.loads(line[5:]).get("usage") or usage
            except (json.JSONDecodeError, AttributeError):
                continue
    return usage
