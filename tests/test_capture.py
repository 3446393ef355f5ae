"""Capture: round trip (both codecs), manifest ↔ shards, torn shards ignored, drop reasons, filter,
quota, auto-seal, privacy; curate splits (no leakage) and drift."""
import json
import os
import threading
import time
from collections import Counter

import pytest
import torch

from tidespec.capture.curate import curate, jsd_bits, snapshot_drift
from tidespec.capture.snapshots import list_snapshots, load_snapshot, seal
from tidespec.capture.store import read_manifest, read_record
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CaptureParams, CurateParams, EngineParams, Params


def _rec(T, H=8, seed=0, prompt_len=4):
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(T, dtype=torch.uint8)
    m[prompt_len:] = 1
    return {"input_ids": torch.randint(0, 100, (T,), generator=g, dtype=torch.int32), "loss_mask": m,
            "aux_hidden_states": torch.randn(T, 3 * H, generator=g).bfloat16(),
            "hidden_states": torch.randn(T, H, generator=g).bfloat16()}


def _mode(p):
    return oct(os.stat(p).st_mode & 0o777)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_roundtrip_and_manifest(tmp_path, compression):
    w = CaptureWriter(
        tmp_path / "cap", "tid", CaptureParams(queue_size=16, shard_max_records=3, compression=compression)
    )
    recs = [_rec(10 + i, seed=i) for i in range(7)]
    for i, r in enumerate(recs):
        # fp32 hidden states in (as the engine produces them): stored as bf16
        fp32 = dict(r, aux_hidden_states=r["aux_hidden_states"].float(), hidden_states=r["hidden_states"].float())
        assert w.submit(fp32, request_id=f"r{i}", workload="code", acceptance_length=1.5, text={"prompt": "secret"})
    w.close()
    rows = read_manifest(tmp_path / "cap")
    assert [r.request_id for r in rows] == [f"r{i}" for i in range(7)]
    assert len({r.shard for r in rows}) == 3  # 3 + 3 + 1 (flushed on close)
    assert all(r.text is None for r in rows)  # store_text off: no raw text
    for row, r in zip(rows, recs):
        back = read_record(tmp_path / "cap", row)
        assert row.num_tokens == r["input_ids"].shape[0]
        for k in r:
            assert back[k].dtype == r[k].dtype and torch.equal(back[k], r[k]), k
    shards = sorted(p.name for p in (tmp_path / "cap").glob("shard-*"))
    assert shards == sorted({r.shard for r in rows})
    assert all(s.endswith(".zst") == (compression == "zstd") for s in shards)
    assert _mode(tmp_path / "cap") == "0o700"
    assert {_mode(p) for p in (tmp_path / "cap").iterdir()} == {"0o600"}
    st = w.stats()
    assert st.written_total == 7 and st.dropped_total == 0 and st.tokens_total == sum(range(10, 17))
    raw_bytes_per_token = 4 * 8 * 2 + 4 + 1  # (3H + H) bf16 + int32 id + uint8 mask
    assert st.bytes_per_token == pytest.approx(st.bytes_total / st.tokens_total)
    assert st.bytes_per_token > (raw_bytes_per_token if compression == "none" else 0)
    w.close()  # idempotent
    assert not w.submit(recs[0], request_id="late", workload="code", acceptance_length=1.0)
    assert w.stats().dropped == {"closed": 1} and len(read_manifest(tmp_path / "cap")) == 7


def test_zstd_is_smaller_on_smooth_states(tmp_path):
    """Byte-shuffled zstd pays on hidden states (exponent bytes repeat); random bf16 would not."""
    g = torch.Generator().manual_seed(0)
    T, H = 64, 64
    base = torch.randn(1, 4 * H, generator=g)
    h = (base + 0.05 * torch.randn(T, 4 * H, generator=g)).bfloat16()
    r = {"input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
         "aux_hidden_states": h[:, :3 * H], "hidden_states": h[:, 3 * H:]}
    sizes = {}
    for c in ("none", "zstd"):
        w = CaptureWriter(tmp_path / c, "tid", CaptureParams(compression=c))
        w.submit(r, request_id="a", workload="x", acceptance_length=1.0)
        w.close()
        sizes[c] = w.stats().bytes_total
        assert torch.equal(
            read_record(tmp_path / c, read_manifest(tmp_path / c)[0])["hidden_states"], r["hidden_states"]
        )
    assert sizes["zstd"] < 0.8 * sizes["none"]


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_fp8_at_rest_halves_the_hidden_states_within_its_rounding(tmp_path, compression):
    """capture.hidden_dtype fp8_e4m3 / fp8_e4m3_b32: the writer stores e4m3 + a scale per row / per 32
    values, readers get bf16 back. Bound (derived): e4m3 rounds to nearest with 3 mantissa bits, ≤ 2⁻⁴
    of the value relative to itself, or half its subnormal step 2⁻¹⁰ × the scale s below 2⁻⁶ s; the
    bf16 it comes back as adds ≤ 2⁻⁸ of the value: |x̂ − x| ≤ 0.07 |x| + 2⁻⁹ s, s the absmax / 448 of
    the value's row or block."""
    T, H = 40, 64
    g = torch.Generator().manual_seed(3)
    h = torch.randn(T, 4 * H, generator=g) * torch.logspace(-3, 4, T)[:, None]  # row scales ≪ 1 and ≫ 1
    h[5] = 0.0  # an all-zero row (scale 1)
    r = {"input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
         "aux_hidden_states": h[:, :3 * H], "hidden_states": h[:, 3 * H:]}
    sizes = {}
    for dt in ("bf16", "fp8_e4m3", "fp8_e4m3_b32"):
        w = CaptureWriter(tmp_path / dt, "tid", CaptureParams(compression=compression, hidden_dtype=dt))
        w.submit(r, request_id="a", workload="x", acceptance_length=1.0)
        w.close()
        sizes[dt] = w.stats().bytes_total
        back = read_record(tmp_path / dt, read_manifest(tmp_path / dt)[0])
        for k in ("aux_hidden_states", "hidden_states"):
            x, y = r[k], back[k]
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            blocks = x.abs().view(T, -1, 32 if dt.endswith("b32") else x.shape[1])
            s = (blocks.amax(dim=2, keepdim=True) / 448).expand_as(blocks).reshape(x.shape)
            assert bool(((y.float() - x).abs() <= 0.07 * x.abs() + 2 ** -9 * s).all()), (dt, k)
        assert bool((back["hidden_states"][5] == 0).all())
        assert torch.equal(back["input_ids"], r["input_ids"])
    if compression == "none":  # 1 byte + 4/(4H) of a scale per element against 2; per block: + 4/32
        assert sizes["fp8_e4m3"] < 0.55 * sizes["bf16"] and sizes["fp8_e4m3_b32"] < 0.6 * sizes["bf16"], sizes
    from tidespec.bench.fp8_capture import fp8_round_trip  # what the fp8 bench trains on is what a reader gets
    rt = fp8_round_trip(r, 32)
    assert all(torch.equal(rt[k], back[k]) for k in back)
    with pytest.raises(ValueError, match="capture.hidden_dtype must be one of"):
        from tidespec.capture.store import encode_shard
        encode_shard([r], hidden_dtype="fp4")
    with pytest.raises(ValueError, match="hidden_dtype"):
        CaptureParams(hidden_dtype="fp16")


def test_store_text_opt_in(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(store_text=True))
    w.submit(_rec(6), request_id="a", workload="x", acceptance_length=1.0, text={"prompt": "p", "completion": "c"})
    w.close()
    assert read_manifest(tmp_path / "cap")[0].text == {"prompt": "p", "completion": "c"}


def test_unlisted_and_torn_files_are_ignored(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(shard_max_records=2))
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
    assert _mode(snap.path) == "0o700" and {_mode(p) for p in snap.path.iterdir()} == {"0o600"}


def test_hung_disk_drops_never_blocks(tmp_path, monkeypatch):
    """The disk hangs (write_shard blocks): submit still returns at once, the overflow is counted."""
    import tidespec.capture.writer as wm
    entered, gate = threading.Event(), threading.Event()
    real = wm.write_shard
    monkeypatch.setattr(wm, "write_shard", lambda *a: (entered.set(), gate.wait(), real(*a))[2])
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(queue_size=2, shard_max_records=1))
    assert w.submit(_rec(6), request_id="first", workload="x", acceptance_length=1.0)
    assert entered.wait(30)  # the writer thread is now stuck in the disk write
    done = threading.Event()
    ok = []
    threading.Thread(target=lambda: (ok.extend(w.submit(_rec(6, seed=i), request_id=str(i), workload="x",
                                                        acceptance_length=1.0) for i in range(50)), done.set())).start()
    assert done.wait(30), "submit blocked on a hung disk"
    gate.set()
    w.close()
    st = w.stats()
    assert ok.count(True) == 2 and st.dropped == {"queue_full": 48}  # 2 fit the queue
    assert st.written_total == 3 and len(read_manifest(tmp_path / "cap")) == 3


def test_filter_sampling_and_acceptance_threshold(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(sample_rate=0.25, max_acceptance_rate=0.5))
    wanted = [w.wants(f"req-{i}") for i in range(400)]
    assert 0.18 < sum(wanted) / 400 < 0.32 and wanted == [w.wants(f"req-{i}") for i in range(400)]  # deterministic
    rates = [None, 0.1, 0.49, 0.5, 0.9]  # None: served without drafts → kept
    kept = [w.submit(_rec(6, seed=i), request_id=f"a{i}", workload="x", acceptance_length=1.0, acceptance_rate=a)
            for i, a in enumerate(rates)]
    w.close()
    assert kept == [True, True, True, False, False]
    st = w.stats()
    assert st.filtered == {"sampled_out": 2 * (400 - sum(wanted)), "high_acceptance": 2}
    assert [r.acceptance_rate for r in read_manifest(tmp_path / "cap")] == [None, 0.1, 0.49]


def test_disk_quota_stops_capture_until_seal(tmp_path):
    rec = _rec(64, H=64)  # ~33 KB a record in bf16
    w = CaptureWriter(
        tmp_path / "cap",
        "tid",
        CaptureParams(shard_max_records=1, disk_quota_mb=0.1),
        snapshots_root=tmp_path / "snaps",
    )
    for i in range(6):
        w.submit(rec, request_id=f"r{i}", workload="x", acceptance_length=1.0)
    w.flush()
    st = w.stats()
    assert st.written_total == 3 and st.dropped == {"disk_quota": 3}  # 3 × 33 KB < 100 KB < 4 × 33 KB
    assert sum(p.stat().st_size for p in (tmp_path / "cap").iterdir()) <= 0.1 * 2 ** 20
    assert not w.submit(rec, request_id="x", workload="x", acceptance_length=1.0)  # latched: dropped at once
    info = w.seal_now()
    assert info.num_records == 3
    assert w.submit(rec, request_id="r9", workload="x", acceptance_length=1.0)  # space is back
    w.close()
    assert w.stats().written_total == 4 and w.stats().dropped == {"disk_quota": 4}


def test_min_free_disk_stops_capture(tmp_path):
    w = CaptureWriter(
        tmp_path / "cap", "tid", CaptureParams(shard_max_records=1, min_free_disk_mb=1e12)
    )  # an exabyte free? no
    w.submit(_rec(6), request_id="a", workload="x", acceptance_length=1.0)
    w.close()
    assert w.stats().dropped == {"disk_full": 1} and read_manifest(tmp_path / "cap") == []


def test_auto_seal_on_tokens_and_age(tmp_path):
    infos = []
    w = CaptureWriter(
        tmp_path / "cap",
        "tid",
        CaptureParams(shard_max_records=2, seal_min_tokens=40, seal_max_age_s=1.0),
        snapshots_root=tmp_path / "snaps",
        on_seal=infos.append,
        idle_flush_s=0.1,
    )
    for i in range(4):  # 4 × 12 tokens: sealed once 48 >= 40 are written
        w.submit(_rec(12, seed=i), request_id=f"r{i}", workload="x", acceptance_length=1.0)
    w.flush()
    deadline = time.monotonic() + 10
    while len(infos) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(i.reason, i.num_records, i.num_tokens) for i in infos] == [("tokens", 4, 48)]
    w.submit(_rec(12, seed=9), request_id="late", workload="x", acceptance_length=1.0)  # then traffic stops
    while len(infos) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    w.close()
    assert [(i.reason, i.num_records) for i in infos] == [("tokens", 4), ("age", 1)]
    assert [p.name for p in list_snapshots(tmp_path / "snaps", "tid")] == [i.snapshot_id for i in infos]
    meta = load_snapshot(infos[0].path)
    assert meta.bytes_per_token == pytest.approx(meta.num_bytes / 48) and meta.num_bytes > 0


def _write_snapshot(tmp_path, name, records):
    w = CaptureWriter(tmp_path / f"cap-{name}", "tid", CaptureParams(shard_max_records=8))
    for rid, r in records:
        w.submit(r, request_id=rid, workload=name, acceptance_length=1.0)
    w.close()
    return seal(tmp_path / f"cap-{name}", tmp_path / "snaps", "tid")


def test_curate_splits_without_leakage(tmp_path):
    """The same prompt sent again under new request ids (later snapshots) never lands in two splits."""
    recs = [(f"r{i}", _rec(12, seed=i)) for i in range(60)]
    _write_snapshot(tmp_path, "a", recs[:40])
    # snapshot b: 20 new prompts + 20 prompts of snapshot a again, new request ids, new completions
    again = []
    for i in range(20):
        r = _rec(12, seed=1000 + i)
        r["input_ids"][:4] = recs[i][1]["input_ids"][:4]
        again.append((f"again{i}", r))
    _write_snapshot(tmp_path, "b", recs[40:] + again)
    bad = _rec(12, seed=99)
    bad["aux_hidden_states"][3, 0] = float("nan")
    _write_snapshot(tmp_path, "c", [("nan", bad), ("short", _rec(3, seed=5, prompt_len=1))])
    p = CurateParams(window=3, val_fraction=0.2, holdout_fraction=0.25, min_tokens=4)
    r = curate(tmp_path / "snaps", "tid", p, tmp_path / "work" / "curated.json")
    idx = json.loads(r.path.read_text())
    splits = {k: idx[k] for k in ("train", "val", "holdout")}
    ids = {k: {e["request_id"] for e in v} for k, v in splits.items()}
    hashes = {k: {e["prompt_hash"] for e in v} for k, v in splits.items()}
    for a, b in (("train", "val"), ("train", "holdout"), ("val", "holdout")):
        assert not ids[a] & ids[b] and not hashes[a] & hashes[b], (a, b)
    assert sum(len(v) for v in ids.values()) == 60  # 80 requests, 60 distinct prompts
    assert r.dropped == {"duplicate_prompt": 20, "non_finite": 1, "length": 1}
    assert {e["request_id"] for e in idx["train"] + idx["val"] + idx["holdout"]} >= {f"again{i}" for i in range(20)}
    assert 8 <= len(ids["holdout"]) <= 22 and 5 <= len(ids["val"]) <= 20  # ~25 % and ~20 % of 60
    # the holdout file holds exactly the holdout requests' prompts
    rows = [json.loads(x) for x in r.holdout.read_text().splitlines()]
    assert {x["id"] for x in rows} == ids["holdout"] and all(len(x["input_ids"]) == 4 for x in rows)
    # a prompt keeps its split in the next cycle, whatever request id it comes with
    r2 = curate(tmp_path / "snaps", "tid", p.model_copy(update={"window": 1}), tmp_path / "work" / "c2.json")
    idx2 = json.loads(r2.path.read_text())
    for k in splits:
        assert {e["prompt_hash"] for e in idx2[k]} <= hashes[k]
    with pytest.raises(ValueError, match="no sealed snapshots"):
        curate(tmp_path / "snaps", "other", p, tmp_path / "c3.json")


def _text_records(texts, seed):
    """Real text as byte-level token ids (no tokenizer needed): 64-byte prompt, rest generated."""
    out = []
    for i, t in enumerate(texts):
        ids = torch.tensor(list(t.encode())[:200], dtype=torch.int32)
        m = torch.ones(len(ids), dtype=torch.uint8)
        m[:64] = 0
        h = torch.zeros(len(ids), 8).bfloat16()
        out.append((f"{seed}-{i}", {"input_ids": ids, "loss_mask": m, "aux_hidden_states": torch.cat([h, h, h], 1),
                                    "hidden_states": h}))
    return out


def test_drift_rises_on_shift_and_stays_low_on_repeat(tmp_path):
    from tidespec.assets import prompts
    code, math = [p.text for p in prompts.load("humaneval")], [p.text for p in prompts.load("gsm-en")]
    p = CurateParams(window=1, val_fraction=0.1, holdout_fraction=0.1)
    first = _write_snapshot(tmp_path, "code1", _text_records(code[:40], "a"))
    c1 = curate(tmp_path / "snaps", "tid", p, tmp_path / "c1.json")
    assert c1.drift_jsd is None
    repeat = _write_snapshot(tmp_path, "code2", _text_records(code[40:80], "b"))
    c2 = curate(tmp_path / "snaps", "tid", p, tmp_path / "c2.json", previous=tmp_path / "c1.json")
    shift = _write_snapshot(tmp_path, "math", _text_records(math[:40], "c"))
    c3 = curate(tmp_path / "snaps", "tid", p, tmp_path / "c3.json", previous=tmp_path / "c2.json")
    assert c3.drift_jsd > 3 * c2.drift_jsd and c3.drift_jsd > 0.06 > 0.03 > c2.drift_jsd
    # the publisher's check: a fresh snapshot against the last curated set
    assert (
        snapshot_drift(repeat.path, tmp_path / "c1.json")
        < 0.03
        < 0.06
        < snapshot_drift(shift.path, tmp_path / "c1.json")
    )
    assert c1.dropped == {} and snapshot_drift(first.path, tmp_path / "c1.json") == pytest.approx(0.0, abs=1e-9)


def test_jsd_bounds():
    assert jsd_bits(Counter({1: 5}), Counter({2: 5})) == pytest.approx(1.0)
    assert jsd_bits(Counter({1: 5, 2: 5}), Counter({1: 1, 2: 1})) == pytest.approx(0.0)


def test_params_validate_capture_and_splits():
    with pytest.raises(ValueError, match="keep_local_snapshots"):
        Params.model_validate({"capture": {"keep_local_snapshots": 2}, "curate": {"window": 4}})
    with pytest.raises(ValueError, match="holdout_fraction"):
        Params.model_validate({"curate": {"val_fraction": 0.5, "holdout_fraction": 0.5}})
    with pytest.raises(ValueError):
        Params.model_validate({"capture": {"compression": "gzip"}})


def test_prometheus_exposition(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from tidespec.capture.metrics import CaptureCollector
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(max_acceptance_rate=0.5))
    reg = CollectorRegistry()
    reg.register(CaptureCollector(w))
    w.submit(_rec(6), request_id="a", workload="x", acceptance_length=1.0)
    w.submit(_rec(6), request_id="b", workload="x", acceptance_length=3.0, acceptance_rate=0.9)
    w.close()
    w.submit(_rec(6), request_id="c", workload="x", acceptance_length=1.0)
    text = generate_latest(reg).decode()
    assert "tidespec:capture_written_total 1.0" in text and "tidespec:capture_tokens_total 6.0" in text
    assert 'tidespec:capture_dropped_total{reason="closed"} 1.0' in text
    assert 'tidespec:capture_dropped_total{reason="queue_full"} 0.0' in text
    assert 'tidespec:capture_filtered_total{reason="high_acceptance"} 1.0' in text
    assert f"tidespec:capture_bytes_total {float(w.stats().bytes_total)}" in text


def test_cli_seals_leftover_capture_and_lists(tmp_path, monkeypatch):
    """After a crash: `tidespec snapshots seal` finishes the interrupted seal and seals the rest."""
    from typer.testing import CliRunner

    import tidespec.capture.snapshots as store
    from tidespec.cli import app
    cap = tmp_path / "data" / "capture" / "tid"
    w = CaptureWriter(cap, "tid-full-id", CaptureParams(shard_max_records=2))
    for i in range(3):
        w.submit(_rec(6, seed=i), request_id=f"a{i}", workload="x", acceptance_length=1.0)
    w.close()
    monkeypatch.setattr(store, "_finish_seal", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        seal(cap, tmp_path / "data" / "snapshots", "tid-full-id")
    monkeypatch.undo()
    w = CaptureWriter(cap, "tid-full-id")  # a new server starts before anyone sealed: recovery runs
    w.submit(_rec(6, seed=7), request_id="b0", workload="x", acceptance_length=1.0)
    w.close()
    r = CliRunner().invoke(app, ["snapshots", "seal", "--root", str(tmp_path), "--no-publish"])
    assert r.exit_code == 0, r.output
    snaps = list_snapshots(tmp_path / "data" / "snapshots", "tid-full-id")
    assert [[x.request_id for x in read_manifest(s)] for s in snaps] == [["a0", "a1", "a2"], ["b0"]]
    from tidespec.cli import common as cli
    monkeypatch.setattr(cli.console, "width", 200)
    out = CliRunner().invoke(app, ["snapshots", "list", "--root", str(tmp_path)]).output
    assert snaps[0].name in out and "local only" in out


def test_one_writer_per_capture_dir(tmp_path):
    from tidespec.capture.snapshots import CaptureDirBusy
    w = CaptureWriter(tmp_path / "cap", "tid")
    w.submit(_rec(6), request_id="a", workload="x", acceptance_length=1.0)
    with pytest.raises(CaptureDirBusy, match="seal_now"):
        seal(tmp_path / "cap", tmp_path / "snaps", "tid")  # would race the writer's appends
    with pytest.raises(CaptureDirBusy):
        CaptureWriter(tmp_path / "cap", "tid")
    w.close()
    assert seal(tmp_path / "cap", tmp_path / "snaps", "tid").num_records == 1  # released on close
    CaptureWriter(tmp_path / "cap", "tid").close()


def test_engine_serves_through_a_hung_disk(tmp_path, tiny_target):
    """End to end: the engine serves with capture on while the writer is stuck in a disk write;
    every request completes with the same tokens as capture off, the overflow is counted. (The ITL
    figure is in the benchmark: `tidespec bench capture`, hung_disk row.)"""
    from tidespec.engine.speculative import Engine
    target = tiny_target
    eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    gate, entered = threading.Event(), threading.Event()
    w = CaptureWriter(tmp_path / "cap", target.target_id, CaptureParams(queue_size=2, shard_max_records=1))
    real = w._write_pending
    w._write_pending = lambda: (entered.set(), gate.wait(), real())[2]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 320, (8,), generator=g).tolist() for _ in range(8)]
    done = threading.Event()
    outs = []

    def serve():
        for i, p in enumerate(prompts):
            gen = eng.generate(p, 16, capture=True)
            w.submit_generation(gen, "code")
            outs.append(gen.tokens)
            if i == 0:
                entered.wait(30)  # from here on the writer is stuck in its first disk write
        done.set()
    threading.Thread(target=serve, daemon=True).start()
    assert done.wait(120), "serving blocked on the hung capture disk"
    gate.set()
    w.close()
    assert outs == [eng.generate(p, 16).tokens for p in prompts]
    st = w.stats()
    assert st.written_total == 3 and st.dropped == {"queue_full": 5}


# -- found by trying to break it ----------------------------------------------------------------
def test_torn_manifest_tail_does_not_swallow_later_rows(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid")
    for i in range(2):
        w.submit(_rec(6, seed=i), request_id=f"a{i}", workload="x", acceptance_length=1.0)
    w.close()
    m = tmp_path / "cap" / "manifest.jsonl"
    m.write_bytes(m.read_bytes()[:-40])  # crash mid-append of the last row (never acknowledged)
    w = CaptureWriter(tmp_path / "cap", "tid", snapshots_root=tmp_path / "snaps")
    w.submit(_rec(6, seed=5), request_id="after_restart", workload="x", acceptance_length=1.0)
    w.flush()
    assert [r.request_id for r in read_manifest(tmp_path / "cap")] == ["a0", "after_restart"]
    info = w.seal_now()
    w.close()
    assert [r.request_id for r in read_manifest(info.path)] == ["a0", "after_restart"]
    assert not list((tmp_path / "cap").glob("shard-*"))  # the torn row's shard went with its shard-mate


def test_bad_records_are_refused_at_submit_and_the_writer_goes_on(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(shard_max_records=3))
    good = _rec(6)
    bad = [{k: v for k, v in good.items() if k != "hidden_states"},
           dict(good, loss_mask=good["loss_mask"][:4]),
           dict(good, hidden_states=good["hidden_states"][:3]),
           dict(good, aux_hidden_states=good["aux_hidden_states"][:, :5]),
           dict(good, input_ids=torch.full((6,), 2 ** 40)),
           dict(good, input_ids=good["input_ids"].float()),
           dict(good, loss_mask=torch.full((6,), 7, dtype=torch.uint8)),
           dict(good, hidden_states=torch.empty(6, 8, device="meta")),
           dict(good, input_ids=[1, 2, 3]),
           {k: v[:0] for k, v in good.items()}]
    w.submit(good, request_id="g0", workload="x", acceptance_length=1.0)
    for b in bad:
        with pytest.raises(ValueError, match="submit_generation"):
            w.submit(b, request_id="bad", workload="x", acceptance_length=1.0)
    shared = dict(good)  # two records sharing one tensor object (safetensors refuses shared storage)
    w.submit(shared, request_id="g1", workload="x", acceptance_length=1.0)
    w.submit(dict(shared), request_id="g2", workload="x", acceptance_length=1.0)
    w.close()
    assert [r.request_id for r in read_manifest(tmp_path / "cap")] == ["g0", "g1", "g2"]
    assert w.stats().dropped == {}


def test_seal_failure_keeps_capturing(tmp_path):
    (tmp_path / "snaps").write_text("not a directory")
    w = CaptureWriter(
        tmp_path / "cap",
        "tid",
        CaptureParams(shard_max_records=2, seal_min_tokens=10),
        snapshots_root=tmp_path / "snaps",
    )
    for i in range(10):
        w.submit(_rec(6, seed=i), request_id=f"r{i}", workload="x", acceptance_length=1.0)
    w.close()
    st = w.stats()
    assert st.written_total == 10 and st.dropped == {} and st.seal_errors == 1  # retried after SEAL_RETRY_S
    (tmp_path / "snaps").unlink()  # fixed: the next writer finishes the interrupted seal, then seals the rest
    w = CaptureWriter(tmp_path / "cap", "tid", snapshots_root=tmp_path / "snaps")
    w.seal_now()
    w.close()
    got = [r.request_id for s in list_snapshots(tmp_path / "snaps", "tid") for r in read_manifest(s)]
    assert sorted(got) == sorted(f"r{i}" for i in range(10))


def test_close_racing_submits_loses_nothing_uncounted(tmp_path):
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(queue_size=256, shard_max_records=4))
    accepted, stop = [], threading.Event()

    def spam(k):
        i = 0
        while not stop.is_set():
            if w.submit(_rec(6, seed=i), request_id=f"{k}-{i}", workload="x", acceptance_length=1.0):
                accepted.append(f"{k}-{i}")
            i += 1
    ts = [threading.Thread(target=spam, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    time.sleep(0.3)
    w.close()
    stop.set()
    for t in ts:
        t.join()
    written = {r.request_id for r in read_manifest(tmp_path / "cap")}
    assert set(accepted) == written and w.stats().written_total == len(written) > 0
    assert set(w.stats().dropped) <= {"closed", "queue_full"}


def test_close_returns_within_its_timeout_on_a_stalled_disk(tmp_path):
    gate, entered = threading.Event(), threading.Event()
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(queue_size=2, shard_max_records=1))
    real = w._write_pending
    w._write_pending = lambda: (entered.set(), gate.wait(), real())[2]
    w.submit(_rec(6), request_id="a", workload="x", acceptance_length=1.0)
    assert entered.wait(10)
    for i in range(4):
        w.submit(_rec(6, seed=i), request_id=f"b{i}", workload="x", acceptance_length=1.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stalled"):
        w.close(timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    gate.set()
    w.close()  # the disk is back: everything queued gets written
    assert [r.request_id for r in read_manifest(tmp_path / "cap")] == ["a", "b0", "b1"]


def test_corrupt_shard_is_named_and_skipped_by_curate(tmp_path, caplog):
    from tidespec.capture.store import CorruptShard
    for c in ("none", "zstd"):
        w = CaptureWriter(tmp_path / f"cap-{c}", "tid", CaptureParams(shard_max_records=2, compression=c))
        for i in range(4):
            w.submit(_rec(12, seed=i + (10 if c == "zstd" else 0)), request_id=f"{c}{i}", workload="x",
                     acceptance_length=1.0)
        w.close()
        info = seal(tmp_path / f"cap-{c}", tmp_path / "snaps", "tid")
        rows = read_manifest(info.path)
        shard = info.path / rows[0].shard
        shard.write_bytes(shard.read_bytes()[:100])  # truncated on disk
        with pytest.raises(CorruptShard, match=rows[0].shard):
            read_record(info.path, rows[0])
    r = curate(tmp_path / "snaps", "tid", CurateParams(window=2, holdout_fraction=0.0, val_fraction=0.0),
               tmp_path / "work" / "curated.json")
    assert r.dropped == {"unreadable": 4} and r.num_train == 4
    assert "snapshots pull" in caplog.text
    assert _mode(r.path) == _mode(r.holdout) == "0o600"


def test_snapshot_ids_never_collide(tmp_path, monkeypatch):
    import tidespec.capture.snapshots as store
    real = store.new_snapshot_id
    ids = iter(["s1-aaaa", "s1-aaaa", "s1-aaaa", "s2-bbbb"])
    monkeypatch.setattr(store, "new_snapshot_id", lambda *a: next(ids, None) or real(*a))
    for name in ("a", "b"):
        w = CaptureWriter(tmp_path / name, "tid")
        w.submit(_rec(6, seed=ord(name)), request_id=name, workload="x", acceptance_length=1.0)
        w.close()
        seal(tmp_path / name, tmp_path / "snaps", "tid")
    snaps = list_snapshots(tmp_path / "snaps", "tid")
    assert [s.name for s in snaps] == ["s1-aaaa", "s2-bbbb"]
    assert [[r.request_id for r in read_manifest(s)] for s in snaps] == [["a"], ["b"]]


def test_fp8_keeps_a_rows_finite_values_next_to_inf_and_nan_and_refuses_bad_shapes():
    from tidespec.capture.store import from_fp8, to_fp8
    x = torch.tensor([[1000.0, float("nan"), 0.05, -600.0, 3.0], [1.0, float("inf"), 2.0, -3.0, 0.5]])
    y = from_fp8(*to_fp8(x)).float()
    fin = torch.isfinite(x)
    s = torch.where(fin, x.abs(), 0.0).amax(dim=1, keepdim=True) / 448
    assert bool(((y - x).abs()[fin] <= (0.07 * x.abs() + 2 ** -9 * s)[fin]).all()), y  # not clipped, not NaN
    assert bool(torch.isnan(y[~fin]).all())
    with pytest.raises(ValueError, match=r"\[T, D\] floating point"):
        to_fp8(torch.ones(4))
    with pytest.raises(ValueError, match="one per row or per block of 32"):
        q, sc = to_fp8(torch.ones(3, 4))
        from_fp8(q, sc[:1])
    with pytest.raises(ValueError, match="one per row or per block of 32"):
        q, sc = to_fp8(torch.ones(3, 70), 32)
        from_fp8(q, sc[:, :2])
    assert to_fp8(torch.ones(3, 70), 32)[1].shape == (3, 3)  # the last block holds 6 values


def test_a_scale_per_block_keeps_the_values_an_outlier_dimension_would_flush():
    """One dimension 10⁵ × the others (LLM hidden states have such outliers): with one scale per row
    (s = 10⁵ / 448) the others fall below e4m3's normal range (2⁻⁶ · 448 s ≈ 3.5) and most lose the
    2⁻⁴ relative precision; with a scale per 32 values the blocks without the outlier keep the bound
    |x̂ − x| ≤ 0.07 |x| + 2⁻⁹ s_block everywhere."""
    from tidespec.capture.store import from_fp8, to_fp8
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 128, generator=g)
    x[:, 7] = 1e5
    err = {b: (from_fp8(*to_fp8(x, b)).float() - x).abs()[:, 32:] for b in (None, 32)}
    rest = x[:, 32:].abs()
    s = (rest.view(8, 3, 32).amax(dim=2, keepdim=True) / 448).expand(8, 3, 32).reshape(8, 96)
    assert bool((err[32] <= 0.07 * rest + 2 ** -9 * s).all())
    assert float((err[None] > 0.07 * rest).float().mean()) > 0.5  # per row: most values lose it


@pytest.mark.parametrize("dtype, args, msg", [
    ("bf16", ["--val", "0"], "--val and --threads must be >= 1"),
    ("bf16", ["--val", "-1"], "--val and --threads must be >= 1"),
    ("bf16", ["--threads", "0"], "--val and --threads must be >= 1"),
    ("bf16", ["--seeds", "0", "0"], "each seed once"),
    ("bf16", ["--val", "6"], "holds 6 records: more than --val 6"),
    ("fp8_e4m3", ["--val", "2"], r"stores hidden states as \['fp8_e4m3'\]"),
])
def test_fp8_bench_refuses_before_loading_the_target(tmp_path, dtype, args, msg):
    from tidespec.bench.fp8_capture import main
    from tidespec.capture.store import shard_hidden_dtype
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(hidden_dtype=dtype, shard_max_records=4))
    for i in range(6):
        w.submit(_rec(8, seed=i), request_id=f"r{i}", workload="code", acceptance_length=1.0)
    w.close()
    snap = seal(tmp_path / "cap", tmp_path / "snaps", "tid")
    assert {shard_hidden_dtype(snap.path / r.shard) for r in read_manifest(snap.path)} == {dtype}
    with pytest.raises(SystemExit, match=msg):
        main(["--snapshot", str(snap.path), *args])


def test_where_the_draft_was_rejected_travels_from_the_generation_to_the_curated_records(tmp_path):
    """A captured Generation's rejected tokens (indices into its tokens) land in the manifest as the
    record positions whose next-token distribution gave them (prompt length + index − 1: the hidden
    state before the token; the last token's too), come back from
    `read_record` and a curated entry as `rejected_mask`, and only when all fields are read. A request
    the draft model never served records None (nothing to weigh); a position outside the record is
    refused at submit."""
    from tidespec.capture.curate import load_records
    from tidespec.capture.writer import rejected_positions
    from tidespec.engine.generation import Generation
    from tidespec.engine.stats import RequestTiming, SpecDecodingStats

    def gen(rid, rejected, drafted=True):
        stats = SpecDecodingStats(3, num_drafts=4, num_draft_tokens=12, num_accepted_tokens=2)
        return Generation(rid, 4, list(range(20, 32)), stats, RequestTiming(), record=_rec(15, seed=len(rid)),
                          by_proposer={"eagle3": stats} if drafted else {},
                          draft_kinds=frozenset({"eagle3"}) if drafted else frozenset(), rejected=rejected)
    assert rejected_positions(gen("a", [1, 5, 11])) == [4, 8, 14]  # token 11, the last: predicted at T - 1
    assert rejected_positions(gen("b", [], drafted=False)) is None
    w = CaptureWriter(tmp_path / "cap", "tid", CaptureParams(shard_max_records=8))
    assert w.submit_generation(gen("a", [1, 5, 11]), "code") and w.submit_generation(gen("bb", [], False), "code")
    with pytest.raises(ValueError, match="outside a record of 15 tokens"):
        w.submit(_rec(15), request_id="c", workload="code", acceptance_length=1.0, rejected=[15])
    w.close()
    info = seal(tmp_path / "cap", tmp_path / "snaps", "tid")
    rows = {r.request_id: r for r in read_manifest(info.path)}
    assert rows["a"].rejected == [4, 8, 14] and rows["bb"].rejected is None and "c" not in rows
    mask = read_record(info.path, rows["a"])["rejected_mask"]
    assert mask.dtype == torch.uint8 and mask.nonzero().flatten().tolist() == [4, 8, 14]
    assert "rejected_mask" not in read_record(info.path, rows["a"], ("input_ids", "loss_mask"))
    assert "rejected_mask" not in read_record(info.path, rows["bb"])
    r = curate(tmp_path / "snaps", "tid", CurateParams(val_fraction=0, holdout_fraction=0, min_tokens=4),
               tmp_path / "work" / "curated.json")
    entries = {e["request_id"]: e for e in json.loads(r.path.read_text())["train"]}
    assert entries["a"]["rejected"] == [4, 8, 14] and "rejected" not in entries["bb"]
    back = load_records([entries["a"], entries["bb"]], r.path.parent)
    assert back[0]["rejected_mask"].nonzero().flatten().tolist() == [4, 8, 14] and "rejected_mask" not in back[1]
    manifest = info.path / "manifest.jsonl"  # a row naming a position outside its record: dropped, the rest curated
    manifest.write_text(manifest.read_text().replace("[4, 8, 14]", "[4, 15]"))
    r = curate(tmp_path / "snaps", "tid", CurateParams(val_fraction=0, holdout_fraction=0, min_tokens=4),
               tmp_path / "work2" / "curated.json")
    assert r.dropped == {"unreadable": 1}
    assert [e["request_id"] for e in json.loads(r.path.read_text())["train"]] == ["bb"]
