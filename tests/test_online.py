"""Online rehydration (`ingest.mode: online`): a text snapshot keeps tokens alone at rest, and the
train step rebuilds the hidden states from the target while it trains (`train.online`), through a
producer thread and a bounded queue (`train.prefetch`).

The equality is exact, not approximate: the record rebuilt during training goes through the same
prefill (`capture.rehydrate.rehydrate`, one exchange at a time) and the same bf16 cast as the one
`ingest.mode: hidden` writes to disk, so the curated sets, the records and the trained weights
are bit for bit those of the hidden-state route (tiny target, one thread).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_params_yaml
from test_ingest import chat, line, reply

WORDS = "def return value list sort key add print index loop while count name data item".split()


def _objects() -> dict[str, str]:
    """Two capture objects of 20 code-ish exchanges (varied lengths), one with a missing response."""
    out = []
    for i in range(20):
        words = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(6 + i % 9))
        out.append(line(f"x{i}", chat(f"task {i}: {words[:30]}"), None if i == 5 else reply(words, "stop")))
    return {"a/00.jsonl": "\n".join(out[:10]) + "\n", "b/00.jsonl": "\n".join(out[10:]) + "\n"}


def _ingested(root: Path, target_dir, source: Path, mode: str, train: str = ""):
    """A workspace whose one sealed snapshot is `source` ingested under `ingest.mode: mode`, curated."""
    from tidespec.capture.ingest import ingest_source
    from tidespec.capture.snapshots import seal
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import load_params
    from tidespec.models.load import get_target
    from tidespec.steps.cycle import step_curate
    from tidespec.workspace import Workspace
    root.mkdir()
    (root / "params.yaml").write_text(tiny_params_yaml(target_dir) + f"""
ingest: {{mode: {mode}, max_new_tokens: 10, workload: code}}
""" + train)
    ws, params = Workspace(root), load_params(root / "params.yaml")
    target, tok = get_target(params)
    w = CaptureWriter(ws.ingest_dir(target.target_id), target.target_id, params.capture)
    try:
        rep = ingest_source(str(source), None, ws, params, target, tok, w)
    finally:
        w.close()
    seal(ws.ingest_dir(target.target_id), ws.snapshots, target.target_id)
    cur = step_curate(ws, params, target.target_id)
    return ws, params, target, rep, cur


@pytest.fixture
def source(tmp_path):
    d = tmp_path / "capture"
    for k, v in _objects().items():
        (d / k).parent.mkdir(parents=True, exist_ok=True)
        (d / k).write_text(v)
    return d


def _snapshot(ws, target):
    from tidespec.capture.snapshots import list_snapshots
    return list_snapshots(ws.snapshots, target.target_id)[0]


def test_online_records_equal_the_records_written_at_rest(tmp_path, tiny_tok_target_dir, source):
    from tidespec.capture.store import read_manifest
    from tidespec.train.online import OnlineRecords, online
    from tidespec.train.source import IndexRecords
    hid, _, target, rep_h, cur_h = _ingested(tmp_path / "hidden", tiny_tok_target_dir, source, "hidden")
    onl, _, _, rep_o, cur_o = _ingested(tmp_path / "online", tiny_tok_target_dir, source, "online")
    assert rep_o == rep_h and rep_o["records"] == 20 and rep_o["regenerated"] == 1
    rows_h, rows_o = read_manifest(_snapshot(hid, target)), read_manifest(_snapshot(onl, target))
    assert [r.tokens_only for r in rows_o] == [True] * 20 and not any(r.tokens_only for r in rows_h)
    keys = ("request_id", "num_tokens", "prompt_hash", "origin", "workload", "offset")  # shard names: time-based
    assert [[getattr(r, k) for k in keys] for r in rows_o] == [[getattr(r, k) for k in keys] for r in rows_h]
    tokens = sum(r.num_tokens for r in rows_o)
    at_rest = {m: sum(f.stat().st_size for f in _snapshot(ws, target).glob("*.safetensors"))
               for m, ws in (("hidden", hid), ("online", onl))}
    H = target.cfg.hidden_size
    assert at_rest["hidden"] >= 8 * H * tokens  # aux [T, 3H] + hidden [T, H] in bf16
    assert at_rest["online"] < 5 * tokens + 4096  # int32 ids + uint8 mask, plus the shards' headers
    idx_h, idx_o = (json.loads(Path(c["curated"]).read_text()) for c in (cur_h, cur_o))
    strip = lambda es: [{k: v for k, v in e.items() if k not in ("snapshot", "shard", "tokens_only", "ts")} for e in es]  # noqa: E731
    for part in ("train", "val", "holdout"):
        assert strip(idx_o[part]) == strip(idx_h[part]) and idx_o[part]
        assert all(e["tokens_only"] for e in idx_o[part])
    assert Path(cur_o["holdout"]).read_text() == Path(cur_h["holdout"]).read_text()  # what evaluate replays
    base_h, base_o = Path(cur_h["curated"]).parent, Path(cur_o["curated"]).parent
    src_h, src_o = IndexRecords(idx_h["train"], base_h), online(IndexRecords(idx_o["train"], base_o), None, target)
    assert isinstance(src_o, OnlineRecords) and online(src_h, None, target) is src_h
    for i in range(len(src_h)):
        a, b = src_h.read(i), src_o.read(i)
        assert set(a) == set(b) == {"input_ids", "loss_mask", "aux_hidden_states", "hidden_states"}
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), (i, k)
    with pytest.raises(ValueError, match="holds tokens only"):
        IndexRecords(idx_o["train"], base_o).read(0, ("aux_hidden_states",))


# streamed: 2 epochs over buffers of ~3 records, each re-read (and, online, rehydrated) per epoch
# by the producer thread while the draft trains on the buffer before
STREAM = "\ntrain: {ttt_steps: 2, epochs: 2, batch_tokens: 128, max_seq_len: 128, min_train_tokens: 16, " \
         "buffer_mb: 0.25, prefetch_mb: 0.01, checkpoint_every: 0}\n"


@pytest.mark.parametrize("train", ["", STREAM], ids=["resident", "streamed"])
def test_online_training_gives_the_hidden_state_weights(tmp_path, tiny_tok_target_dir, source, train):
    from tidespec.steps.cycle import train_candidate
    from tidespec.steps.evaluate import step_evaluate
    out = {}
    for mode in ("hidden", "online"):
        ws, params, _, _, cur = _ingested(tmp_path / mode, tiny_tok_target_dir, source, mode, train)
        m = train_candidate(ws, params, Path(cur["curated"]), None, tmp_path / mode / "cand")
        out[mode] = (m, load_file(str(tmp_path / mode / "cand" / "model.safetensors")), ws, params, cur)
    (mh, wh, *_), (mo, wo, ws, params, cur) = out["hidden"], out["online"]
    if train:
        assert mo["train_buffers"] >= 3  # streamed: rehydrated again each epoch
    else:
        assert mo["train_buffers"] == 1
    assert mo["train_steps"] == mh["train_steps"] and mo["train/loss"] == mh["train/loss"]
    assert wo.keys() == wh.keys() and all(torch.equal(wo[k], wh[k]) for k in wh)
    rep = step_evaluate(ws, params, tmp_path / "online" / "cand", None, Path(cur["holdout"]),
                        tmp_path / "online" / "eval.json")
    assert rep["lossless"] and rep["candidate"]["new_tokens"] > 0 and cur["num_holdout"] > 0


def test_prefetch_runs_ahead_within_its_bound_and_stops():
    from tidespec.train.prefetch import Prefetch, read_ahead
    rec = lambda i: {"x": torch.full((256,), i, dtype=torch.int32)}  # 1 KiB each  # noqa: E731
    read_started, second_read = [], threading.Event()

    def read(chunk):
        read_started.extend(chunk)
        if 1 in chunk:
            second_read.set()
        return [rec(i) for i in chunk]

    got = []
    p = Prefetch(read, range(40), max_bytes=4096)
    for i, r in p:
        if i == 0:  # the producer reads record 1 while the consumer still holds record 0
            assert second_read.wait(10), "the producer did not run ahead"
            time.sleep(0.05)
            assert len(read_started) <= 5 + 1  # 4 KiB queued + the one being read, not all 40
        got.append(int(r["x"][0]))
    assert got == list(range(40)) and p.peak_bytes <= 4096 + 1024

    def failing(chunk):
        if 3 in chunk:
            raise OSError("shard gone")
        return [rec(i) for i in chunk]

    seen = []
    with pytest.raises(OSError, match="shard gone"):
        for i, _ in read_ahead(failing, range(10), 1 << 20, batch=2):
            seen.append(i)
    assert seen == [0, 1]  # the batch holding the bad record raises at its turn
    p = Prefetch(read, range(1000), max_bytes=2048)
    next(iter(p))
    p.close()
    assert not p._thread.is_alive()
    assert [i for i, _ in read_ahead(read, range(5), 0, batch=2)] == list(range(5))  # in line
