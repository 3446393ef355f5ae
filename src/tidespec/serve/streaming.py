"""Streamed OpenAI responses (`stream: true`): server-sent events built from the engine's per-step
tokens. Per choice: an opening chunk (chat: the assistant role; completions with echo: the prompt's
text), one chunk per engine step with its new text (none while the text may still begin a stop
string or a character is incomplete), a last chunk with finish_reason; with
stream_options.include_usage one more chunk with usage and no choices; then `data: [DONE]`.
A failure after the stream began — the engine failing a choice (500, with the request id), the
request timing out (504), a server bug (500) — ends it with one `data:` event holding the same error
body a whole response would carry. A client that disconnects aborts all its choices."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from ..engine.sampling import TokenLogprob
from ..engine.speculative import Generation
from .errors import InternalError, OpenAIError, RequestTimeout
from .protocol import StreamOptions, _Sampling
from .responses import Api, envelope, usage
from .serving import Admitted, Choice, OpenAIServing
from .structured import Constraint


def stream(serving: OpenAIServing, api: Api, body: _Sampling, prompts: list[list[int]], logprobs: int | None,
           echo: bool = False, constraint: Constraint | None = None) -> StreamingResponse:
    """Admit the request (raising `OpenAIError` as `OpenAIServing.admit` does, before any byte is
    sent) and stream it. `prompts`: token ids, one list per prompt; `logprobs`: top alternatives per
    token (None: none); `echo`: completions only, the prompt's text first; `constraint`: the
    request's grammar (a tool-calling choice streams `delta.tool_calls`, `structured.ToolCallStream`)."""
    aio = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    adm = serving.admit(body, api, prompts, logprobs,
                        lambda idx: lambda toks, lps: aio.call_soon_threadsafe(q.put_nowait, (idx, toks, lps)),
                        constraint=constraint)
    for c in adm.choices:
        c.fut.add_done_callback(lambda f, idx=c.index: aio.call_soon_threadsafe(q.put_nowait, (idx, None, None)))
    return StreamingResponse(ChoiceStream(serving, api, body, adm, q, echo).events(), media_type="text/event-stream")


class ChoiceStream:
    """The events of one admitted request. `queue` receives (choice index, new token ids, their
    logprobs) from the engine thread for each step, and (choice index, None, None) when a choice's
    Future is done."""

    def __init__(self, serving: OpenAIServing, api: Api, body: _Sampling, adm: Admitted, queue: asyncio.Queue,
                 echo: bool):
        self.serving, self.api, self.body, self.adm, self.queue, self.echo = serving, api, body, adm, queue, echo
        self.opts = body.stream_options or StreamOptions()
        self.created = int(time.time())
        self.sent: list[str] = []  # the events sent, for text capture

    async def events(self) -> AsyncIterator[str]:
        """The server-sent events; the exchange is text-captured once `[DONE]` went out."""
        done = False
        deadline = time.monotonic() + self.serving.cfg.request_timeout_s
        try:
            for c in self.adm.choices:
                piece = self.api.opening(c.index, self._echo(c))
                if piece is not None:
                    yield self._chunk(piece)
            remaining = len(self.adm.choices)
            while remaining:
                idx, toks, lps = await self._next(deadline)
                c = self.adm.choices[idx]
                if toks is not None:
                    yield self._chunk(self._step(c, toks, lps))  # one per engine step
                    continue
                remaining -= 1
                yield self._chunk(self._last(c))
            if self.opts.include_usage:
                yield self._chunk(None, usage=self._usage())
            yield self._send("data: [DONE]\n\n")
            done = True
        except OpenAIError as e:  # EngineError 500, RequestTimeout 504: the body a whole response would have
            yield e.sse()
        except Exception as e:  # noqa: BLE001 - a bug here: 500 with the request id, traceback in the log only
            yield InternalError.of(e, self.adm.request_id, "stream").sse()
        finally:
            if not done:  # client gone (the generator is closed), timeout or error
                self.serving.abort(self.adm.choices)
        if done:
            self.serving.log_text(self.body, "".join(self.sent), self.adm)

    async def _next(self, deadline: float) -> tuple[int, list[int] | None, list[TokenLogprob] | None]:
        try:
            return await asyncio.wait_for(self.queue.get(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RequestTimeout(self.serving.cfg.request_timeout_s) from None

    def _echo(self, c: Choice) -> str | None:
        if not self.echo:
            return None
        c.prefix = self.serving.echo_prefix(self.adm, c)
        return c.prefix

    def _step(self, c: Choice, toks: list[int], lps: list[TokenLogprob] | None) -> dict:
        """The piece of one engine step's new tokens of choice `c`."""
        if lps:
            raw = c.text.offsets[c.delivered:c.delivered + len(toks)] if c.text is not None else [0] * len(toks)
            c.lp_pending += list(zip(lps, raw))
        c.delivered += len(toks)
        delta = c.text.release() if c.text is not None else ""
        return self._piece(c, delta, self._ready_logprobs(c, False), None, toks)

    def _last(self, c: Choice) -> dict:
        """The last piece of a done choice (finish_reason). Raises EngineError when the engine failed it."""
        g = self.serving.result(self.adm, c)
        delta = c.text.release(final=True) if c.text is not None else ""
        return self._piece(c, delta, self._ready_logprobs(c, True), g)

    def _piece(self, c: Choice, delta: str, entries: list[tuple[TokenLogprob, int]], finish: Generation | None,
               toks: list[int] | None = None) -> dict:
        calls = None
        if c.calls is not None:  # a tool-calling choice: the text becomes content and/or tool-call deltas
            delta, calls = c.calls.feed(delta, final=finish is not None)
        return self.api.choice(c.index, delta, delta=True, lps=[lp for lp, _ in entries] or None,
                               offsets=[o for _, o in entries], base=len(c.prefix), finish=finish, token_ids=toks,
                               calls=calls, called=c.calls is not None and c.calls.calls > 0)

    @staticmethod
    def _ready_logprobs(c: Choice, final: bool) -> list[tuple[TokenLogprob, int]]:
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

    def _usage(self) -> dict:
        return usage(self.adm.prompts, sum(c.delivered for c in self.adm.choices))

    def _chunk(self, choice: dict | None, **fields) -> str:
        """One chunk (the shared `envelope`); usage: null in each chunk with include_usage, the usage so
        far with continuous_usage_stats."""
        if self.opts.include_usage or self.opts.continuous_usage_stats:
            fields = {"usage": self._usage() if self.opts.continuous_usage_stats else None} | fields
        model = self.body.model or self.serving.model
        env = envelope(self.api, self.adm.request_id, self.created, model, [choice] if choice else [],
                       chunk=True, **fields)
        return self._send(f"data: {json.dumps(env)}\n\n")

    def _send(self, event: str) -> str:
        self.sent.append(event)
        return event
