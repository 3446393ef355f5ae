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
    eng = Engine(target, DraftRunner(random_draft(target, 64, seed=1)), EngineParams(num_draft_tokens=3, max_seq_len=256), capture=live)  # speculation on
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
    assert ingest_source(str(tmp_path / "text"), None, ws, params, target, tok, w)["objects"] == 0  # unchanged: not read
    w.close()
