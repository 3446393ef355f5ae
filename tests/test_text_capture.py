"""Text capture (`capture.mode: text`) → `tidespec ingest` → the same records the engine captures live:
identical token ids and loss masks, hidden states equal up to fp32 rounding of the different forward
shapes (one prefill vs prefill + verify blocks), on the tiny target with a word-level tokenizer whose
text round trip is exact."""
from __future__ import annotations

import json
import shutil

import torch
from fastapi.testclient import TestClient

from conftest import add_tiny_word_tokenizer, random_draft, tiny_params_yaml
from tidespec.config import CaptureParams, EngineParams


def test_text_capture_rehydrates_to_the_live_records(tmp_path, tiny_target_dir):
    from tidespec.capture.ingest import ingest_source
    from tidespec.capture.store import read_manifest, read_record
    from tidespec.capture.text import TextCapture
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import ServeParams, load_params
    from tidespec.engine.speculative import Engine
    from tidespec.models.runner import DraftRunner
    from tidespec.models.target import load_target
    from tidespec.serve.server import build_app
    from tidespec.workspace import Workspace

    tdir = tmp_path / "target"
    shutil.copytree(tiny_target_dir, tdir)
    add_tiny_word_tokenizer(tdir)
    target, tok = load_target(tdir)
    tid = target.target_id
    live = CaptureWriter(tmp_path / "live", tid, CaptureParams(shard_max_records=4))
    text = TextCapture(tmp_path / "text")
    eng = Engine(
        target,
        DraftRunner(random_draft(target, 64, seed=1)),
        EngineParams(num_draft_tokens=3, max_seq_len=256),
        capture=live,
    )  # speculation on
    with TestClient(build_app(eng, tok, ServeParams(max_tokens=12), text_capture=text)) as c:
        for body in ({"messages": [{"role": "user", "content": "t7 t99 t300 t41"}]},
                     {"messages": [{"role": "system", "content": "t12 t13"}, {"role": "user", "content": "t88"}],
                      "max_tokens": 9},
                     {"messages": [{"role": "user", "content": "t50 t51 t52"}], "stream": True},
                     {"prompt": "t60 t61 t62 t63", "max_tokens": 7}):
            route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = c.post(route, json=body)
            assert r.status_code == 200, r.text
    live.close()
    text.close()
    files = list((tmp_path / "text").rglob("*.jsonl"))
    assert len(files) == 1 and len(files[0].read_text().splitlines()) == 4
    assert oct(files[0].stat().st_mode & 0o777) == "0o600"
    (tmp_path / "params.yaml").write_text(tiny_params_yaml(tdir))
    params = load_params(tmp_path / "params.yaml")
    ws = Workspace(tmp_path)
    w = CaptureWriter(tmp_path / "ingested", tid, CaptureParams(shard_max_records=4))
    rep = ingest_source(str(tmp_path / "text"), None, ws, params, target, tok, w)
    w.close()
    assert rep["records"] == 4 and rep["rehydrated"] == 4 and rep["skipped"] == {}
    want = {r.request_id: r for r in read_manifest(tmp_path / "live")}
    got = {r.request_id: r for r in read_manifest(tmp_path / "ingested")}
    assert set(got) == set(want) and len(want) == 4  # the text record's event id is the served request id
    equal = total = 0
    for rid, row in got.items():
        a, b = read_record(tmp_path / "ingested", row), read_record(tmp_path / "live", want[rid])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for k in ("aux_hidden_states", "hidden_states"):  # both stored bf16: equal but for rounding-boundary flips
            torch.testing.assert_close(a[k].float(), b[k].float(), atol=2e-2, rtol=1e-2)
            equal += int((a[k] == b[k]).sum())
            total += a[k].numel()
        assert row.origin == "rehydrated" and want[rid].origin == "live"
    assert equal / total > 0.999, equal / total
    assert json.loads(files[0].read_text().splitlines()[2])["captureData"]["endpointOutput"][
        "observedContentType"] == "text/event-stream"  # the stream was logged as sent
    # the live hourly file grows after an ingest: the next ingest reads it again, takes the new
    # exchange and skips the four it already has (event ids), so nothing is lost or counted twice
    line = json.loads(files[0].read_text().splitlines()[3])
    line["eventMetadata"]["eventId"] = "grown-1"
    with open(files[0], "a") as f:
        f.write(json.dumps(line) + "\n")
    w = CaptureWriter(tmp_path / "ingested", tid, CaptureParams(shard_max_records=4))
    again = ingest_source(str(tmp_path / "text"), None, ws, params, target, tok, w)
    w.close()
    assert (again["objects"], again["records"], again["skipped"]) == (1, 1, {"duplicate_event": 4})
    w = CaptureWriter(tmp_path / "ingested", tid, CaptureParams(shard_max_records=4))
    assert (
        ingest_source(str(tmp_path / "text"), None, ws, params, target, tok, w)["objects"] == 0
    )  # unchanged: not read
    w.close()


def test_text_capture_honours_the_disk_quota_floor_and_refuses_the_acceptance_filter(tmp_path):
    """capture.disk_quota_mb bounds the text directory, counting what a previous run left there;
    capture.min_free_disk_mb keeps the filesystem's free space; an exchange over either is dropped and
    counted, never written in part."""
    import shutil as sh
    from datetime import UTC, datetime

    import pytest

    from tidespec.capture.text import MB, TextCapture, capture_line
    req, resp = {"prompt": "x" * 400}, {"id": "r", "usage": {"total_tokens": 3}}
    line = len(capture_line("e0", req, resp, datetime.now(UTC)).encode()) + 1
    quota = 3.5 * line / MB  # room for three exchanges, not four
    t = TextCapture(tmp_path / "t", CaptureParams(disk_quota_mb=quota, min_free_disk_mb=0))
    assert [t.log(f"e{i}", req, resp) > 0 for i in range(5)] == [True] * 3 + [False] * 2
    t.close()
    assert t.written_total == 3 and t.dropped == {"disk_quota": 2}
    again = TextCapture(tmp_path / "t", CaptureParams(disk_quota_mb=quota, min_free_disk_mb=0))  # a restart
    assert again.log("e9", req, resp) == 0 and again.dropped == {"disk_quota": 1}
    free_mb = sh.disk_usage(tmp_path).free / MB
    full = TextCapture(tmp_path / "u", CaptureParams(min_free_disk_mb=free_mb + 1))
    assert full.log("e0", req, resp) == 0 and full.dropped == {"disk_full": 1}
    assert not list((tmp_path / "u").rglob("*.jsonl"))
    with pytest.raises(ValueError, match="capture.max_acceptance_rate .* text capture has no acceptance"):
        TextCapture(tmp_path / "v", CaptureParams(max_acceptance_rate=0.5))
