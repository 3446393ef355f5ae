"""SageMaker Data Capture objects → OpenAI exchanges (pure parsing; every bad input counted by reason).

`parse_object(data, model)` reads one JSON Lines object (AWS's Data Capture layout: `captureData`
endpointInput/Output with JSON, BASE64 or CSV encoding, `eventMetadata` eventId/inferenceTime) and
yields `Exchange`s (request body, response text or None, event id, time) and `SkipRecord`s whose
`reason` names the first rule the line broke: non_utf8, malformed_json, truncated, bad_record,
csv_body, bad_base64, not_openai, other_model, n_gt_1, empty_prompt, error_response. A missing or
empty response, a stream cut before `data: [DONE]`, or a reply with tool calls is not a skip: its
`response_text` is None and the caller regenerates it. SSE bodies (OpenAI streams) are parsed.
The raw object is never modified. Sources and the layout in full: docs/design/capture.md.
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
