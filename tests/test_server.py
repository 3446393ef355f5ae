"""tidespec serve's HTTP app on the tiny target (FastAPI TestClient, real engine thread)."""
import shutil

import pytest
from fastapi.testclient import TestClient

from conftest import add_tiny_word_tokenizer, make_tiny_target, random_draft
from tidespec.config import EngineParams


@pytest.fixture
def served(tiny_target, tmp_path):
    from tidespec.config import ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.runner import DraftRunner
    from tidespec.serve.server import build_app

    drafts = tmp_path / "drafts"
    save_checkpoint(random_draft(tiny_target, 64, seed=1), drafts / "v1")
    save_checkpoint(random_draft(tiny_target, 64, seed=2), drafts / "v2")
    from tidespec.models.eagle3 import load_checkpoint

    eng = Engine(
        tiny_target,
        DraftRunner(load_checkpoint(drafts / "v1", tiny_target.embed, tiny_target.target_id)),
        EngineParams(num_draft_tokens=3, max_seq_len=256),
        draft_version="v1",
    )
    cfg = ServeParams(max_tokens=16, replica_id="replica-a")
    with TestClient(build_app(eng, None, cfg, drafts_dir=drafts, admin_token="s3cret")) as c:
        yield c, eng, drafts


def _prom(c, name):
    for line in c.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_completions_lossless_usage_and_metrics(served, tiny_target):
    from tidespec.engine.speculative import Engine

    c, eng, _ = served
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    prompts = [[5, 17, 33, 2 + i, 90, 41] for i in range(4)]
    total = 0
    for p in prompts:
        r = c.post("/v1/completions", json={"model": "tidespec", "prompt": p, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        want = ref.generate(p, 12, speculative=False).tokens
        assert body["tidespec"]["token_ids"] == want  # speculative serving == target-only greedy
        assert body["usage"] == {"prompt_tokens": len(p), "completion_tokens": len(want),
                                 "total_tokens": len(p) + len(want)}
        assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] in ("length", "stop")
        total += len(want)
    assert _prom(c, "tidespec:generation_tokens_total") == total
    assert _prom(c, "tidespec:spec_decode_num_drafts_total") > 0
    assert _prom(c, 'tidespec:draft_info{replica_id="replica-a",version="v1"}') == 1
    assert c.get("/health").json()["draft_version"] == "v1"
    assert c.get("/health").json()["target_precision"] == "fp32"  # which weights answer (target.quantization)
    assert c.get("/health").json()["replica_id"] == "replica-a"  # its name in a fleet (serve.replica_id)


def test_bad_requests_get_clear_4xx(served, tiny_target):
    from tidespec.config import ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.serve.server import build_app

    c, _, _ = served
    assert "token ids" in c.post("/v1/completions", json={"prompt": "hello"}).json()["error"]["message"]
    assert c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).status_code == 400
    assert c.post("/v1/completions", json={"prompt": [10**6]}).status_code == 400  # id outside the vocab
    r = c.post("/v1/completions", json={"prompt": [5], "top_p": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    from tidespec.engine.speculative import Request
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    with TestClient(build_app(eng, None, ServeParams(max_queue=1, max_tokens=16))) as full:
        with eng._step_lock:  # hold the engine between steps so the queued request stays queued
            busy = full.app.state.loop.submit(Request([5, 6], 200))  # the one queue slot is taken
            r = full.post("/v1/completions", json={"prompt": [5, 6]})
        assert (
            r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        )
        assert _prom(full, "tidespec:request_rejected_total") == 1
        r = full.post("/v1/completions", json={"prompt": [5, 6], "n": 2})  # can never fit: 400, not a retry loop
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        busy.result(timeout=60)


def test_admin_swap_auth_traversal_wrong_target(served, tmp_path):
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.target import load_target

    c, eng, drafts = served
    ok = {"Authorization": "Bearer s3cret"}
    assert c.post("/admin/draft", json={"path": "v2"}).status_code == 401
    assert c.post("/admin/draft", json={"path": "v2"}, headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.post("/admin/draft", json={"path": "../../etc"}, headers=ok).status_code == 400
    (tmp_path / "outside").mkdir()
    (drafts / "link").symlink_to(tmp_path / "outside")
    assert c.post("/admin/draft", json={"path": "link"}, headers=ok).status_code == 400  # symlink escape
    assert c.post("/admin/draft", json={"version": "3"}, headers=ok).status_code == 400  # no registry here
    other, _ = load_target(make_tiny_target(tmp_path / "other", seed=9))
    save_checkpoint(random_draft(other, 64), drafts / "foreign")
    r = c.post("/admin/draft", json={"path": "foreign"}, headers=ok)
    assert r.status_code == 409 and "keeps serving" in r.json()["error"]["message"]
    assert eng.draft_version == "v1"
    r = c.post("/admin/draft", json={"path": "v2"}, headers=ok)
    assert r.status_code == 200 and r.json() == {"draft_version": "v2", "pinned": True}
    assert c.get("/health").json()["draft_version"] == "v2"
    out = c.post("/v1/completions", json={"prompt": [5, 17, 33], "max_tokens": 8}).json()
    assert out["tidespec"]["draft_version"] == "v2"
    assert _prom(c, 'tidespec:draft_info{replica_id="replica-a",version="v2"}') == 1


def test_streaming_pieces_concatenate_to_the_output(served, tiny_target):
    import json

    from tidespec.engine.speculative import Engine

    c, _, _ = served
    p = [5, 17, 33, 8, 90, 41]
    want = (
        Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
        .generate(p, 14, speculative=False)
        .tokens
    )
    with c.stream("POST", "/v1/completions", json={"prompt": p, "max_tokens": 14, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    pieces = [ch["choices"][0]["tidespec"]["token_ids"] for ch in chunks[:-2]]
    assert sum(pieces, []) == want and len(pieces) > 1  # several steps, in order, nothing past EOS/max
    last, usage = chunks[-2], chunks[-1]
    assert (
        last["choices"][0]["finish_reason"] in ("length", "stop")
        and last["choices"][0]["tidespec"]["token_ids"] == want
    )
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want)
    assert all(ch["object"] == "text_completion" and ch["choices"][0]["finish_reason"] is None for ch in chunks[:-2])
    assert all(ch["usage"] is None for ch in chunks[:-1])  # include_usage: null until the usage chunk


def test_load_with_hot_swap_no_errors_outputs_unchanged(tiny_target, tmp_path):
    """16 concurrent clients for 8 s over real HTTP (uvicorn); the draft is swapped half-way: no
    error status, every greedy output equals target-only output, both drafts served."""
    from tidespec.bench.serve import load, serve_in_thread
    from tidespec.config import ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.eagle3 import load_checkpoint, save_checkpoint
    from tidespec.models.runner import DraftRunner
    from tidespec.serve.server import build_app

    drafts = tmp_path / "drafts"
    save_checkpoint(random_draft(tiny_target, 64, seed=1), drafts / "v1")
    save_checkpoint(random_draft(tiny_target, 64, seed=2), drafts / "v2")
    eng = Engine(
        tiny_target,
        DraftRunner(load_checkpoint(drafts / "v1", tiny_target.embed, tiny_target.target_id)),
        EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=8),
        draft_version="v1",
    )
    prompts = [[5 + i, 17, 33, 8 + 2 * i, 90, 41 + i] for i in range(8)]
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    reference = {i: ref.generate(p, 12, speculative=False).tokens for i, p in enumerate(prompts)}
    srv = serve_in_thread(build_app(eng, None, ServeParams(max_tokens=12), drafts_dir=drafts, admin_token="t"))
    try:
        rep = load(srv.url, prompts, reference, clients=16, duration_s=8, max_tokens=12, swap={"path": "v2"},
                   admin_token="t")
    finally:
        srv.stop()
    assert set(rep["status"]) == {200} and rep["requests"] >= 16, rep
    assert rep["mismatches"] == 0 and rep["swap"]["status"] == 200
    assert set(rep["versions"]) == {"v1", "v2"}  # requests before and after the swap
    assert rep["rss_mib_max"] - rep["rss_mib_start"] < 300


def test_deploy_notifies_a_running_server(tiny_target, tmp_path):
    """The cycle's deploy step (notify_server) makes a running server swap to the new champion dir;
    a wrong token or no server is reported, never raised."""
    import json

    from tidespec.bench.serve import serve_in_thread
    from tidespec.config import ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.serve.server import build_app
    from tidespec.steps.deploy.local import notify_server

    drafts = tmp_path / "data" / "drafts"
    save_checkpoint(random_draft(tiny_target, 64, seed=3), drafts / "champion")
    (drafts / "champion" / "version.json").write_text(json.dumps({"version": "7", "run_id": "r"}))
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    with pytest.raises(ValueError, match=r"serve.max_tokens \(256\) must be < the engine's max_seq_len \(256\)"):
        build_app(eng, None, ServeParams(max_tokens=256))  # no room left for the prompt
    srv = serve_in_thread(build_app(eng, None, ServeParams(max_tokens=64), drafts_dir=drafts, admin_token="t"))
    try:
        bad = notify_server(drafts / "champion", srv.url, "wrong")
        assert bad["status"] == 401 and "bearer token" in bad["error"] and eng.draft_version is None
        got = notify_server(drafts / "champion", srv.url, "t")
        assert got == {"server": srv.url, "status": 200, "draft_version": "7"} and eng.draft_version == "7"
    finally:
        srv.stop()
    assert "unreachable" in notify_server(drafts / "champion", srv.url, "t")["error"]
    assert notify_server(drafts / "champion", None, None) == {"server": None}


def test_capture_sample_rate_over_http_and_counters_on_metrics(tiny_target, tmp_path):
    """capture.sample_rate 0.5: the engine asks the writer at admission, so about half of 40 served
    requests are captured (the rest counted as sampled_out), and /metrics shows the writer's counters."""
    from tidespec.capture.store import read_manifest
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import CaptureParams, ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.serve.server import build_app

    w = CaptureWriter(tmp_path / "cap", tiny_target.target_id, CaptureParams(sample_rate=0.5))
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256), capture=w)
    n = 40
    with TestClient(build_app(eng, None, ServeParams(max_tokens=4))) as c:
        for i in range(n):
            r = c.post("/v1/completions", json={"prompt": [5, 17, 33, i % 50 + 3], "max_tokens": 4})
            assert r.status_code == 200, r.text
        w.flush()
        written, skipped = _prom(c, "tidespec:capture_written_total"), _prom(c, 'tidespec:capture_filtered_total'
                                                                                '{reason="sampled_out"}')
    w.close()
    rows = read_manifest(tmp_path / "cap")
    # request ids are random uuids: binomial(40, 0.5) lies in [10, 30] with probability 0.998
    assert 10 <= len(rows) <= 30 and written == len(rows) and written + skipped == n
    assert all(4 <= r.num_tokens <= 7 for r in rows)  # whole requests: prompt (4) + generated (≤ 4) - 1


def _events(c, body):
    import json

    with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(ln[len("data: "):]) for ln in r.iter_lines() if ln and ln != "data: [DONE]"]


def test_engine_failure_is_a_500_with_the_request_id_streamed_or_not(tiny_target, caplog):
    """A draft whose step raises (a ValueError, as a kernel's shape check would): the engine fails the
    request, and the client gets 500 `engine_error` naming the request id — the same error body
    whole or streamed (its last event) — never a 400 and never the cause or a traceback, which go
    to the server log under that id."""
    from tidespec.config import ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.runner import DraftRunner
    from tidespec.serve.server import build_app

    class ExplodingDraft(DraftRunner):
        def new_cache(self, max_len):
            raise ValueError("draft kernel exploded at /secret/internal/path")

    eng = Engine(
        tiny_target,
        ExplodingDraft(random_draft(tiny_target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=256),
        draft_version="bad",
    )
    with TestClient(build_app(eng, None, ServeParams(max_tokens=8))) as c:
        r = c.post("/v1/completions", json={"prompt": [5, 17, 33], "max_tokens": 4})
        assert r.status_code == 500, r.text
        whole = r.json()["error"]
        rid = whole["request_id"]
        assert rid in whole["message"] and whole["type"] == "server_error" and whole["code"] == "engine_error"
        assert "secret" not in r.text and "Traceback" not in r.text
        assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)  # the cause, logged

        opening, last = _events(c, {"prompt": [5, 17, 33], "max_tokens": 4, "echo": True})  # echo: a first chunk
        streamed = last["error"]
        assert opening["id"] == f"cmpl-{streamed['request_id']}"  # the error names the stream's request
        assert streamed == whole | {"request_id": streamed["request_id"],
                                    "message": whole["message"].replace(rid, streamed["request_id"])}
        assert "secret" not in str(last)
        assert c.get("/health").json()["requests"] == 0  # nothing left behind


def test_a_bad_field_is_a_400_naming_it_streamed_or_not(served):
    """Client errors are found before anything is queued, so a streamed request gets the same 400 as
    a whole one; a refusal of the engine's own checks names the field too."""
    c, eng, _ = served
    for body, param in (({"prompt": [10**6]}, "prompt"),  # an id outside the vocabulary (Engine.validate)
                        ({"prompt": [5], "logit_bias": {"99999": 1}}, "logit_bias"),
                        ({"prompt": [5] * 250, "max_tokens": 16}, "max_tokens"),  # prompt + max_tokens > max_seq_len
                        ({"prompt": [5] * 252, "max_tokens": 1}, "prompt"),  # 252 + 1 + k + 1 > 256: no max_tokens fits
                        ({"prompt": [5], "max_tokens": 10**5}, "max_tokens"),  # above serve.max_tokens
                        ({"prompt": [5], "top_p": 0}, "top_p")):
        for stream in (False, True):
            r = c.post("/v1/completions", json=body | {"stream": stream})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param, (body, stream, r.text)
            assert err["type"] == "invalid_request_error"
    assert eng.num_unfinished == 0


def test_a_bug_in_a_handler_is_a_500_with_a_request_id_not_a_traceback(served, monkeypatch):
    """Whatever a handler raises that is no OpenAIError (not even a ValueError) is 500
    `internal_error` with a request id; in a stream it is the last event."""
    from tidespec.serve.responses import CompletionApi

    c, eng, _ = served

    def broken(*a, **kw):
        raise ValueError("bug at /secret/internal/path")

    monkeypatch.setattr(CompletionApi, "choice", broken)  # every choice, whole or streamed
    full = TestClient(c.app, raise_server_exceptions=False)  # Starlette re-raises it after answering, for the log
    r = full.post("/v1/completions", json={"prompt": [5, 17, 33], "max_tokens": 4})
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "internal_error" and err["request_id"] in err["message"]
    assert "secret" not in r.text and "Traceback" not in r.text
    (last,) = _events(c, {"prompt": [5, 17, 33], "max_tokens": 4})
    assert last["error"]["code"] == "internal_error" and last["error"]["request_id"] in last["error"]["message"]
    assert "secret" not in str(last)
    import time
    deadline = time.monotonic() + 10
    while eng.num_unfinished and time.monotonic() < deadline:  # aborted: freed at the next engine step
        time.sleep(0.02)
    assert eng.num_unfinished == 0


def test_store_false_is_served_and_never_captured(tiny_target_dir, tmp_path):
    """OpenAI's `"store": false` opts a request out of capture: served as usual, but neither its hidden
    states (the engine's sink is not even asked) nor its text are captured; the same request without
    it is captured both ways. `"store": true` stays refused (stored completions are not kept)."""
    from tidespec.capture.store import read_manifest
    from tidespec.capture.text import TextCapture
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import CaptureParams, ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.target import load_target
    from tidespec.serve.server import build_app

    shutil.copytree(tiny_target_dir, tmp_path / "target")
    add_tiny_word_tokenizer(tmp_path / "target")
    target, tok = load_target(tmp_path / "target")
    w = CaptureWriter(tmp_path / "cap", target.target_id, CaptureParams())
    text = TextCapture(tmp_path / "text")
    eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256), capture=w)
    chat = {"messages": [{"role": "user", "content": "t7 t99"}], "max_tokens": 4}
    with TestClient(build_app(eng, tok, ServeParams(max_tokens=4), text_capture=text)) as c:
        for body in (chat | {"store": False}, chat | {"store": False, "stream": True}, chat):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        refused = c.post("/v1/chat/completions", json=chat | {"store": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "store"
        w.flush()
    w.close()
    text.close()
    assert len(read_manifest(tmp_path / "cap")) == 1  # the one request sent without store: false
    (f,) = list((tmp_path / "text").rglob("*.jsonl"))
    assert len(f.read_text().splitlines()) == 1 and '"store"' not in f.read_text()


def test_an_operators_swap_is_pinned_until_released(tiny_target, tmp_path, caplog):
    """Under a champion watcher: `POST /admin/draft {"version": 2}` (an integer, as docs/serving.md
    writes it) installs v2 and pins it; the watcher, whose champion is v3, leaves v2 serving and logs
    that once; `DELETE /admin/draft/pin` releases it and the watcher installs v3. Every swap is
    logged with the version served."""
    import logging
    import time

    from tidespec.config import ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.eagle3 import load_checkpoint, save_checkpoint
    from tidespec.models.runner import DraftRunner
    from tidespec.serve.server import build_app
    from tidespec.workspace import make_bundle, write_version
    drafts = tmp_path / "drafts"
    for v in (1, 2, 3):
        save_checkpoint(random_draft(tiny_target, 64, seed=v), drafts / f"v{v}")
    champion = make_bundle(drafts / "v3", tmp_path / "champion")
    write_version(champion, "3", "run")
    eng = Engine(tiny_target, DraftRunner(load_checkpoint(drafts / "v1", tiny_target.embed, tiny_target.target_id)),
                 EngineParams(num_draft_tokens=3, max_seq_len=256), draft_version="1")
    ok = {"Authorization": "Bearer s3cret"}
    caplog.set_level(logging.INFO, logger="tidespec.serve.admin")
    app = build_app(eng, None, ServeParams(max_tokens=16), drafts_dir=drafts, admin_token="s3cret",
                    load_version=lambda v: drafts / f"v{v}", watch_dir=champion, watch_s=0.05)

    def wait_for(version):
        for _ in range(200):
            if eng.draft_version == version:
                return
            time.sleep(0.02)
        raise AssertionError(f"serving {eng.draft_version}, not {version}")
    with TestClient(app) as c:
        wait_for("3")  # the watcher follows the champion
        r = c.post("/admin/draft", json={"version": 2}, headers=ok)
        assert r.status_code == 200 and r.json() == {"draft_version": "2", "pinned": True}, r.text
        time.sleep(0.5)  # ten polls
        assert eng.draft_version == "2" and c.get("/health").json()["draft_version"] == "2"
        held = [m for m in caplog.messages if "pinned by POST /admin/draft" in m]
        assert held == [f"champion 3 at {champion} not installed: draft 2 is pinned by POST /admin/draft (DELETE "
                        "/admin/draft/pin to follow the champion again)"]
        assert c.post("/admin/draft", json={"version": 0}, headers=ok).status_code == 400
        assert c.delete("/admin/draft/pin").status_code == 401
        r = c.delete("/admin/draft/pin", headers=ok)
        assert r.status_code == 200 and r.json() == {"draft_version": "2", "released": "2"}
        wait_for("3")
    swaps = [m for m in caplog.messages if m.startswith("serving draft")]
    assert [m.split(" from ")[0] for m in swaps] == [
        "serving draft 3 (was 1), installed by the champion watcher",
        "serving draft 2 (was 3), installed by POST /admin/draft",
        "serving draft 3 (was 2), installed by the champion watcher"]


def test_champion_watcher_survives_an_unreadable_version_json(tmp_path, caplog):
    """A malformed version.json in the watched champion dir is logged once and polling goes on (the
    watcher used to die on it, so later champions and rollbacks were never installed)."""
    import json
    import time
    from types import SimpleNamespace

    from tidespec.serve.admin import ChampionWatcher
    installed = []
    engine = SimpleNamespace(draft_version="1")
    (tmp_path / "version.json").write_text(json.dumps({"version": "2", "replayed": {"": [0.5, float("inf")]}}))
    def install(d, v):
        installed.append(v)
        engine.draft_version = v

    w = ChampionWatcher(tmp_path, 0.02, engine, install)
    try:
        time.sleep(0.2)  # several polls of the bad file
        assert w._thread.is_alive() and installed == []
        assert sum("unreadable" in r.message for r in caplog.records) == 1
        (tmp_path / "version.json").write_text(json.dumps({"version": "2"}))
        for _ in range(100):
            if installed:
                break
            time.sleep(0.02)
        assert installed == ["2"]
    finally:
        w.close()
