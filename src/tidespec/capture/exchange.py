"""SageMaker Data Capture object → OpenAI exchanges (pure parsing; every bad input counted by reason).

An endpoint with Data Capture on writes JSON Lines objects to
``s3://<destination>/<endpoint>/<variant>/yyyy/mm/dd/hh/<file>.jsonl``, one line per sampled invocation::

    {"captureData": {"endpointInput":  {"observedContentType": ..., "mode": "INPUT",  "data": ..., "encoding": ...},
                     "endpointOutput": {"observedContentType": ..., "mode": "OUTPUT", "data": ..., "encoding": ...}},
     "eventMetadata": {"eventId": ..., "inferenceTime": "2022-02-14T17:25:49Z", "inferenceId"?: ...},
     "eventVersion": "0"}

``encoding`` is ``JSON`` (``data`` is the body text), ``BASE64`` (the body bytes, base64) or ``CSV``.
Bodies whose content type is not listed in ``CaptureContentTypeHeader`` are base64 encoded by default,
so an SSE body (``text/event-stream``) normally arrives as BASE64.

Sources
  * AWS, "Capture data from real-time endpoint", section "View Captured Data" (layout, S3 path; its example takes
    ``capture_file[-3:-1]`` after ``split("\\n")``, which suggests objects end in a newline):
    https://docs.aws.amazon.com/sagemaker/latest/dg/model-monitor-data-capture-endpoint.html ; "Data capture"
    (``inferenceId``): https://docs.aws.amazon.com/sagemaker/latest/dg/model-monitor-data-capture.html ; API reference
    "DataCaptureConfig" (base64 by default):
    https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_DataCaptureConfig.html
  * OpenAI API reference, chat completion / chat completion chunk / completion objects:
    https://platform.openai.com/docs/api-reference/chat , https://platform.openai.com/docs/api-reference/completions
    (SGLang and vLLM serve the same shapes and send errors as ``{"error": ...}`` / ``{"object": "error", ...}``).
  * Server-sent events, WHATWG HTML Living Standard: https://html.spec.whatwg.org/multipage/server-sent-events.html :
    ``data:`` lines (one space after the colon dropped) joined by newlines form an event, a blank line ends it;
    other fields and ``:`` comments carry no data. OpenAI streams end with ``data: [DONE]``.

Streaming finding: none of the AWS pages above, nor the "InvokeEndpointWithResponseStream" API reference
(https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_runtime_InvokeEndpointWithResponseStream.html),
says what Data Capture records for a streamed response; it could not be confirmed either way. So a missing or
empty ``endpointOutput`` is not a skip: the exchange is yielded with ``response_text=None`` (counted
``missing_response``) and the caller regenerates the response. An SSE body, when captured, is parsed.

Skip rules (``SkipRecord.reason``); the line is checked first, then the request, then the response, and the
first rule that fails names the skip:
  * ``non_utf8``: the line, or a base64-decoded body, is not UTF-8.
  * ``malformed_json``: the line is not JSON; or a body (request, response, stream chunk) is not JSON.
  * ``truncated``: the object's last line has no trailing newline and is not JSON (cut mid-write).
  * ``bad_record``: JSON, but not the capture layout (no ``captureData.endpointInput``, no string
    ``eventMetadata.eventId``/``inferenceTime``, a non-string ``data``, an unknown ``encoding``).
  * ``csv_body``: a body captured with ``CSV`` encoding (LLM traffic is JSON; refused).
  * ``bad_base64``: a ``BASE64`` body that does not decode.
  * ``not_openai``: the request is not a JSON object with a ``messages`` list (chat) or a ``prompt`` (completions),
    or has a malformed ``messages`` entry, ``prompt`` or ``n``.
  * ``other_model``: ``model`` was given and the request's or the response's model id differs from it
    (a side that names no model is not checked).
  * ``n_gt_1``: ``n`` > 1, a batch of several prompts, several response choices, or a stream chunk for choice index > 0
    (which choice would be the target's?).
  * ``empty_prompt``: chat with no user message with text (string content, or ``{"type": "text"}`` parts; a list
    of only non-text parts is empty), or a completions prompt that is blank / an empty token list.
  * ``error_response``: the response is ``{"error": ...}`` or ``{"object": "error"}`` (OpenAI, vLLM, SGLang errors,
    also as a stream chunk), or JSON without a non-empty ``choices`` list, or a choice without its text.

Not skips, ``response_text=None`` (the caller regenerates): a missing/empty response, a stream cut before
``data: [DONE]``, a chat reply whose ``content`` is not all the model generated (``tool_calls``, ``function_call``,
``reasoning_content`` or ``reasoning`` present, or ``content`` null). Blank lines carry no record: passed over.
"""
from __future__ import annotations

import base64
import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from ..engine.constraint import call_text

SKIP_REASONS = ("malformed_json", "truncated", "bad_record", "bad_base64", "csv_body", "non_utf8", "not_openai",
                "error_response", "other_model", "empty_prompt", "n_gt_1")
#: also counted by `parse_object`: a repeated event id (line dropped), an exchange without response (kept; information)
OBJECT_COUNTS = ("duplicate_event", "missing_response")
#: generated output a chat message/delta can carry besides `content` that is not recoverable as the target's text
#: (deprecated function calls; vLLM/SGLang reasoning parsers). `tool_calls` are: `engine.constraint.call_text`.
_NOT_CONTENT = ("function_call", "reasoning_content", "reasoning")


class SkipRecord(ValueError):
    """A capture line that yields no exchange; `reason` is one of `SKIP_REASONS`, the message says what was wrong."""

    def __init__(self, reason: str, message: str):
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class Exchange:
    """One captured request with the target's reply (`response_text` None: the caller regenerates it).
    finish_reason "stop" means EOS ended the reply; a "stop" of a request that set `stop` or
    `stop_token_ids` is read as "length" (a stop string may have cut it: no EOS was generated there)."""

    event_id: str
    inference_time: str
    route: Literal["chat", "completions"]
    request: dict
    response_text: str | None
    finish_reason: str | None
    streamed: bool
    model: str | None


def _utf8(raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SkipRecord("non_utf8", f"{what} is not UTF-8 ({e})") from None


def _json(text: str, what: str, reason: str = "malformed_json") -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; absurd nesting
        raise SkipRecord(reason, f"{what} is not JSON ({e})") from None


def _str(d: Any, key: str) -> str | None:
    return d.get(key) if isinstance(d, dict) and isinstance(d.get(key), str) else None


def _body_text(part: dict, side: str) -> str:
    enc, data = part.get("encoding"), part.get("data")
    if enc == "CSV":
        raise SkipRecord("csv_body", f"{side} body captured with CSV encoding")
    if not isinstance(data, str) or enc not in ("JSON", "BASE64"):
        raise SkipRecord("bad_record", f"{side} has encoding {enc!r} and {type(data).__name__} data")
    if enc == "JSON":
        return data
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError as e:  # binascii.Error
        raise SkipRecord("bad_base64", f"{side} body does not decode as base64 ({e})") from None
    return _utf8(raw, f"{side} body")


def _text(content: Any) -> str:
    """The text of a chat `content`: a string, or the `text` of its `{"type": "text"}` parts."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if _str(p, "text") is not None and p.get("type") == "text")
    return content if isinstance(content, str) else ""


def _check_model(found: str | None, model: str | None, side: str) -> None:
    if model is not None and found is not None and found != model:
        raise SkipRecord("other_model", f"{side} model {found!r} is not {model!r}")


def _request(text: str, model: str | None) -> tuple[Literal["chat", "completions"], dict]:
    body = _json(text, "request body")
    if not isinstance(body, dict) or not (isinstance(body.get("messages"), list) or "prompt" in body):
        raise SkipRecord("not_openai", "request has no 'messages' list and no 'prompt'")
    _check_model(_str(body, "model"), model, "request")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool)):
        raise SkipRecord("not_openai", f"request n={n!r} is not an integer")
    if n is not None and n > 1:
        raise SkipRecord("n_gt_1", f"request asks n={n} choices")
    if isinstance(body.get("messages"), list):
        if not all(isinstance(m, dict) for m in body["messages"]):
            raise SkipRecord("not_openai", "a 'messages' entry is not an object")
        if not any(m.get("role") == "user" and _text(m.get("content")).strip() for m in body["messages"]):
            raise SkipRecord("empty_prompt", "no user message with text content")
        return "chat", body
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise SkipRecord("n_gt_1", f"batch of {len(prompt)} prompts")
        prompt = prompt[0]
    tokens = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not (isinstance(prompt, str) or tokens):
        raise SkipRecord("not_openai", "'prompt' is not a string, a token list or a one-prompt batch")
    if not (prompt.strip() if isinstance(prompt, str) else prompt):
        raise SkipRecord("empty_prompt", "blank prompt")
    return "completions", body


def _raise_if_error(obj: Any, what: str) -> None:
    if isinstance(obj, dict) and (obj.get("error") is not None or obj.get("object") == "error"):
        err = obj.get("error")
        msg = err.get("message") if isinstance(err, dict) else (err or obj.get("message"))
        raise SkipRecord("error_response", f"{what} is an error: {msg!r}")


def _choice_text(choice: dict, route: str, key: str) -> tuple[str | None, bool]:
    """(text of one choice's message or None; whether it also carries output that is not recoverable
    text, i.e. is partial). A message's `tool_calls` become the completion the target generated in
    tidespec's tool-call format (`engine.constraint.call_text`)."""
    if route == "completions":
        return _str(choice, "text"), False
    msg = choice.get(key)
    partial = isinstance(msg, dict) and any(msg.get(k) for k in _NOT_CONTENT)
    calls = msg.get("tool_calls") if isinstance(msg, dict) else None
    if calls:
        try:
            return call_text(_str(msg, "content"), calls), partial
        except (KeyError, TypeError):
            return None, True
    return _str(msg, "content"), partial


def _delta_calls(acc: dict[int, dict], entries) -> None:
    """Accumulate streamed `delta.tool_calls` entries into {index: {"function": {"name", "arguments"}}}."""
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict):
            continue
        fn, c = e.get("function") or {}, acc.setdefault(e.get("index", 0), {"function": {"name": "", "arguments": ""}})
        c["function"]["name"] += fn.get("name") or ""
        c["function"]["arguments"] += fn.get("arguments") or ""


def _sse_events(text: str) -> list[str]:
    events, data = [], []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") + [""]:  # SSE line ends only
        if not line and data:
            events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            data.append(line[6:] if line.startswith("data: ") else line[5:])
    return events


def _stream(text: str, route: str, model: str | None) -> tuple[str | None, str | None, str | None]:
    """(text, or None when cut before [DONE] or partial; last finish_reason; model) of an SSE body."""
    parts, finish, seen, done, partial, calls = [], None, None, False, False, {}
    for data in _sse_events(text):
        if data.strip() == "[DONE]":
            done = True
            continue
        chunk = _json(data, "stream chunk")
        _raise_if_error(chunk, "stream chunk")
        choices = chunk.get("choices") if isinstance(chunk, dict) else "not an object"
        if not isinstance(choices, list | None) or not all(isinstance(c, dict) for c in choices or []):
            raise SkipRecord("error_response", "stream chunk without a list of choice objects")
        _check_model(_str(chunk, "model"), model, "response")
        seen = _str(chunk, "model") or seen
        for ch in choices or []:
            if ch.get("index", 0) != 0:
                raise SkipRecord("n_gt_1", f"stream chunk for choice index {ch.get('index')!r}")
            delta = ch.get("delta") if route == "chat" else None
            if isinstance(delta, dict) and delta.get("tool_calls"):
                _delta_calls(calls, delta["tool_calls"])
                delta = {k: v for k, v in delta.items() if k != "tool_calls"}
                ch = ch | {"delta": delta}
            piece, extra = _choice_text(ch, route, "delta")
            parts.append(piece or "")
            partial = partial or extra
            finish = _str(ch, "finish_reason") or finish
    text = call_text("".join(parts), [calls[i] for i in sorted(calls)]) if calls else "".join(parts)
    return (text if done and not partial else None), finish, seen


def _response(part: Any, route: str, model: str | None) -> tuple[str | None, str | None, bool | None, str | None]:
    """(response_text, finish_reason, streamed, model) of `endpointOutput`; all None when it is missing or empty."""
    if not isinstance(part, dict) or part.get("data") in (None, ""):
        return None, None, None, None
    text = _body_text(part, "response")
    if text.lstrip().startswith("data:") or "event-stream" in (_str(part, "observedContentType") or ""):
        resp_text, finish, seen = _stream(text, route, model)
        return resp_text, finish, True, seen
    body = _json(text, "response body")
    _raise_if_error(body, "response")
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices:
        raise SkipRecord("error_response", "response has no 'choices'")
    if len(choices) > 1:
        raise SkipRecord("n_gt_1", f"response has {len(choices)} choices")
    _check_model(_str(body, "model"), model, "response")
    choice, (key, kind) = choices[0], (("message", dict) if route == "chat" else ("text", str))
    if not isinstance(choice, dict) or not isinstance(choice.get(key), kind):
        raise SkipRecord("error_response", f"choices[0] has no {key}")
    resp_text, partial = _choice_text(choice, route, "message")
    return (None if partial else resp_text), _str(choice, "finish_reason"), False, _str(body, "model")


def _exchange(rec: Any, model: str | None) -> Exchange:
    cap, meta = (rec.get("captureData"), rec.get("eventMetadata")) if isinstance(rec, dict) else (None, None)
    if not isinstance(cap, dict) or not isinstance(cap.get("endpointInput"), dict):
        raise SkipRecord("bad_record", "no captureData.endpointInput object")
    if _str(meta, "eventId") is None or _str(meta, "inferenceTime") is None:
        raise SkipRecord("bad_record", "eventMetadata lacks a string eventId/inferenceTime")
    route, request = _request(_body_text(cap["endpointInput"], "request"), model)
    text, finish, streamed, resp_model = _response(cap.get("endpointOutput"), route, model)
    if finish == "stop" and (request.get("stop") or request.get("stop_token_ids")):
        finish = "length"  # a stop string / id may have ended it, not EOS: rehydrate the text's ids, no EOS
    return Exchange(event_id=meta["eventId"], inference_time=meta["inferenceTime"], route=route, request=request,
                    response_text=text, finish_reason=finish,
                    streamed=request.get("stream") is True if streamed is None else streamed,
                    model=_str(request, "model") or resp_model)


def _load_line(line: str | bytes, cut: bool) -> Any:
    text = _utf8(line, "capture line") if isinstance(line, bytes) else line
    return _json(text, *(("last line (no trailing newline)", "truncated") if cut else ("capture line",)))


def parse_line(line: str | bytes, *, model: str | None = None) -> Exchange:
    """One capture line (str, or bytes decoded as UTF-8) → its `Exchange`.

    `model`: when given, traffic naming another model is skipped. Raises `SkipRecord` (`.reason` in `SKIP_REASONS`)
    for a line that yields no exchange; a missing response is not an error (`response_text` None).
    """
    return _exchange(_load_line(line, cut=False), model)


def parse_object(body: bytes, *, model: str | None = None) -> tuple[list[Exchange], Counter]:
    """Every line of one capture object → (exchanges in line order, Counter of reasons).

    The Counter holds each `SkipRecord.reason`, ``duplicate_event`` (an event id already seen in this object: the
    first is kept) and ``missing_response`` (exchanges yielded with `response_text` None: information, not a skip).
    A last line without trailing newline that is not JSON counts ``truncated``. Never raises for bad content.
    """
    exchanges: list[Exchange] = []
    counts: Counter = Counter()
    seen: set[str] = set()
    lines = body.split(b"\n")
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            ex = _exchange(_load_line(raw, cut=i == len(lines) - 1), model)
        except SkipRecord as e:
            counts[e.reason] += 1
            continue
        if ex.event_id in seen:
            counts["duplicate_event"] += 1
            continue
        seen.add(ex.event_id)
        exchanges.append(ex)
        if ex.response_text is None:
            counts["missing_response"] += 1
    return exchanges, counts
