"""`tidespec bench static-general` on the real target at a tiny budget: resumable preparation, the
cached draft with its provenance and learning curve, and the report (docs/benchmarks.md)."""
import json

import pytest
import torch

from conftest import REPO
from tidespec.bench import static_general as sg
from tidespec.capture.store import MANIFEST, read_rows


@pytest.fixture
def small_shards(monkeypatch):
    monkeypatch.setattr(sg, "SHARD_CONVS", 4)  # resumable units of 4 conversations instead of 64


def test_preparation_resumes_after_the_last_shard_written(real_target, tmp_path, small_shards, monkeypatch):
    """Killed during its second shard, a rerun keeps the first shard's bytes and goes on from there:
    the same records, shard for shard, as one uninterrupted run."""
    from tidespec.assets.prompts import sharegpt_conversations

    target, tok = real_target
    convs = sharegpt_conversations(limit=16)[:12]
    calls = []

    def dies_on_second(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return sg.teacher_force.__wrapped__(*args, **kw)

    real_tf = sg.teacher_force
    dies_on_second.__wrapped__ = real_tf
    monkeypatch.setattr(sg, "teacher_force", dies_on_second)
    rec, whole = tmp_path / "rec", tmp_path / "whole"
    with pytest.raises(KeyboardInterrupt):
        sg.prepare(target, tok, convs, rec, 10**9, 256, print)
    first = {p.name: p.read_bytes() for p in rec.glob("s*.safetensors")}
    assert list(first) == ["s000000.safetensors"]
    monkeypatch.setattr(sg, "teacher_force", real_tf)
    entries = sg.prepare(target, tok, convs, rec, 10**9, 256, print)
    assert (rec / "s000000.safetensors").read_bytes() == first["s000000.safetensors"]
    assert sorted(p.name for p in rec.glob("s*.safetensors")) == [f"s{i:06d}.safetensors" for i in (0, 4, 8)]
    once = sg.prepare(target, tok, convs, whole, 10**9, 256, print)
    assert [(e["shard"], e["offset"], e["num_tokens"]) for e in entries] == [
        (e["shard"], e["offset"], e["num_tokens"]) for e in once]
    assert [r.request_id for r in read_rows(rec / MANIFEST)] == [e["request_id"] for e in entries]


def test_a_small_static_is_trained_cached_and_reported(real_target, tmp_path, small_shards, capsys):
    """Two epochs on ~300 tokens: the draft and provenance.json land in the recipe's dir, the curve has
    one row per epoch (acceptance per TTT position), `--out` writes the report; a rerun finds the cached
    draft without training again and writes the report from its provenance."""
    argv = ["--tokens", "300", "--skip", "0", "--holdout", "2", "--max-tokens", "160", "--epochs", "2",
            "--threads", "1", "--params", str(REPO / "params.yaml"), "--cache", str(tmp_path / "cache"),
            "--out", str(tmp_path / "out" / "sg")]
    sg.main(argv)
    drafts = list((tmp_path / "cache" / "bench-static").glob("general-data-*/draft-*"))
    assert len(drafts) == 1 and (drafts[0] / "model.safetensors").is_file()
    prov = json.loads((drafts[0] / "provenance.json").read_text())
    assert prov["tokens"] >= 300 and prov["epochs"] == 2 and prov["holdout_conversations"] == 2
    assert [c["epoch"] for c in prov["curve"]] == [1, 2]
    assert all(len(c["holdout/acc"]) == 4 and c["simulated_acceptance_length"] >= 1.0 for c in prov["curve"])
    assert prov["curve"][1]["train_tokens"] == 2 * prov["curve"][0]["train_tokens"]
    assert prov["command"] == "tidespec bench static-general " + " ".join(argv)
    assert prov["hardware"].endswith(", 1 threads, torch " + torch.__version__) and len(prov["date"]) == 10
    saved = json.loads((tmp_path / "out" / "sg.json").read_text())
    assert saved["draft_dir"] == str(drafts[0]) and saved["curve"] == prov["curve"]
    md = (tmp_path / "out" / "sg.md").read_text()
    assert f"{prov['tokens']:,} tokens, 2 epochs" in md and md.count("\n| 1 |") == 1 and md.count("\n| 2 |") == 1
    stamp = (drafts[0] / "model.safetensors").stat().st_mtime_ns
    assert "unrecorded" not in md and "undated" not in md
    (tmp_path / "out" / "sg.md").unlink()
    (tmp_path / "out" / "sg.json").unlink()
    capsys.readouterr()
    sg.main(argv)
    assert "already trained" in capsys.readouterr().out
    assert (drafts[0] / "model.safetensors").stat().st_mtime_ns == stamp
    assert (tmp_path / "out" / "sg.md").read_text() == md
    assert json.loads((tmp_path / "out" / "sg.json").read_text()) == saved


def test_the_report_prints_each_epoch_of_the_curve():
    prov = {"tokens": 1_000_164, "epochs": 2, "source": "ShareGPT", "conversations": [2400, 17182], "records": 3323,
            "holdout_conversations": 177, "hardware": "Some CPU, 2 threads", "date": "2026-12-07",
            "command": "tidespec bench static-general --epochs 2", "metrics": {"train_device": "cpu"},
            "curve": [{"epoch": 1, "train_tokens": 1000164, "train_seconds": 2500.4,
                       "holdout/acc": [0.387, 0.338, 0.3183, 0.305], "simulated_acceptance_length": 1.4571},
                      {"epoch": 2, "train_tokens": 2000328, "train_seconds": 5001.0,
                       "holdout/acc": [0.448, 0.399, 0.377, 0.36], "simulated_acceptance_length": 1.563}]}
    md = sg.report(prov)
    assert "# A general static draft: 1,000,164 tokens, 2 epochs" in md
    assert "| 1 | 1,000,164 | 2,500 | 0.387 / 0.338 / 0.318 / 0.305 | 1.457 |" in md
    assert "| 2 | 2,000,328 | 5,001 | 0.448 / 0.399 / 0.377 / 0.360 | 1.563 |" in md
    assert "Some CPU, 2 threads (2026-12-07)" in md and "Reproduce: `tidespec bench static-general --epochs 2`" in md


def test_a_provenance_from_before_the_hardware_was_recorded_still_reports():
    """The 1M static's first provenance (2026-12-06, bench/results) predates `hardware` and `date`: the
    report says so."""
    prov = json.loads((REPO / "bench/results/static-general-1M-provenance-2026-12-06.json").read_text())
    assert "hardware" not in prov and "date" not in prov
    md = sg.report(prov)
    assert "Training finished on unrecorded hardware (undated), cpu float32." in md
    assert "| 4 | 4,000,656 | 40,654 | 0.491 / 0.444 / 0.417 / 0.397 | 1.650 |" in md


@pytest.mark.parametrize("n", [0, 1001])
def test_train_tokens_outside_the_preparation_are_refused(n):
    with pytest.raises(SystemExit, match=f"--train-tokens {n}: must be in 1..--tokens \\(1000\\)"):
        sg.main(["--tokens", "1000", "--train-tokens", str(n)])
