"""The official `openai` SDK against a live uvicorn `tidespec serve` app (tiny target, word tokenizer,
speculation on and off side by side), plus raw HTTP for malformed bodies and disconnects. Every
parameter in docs/api.md's table is exercised here or in test_request_params.py."""
import json
import shutil
import time

import httpx
import openai
import pytest

from conftest import add_tiny_word_tokenizer, random_draft
from numerics import fp32_logprob_tol, logit_scale
from tidespec.bench.serve import serve_in_thread
from tidespec.config import EngineParams, ServeParams
from tidespec.engine.speculative import Engine
from tidespec.models.runner import DraftRunner
from tidespec.models.target import load_target
from tidespec.serve.server import build_app

MODEL = "tiny"


class Sink:
    """A capture sink that wants every request and keeps what it is handed."""

    def __init__(self):
        self.ids = []

    def wants(self, rid):
        return True

    def submit_generation(self, gen, workload="default", prompt_id=""):
        self.ids.append(gen.request_id)
        return True


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_target_dir):
    d = tmp_path_factory.mktemp("oa") / "target"
    shutil.copytree(tiny_target_dir, d)
    add_tiny_word_tokenizer(d)
    target, tok = load_target(d)
    sink = Sink()
    spec_eng = Engine(
        target,
        DraftRunner(random_draft(target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=512),
        capture=sink,
        draft_version="v7",
    )
    plain_eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=512))
    cfg = ServeParams(max_tokens=256)
    spec = serve_in_thread(build_app(spec_eng, tok, cfg, model=MODEL))
    plain = serve_in_thread(build_app(plain_eng, tok, cfg, model=MODEL))
    yield {"spec": spec, "plain": plain, "tok": tok, "engine": spec_eng, "sink": sink, "target": target}
    spec.stop()
    plain.stop()


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


def both(servers, fn):
    return fn(client(servers["spec"])), fn(client(servers["plain"]))


def tol(servers, prompt: str, resp) -> float:
    """fp32 bound for logprobs of a multi-row verify vs one-row decode (tests/numerics.py): logit
    scale over the prompt's and the completion's tokens (the chat template adds a few more)."""
    t = servers["target"]
    ids = servers["tok"](prompt)["input_ids"] + resp.model_extra["tidespec"]["token_ids"]
    return fp32_logprob_tol(t.cfg, logit_scale(t, ids))


def _metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_models_lists_the_served_id_and_draft(servers):
    (m,) = client(servers["spec"]).models.list().data
    assert m.id == MODEL and m.model_extra["tidespec"]["draft_version"] == "v7"
    assert client(servers["spec"]).models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client(servers["spec"]).models.retrieve("gpt-4o")


def test_completion_logprobs_equal_speculation_off(servers):
    def run(c):
        return c.completions.create(model=MODEL, prompt="t8 t17 t33 t90", max_tokens=16, temperature=0,
                                    logprobs=3)
    a, b = both(servers, run)
    assert a.choices[0].text == b.choices[0].text and a.model_extra["tidespec"]["num_drafts"] > 0
    la, lb = a.choices[0].logprobs, b.choices[0].logprobs
    assert la.tokens == lb.tokens and len(la.tokens) == a.usage.completion_tokens == 16
    assert max(abs(x - y) for x, y in zip(la.token_logprobs, lb.token_logprobs)) <= tol(servers, "t8 t17 t33 t90", a)
    assert all(len(t) >= 3 and tok in t for t, tok in zip(la.top_logprobs, la.tokens))  # top 3 + the chosen one
    assert la.text_offset[0] == 0 and la.text_offset == sorted(la.text_offset)
    assert all(lp <= 0 for lp in la.token_logprobs)


def _ref_text(servers, **kw) -> str:
    return client(servers["plain"]).completions.create(model=MODEL, prompt="t8 t17 t33 t90", max_tokens=40,
                                                       temperature=0, **kw).choices[0].text


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_across_token_boundaries(servers, include):
    text = _ref_text(servers, frequency_penalty=1.5)  # a penalty varies the tiny target's output
    words = text.split()
    stop = f"{words[3][-1]} {words[4][:2]}"  # the end of word 3, the space, the start of word 4: 2 tokens
    cut = text.index(stop) + (len(stop) if include else 0)
    for srv in ("spec", "plain"):
        r = client(servers[srv]).completions.create(
            model=MODEL, prompt="t8 t17 t33 t90", max_tokens=40, temperature=0, frequency_penalty=1.5,
            stop=[stop, "never-there"], extra_body={"include_stop_str_in_output": include})
        ch = r.choices[0]
        assert ch.text == text[:cut] and ch.finish_reason == "stop" and ch.model_extra["stop_reason"] == stop
        assert r.usage.completion_tokens == len(ch.model_extra["tidespec"]["token_ids"]) <= 6


def test_streaming_chat_joined_deltas_equal_the_whole_and_usage(servers):
    c = client(servers["spec"])
    msgs = [
        {"role": "developer", "content": "t9 t10"},
        {"role": "user", "content": [{"type": "text", "text": "t8 t66"}]},
    ]
    whole = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, frequency_penalty=1.0, stop=["t2"])
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, frequency_penalty=1.0, stop=["t2"],
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content and len(chunks) > 3
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == whole.choices[0].finish_reason


def test_n_choices_with_seeds(servers):
    c = client(servers["spec"])
    kw = dict(model=MODEL, prompt="t8 t17", max_tokens=12, temperature=1.0, n=3, seed=11)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]  # seed i + choice index: reproducible
    assert len({ch.text for ch in a.choices}) > 1  # independent samples
    assert a.usage.completion_tokens == sum(len(ch.model_extra["tidespec"]["token_ids"]) for ch in a.choices)
    one = c.completions.create(**(kw | {"n": 1, "seed": 12}))
    assert one.choices[0].text == a.choices[1].text  # choice j uses seed + j


def test_streamed_n_and_echo(servers):
    c = client(servers["spec"])
    chunks = list(c.completions.create(model=MODEL, prompt="t8 t17", max_tokens=8, n=2, stream=True, echo=True,
                                       temperature=0))
    by = {0: "", 1: ""}
    for ch in chunks:
        for x in ch.choices:
            by[x.index] += x.text
    whole = c.completions.create(model=MODEL, prompt="t8 t17", max_tokens=8, n=2, echo=True, temperature=0)
    assert [by[0], by[1]] == [ch.text for ch in whole.choices] and by[0].startswith("t8 t17")


@pytest.mark.parametrize("kw", [dict(presence_penalty=1.5, frequency_penalty=1.0), dict(logit_bias={"7": -100}),
                                dict(extra_body={"repetition_penalty": 1.5, "min_p": 0.1, "top_k": 5}),
                                dict(extra_body={"min_tokens": 12, "ignore_eos": True}),
                                dict(extra_body={"stop_token_ids": [235]}, frequency_penalty=1.5)])
def test_chat_parameters_speculation_on_equals_off(servers, kw):
    def run(c):
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t8 t66 t7"}],
                                         max_tokens=20, temperature=0, **kw)
    a, b = both(servers, run)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.model_extra["tidespec"]["token_ids"] == b.model_extra["tidespec"]["token_ids"]


def test_chat_logprobs(servers):
    def run(c):
        return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t8 t66 t7"}],
                                         max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    a, b = both(servers, run)
    ca, cb = a.choices[0].logprobs.content, b.choices[0].logprobs.content
    assert len(ca) == a.usage.completion_tokens and [x.token for x in ca] == [x.token for x in cb]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(ca, cb)) <= tol(servers, "t8 t66 t7", a)
    assert all(len(x.top_logprobs) == 2 and x.bytes == list(x.token.encode()) for x in ca)


@pytest.mark.parametrize("call, param", [
    (lambda c: c.completions.create(model=MODEL, prompt="t8", extra_body={"frobnicate": 1}), "frobnicate"),
    (lambda c: c.completions.create(model=MODEL, prompt="t8", suffix="t9"), "suffix"),
    (lambda c: c.completions.create(model=MODEL, prompt="t8", best_of=3), "best_of"),
    (lambda c: c.completions.create(model=MODEL, prompt="t8", stop=["a", "b", "c", "d", "e"]), "stop"),
    (lambda c: c.completions.create(model=MODEL, prompt="t8", max_tokens=100000), "max_tokens"),
    (lambda c: c.completions.create(model=MODEL, prompt="t8", logit_bias={"999999": 5}), None),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t8"}],
                                         functions=[{"name": "f", "parameters": {}}]), "functions"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t8"}],
                                         tool_choice="required"), "tool_choice"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), "messages.content"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t8", "name": "bob"}]),
     "messages.name"),
    (lambda c: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "t8"}], top_logprobs=2),
     "top_logprobs"),
])
def test_refused_parameters_raise_the_sdk_error_naming_them(servers, call, param):
    with pytest.raises(openai.BadRequestError) as e:
        call(client(servers["spec"]))
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param or err["param"].startswith(param), err


def test_wrong_model_is_not_found_and_raw_malformed_bodies(servers):
    with pytest.raises(openai.NotFoundError):
        client(servers["spec"]).completions.create(model="gpt-4o", prompt="t8")
    url = servers["spec"].url
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "t5", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def _wait(cond, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_aborts_within_a_step_not_captured(servers):
    url, eng, sink = servers["spec"].url, servers["engine"], servers["sink"]
    name = 'tidespec:request_success_total{finished_reason="abort"}'
    before = _metric(url, name)
    body = {"model": MODEL, "prompt": "t8 t66", "max_tokens": 256, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", f"{url}/v1/completions", json=body) as r:
        first = next(r.iter_lines())
        rid = json.loads(first[len("data: "):])["id"].split("-", 1)[1]
    assert _wait(lambda: _metric(url, name) == before + 1 and eng.num_unfinished == 0), "streamed request not aborted"
    with pytest.raises(httpx.ReadTimeout):  # a non-streamed request whose client gives up
        httpx.post(f"{url}/v1/completions", json=body | {"stream": False}, timeout=0.5)
    assert _wait(lambda: _metric(url, name) == before + 2 and eng.num_unfinished == 0), "request not aborted"
    assert rid not in sink.ids and _metric(url, "tidespec:generation_tokens_total") > 0
    ok = client(servers["spec"]).completions.create(model=MODEL, prompt="t8 t66", max_tokens=4)
    assert ok.choices[0].finish_reason == "length"  # the engine keeps serving


def test_breaker_findings_are_400s_and_stop_token_text_is_left_out(servers):
    url = servers["spec"].url
    for raw in (b'{"prompt": "\\ud800 t10", "max_tokens": 3}',):  # a lone surrogate: 400, not a bare 500
        r = httpx.post(f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\udc00"}]}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["t10"] * 5, "n": 16, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"  # can never fit max_queue: not a 429
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "t50", "max_tokens": 4, "min_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "tool", "content": "t9"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.tool_call_id"
    ref = client(servers["plain"]).completions.create(model=MODEL, prompt="t8 t17", max_tokens=12, temperature=0,
                                                       frequency_penalty=1.5)
    ids = ref.model_extra["tidespec"]["token_ids"]
    stop = next(t for t in ids if t != ids[0])
    for include in (False, True):
        r = client(servers["spec"]).completions.create(
            model=MODEL, prompt="t8 t17", max_tokens=12, temperature=0, frequency_penalty=1.5,
            extra_body={"stop_token_ids": [stop], "include_stop_str_in_output": include})
        ch = r.choices[0]
        assert ch.model_extra["stop_reason"] == stop and ch.model_extra["tidespec"]["token_ids"][-1] == stop
        assert ch.text.endswith(f"t{stop}") == include  # vLLM: the stop token's text only when asked


@pytest.mark.parametrize("body", [{"prompt": "t8", "max_tokens": "5"}, {"prompt": "t8", "logprobs": True},
                                  {"prompt": "t8", "logit_bias": {"٥": 5}}, {"prompt": "t8", "echo": 1}])
def test_no_lax_coercion(servers, body):
    r = httpx.post(f"{servers['spec'].url}/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] in body, r.text


def test_echo_joins_prompt_and_completion_as_the_tokenizer_would(servers):
    r = client(servers["spec"]).completions.create(model=MODEL, prompt=[10, 11, 12], echo=True, max_tokens=3,
                                                   temperature=0)
    ids = [10, 11, 12] + r.choices[0].model_extra["tidespec"]["token_ids"]
    assert r.choices[0].text == servers["tok"].decode(ids)


def test_streamed_logprobs_and_offsets_equal_non_streamed_with_a_stop_string(servers):
    kw = dict(model=MODEL, prompt="t50 t60 t70", max_tokens=20, logprobs=2, n=2, temperature=1.0, seed=5,
              frequency_penalty=1.0)
    c = client(servers["spec"])
    text = c.completions.create(**kw).choices[0].text
    stop = " ".join(text.split()[1:3])  # words 2-3: the third token's offset lies past the cut text
    whole = c.completions.create(**kw, stop=[stop])
    got = {0: ([], [], []), 1: ([], [], [])}
    for ch in c.completions.create(**kw, stop=[stop], stream=True):
        for x in ch.choices:
            if x.logprobs:
                for key, lst in zip(("tokens", "token_logprobs", "text_offset"), got[x.index]):
                    lst += getattr(x.logprobs, key)
    for ch in whole.choices:
        lp = ch.logprobs
        assert got[ch.index] == (lp.tokens, lp.token_logprobs, lp.text_offset)
        assert all(o <= len(ch.text) for o in lp.text_offset)
