"""Structured output and tool calls through `tidespec serve`, driven by the official `openai` SDK's
helpers (`chat.completions.parse`, `pydantic_function_tool`, streamed and not), against two live
servers: speculation (EAGLE3 random draft + suffix + grammar proposer) and none. The tiny target is
random, so only the grammar makes its output valid; outputs must be equal on both servers."""
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from conftest import add_tiny_tokenizer, make_tiny_target, random_draft
from tidespec.bench.serve import serve_in_thread
from tidespec.config import CaptureParams, EngineParams, ServeParams
from tidespec.engine.constraint import ToolCallStream, parse_tool_calls
from tidespec.engine.speculative import Engine
from tidespec.engine.suffix_tree import SuffixCache
from tidespec.models.runner import DraftRunner
from tidespec.models.target import load_target
from tidespec.serve.server import build_app


class Person(BaseModel):
    name: str = Field(max_length=6)
    role: Literal["engineer", "manager"]
    age: int = Field(ge=0, le=99)
    remote: bool


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"query": {"type": "string", "maxLength": 6}, "limit": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 9}},
    "required": ["query", "limit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _deep(n: int) -> dict:
    s: dict = {"type": "integer"}
    for _ in range(n):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("structured") / "target"  # a byte-level tokenizer: tool prompts need > 512 positions
    add_tiny_tokenizer(make_tiny_target(d, max_position_embeddings=2048))
    target, tok = load_target(d)
    spec_eng = Engine(
        target,
        DraftRunner(random_draft(target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=2048),
        suffix=SuffixCache(),
    )
    plain_eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=2048))
    cfg = ServeParams(max_tokens=400)
    spec, plain = (serve_in_thread(build_app(e, tok, cfg, model="tiny")) for e in (spec_eng, plain_eng))
    yield {"spec": spec, "plain": plain}
    spec.stop()
    plain.stop()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)


def both(servers, fn):
    return fn(client(servers["spec"])), fn(client(servers["plain"]))


def test_parse_helper_returns_the_pydantic_model_equal_with_and_without_speculation(servers):
    a, b = both(servers, lambda c: c.chat.completions.parse(model="tiny", messages=ASK, response_format=Person,
                                                             temperature=0, max_tokens=200))
    for r in (a, b):
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Person)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].model_extra["tidespec"]["token_ids"] == b.choices[0].model_extra["tidespec"]["token_ids"]
    stats = a.choices[0].model_extra["tidespec"]
    assert stats["num_drafts"] > 0  # speculation ran (the grammar proposer at least: keys are forced)


def test_json_object_and_json_schema_stream_equal_to_whole(servers):
    schema = Person.model_json_schema() | {"additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}
    c = client(servers["spec"])
    whole = c.chat.completions.create(model="tiny", messages=ASK, response_format=fmt, temperature=0, max_tokens=200)
    parts = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny", messages=ASK, response_format=fmt, temperature=0, max_tokens=200, stream=True) if ch.choices]
    assert "".join(parts) == whole.choices[0].message.content
    jsonschema.validate(json.loads(whole.choices[0].message.content), schema)
    obj = c.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                    temperature=0, max_tokens=300)
    text = obj.choices[0].message.content
    assert text.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "search"}}])
def test_tool_calls_valid_streamed_like_whole_and_equal_across_servers(servers, choice):
    kw = dict(model="tiny", messages=ASK, tools=[WEATHER, SEARCH], tool_choice=choice, temperature=0, max_tokens=300,
              parallel_tool_calls=False)
    a, b = both(servers, lambda c: c.chat.completions.create(**kw))
    msg = a.choices[0].message
    assert a.choices[0].finish_reason == "tool_calls" and msg.content is None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(choice, dict):
        assert call.function.name == "search"
    tool = {"get_weather": WEATHER, "search": SEARCH}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
    assert [(t.function.name, t.function.arguments) for t in b.choices[0].message.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    deltas = [ch.choices[0] for ch in client(servers["spec"]).chat.completions.create(**kw, stream=True) if ch.choices]
    entries = [e for d in deltas for e in d.delta.tool_calls or []]
    assert entries[0].id.startswith("call_") and entries[0].function.name == call.function.name
    assert entries[0].function.arguments == "" and len(entries) > 2  # arguments arrive in pieces, as vLLM streams
    assert "".join(e.function.arguments or "" for e in entries) == call.function.arguments
    assert deltas[-1].finish_reason == "tool_calls" and all(d.delta.content in (None, "") for d in deltas)


def test_sdk_streaming_helper_with_pydantic_function_tool(servers):
    class Lookup(BaseModel):
        """Look a word up."""
        word: str = Field(max_length=5)
        lang: Literal["en", "fr"]

    with client(servers["spec"]).chat.completions.stream(
            model="tiny", messages=ASK, tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
            parallel_tool_calls=False,
            temperature=0, max_tokens=200) as s:
        final = s.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert call.function.name == "Lookup" and isinstance(call.function.parsed_arguments, Lookup)


def test_sdk_streaming_helper_with_a_pydantic_response_format(servers):
    with client(servers["spec"]).chat.completions.stream(model="tiny", messages=ASK, response_format=Person,
                                                          temperature=0, max_tokens=200) as s:
        events = [e.type for e in s]
        final = s.get_final_completion()
    assert "content.delta" in events and "content.done" in events
    assert isinstance(final.choices[0].message.parsed, Person)


def test_tool_results_in_history_and_auto_choice(servers):
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    r = client(servers["spec"]).chat.completions.create(model="tiny", messages=history, tools=[WEATHER],
                                                        tool_choice="auto", temperature=0, max_tokens=60)
    msg = r.choices[0].message
    assert (msg.tool_calls is None) != (msg.content is None)  # text or calls, never both
    for call in msg.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}}},
     "response_format.json_schema.schema"),  # a keyword the grammar library does not implement
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}], "tool_choice": "auto"},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos"),
    ({"tools": [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "s", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": _deep(200)}}},
     "response_format.json_schema.schema"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.tool_calls"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "open", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "s", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
])
def test_bad_structured_requests_are_400_naming_the_field(servers, body, param):
    r = httpx.post(f"{servers['spec'].url}/v1/chat/completions", json={"model": "tiny", "messages": ASK} | body,
                   timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param or (err["param"] or "").startswith(param), err


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_tool_call_stream_gives_the_whole_parse_for_any_split(step):
    text = ('<tool_call>\n{"name": "f", "arguments": {"a": "}\\"]", "b": [1, {"c": 2}]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>')
    s, content, entries = ToolCallStream(), "", []
    for i in range(0, len(text), step):  # the separator newline may arrive alone: it is never content
        c, e = s.feed(text[i:i + step], final=i + step >= len(text))
        content, entries = content + c, entries + e
    assert content == "" and s.calls == 2
    heads = [e for e in entries if "id" in e]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [(0, "f"), (1, "g")]
    args = ["".join(e["function"]["arguments"] for e in entries if e["index"] == i) for i in (0, 1)]
    assert args == ['{"a": "}\\"]", "b": [1, {"c": 2}]}', "{}"]
    whole_content, calls = parse_tool_calls(text)
    assert whole_content is None and [c["function"]["arguments"] for c in calls] == args
    # text first (tool_choice auto's text branch): a call block inside it is text, never a call
    assert parse_tool_calls("Sure.<tool_call>\n" + text[12:]) == ("Sure.<tool_call>\n" + text[12:], [])
    # cut by max_tokens inside the arguments: the partial call, as OpenAI returns it
    assert parse_tool_calls('<tool_call>\n{"name": "a", "arguments": {"x": 12')[1][0]["function"]["arguments"] \
        == '{"x": 12'
    # cut anywhere else in the layout: the fragment is neither a call nor content, streamed or whole
    two = text.index("<tool_call>", 1)
    for cut, n in [('<tool_call>\n{"na', 0), ("<tool_", 0), (text[:two + 5], 1), (text[:two + 30], 1),
                   (text[:two - 4], 1), (text[:-3], 2)]:
        content, calls = parse_tool_calls(cut)
        assert content is None and len(calls) == n, (cut, content, calls)
        s, got = ToolCallStream(), ""
        for i in range(0, len(cut), step):
            got += s.feed(cut[i:i + step], final=i + step >= len(cut))[0]
        assert got == "", (cut, got)
    assert [c["function"]["arguments"] for c in parse_tool_calls(text[:-3])[1]] == args  # cut in the close


def test_nested_pydantic_tool_refs_resolve_in_the_tool_own_schema(servers):
    class Address(BaseModel):
        city: str = Field(max_length=6)
        zip: int = Field(ge=0, le=99)

    class Ship(BaseModel):
        """Ship a parcel."""
        to: Address
        back: Address | None

    tool = openai.pydantic_function_tool(Ship)
    assert "$defs" in tool["function"]["parameters"]  # refs '#/$defs/Address', resolved inside the tool's schema
    r = client(servers["spec"]).chat.completions.parse(model="tiny", messages=ASK, tools=[tool], tool_choice="required",
                                                       parallel_tool_calls=False, temperature=0, max_tokens=300)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Ship)
    tree = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "kid": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["v", "kid"], "additionalProperties": False}
    for seed in range(3):  # '#' is the tool's own parameters, not the call envelope
        r = client(servers["spec"]).chat.completions.create(
            model="tiny", messages=ASK, tools=[{"type": "function", "function": {"name": "t", "parameters": tree}}],
            tool_choice="required", parallel_tool_calls=False, temperature=1, seed=seed, max_tokens=300)
        if r.choices[0].finish_reason == "tool_calls":
            jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), tree)


def test_logprobs_of_constrained_requests_are_finite_json(servers):
    for stream in (False, True):
        r = httpx.post(f"{servers['spec'].url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": ASK, "response_format": {"type": "json_object"}, "logprobs": True,
            "top_logprobs": 5, "max_tokens": 12, "temperature": 0, "stream": stream})
        assert r.status_code == 200 and "Infinity" not in r.text and "NaN" not in r.text
    tops = [t["logprob"] for c in r.text.split("\n") if c.startswith("data: {")
            for x in (json.loads(c[6:])["choices"] or [{}]) for e in ((x.get("logprobs") or {}).get("content") or [])
            for t in e["top_logprobs"]]
    assert min(tops) == -9999.0  # the first token of an object is "{": the other four of the top five are masked


def test_wide_optional_schemas_and_recompiled_failures(tmp_path):
    """An object of 300 optional properties compiles and generates (rows of ~1200 Earley items); a
    grammar whose matcher failed is compiled afresh for the next request."""
    from tidespec.engine.grammar_state import GrammarCompiler
    target, tok = load_target(add_tiny_tokenizer(make_tiny_target(tmp_path / "t")))
    gc = GrammarCompiler.for_target(target, tok)
    wide = {"type": "object", "properties": {f"k{i}": {"type": "boolean"} for i in range(300)},
            "additionalProperties": False}
    g = gc.json_schema(wide)
    st = g.state()
    st.advance(tok.encode('{"k7": true, "k150": false', add_special_tokens=False))  # keys in schema order
    assert st.error is None and sorted(tok.decode(st.masks([], 1)[0].nonzero().squeeze(1).tolist())) == [",", "}"]
    assert gc.json_schema(wide) is g
    g.broken.append("lexer error")
    assert gc.json_schema(wide) is not g


def test_constrained_exchanges_keep_their_constraint_through_capture_ingest_and_replay(tmp_path):
    """Served with live capture and text capture at once: the ingested (rehydrated) records equal the
    live ones token for token, both keep the request's constraint spec, and replaying a record's
    prompt under the grammar compiled from that spec gives the served tokens back (evaluation's path)."""
    from fastapi.testclient import TestClient

    from conftest import tiny_params_yaml
    from tidespec.capture.ingest import ingest_source
    from tidespec.capture.store import read_manifest, read_record
    from tidespec.capture.text import TextCapture
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import load_params
    from tidespec.engine.replay import replay
    from tidespec.train.evaluation import constrained
    from tidespec.workspace import Workspace

    d = add_tiny_tokenizer(make_tiny_target(tmp_path / "target", max_position_embeddings=2048))
    target, tok = load_target(d)
    live = CaptureWriter(tmp_path / "live", target.target_id, CaptureParams(shard_max_records=4))
    text = TextCapture(tmp_path / "text")
    eng = Engine(
        target,
        DraftRunner(random_draft(target, 64, seed=1)),
        EngineParams(num_draft_tokens=3, max_seq_len=2048),
        capture=live,
        suffix=SuffixCache(),
    )
    schema = Person.model_json_schema() | {"additionalProperties": False}
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}},
              {"response_format": {"type": "json_object"}, "max_tokens": 40},
              {"tools": [WEATHER, SEARCH], "tool_choice": "required", "parallel_tool_calls": False},
              {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
               "stream": True}]
    with TestClient(build_app(eng, tok, ServeParams(max_tokens=160), text_capture=text)) as c:
        for b in bodies:
            r = c.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0} | b)
            assert r.status_code == 200, r.text
    live.close()
    text.close()
    (tmp_path / "params.yaml").write_text(tiny_params_yaml(d))
    params = load_params(tmp_path / "params.yaml")
    w = CaptureWriter(tmp_path / "ingested", target.target_id, CaptureParams(shard_max_records=4))
    rep = ingest_source(str(tmp_path / "text"), None, Workspace(tmp_path), params, target, tok, w)
    w.close()
    assert rep["rehydrated"] == 4 and rep["skipped"] == {}, rep
    want = {r.request_id: r for r in read_manifest(tmp_path / "live")}
    got = {r.request_id: r for r in read_manifest(tmp_path / "ingested")}
    assert set(got) == set(want) and len(want) == 4
    rows = []
    for rid, row in got.items():
        a, b = read_record(tmp_path / "ingested", row), read_record(tmp_path / "live", want[rid])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        assert row.constraint == want[rid].constraint and row.constraint is not None
        prompt = b["input_ids"][b["loss_mask"] == 0].tolist()
        served = b["input_ids"][b["loss_mask"] == 1].tolist()
        rows.append({"id": rid, "input_ids": prompt, "constraint": row.constraint, "served": served})
    kinds = sorted("tools" if "tools" in r["constraint"] else r["constraint"]["response_format"]["type"] for r in rows)
    assert kinds == ["json_object", "json_schema", "tools", "tools"]
    runs = replay(
        {"base": (Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=2048)), False)},
        constrained(rows, target, tok),
        160,
    )
    for r in rows:  # a record holds prompt + generated[:-1]: the replayed output continues it exactly
        out = runs["base"]["outputs"][r["id"]]
        assert out[:len(r["served"])] == r["served"] and len(out) > len(r["served"])


def test_strict_means_closed_objects_as_openai_means_it():
    """`strict: true` refuses an object that is not closed, naming its JSON pointer and what it lacks;
    a closed schema (what the SDK's `parse` sends, here from pydantic) passes, nested objects and
    $defs included."""
    from openai.lib._pydantic import to_strict_json_schema

    from tidespec.serve.errors import OpenAIError
    from tidespec.serve.structured import check_strict

    class Inner(BaseModel):
        x: int

    class Outer(BaseModel):
        inner: Inner
        tags: list[Inner]
    check_strict(to_strict_json_schema(Outer), "p")  # closed everywhere: passes
    bad = {"type": "object", "additionalProperties": False, "required": ["a", "b"], "properties": {
        "a": {"type": "string"}, "b": {"type": "array", "items": {"$ref": "#/$defs/I"}}},
           "$defs": {"I": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                           "required": ["x"], "additionalProperties": False}}}
    with pytest.raises(OpenAIError, match=r"the object at /\$defs/I needs 'y' in \"required\"") as e:
        check_strict(bad, "response_format.json_schema.schema")
    assert e.value.param == "response_format.json_schema.schema"
    bad["$defs"]["I"] |= {"required": ["x", "y"], "additionalProperties": True}
    with pytest.raises(OpenAIError, match=r'the object at /\$defs/I needs "additionalProperties": false'):
        check_strict(bad, "p")


def test_formats_the_grammar_cannot_enforce_are_annotations(servers):
    """What pydantic writes for Path, bytes, SecretStr (format path, binary, password; also
    uri-reference, regex) is generated as a plain string instead of a 400; an enforced format (date)
    still constrains the value."""
    schema = {"type": "object", "additionalProperties": False, "required": ["p", "b", "s", "u", "r", "d"],
              "properties": {"p": {"type": "string", "format": "path", "maxLength": 4},
                             "b": {"type": "string", "format": "binary", "maxLength": 4},
                             "s": {"type": "string", "format": "password", "maxLength": 4},
                             "u": {"type": "string", "format": "uri-reference", "maxLength": 4},
                             "r": {"type": "string", "format": "regex", "maxLength": 4},
                             "d": {"type": "string", "format": "date"}}}
    r = httpx.post(f"{servers['spec'].url}/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": ASK, "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["choices"][0]["message"]["content"])
    jsonschema.validate(out, schema)  # format is an annotation to jsonschema too: the shape and lengths
    # the enforced one is an RFC 3339 full-date (JSON Schema's "date"); its year may be 0000, which RFC
    # 3339 allows and Python's date does not (a run of the suite produced "0000-…")
    assert re.fullmatch(r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", out["d"]), out["d"]
