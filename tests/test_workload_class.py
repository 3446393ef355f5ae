"""Workload classes without client cooperation (`serve.workload`): the content rules' separation of
the shipped sets, the order of the signals (field > model alias > constraint > content), and a live
server that classes plain OpenAI requests, answers to its aliases and counts τ per class on /metrics."""
import shutil
from collections import Counter

import httpx
import openai
import pytest
from pydantic import ValidationError

from conftest import add_tiny_word_tokenizer, random_draft
from tidespec.bench.serve import serve_in_thread
from tidespec.config import EngineParams, ServeParams
from tidespec.engine.speculative import Engine
from tidespec.models.runner import DraftRunner
from tidespec.models.target import load_target
from tidespec.serve.server import build_app
from tidespec.serve.workload import content_class, workload_of

CODE = "def add(a: int, b: int) -> int:\n    \"\"\"Add two numbers.\n    >>> add(2, 3)\n    5\n    \"\"\"\n"
MATH = "Tom has 3 apples and buys 5 more. How many apples does he have now?"
CHAT = "Write a short poem about the sea at dawn."


def test_content_rules_and_the_order_of_signals():
    assert [content_class(t) for t in (CODE, MATH, CHAT)] == ["code", "math", "chat"]
    assert content_class("Write a Python program that reads a file and counts words.") == "code"
    assert content_class("```js\nconsole.log(1)\n```") == "code"
    assert content_class("생선 3마리와 4마리가 있습니다. 모두 몇 마리입니까?") == "math"  # numbers inside words
    alias = {"tiny-code": "code"}
    def text(t):
        return lambda: t

    def never():
        raise AssertionError("the content is read only when it decides")

    assert workload_of("mine", "tiny-code", alias, True, never) == "mine"  # the field overrides everything
    assert workload_of(None, "tiny-code", alias, True, never) == "code"  # then the model alias
    assert workload_of(None, "tiny", alias, True, never) == "structured"  # then response_format / tools
    assert workload_of(None, None, alias, False, text(MATH)) == "math"  # then the content
    assert workload_of(None, "tiny-code", alias, False, never, derive=False) == "code"  # aliases even when not deriving
    assert workload_of(None, None, alias, True, never, derive=False) == "default"


def test_line_start_patterns_do_not_run_over_blank_lines():
    r"""A pattern anchored at a line start with `\s*` runs over every blank line below it (quadratic in the
    prompt: 4000 newlines took a second and held the event loop); they must start on the code's line."""
    from tidespec.serve.workload import _CODE_LINE, _SIGNATURE
    text = "\n" * 50 + "def f(x):\n    return x\n"
    assert [m.start() for m in _SIGNATURE.finditer(text)] == [50]
    assert min(m.start() for m in _CODE_LINE.finditer(text)) == 50
    assert content_class("\n" * 4000) == "chat"


def test_content_rules_separate_the_shipped_sets():
    """Recall per class on 624 labelled prompts (measured: code 181/184, math 300/320, chat 107/120;
    `tidespec bench classes`). A rule that stops firing (e.g. numbers glued to Korean words no longer
    counted) drops a class far below these floors."""
    from tidespec.bench.classes import labelled
    hits, total = Counter(), Counter()
    for workload, text in labelled():
        total[workload] += 1
        hits[workload] += content_class(text) == workload
    assert total == {"code": 184, "math": 320, "chat": 120}
    assert hits["code"] / total["code"] >= 0.95
    assert hits["math"] / total["math"] >= 0.90
    assert hits["chat"] / total["chat"] >= 0.85


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_target_dir):
    d = tmp_path_factory.mktemp("wl") / "target"
    shutil.copytree(tiny_target_dir, d)
    add_tiny_word_tokenizer(d)
    target, tok = load_target(d)
    eng = Engine(
        target,
        DraftRunner(random_draft(target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=512),
        draft_version="v1",
    )
    srv = serve_in_thread(build_app(eng, tok, ServeParams(max_tokens=16, workload_by_model={"tiny-code": "code"}),
                                    model="tiny"))
    yield srv
    srv.stop()


def _chat(srv, text: str, **kw):
    c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    return c.chat.completions.create(model=kw.pop("model", "tiny"), messages=[{"role": "user", "content": text}],
                                     max_tokens=4, **kw)


def _series(srv, name: str) -> dict[str, float]:
    """{workload label (or "" unlabelled): value} of the samples called `name` on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{srv.url}/metrics").text
    return {s.labels.get("workload", ""): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_server_classes_plain_requests_and_counts_them_per_class(server):
    got = {text: _chat(server, text).model_extra["tidespec"]["workload"] for text in (CODE, MATH, CHAT)}
    assert got == {CODE: "code", MATH: "math", CHAT: "chat"}
    r = _chat(server, CHAT, model="tiny-code")
    assert r.model == "tiny-code" and r.model_extra["tidespec"]["workload"] == "code"  # the alias names the class
    assert _chat(server, CODE, extra_body={"workload": "mine"}).model_extra["tidespec"]["workload"] == "mine"
    done = _series(server, "tidespec:request_success_by_workload_total")
    assert done == {"code": 2.0, "math": 1.0, "chat": 1.0, "mine": 1.0}
    drafts = _series(server, "tidespec:spec_decode_num_drafts_by_workload_total")
    total = _series(server, "tidespec:spec_decode_num_drafts_total")[""]
    assert sum(drafts.values()) == total > 0  # the classes add up to the total
    by_draft = _series(server, "tidespec:spec_decode_num_drafts_by_draft_total")
    assert by_draft == drafts  # one draft (v1) served every class: its prequential counts are the classes'
    ids = [m.id for m in openai.OpenAI(base_url=f"{server.url}/v1", api_key="x").models.list().data]
    assert ids == ["tiny", "tiny-code"]
    with pytest.raises(openai.NotFoundError, match="tiny-code"):
        _chat(server, CHAT, model="tiny-math")
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.completions.create(model="tiny", prompt=[[7, 8], [9, 10]], max_tokens=2, extra_body={"workload": "w"})
    assert [ch.model_extra["tidespec"]["workload"] for ch in r.choices] == ["w", "w"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CODE}], tools=tools,
                                  tool_choice="none", max_tokens=2)
    assert r.model_extra["tidespec"]["workload"] == "code"  # tool_choice none: not constrained, the content decides


def test_token_id_prompts_are_decoded_to_be_classed():
    """A completion sent as token ids is classed by its decoded text (ids outside the vocabulary left
    out: the engine refuses them with a 400, classifying must not crash first)."""
    from types import SimpleNamespace

    from tidespec.serve.protocol import CompletionRequest
    from tidespec.serve.serving import OpenAIServing

    class Tok:
        def decode(self, ids):
            assert all(0 <= t < 50 for t in ids)
            return CODE if ids and ids[0] == 1 else CHAT

    sv = object.__new__(OpenAIServing)
    sv.cfg, sv.tokenizer = ServeParams(), Tok()
    sv.engine = SimpleNamespace(target=SimpleNamespace(cfg=SimpleNamespace(vocab_size=50)))
    body = CompletionRequest(prompt=[[1, 2, -5, 99], [3, 4]], max_tokens=2)
    assert sv.workloads(body, [[1, 2, -5, 99], [3, 4]]) == ["code", "chat"]


def test_classifying_off_and_bad_aliases():
    assert ServeParams(classify_workload=False).classify_workload is False
    with pytest.raises(ValidationError, match="workload_by_model"):
        ServeParams(workload_by_model={"tiny-code": ""})


def test_bench_classes_writes_both_signals(tmp_path):
    """`tidespec bench classes`' work: both signals scored on the same labelled prompts (a character
    tokenizer stands in for the target's here)."""
    from tidespec.bench import classes

    def chars(text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    res = classes.run(chars, tmp_path, sharegpt=50)
    assert res["prompts"] == {"code": 184, "math": 320, "chat": 120}
    assert res["rules"]["accuracy"] == pytest.approx((181 + 300 + 107) / 624, abs=0.02)
    assert 0 <= res["kmeans_tfidf"]["accuracy"] <= 1 and sum(res["sharegpt_by_rules"]["classes"].values()) == 50
    assert "| content rules" in (tmp_path / "classes.md").read_text()
    h = res["held_out"]  # the held-out part (GSM problems and MT-Bench questions whole on one side)
    assert sum(h["prompts"].values()) == sum(sum(r.values()) for r in h["rules"]["matrix"].values())
    assert 100 < sum(h["prompts"].values()) < 300  # about 30 % of the 624
    assert h["logistic_tfidf"]["accuracy"] > 0.8  # learned on the rest: character n-grams separate these sets
    assert "logistic regression" in (tmp_path / "classes.md").read_text()
