"""The inputs issue 18 listed as failing, on the real SmolLM2 target (greedy unless stated), with
speculation on (a random draft: verification is exercised, outputs must not change) and off; and
incremental detokenization on its byte-level tokenizer."""
import json

import pytest
from fastapi.testclient import TestClient

from conftest import random_draft
from numerics import fp32_logprob_tol, logit_scale
from tidespec.config import EngineParams, ServeParams
from tidespec.engine.speculative import Engine
from tidespec.models.detok import TextOutput
from tidespec.models.runner import DraftRunner
from tidespec.serve.server import build_app

JAPANESE = "おはようございます 🌅 — 日本語のテキスト、絵文字 👍🏽 も。"


@pytest.fixture(scope="module")
def clients(real_target):
    target, tok = real_target
    spec = Engine(target, DraftRunner(random_draft(target, 512)), EngineParams(num_draft_tokens=3, max_seq_len=512))
    plain = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=512))
    cfg = ServeParams(max_tokens=64, served_model_name="smol")
    with (
        TestClient(build_app(spec, tok, cfg, model="smol")) as a,
        TestClient(build_app(plain, tok, cfg, model="smol")) as b,
    ):
        yield a, b, tok


def comp(c, **kw):
    r = c.post("/v1/completions", json={"max_tokens": 16, "temperature": 0} | kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_byte_level_alphabet_is_gpt2s():
    """logprobs' bytes of a byte-level BPE token: the alphabet, byte for byte, of GPT-2's encoder (as
    transformers ships it), without importing transformers to serve."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from tidespec.models.detok import byte_level_alphabet
    assert byte_level_alphabet() == {c: b for b, c in bytes_to_unicode().items()}


def test_decode_stream_never_splits_a_character(real_target):
    _, tok = real_target
    ids = tok(JAPANESE, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens are parts of a character
    out = TextOutput(tok)
    pieces = []
    for i in ids:
        out([i])
        pieces.append(out.release())
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == tok.decode(ids) == JAPANESE


def test_stop_string_text_is_held_back_until_it_cannot_match(real_target):
    _, tok = real_target
    ids = tok("alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    out = TextOutput(tok, stop=["gamma d"])
    streamed = []
    for t in ids:
        hit = out([t])
        streamed.append(out.release())
        if hit:
            break
    assert hit == (1, "gamma d") and "".join(streamed) == out.text == "alpha beta "


def test_listed_inputs(clients, real_target):
    spec, plain, tok = clients
    assert spec.get("/v1/models").json()["data"][0]["id"] == "smol"
    for c in (spec, plain):
        full = comp(c, prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=48)["choices"][0]["text"]
        r = comp(c, prompt="Count: 1, 2, 3, 4, 5, 6,", max_tokens=48, stop=[" 9,"])["choices"][0]
        assert " 9," in full and r["text"] == full[:full.index(" 9,")] and r["finish_reason"] == "stop"
    ra, rb = (comp(c, prompt="The capital of France is", max_tokens=8, logprobs=2) for c in (spec, plain))
    a, b = ra["choices"][0]["logprobs"], rb["choices"][0]["logprobs"]
    assert len(a["tokens"]) == 8 and a["tokens"] == b["tokens"]
    target = real_target[0]
    ids = tok("The capital of France is", add_special_tokens=False)["input_ids"] + ra["tidespec"]["token_ids"]
    tol = fp32_logprob_tol(target.cfg, logit_scale(target, ids))  # multi-row vs one-row fp32 GEMMs
    assert max(abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])) <= tol
    base = comp(spec, prompt="List the colors: red, green,", max_tokens=24)
    text = base["choices"][0]["text"]
    for kw in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.5},
               {"logit_bias": {str(base["tidespec"]["token_ids"][0]): -100}}):
        got = [comp(c, prompt="List the colors: red, green,", max_tokens=24, **kw) for c in (spec, plain)]
        assert got[0]["choices"][0]["text"] == got[1]["choices"][0]["text"] != text, kw
    assert base["tidespec"]["token_ids"][0] not in got[0]["tidespec"]["token_ids"]
    r = comp(spec, prompt="Say hi.", max_tokens=30, min_tokens=20)
    assert r["usage"]["completion_tokens"] >= 20
    r = comp(spec, prompt="Once upon a time", max_tokens=12, n=2, temperature=0.9, seed=1)
    assert [ch["index"] for ch in r["choices"]] == [0, 1]


def test_japanese_chat_streams_whole_characters(clients):
    spec, _, _ = clients
    body = {"messages": [{"role": "user", "content": "Translate to Japanese with an emoji: good morning"}],
            "max_tokens": 40, "temperature": 0}
    whole = spec.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    with spec.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    pieces = [ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == whole
    assert any(ord(ch) > 0x3000 for ch in whole)  # it did write non-ASCII characters


def test_content_parts_and_developer_role(clients):
    spec, _, tok = clients
    r = spec.post("/v1/chat/completions", json={"max_tokens": 8, "messages": [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]})
    same = spec.post("/v1/chat/completions", json={"max_tokens": 8, "messages": [
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"}]})
    assert r.status_code == 200 and r.json()["choices"] == same.json()["choices"]
