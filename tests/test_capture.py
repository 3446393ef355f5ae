"""Capture: round trip, manifest ↔ shards, torn shards ignored, sealing, curate split + drift."""
import json
import os

import pytest
import torch

from tidespec.capture.store import list_snapshots, read_manifest, read_record, seal
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CurateParams
from tidespec.curate import curate, jsd_bits


def _rec(T, H=8, seed=0, prompt_len=4):
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(T, dtype=torch.uint8)
    m[prompt_len:] = 1
    return {"input_ids": torch.randint(0, 100, (T,), generator=g, dtype=torch.int32), "loss_mask": m,
            "aux_hidden_states": torch.randn(T, 3 * H, generator=g).bfloat16(),
            "hidden_states": torch.randn(T, H, generator=g).bfloat16()}


def test_roundtrip_and_manifest(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", queue_size=16, shard_max_records=3)
    recs = [_rec(10 + i, seed=i) for i in range(7)]
    for i, r in enumerate(recs):
        assert w.submit(r, request_id=f"r{i}", workload="code", acceptance_length=1.5)
    w.close()
    rows = read_manifest(tmp_path / "cap")
    assert [r.request_id for r in rows] == [f"r{i}" for i in range(7)]
    assert len({r.shard for r in rows}) == 3  # 3 + 3 + 1 (flushed on close)
    for row, r in zip(rows, recs):
        back = read_record(tmp_path / "cap", row)
        assert row.num_tokens == r["input_ids"].shape[0]
        for k in r:
            assert back[k].dtype == r[k].dtype and torch.equal(back[k], r[k]), k
    shards = sorted(p.name for p in (tmp_path / "cap").glob("*.safetensors"))
    assert shards == sorted({r.shard for r in rows})
    assert oct(os.stat(tmp_path / "cap").st_mode & 0o777) == "0o700"
    assert w.written_total == 7 and w.dropped_total == 0 and w.bytes_total > 0
    w.close()  # idempotent
    assert not w.submit(recs[0], request_id="late", workload="code", acceptance_length=1.0)
    assert w.dropped_total == 1 and len(read_manifest(tmp_path / "cap")) == 7


def test_unlisted_and_torn_files_are_ignored(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", shard_max_records=2)
    w.submit(_rec(6), request_id="a", workload="x", acceptance_length=1.0)
    w.close()
    (tmp_path / "cap" / "shard-999.safetensors").write_bytes(b"torn")  # not in the manifest
    (tmp_path / "cap" / ".shard-1.safetensors.tmp").write_bytes(b"x")
    with open(tmp_path / "cap" / "manifest.jsonl", "a") as f:
        f.write('{"request_id": "half')  # crash mid-append
    assert [r.request_id for r in read_manifest(tmp_path / "cap")] == ["a"]
    CaptureWriter(tmp_path / "cap", "tid").close()  # restart cleans temp files
    assert not (tmp_path / "cap" / ".shard-1.safetensors.tmp").exists()
    snap = seal(tmp_path / "cap", tmp_path / "snaps", "tid")
    assert snap.num_records == 1 and [r.request_id for r in read_manifest(snap.path)] == ["a"]
    assert not (snap.path / "shard-999.safetensors").exists()


def test_full_queue_drops_and_counts(tmp_path, monkeypatch):
    import time

    import tidespec.capture.writer as wm
    real = wm.write_shard
    monkeypatch.setattr(wm, "write_shard", lambda *a: (time.sleep(0.05), real(*a))[1])  # slow disk
    w = CaptureWriter(tmp_path / "cap", "tid", queue_size=2, shard_max_records=1)
    t0 = time.perf_counter()
    ok = [w.submit(_rec(6, seed=i), request_id=str(i), workload="x", acceptance_length=1.0) for i in range(50)]
    submit_s = time.perf_counter() - t0
    w.close()
    assert ok.count(False) > 0 and submit_s < 50 * 0.05 / 2  # never waited for the disk
    assert w.dropped_total == ok.count(False) and w.written_total == ok.count(True)
    assert len(read_manifest(tmp_path / "cap")) == w.written_total


def test_seal_curate_split_and_drift(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", shard_max_records=4)
    for i in range(20):
        w.submit(_rec(12, seed=i), request_id=f"r{i}", workload="code", acceptance_length=1.0)
    w.submit(_rec(12, seed=0), request_id="dup", workload="code", acceptance_length=1.0)  # same prompt as r0
    bad = _rec(12, seed=99)
    bad["aux_hidden_states"][3, 0] = float("nan")
    w.submit(bad, request_id="nan", workload="code", acceptance_length=1.0)
    w.close()
    s1 = seal(tmp_path / "cap", tmp_path / "snaps", "tid")
    assert s1.num_records == 22 and list_snapshots(tmp_path / "snaps", "tid") == [s1.path]
    assert read_manifest(tmp_path / "cap") == []
    p = CurateParams(val_fraction=0.3)
    r = curate(tmp_path / "snaps", "tid", p, tmp_path / "c1.json")
    idx = json.loads((tmp_path / "c1.json").read_text())
    tr, va = {e["request_id"] for e in idx["train"]}, {e["request_id"] for e in idx["val"]}
    assert not tr & va and len(tr | va) == 20
    assert r.dropped == {"duplicate_prompt": 1, "non_finite": 1}
    assert r.drift_jsd is None
    r2 = curate(tmp_path / "snaps", "tid", p, tmp_path / "c2.json", previous=tmp_path / "c1.json")
    assert r2.drift_jsd == pytest.approx(0.0, abs=1e-9)  # same data: no drift
    with pytest.raises(ValueError, match="no sealed snapshots"):
        curate(tmp_path / "snaps", "other", p, tmp_path / "c3.json")


def test_jsd_bounds():
    from collections import Counter
    assert jsd_bits(Counter({1: 5}), Counter({2: 5})) == pytest.approx(1.0)
    assert jsd_bits(Counter({1: 5, 2: 5}), Counter({1: 1, 2: 1})) == pytest.approx(0.0)
