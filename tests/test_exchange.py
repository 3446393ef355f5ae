"""capture.exchange: SageMaker Data Capture lines (layout as in the AWS "Capture data from real-time endpoint"
page) → OpenAI exchanges, every bad line counted by reason. Pure, no model, no network."""
from __future__ import annotations

import base64
import json
from collections import Counter

import pytest

from tidespec.capture.exchange import SKIP_REASONS, Exchange, SkipRecord, parse_line, parse_object

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
CHAT_REQ = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Capital of France?"}],
            "max_tokens": 64, "temperature": 0.0}
CHAT_RESP = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1739553949, "model": MODEL,
             "choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris."},
                          "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 20, "completion_tokens": 3, "total_tokens": 23}}
COMP_REQ = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16}
COMP_RESP = {"id": "cmpl-1", "object": "text_completion", "created": 1739553949, "model": MODEL,
             "choices": [{"index": 0, "text": " there was a fox.", "logprobs": None, "finish_reason": "length"}]}


def _part(mode: str, body, encoding: str, ctype: str) -> dict:
    text = body if isinstance(body, str) else json.dumps(body)
    data = base64.b64encode(text.encode()).decode() if encoding == "BASE64" else text
    return {"observedContentType": ctype, "mode": mode, "data": data, "encoding": encoding}


def capture_line(request, response=None, *, encoding="JSON", event_id="aaaaaaaa-bbbb-cccc-dddd-000000000001",
                 out_encoding=None, out_ctype="application/json") -> str:
    """One Data Capture JSON line as SageMaker writes it (captureData / eventMetadata / eventVersion)."""
    cap = {"endpointInput": _part("INPUT", request, encoding, "application/json")}
    if response is not None:
        cap["endpointOutput"] = _part("OUTPUT", response, out_encoding or encoding, out_ctype)
    return json.dumps({"captureData": cap,
                       "eventMetadata": {"eventId": event_id, "inferenceId": "inf-1",
                                         "inferenceTime": "2022-02-14T17:25:49Z"},
                       "eventVersion": "0"})


def sse(chunks: list[dict], done: bool = True) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ("data: [DONE]\n\n" if done else "")


def chat_chunk(content=None, finish=None, role=None) -> dict:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def obj(*lines: str, trailing_newline: bool = True) -> bytes:
    return ("\n".join(lines) + ("\n" if trailing_newline else "")).encode()


def reason_of(line, **kw) -> str:
    with pytest.raises(SkipRecord) as e:
        parse_line(line, **kw)
    assert e.value.reason in SKIP_REASONS and str(e.value).startswith(e.value.reason + ":")
    return e.value.reason


@pytest.mark.parametrize("encoding", ["JSON", "BASE64"])
def test_chat_and_completions_round_trip(encoding):
    ex = parse_line(capture_line(CHAT_REQ, CHAT_RESP, encoding=encoding), model=MODEL)
    assert ex == Exchange(event_id="aaaaaaaa-bbbb-cccc-dddd-000000000001", inference_time="2022-02-14T17:25:49Z",
                          route="chat", request=CHAT_REQ, response_text="Paris.", finish_reason="stop",
                          streamed=False, model=MODEL)
    ex = parse_line(capture_line(COMP_REQ, COMP_RESP, encoding=encoding).encode(), model=MODEL)
    assert (ex.route, ex.request, ex.response_text, ex.finish_reason, ex.model, ex.streamed) == \
        ("completions", COMP_REQ, " there was a fox.", "length", MODEL, False)


def test_sse_stream_concatenates_deltas_and_keeps_last_finish_reason():
    stream = sse([chat_chunk("", role="assistant"), chat_chunk("Par"), chat_chunk("is"), chat_chunk("."),
                  chat_chunk(finish="stop"),
                  {"id": "chatcmpl-2", "object": "chat.completion.chunk", "model": MODEL, "choices": [],
                   "usage": {"completion_tokens": 3}}])
    req = {**CHAT_REQ, "stream": True}
    ex = parse_line(capture_line(req, stream, out_encoding="BASE64", out_ctype="text/event-stream"), model=MODEL)
    assert (ex.response_text, ex.finish_reason, ex.streamed, ex.request) == ("Paris.", "stop", True, req)
    comp = sse([{"object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": t, "finish_reason": f}]}
                for t, f in ((" there", None), (" was", None), ("", "length"))])
    ex = parse_line(capture_line({**COMP_REQ, "stream": True}, comp, out_encoding="JSON"))
    assert (ex.response_text, ex.finish_reason, ex.streamed) == (" there was", "length", True)


def test_stream_cut_before_done_is_a_missing_response():
    cut = sse([chat_chunk("Par"), chat_chunk("is")], done=False)
    ex = parse_line(capture_line({**CHAT_REQ, "stream": True}, cut, out_encoding="BASE64"))
    assert (ex.response_text, ex.streamed) == (None, True)


def test_object_counts_every_bad_line_and_keeps_good_ones_in_order():
    good1 = capture_line(CHAT_REQ, CHAT_RESP, event_id="e1")
    good2 = capture_line(COMP_REQ, COMP_RESP, encoding="BASE64", event_id="e2")
    no_output = capture_line(CHAT_REQ, None, event_id="e3")
    body = obj(good1, '{"captureData": {"endpointInput": {"data": "{', good2, no_output,
               capture_line(CHAT_REQ, CHAT_RESP, event_id="e1"),  # duplicate of the first
               good1[: len(good1) // 2], trailing_newline=False)
    exchanges, counts = parse_object(body, model=MODEL)
    assert [e.event_id for e in exchanges] == ["e1", "e2", "e3"]
    assert exchanges[2].response_text is None and exchanges[2].request == CHAT_REQ
    assert counts == Counter(malformed_json=1, truncated=1, duplicate_event=1, missing_response=1)


def test_complete_last_line_without_newline_still_parses():
    exchanges, counts = parse_object(obj(capture_line(CHAT_REQ, CHAT_RESP), trailing_newline=False))
    assert len(exchanges) == 1 and counts == Counter()


def test_cut_middle_line_is_malformed_not_truncated():
    line = capture_line(CHAT_REQ, CHAT_RESP, event_id="e1")
    exchanges, counts = parse_object(obj(line[:40], capture_line(CHAT_REQ, CHAT_RESP, event_id="e2")))
    assert [e.event_id for e in exchanges] == ["e2"] and counts == Counter(malformed_json=1)


def test_csv_base64_utf8_rules():
    csv_line = json.dumps({"captureData": {"endpointInput": {"observedContentType": "text/csv", "mode": "INPUT",
                                                             "data": "1,2,3\n", "encoding": "CSV"}},
                           "eventMetadata": {"eventId": "e", "inferenceTime": "2022-02-14T17:25:49Z"},
                           "eventVersion": "0"})
    assert reason_of(csv_line) == "csv_body"
    bad64 = json.loads(capture_line(CHAT_REQ, CHAT_RESP, encoding="BASE64"))
    bad64["captureData"]["endpointInput"]["data"] = "not base64 at all!"
    assert reason_of(json.dumps(bad64)) == "bad_base64"
    latin1 = json.loads(capture_line(CHAT_REQ, CHAT_RESP, encoding="BASE64"))
    latin1["captureData"]["endpointInput"]["data"] = base64.b64encode("caf\u00e9".encode("latin-1")).decode()
    assert reason_of(json.dumps(latin1)) == "non_utf8"
    raw = capture_line(CHAT_REQ, CHAT_RESP).encode().replace(b"France", b"Fran\xe7e")  # latin-1 byte in the line
    assert reason_of(raw) == "non_utf8"
    _, counts = parse_object(obj(csv_line, json.dumps(bad64), json.dumps(latin1)).replace(b"\n", b"\xff\n", 1))
    assert counts == Counter(non_utf8=2, bad_base64=1)


def test_missing_or_empty_output_is_an_exchange_without_response():
    ex = parse_line(capture_line({**CHAT_REQ, "stream": True}))
    assert (ex.response_text, ex.finish_reason, ex.streamed, ex.model) == (None, None, True, MODEL)
    empty = json.loads(capture_line(CHAT_REQ, CHAT_RESP))
    empty["captureData"]["endpointOutput"]["data"] = ""
    _, counts = parse_object(obj(json.dumps(empty), capture_line(CHAT_REQ, event_id="x")))
    assert counts == Counter(missing_response=2)


@pytest.mark.parametrize("resp", [
    {"error": {"message": "max_tokens too large", "type": "BadRequestError", "code": 400}},  # OpenAI / vLLM
    {"object": "error", "message": "The model does not exist.", "type": "NotFoundError", "code": 404},  # vLLM/SGLang
    {"id": "x", "object": "chat.completion", "model": MODEL, "choices": []},
    "[1, 2]",
    sse([{"error": {"message": "engine died"}}]),
])
def test_error_responses(resp):
    assert reason_of(capture_line(CHAT_REQ, resp)) == "error_response"


def test_other_model_on_either_side_only_when_model_given():
    line = capture_line({**CHAT_REQ, "model": "Qwen/Qwen3-8B"}, {**CHAT_RESP, "model": "Qwen/Qwen3-8B"})
    assert reason_of(line, model=MODEL) == "other_model"
    assert parse_line(line).model == "Qwen/Qwen3-8B"
    no_req_model = {k: v for k, v in CHAT_REQ.items() if k != "model"}
    assert reason_of(capture_line(no_req_model, {**CHAT_RESP, "model": "other"}), model=MODEL) == "other_model"
    assert parse_line(capture_line(no_req_model, CHAT_RESP), model=MODEL).model == MODEL  # from the response


def test_content_parts_kept_as_is_and_all_non_text_is_empty():
    parts = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]
    req = {**CHAT_REQ, "messages": [{"role": "user", "content": parts}]}
    assert parse_line(capture_line(req, CHAT_RESP)).request["messages"][0]["content"] == parts
    only_image = {**CHAT_REQ, "messages": [{"role": "user", "content": parts[1:]}]}
    assert reason_of(capture_line(only_image, CHAT_RESP)) == "empty_prompt"


@pytest.mark.parametrize("req", [
    {**CHAT_REQ, "messages": [{"role": "system", "content": "Be brief."}]},
    {**CHAT_REQ, "messages": [{"role": "user", "content": "   "}]},
    {**COMP_REQ, "prompt": ""},
    {**COMP_REQ, "prompt": []},
])
def test_empty_prompt(req):
    assert reason_of(capture_line(req, CHAT_RESP)) == "empty_prompt"


def test_n_gt_1():
    assert reason_of(capture_line({**CHAT_REQ, "n": 2}, CHAT_RESP)) == "n_gt_1"
    two = {**CHAT_RESP, "choices": CHAT_RESP["choices"] * 2}
    assert reason_of(capture_line(CHAT_REQ, two)) == "n_gt_1"
    assert reason_of(capture_line({**COMP_REQ, "prompt": ["a", "b"]}, COMP_RESP)) == "n_gt_1"
    second = chat_chunk("x")
    second["choices"][0]["index"] = 1
    assert reason_of(capture_line(CHAT_REQ, sse([chat_chunk("y"), second]))) == "n_gt_1"


@pytest.mark.parametrize("req", [{"inputs": "hello", "parameters": {}}, [1, 2], {"messages": "hi"},
                                 {"prompt": {"text": "x"}}, {**CHAT_REQ, "n": "2"}])
def test_not_openai(req):
    assert reason_of(capture_line(req, CHAT_RESP)) == "not_openai"


def test_completions_token_prompt_and_one_prompt_batch_are_accepted():
    assert parse_line(capture_line({**COMP_REQ, "prompt": [791, 6864, 315]}, COMP_RESP)).response_text
    assert parse_line(capture_line({**COMP_REQ, "prompt": ["Once"]}, COMP_RESP)).route == "completions"


def test_partial_chat_text_is_regenerated_not_trusted():
    tool = {**CHAT_RESP, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [{"id": "t", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]}}]}
    reasoning = {**CHAT_RESP, "choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "42", "reasoning_content": "6*7"}}]}
    ex = parse_line(capture_line(CHAT_REQ, reasoning))
    assert ex.response_text is None and ex.finish_reason == "stop"
    # tool calls are the target's text in the Hermes-style tool-call format (what `tidespec serve` emits)
    ex = parse_line(capture_line(CHAT_REQ, tool))
    assert ex.response_text == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert ex.finish_reason == "tool_calls"


def test_streamed_tool_calls_are_joined_into_the_calls_text():
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                                                  "function": {"name": "get", "arguments": ""}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '1}'}}]}}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
    line = capture_line({**CHAT_REQ, "stream": True}, sse([c | {"model": CHAT_RESP["model"]} for c in chunks]),
                        out_encoding="BASE64", out_ctype="text/event-stream")
    ex = parse_line(line)
    assert ex.response_text == '<tool_call>\n{"name": "get", "arguments": {"a": 1}}\n</tool_call>'


def test_not_a_capture_record():
    for line in ('[1]', '{"captureData": {}}', json.dumps({"captureData": {"endpointInput": {}},
                                                          "eventMetadata": {"eventId": "e", "inferenceTime": "t"}})):
        assert reason_of(line) == "bad_record"
    meta_less = json.loads(capture_line(CHAT_REQ, CHAT_RESP))
    del meta_less["eventMetadata"]["eventId"]
    assert reason_of(json.dumps(meta_less)) == "bad_record"


def test_parse_object_never_raises_on_odd_shapes():
    odd = ['"just a string"', "null", '{"captureData": []}', "[" * 100_000,
           json.dumps({"captureData": {"endpointInput": {"encoding": "JSON", "data": 5}}, "eventMetadata": {}}),
           capture_line(CHAT_REQ, {"choices": "nope"}), capture_line(CHAT_REQ, {"choices": [1]}),
           capture_line(CHAT_REQ, {"choices": [{"message": "x"}]}), capture_line(COMP_REQ, {"choices": [{}]}),
           capture_line(CHAT_REQ, "data: {not json}\n\n"), capture_line(CHAT_REQ, "data: {\"choices\": 3}\n\n"),
           capture_line({**CHAT_REQ, "messages": [1]}, CHAT_RESP), capture_line(CHAT_REQ, "plain text error")]
    exchanges, counts = parse_object(obj(*odd))
    assert exchanges == []
    assert counts == Counter(bad_record=4, malformed_json=3, error_response=5, not_openai=1)


def test_skip_record_refuses_unknown_reason():
    with pytest.raises(ValueError):
        SkipRecord("whatever", "x")


def test_stream_edge_cases():
    # SSE line ends are only CR/LF: a U+2028 inside a chunk (ensure_ascii=False servers) must not split it
    chunk = json.dumps(chat_chunk("a\u2028b", finish="stop"), ensure_ascii=False)
    raw = f"data: {chunk}\r\n\r\ndata: [DONE]\r\n\r\n"
    assert parse_line(capture_line(CHAT_REQ, raw, out_encoding="BASE64")).response_text == "a\u2028b"
    # comments / event fields carry no data; a chunk without delta adds nothing; "data:" without the space
    raw = ": keep-alive\n\nevent: message\ndata:" + json.dumps(chat_chunk("Hi")) + "\n\n" + \
        f"data: {json.dumps({'model': MODEL, 'choices': [{'index': 0, 'finish_reason': 'stop'}]})}\n\ndata: [DONE]\n\n"
    ex = parse_line(capture_line(CHAT_REQ, raw, out_ctype="text/event-stream"))
    assert (ex.response_text, ex.finish_reason, ex.streamed) == ("Hi", "stop", True)
    # vLLM reasoning parser output in the deltas: the content alone is not the generation
    think = chat_chunk("42")
    think["choices"][0]["delta"]["reasoning"] = "6*7"
    assert parse_line(capture_line(CHAT_REQ, sse([think]))).response_text is None
    assert reason_of(capture_line(CHAT_REQ, "data: 3\n\ndata: [DONE]\n\n")) == "error_response"


def test_successful_response_with_null_error_field_is_not_an_error():
    assert parse_line(capture_line(CHAT_REQ, {**CHAT_RESP, "error": None})).response_text == "Paris."


def test_stop_of_a_request_with_stop_strings_is_not_read_as_eos():
    """EOS ends a reply with finish "stop", but so does a stop string, after which the target never
    generated EOS: rehydration must not append one."""
    assert parse_line(capture_line(CHAT_REQ, CHAT_RESP), model=MODEL).finish_reason == "stop"
    ex = parse_line(capture_line(CHAT_REQ | {"stop": ["\n\n"]}, CHAT_RESP), model=MODEL)
    assert ex.finish_reason == "length" and ex.response_text == "Paris."
    ex = parse_line(capture_line(CHAT_REQ | {"stop_token_ids": [7]}, CHAT_RESP), model=MODEL)
    assert ex.finish_reason == "length"
