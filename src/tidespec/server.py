"""OpenAI-compatible HTTP server over the embedded engine (FastAPI + uvicorn): `tidespec serve`.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (OpenAI request/response shapes,
`stream: true` as server-sent events; every request field honoured or refused with a 400 in
OpenAI's error envelope: `protocol`), `GET /v1/models` (the served id; the draft in `tidespec`), `GET /health`, `GET /metrics` (Prometheus, spec-decode names after
vLLM `vllm/v1/spec_decode/metrics.py` and `vllm/v1/metrics/loggers.py`, prefix `tidespec:`),
`POST /admin/draft` (bearer token: swap the draft between engine steps; requests in flight
finish on the draft they started with). One background thread steps the engine (continuous
batching); requests beyond `serve.max_queue` waiting get 429. Capture is the engine's own hook
(`Engine(capture=writer)`): the server only exposes the writer's counters on /metrics and flushes
it on shutdown. Limits come from `config.ServeParams` (params.yaml `serve:`), the one serve config.
Text comes from `detok.TextOutput` (incremental, stop strings; the same object feeds streamed
deltas and the whole text). A client that disconnects aborts its request within one engine step.
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
from dataclasses import dataclass, field

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from .bootstrap import chat_ids
from .config import ServeParams
from .detok import TextOutput, token_text_and_bytes
from .engine.sampling import TokenLogprob
from .engine.speculative import Engine, Generation
from .engine.speculative import Request as EngineRequest
from .protocol import ChatRequest, CompletionRequest, OpenAIError, StreamOptions, _Sampling, error_body
from .runtime import install_draft
from .workspace import served_version

log = logging.getLogger(__name__)
ADMIN_TOKEN_ENV = "TIDESPEC_ADMIN_TOKEN"
DEFAULT_WORKLOAD = "default"
DISCONNECT_POLL_S = 0.05  # how often a waiting non-streamed request checks that its client is still there


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
        self.by_proposer = {
            name: Counter(f"{p}spec_decode_{name}_by_proposer", help_, ["proposer"], registry=r)
            for name, help_ in (("num_drafts", "Draft-verify steps by proposer (eagle3, suffix)."),
                                ("num_draft_tokens", "Draft tokens proposed by proposer."),
                                ("num_accepted_tokens", "Draft tokens accepted by proposer."))}
        self.request_tau = Histogram(
            f"{p}request_spec_decode_acceptance_length", "Acceptance length τ of each finished request that "
            "drafted (1 + accepted / drafts).", registry=r, buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0))
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
        if st.num_drafts:
            self.request_tau.observe(st.acceptance_length)
        for proposer, ps in g.stats_by_proposer.items():
            for name, c in self.by_proposer.items():
                c.labels(proposer=proposer).inc(getattr(ps, name))
        for ms in g.timing.itl_ms():
            self.itl.observe(ms / 1000)

    def set_draft(self, version: str | None) -> None:
        self.draft_info.clear()
        self.draft_info.labels(version=str(version)).set(1)


class ChampionWatcher:
    """Polls `directory/version.json` every `every_s` s on a daemon thread and calls
    `install(directory, version)` when it names another version than the engine serves: how a
    running `tidespec serve` picks up the draft a `tide_cycle` run deployed (deploy.local writes the
    directory by rename, so a poll never sees half a draft). A version the engine refuses is
    logged once and not retried until the directory changes again."""

    def __init__(self, directory: Path, every_s: float, engine: Engine, install: Callable[[Path, str], dict]):
        self.directory, self.every_s, self.engine, self.install = Path(directory), every_s, engine, install
        self._refused: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidespec-champion-watch", daemon=True)
        self._thread.start()

    def check(self) -> str | None:
        """One poll; returns the version installed now, or None."""
        v = served_version(self.directory)
        if v is None or v == self.engine.draft_version or v == self._refused:
            return None
        try:
            self.install(self.directory, v)
        except (ValueError, OSError) as e:
            self._refused = v
            log.error("champion %s at %s refused, draft %s keeps serving: %s", v, self.directory,
                      self.engine.draft_version, e)
            return None
        log.info("serving champion %s from %s", v, self.directory)
        return v

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class DraftSwap(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None  # a draft checkpoint dir inside the server's drafts_dir
    version: str | None = None  # a registry version, or an alias ("champion", "challenger")


@dataclass
class _Choice:
    """One engine request of an HTTP request (prompt i, sample j → choice index i·n + j)."""

    index: int
    req: EngineRequest
    fut: Future
    text: TextOutput | None
    prefix: str = ""  # echo: the prompt's text
    delivered: int = 0  # tokens streamed so far
    lp_pending: list = field(default_factory=list)  # streamed (TokenLogprob, text offset) not yet sent
    observed: bool = False  # its Generation is on /metrics


def build_app(engine: Engine, tokenizer=None, serve: ServeParams | None = None, *, model: str = "tidespec",
              drafts_dir: Path | None = None, admin_token: str | None = None,
              load_version: Callable[[str], Path] | None = None, text_capture=None,
              watch_dir: Path | None = None, watch_s: float = 5.0) -> FastAPI:
    """The FastAPI app. `tokenizer`: HF fast tokenizer (None: token-id prompts only, no chat, no
    stop strings); `serve`: the limits (max_queue, request_timeout_s in s, max_tokens: default and
    cap of a request's max_tokens, which must be resolved: `Params.serve_resolved()`;
    default_temperature); `model`: the served model id (a request naming another gets 404, as in
    vLLM); `drafts_dir`: `/admin/draft` paths must lie inside it; `admin_token`: bearer token for
    /admin (None: admin disabled, 403); `load_version(v)`: registry version or alias → local
    checkpoint dir (raises LookupError for an unknown one); `text_capture`
    (`capture.text.TextCapture`, `capture.mode: text`): each finished request's request and
    response bodies are logged in the Data Capture format; `watch_dir` (the local champion dir,
    data/drafts/champion): every `watch_s` s the server installs the version the cycle's deploy step
    put there (`ChampionWatcher`). The engine's capture sink (if any) is
    flushed on shutdown and its counters are served on /metrics. Every error is answered in
    OpenAI's envelope (`protocol.OpenAIError`). Raises ValueError for unresolved max_tokens."""
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
    started = int(time.time())

    @app.on_event("shutdown")
    def _shutdown():  # finish in-flight requests, then flush capture
        if watcher is not None:
            watcher.close()
        loop.close()
        if writer is not None and hasattr(writer, "flush"):
            writer.flush()
        if text_capture is not None:
            text_capture.close()

    # -- admission ------------------------------------------------------------------------
    def encode(prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise OpenAIError("this server has no tokenizer: send the prompt as a list of token ids", param=param)
            return tokenize(lambda: tokenizer(prompt, add_special_tokens=False)["input_ids"], param)
        return list(prompt)

    def tokenize(fn: Callable[[], list[int]], param: str) -> list[int]:
        try:
            return fn()
        except (TypeError, ValueError, UnicodeError) as e:  # e.g. a lone UTF-16 surrogate
            raise OpenAIError(f"{param} cannot be tokenized: {e}", param=param) from None

    def admit(body: _Sampling, prompts: list[list[int]], logprobs: int | None,
              on_tokens: Callable[[int], Callable] | None = None) -> list[_Choice]:
        """Queue n engine requests per prompt (429 when the queue cannot take them all, 400 for bad
        input: nothing is queued then)."""
        if body.model is not None and body.model != model:
            raise OpenAIError(f"the model {body.model!r} does not exist; this server serves {model!r} "
                              "(GET /v1/models)", param="model", status=404, code="model_not_found")
        total = len(prompts) * body.n
        if total > cfg.max_queue:
            raise OpenAIError(f"{len(prompts)} prompts × n {body.n} = {total} sequences can never fit "
                              f"serve.max_queue {cfg.max_queue}; send fewer", param="n")
        if engine.num_unfinished + total > cfg.max_queue:
            metrics.rejected.inc()
            raise OpenAIError(f"{engine.num_unfinished} requests queued, {total} more would exceed "
                              f"serve.max_queue {cfg.max_queue}; retry later", status=429, code="queue_full",
                              headers={"Retry-After": "1"})
        max_new = body.max_new() or cfg.max_tokens
        if max_new > cfg.max_tokens:
            raise OpenAIError(f"max_tokens {max_new} exceeds this server's cap {cfg.max_tokens} (serve.max_tokens)",
                              param="max_tokens")
        if body.min_tokens > max_new:
            raise OpenAIError(f"min_tokens {body.min_tokens} exceeds max_tokens {max_new}", param="min_tokens")
        # the text of a stop token (stop_token_ids, EOS) is left out unless include_stop_str_in_output (vLLM)
        stop_ids = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else set(engine.target.cfg.eos_token_ids))
        stops = body.stops()
        if stops and tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer; this server has none: use stop_token_ids", param="stop")
        rid, choices = uuid.uuid4().hex, []  # choice 0's engine request id is the response id's suffix
        try:
            for i, ids in enumerate(prompts):
                for j in range(body.n):
                    idx = i * body.n + j
                    sp = body.sampling(cfg.default_temperature, j, logprobs)
                    text = TextOutput(tokenizer, stops, body.include_stop_str_in_output, body.skip_special_tokens,
                                      stop_ids, prompt_ids=ids) if tokenizer is not None else None
                    req = EngineRequest(ids, max_new, request_id=rid if idx == 0 else f"{rid}-{idx}", sampling=sp,
                                        workload=body.workload or DEFAULT_WORKLOAD, stop=text,
                                        on_tokens=on_tokens(idx) if on_tokens else None)
                    choices.append(_Choice(idx, req, loop.submit(req), text))
        except (ValueError, OpenAIError) as e:
            for c in choices:
                engine.abort(c.req.request_id)
            raise e if isinstance(e, OpenAIError) else OpenAIError(str(e)) from None
        metrics.running.set(engine.num_unfinished)
        return choices

    observe_lock = threading.Lock()

    def finished(c: _Choice, g: Generation) -> None:
        """Count a finished (or aborted) choice on /metrics, once."""
        with observe_lock:
            if c.observed:
                return
            c.observed = True
        metrics.observe(g)
        metrics.running.set(engine.num_unfinished)

    def abort(choices: list[_Choice]) -> None:
        """Abort every unfinished choice (freed at the next engine step, never captured); each is
        counted as request_success{finished_reason="abort"} when the engine lets it go."""
        for c in choices:
            engine.abort(c.req.request_id)
            c.fut.add_done_callback(lambda f, c=c: f.exception() is None and finished(c, f.result()))

    async def collect(request: Request, choices: list[_Choice]) -> list[Generation] | None:
        """Wait for every choice; None when the client went away (all aborted within one engine
        step). 504 after serve.request_timeout_s (aborted too)."""
        pending = {asyncio.wrap_future(c.fut) for c in choices}
        deadline = time.monotonic() + cfg.request_timeout_s
        while pending:
            _, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S)
            if pending and await request.is_disconnected():
                abort(choices)
                return None
            if pending and time.monotonic() > deadline:
                abort(choices)
                raise OpenAIError(f"request took longer than {cfg.request_timeout_s:g} s (serve.request_timeout_s)",
                                  status=504, code="timeout")
        gens = []
        for c in choices:
            g = c.fut.result()  # an engine error propagates: 500
            finished(c, g)
            gens.append(g)
        return gens

    # -- response pieces ------------------------------------------------------------------
    def usage(prompts: list[list[int]], n_tokens: int) -> dict:
        p = sum(len(x) for x in prompts)
        return {"prompt_tokens": p, "completion_tokens": n_tokens, "total_tokens": p + n_tokens}

    def ext(g: Generation) -> dict:
        return {"token_ids": g.tokens, "draft_version": g.draft_version,
                "acceptance_length": g.stats.acceptance_length, "num_drafts": g.stats.num_drafts}

    def text_of(c: _Choice) -> str:
        return c.text.text if c.text is not None else ""

    def tok_text(t: int) -> tuple[str, bytes]:
        return token_text_and_bytes(tokenizer, t) if tokenizer is not None else (str(t), str(t).encode())

    def completion_logprobs(lps: list[TokenLogprob], offsets: list[int], base: int) -> dict:
        """OpenAI legacy format: tokens, token_logprobs, top_logprobs (the top n plus the chosen
        token, as OpenAI and vLLM return it), text_offset (characters into the choice's text)."""
        def top(tl):
            d = {tok_text(t)[0]: v for t, v in tl.top}
            d.setdefault(tok_text(tl.token_id)[0], tl.logprob)
            return d
        return {"tokens": [tok_text(tl.token_id)[0] for tl in lps], "token_logprobs": [tl.logprob for tl in lps],
                "top_logprobs": [top(tl) for tl in lps], "text_offset": [base + o for o in offsets]}

    def chat_logprobs(lps: list[TokenLogprob]) -> dict:
        def entry(t, v):
            s, b = tok_text(t)
            return {"token": s, "logprob": v, "bytes": list(b)}
        return {"content": [entry(tl.token_id, tl.logprob) | {"top_logprobs": [entry(t, v) for t, v in tl.top]}
                            for tl in lps], "refusal": None}

    def offsets(c: _Choice, start: int, count: int) -> list[int]:
        if c.text is None:
            return [0] * count
        return [min(o, len(c.text.text)) for o in c.text.offsets[start:start + count]]

    def log_text(body: BaseModel, response: dict | str, request_id: str) -> None:
        if text_capture is not None:  # never fails a request: a full disk is logged, the answer still goes out
            try:
                text_capture.log(request_id, body.model_dump(exclude_none=True), response)
            except OSError:
                log.exception("text capture of request %s failed", request_id)

    # -- streaming ------------------------------------------------------------------------
    def stream(request: Request, body: _Sampling, prompts: list[list[int]], logprobs: int | None, chat: bool,
               echo: bool = False) -> StreamingResponse:
        """Server-sent events (OpenAI streaming): per choice, chunks with each step's new text
        (none while text may still begin a stop string or a character is incomplete), a last chunk
        with finish_reason; with stream_options.include_usage one more chunk with usage and no
        choices; then `data: [DONE]`. A client that disconnects aborts all its choices."""
        aio = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        choices = admit(body, prompts, logprobs,
                        lambda idx: lambda toks, lps: aio.call_soon_threadsafe(q.put_nowait, (idx, toks, lps)))
        for c in choices:
            c.fut.add_done_callback(lambda f, idx=c.index: aio.call_soon_threadsafe(q.put_nowait, (idx, None, None)))
        obj = "chat.completion.chunk" if chat else "text_completion"
        cid, now = f"{'chatcmpl' if chat else 'cmpl'}-{choices[0].req.request_id}", int(time.time())
        opts = body.stream_options or StreamOptions()
        per = len(prompts) and len(choices) // len(prompts)

        def chunk(choice: dict | None, extra: dict | None = None) -> str:
            env = {"id": cid, "object": obj, "created": now, "model": model, "choices": [choice] if choice else []}
            if opts.include_usage or opts.continuous_usage_stats:
                env["usage"] = usage(prompts, sum(c.delivered for c in choices)) if opts.continuous_usage_stats \
                    else None
            return f"data: {json.dumps(env | (extra or {}))}\n\n"

        def ready_logprobs(c: _Choice, final: bool) -> list[tuple[TokenLogprob, int]]:
            """The pending logprobs whose token text has been released (all, offsets clamped to the
            text, once final): a token's logprob never runs ahead of its text, so the streamed
            text_offset values equal the non-streamed ones even when a stop string cuts the text."""
            if c.text is None or final:
                n = len(c.lp_pending)
            else:
                n = next((i for i, (_, o) in enumerate(c.lp_pending) if o >= c.text.released), len(c.lp_pending))
            out, c.lp_pending = c.lp_pending[:n], c.lp_pending[n:]
            end = len(c.text.text) if c.text is not None else 0
            return [(lp, min(o, end)) for lp, o in out]

        def piece(c: _Choice, delta: str, entries: list[tuple[TokenLogprob, int]], finish: Generation | None,
                  toks: list[int] | None = None) -> dict:
            reason = None if finish is None else finish.finish_reason
            lps = [lp for lp, _ in entries]
            if chat:
                d = {"index": c.index, "delta": {"content": delta} if delta else {}, "finish_reason": reason,
                     "logprobs": chat_logprobs(lps) if lps else None}
            else:
                d = {"index": c.index, "text": delta, "finish_reason": reason,
                     "logprobs": completion_logprobs(lps, [o for _, o in entries], len(c.prefix)) if lps else None}
            if finish is not None:
                d |= {"stop_reason": finish.stop_reason, "tidespec": ext(finish)}
            else:
                d["tidespec"] = {"token_ids": toks}
            return d

        async def events():
            sent, remaining, done = [], len(choices), False
            deadline = time.monotonic() + cfg.request_timeout_s
            try:
                for c in choices:  # the role (chat) or the echoed prompt (completions) comes first
                    if chat:
                        sent.append(chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                           "finish_reason": None, "logprobs": None}))
                        yield sent[-1]
                    elif echo:
                        c.prefix = tokenizer.decode(prompts[c.index // per]) if tokenizer is not None else ""
                        sent.append(chunk({"index": c.index, "text": c.prefix, "finish_reason": None,
                                           "logprobs": None}))
                        yield sent[-1]
                while remaining:
                    try:
                        idx, toks, lps = await asyncio.wait_for(q.get(), max(0.0, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        err = error_body(f"request took longer than {cfg.request_timeout_s:g} s", 504, code="timeout")
                        yield f"data: {json.dumps(err)}\n\n"
                        return
                    c = choices[idx]
                    if toks is not None:
                        if lps:
                            raw = c.text.offsets[c.delivered:c.delivered + len(toks)] if c.text is not None else \
                                [0] * len(toks)
                            c.lp_pending += list(zip(lps, raw))
                        c.delivered += len(toks)
                        delta = c.text.release() if c.text is not None else ""
                        sent.append(chunk(piece(c, delta, ready_logprobs(c, False), None, toks)))  # one per step
                        yield sent[-1]
                        continue
                    remaining -= 1
                    exc = c.fut.exception()
                    if exc is not None:
                        log.error("request %s failed: %r", c.req.request_id, exc)
                        yield f"data: {json.dumps(error_body(str(exc), 500))}\n\n"
                        return
                    g = c.fut.result()
                    finished(c, g)
                    delta = c.text.release(final=True) if c.text is not None else ""
                    sent.append(chunk(piece(c, delta, ready_logprobs(c, True), g)))
                    yield sent[-1]
                if opts.include_usage:
                    sent.append(chunk(None, {"usage": usage(prompts, sum(c.delivered for c in choices))}))
                    yield sent[-1]
                sent.append("data: [DONE]\n\n")
                yield sent[-1]
                done = True
                log_text(body, "".join(sent), choices[0].req.request_id)
            finally:
                if not done:  # client gone (the generator is cancelled), timeout or error
                    abort(choices)
        return StreamingResponse(events(), media_type="text/event-stream")

    # -- routes ---------------------------------------------------------------------------
    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    def model_entry(model_id: str):
        if model_id != model:
            raise OpenAIError(f"the model {model_id!r} does not exist; this server serves {model!r}",
                              param="model", status=404, code="model_not_found")
        return model_card()

    def model_card() -> dict:
        return {"id": model, "object": "model", "created": started, "owned_by": "tidespec", "root": model,
                "parent": None, "max_model_len": engine.max_seq_len,
                "tidespec": {"draft_version": engine.draft_version, "num_draft_tokens": engine.k,
                             "adaptive": engine.adaptive is not None}}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [encode(p) for p in body.prompts()]
        if body.stream:
            return stream(request, body, prompts, body.logprobs, chat=False, echo=body.echo)
        choices = admit(body, prompts, body.logprobs)
        gens = await collect(request, choices)
        if gens is None:
            return Response(status_code=499)  # nobody is listening (nginx's "client closed request")
        out = []
        for c, g in zip(choices, gens):
            prefix = tokenizer.decode(prompts[c.index // body.n]) if body.echo and tokenizer is not None else ""
            lp = completion_logprobs(g.logprobs, offsets(c, 0, len(g.tokens)), len(prefix)) \
                if g.logprobs is not None else None
            out.append({"index": c.index, "text": prefix + text_of(c), "finish_reason": g.finish_reason,
                        "stop_reason": g.stop_reason, "logprobs": lp, "tidespec": ext(g)})
        resp = {"id": f"cmpl-{choices[0].req.request_id}", "object": "text_completion",
                "created": int(time.time()), "model": model, "choices": out,
                "usage": usage(prompts, sum(len(g.tokens) for g in gens)), "tidespec": ext(gens[0])}
        log_text(body, resp, choices[0].req.request_id)  # = the live capture's request id
        return resp

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise OpenAIError("this server's target has no chat template: use /v1/completions", param="messages")
        prompts = [tokenize(lambda: chat_ids(tokenizer, body.template_messages(), True), "messages")]
        if body.stream:
            return stream(request, body, prompts, body.num_logprobs(), chat=True)
        choices = admit(body, prompts, body.num_logprobs())
        gens = await collect(request, choices)
        if gens is None:
            return Response(status_code=499)
        out = [{"index": c.index, "message": {"role": "assistant", "content": text_of(c)},
                "finish_reason": g.finish_reason, "stop_reason": g.stop_reason,
                "logprobs": chat_logprobs(g.logprobs) if g.logprobs is not None else None, "tidespec": ext(g)}
               for c, g in zip(choices, gens)]
        resp = {"id": f"chatcmpl-{choices[0].req.request_id}", "object": "chat.completion",
                "created": int(time.time()), "model": model, "choices": out,
                "usage": usage(prompts, sum(len(g.tokens) for g in gens)), "tidespec": ext(gens[0])}
        log_text(body, resp, choices[0].req.request_id)  # = the live capture's request id
        return resp

    @app.get("/health")
    def health():
        return {"status": "ok", "draft_version": engine.draft_version, "requests": engine.num_unfinished}

    @app.get("/metrics")
    def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    swap_lock = threading.Lock()

    def install(path: Path, version: str | None) -> dict:
        """The draft at `path` into the engine (`runtime.install_draft`), and on /metrics."""
        with swap_lock:
            out = install_draft(engine, path, version)
            metrics.set_draft(out["draft_version"])
        return out

    watcher = ChampionWatcher(watch_dir, watch_s, engine, install) if watch_dir is not None and watch_s > 0 else None

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
        try:
            out = install(path, version)
        except (ValueError, OSError) as e:
            raise HTTPException(409, f"draft refused, the old one keeps serving: {e}") from None
        if engine.suffix is None:  # tokens of the global suffix tree installed: only with the suffix proposer
            out.pop("suffix_corpus_tokens")
        return out

    _error_handlers(app)
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's envelope, so SDKs raise their typed exceptions with our message."""

    @app.exception_handler(OpenAIError)
    async def _openai(_, e: OpenAIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e: RequestValidationError):
        err = e.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x != "body" and not isinstance(x, int)]
        param = ".".join(loc) or None
        if err.get("type") == "extra_forbidden":
            msg = (f"unknown parameter {param!r}: this server does not support it "
                   "(docs/api.md lists every parameter it takes)")
        else:
            msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
        return JSONResponse(error_body(msg, 400, param, err.get("type")), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ValueError)
    async def _bad(_, e: ValueError):
        return JSONResponse(error_body(str(e), 400), status_code=400)


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
