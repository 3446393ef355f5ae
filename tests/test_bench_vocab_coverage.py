"""`tidespec bench vocab-coverage`: the share of captured completion tokens inside a draft's vocabulary, per
workload, and the size sweep (a vocabulary built from the first half of the records, on the second half)."""
import json

import pytest
import torch
from safetensors.torch import save_file

from tidespec.bench import vocab_coverage
from tidespec.capture.snapshots import seal
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CaptureParams

TID, V = "tid", 50


def _snapshot(root, recs):
    """Seal `recs` ([(workload, prompt ids, completion ids)]) as one snapshot; returns the target's snapshots dir."""
    w = CaptureWriter(root / "cap", TID, CaptureParams(shard_max_records=2))
    for i, (wl, prompt, comp) in enumerate(recs):
        ids = torch.tensor(prompt + comp, dtype=torch.int32)
        mask = torch.tensor([0] * len(prompt) + [1] * len(comp), dtype=torch.uint8)
        w.submit({"input_ids": ids, "loss_mask": mask, "aux_hidden_states": torch.zeros(len(ids), 6),
                  "hidden_states": torch.zeros(len(ids), 2)}, request_id=f"r{i}", workload=wl, acceptance_length=1.0)
    w.close()
    seal(root / "cap", root / "snaps", TID)
    return root / "snaps" / TID


def test_coverage_per_draft_and_workload_and_the_size_sweep(tmp_path):
    snaps = _snapshot(tmp_path, [("code", [1, 2], [3, 3, 4, 5]), ("chat", [1], [6, 7]),
                                 ("code", [2], [3, 4, 9, 9]), ("chat", [2], [6, 8])])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[1, 2, 3, 4, 6]] = True  # the prompt ids 1, 2 are never counted: only completions are the target's output
    (tmp_path / "d").mkdir()
    save_file({"t2d": t2d}, str(tmp_path / "d" / "model.safetensors"))
    rep = vocab_coverage.main(["--snapshots", str(snaps), "--draft", f"small={tmp_path / 'd'}", "--sizes", "1,2",
                               "--out", str(tmp_path / "out" / "vc")])
    assert rep["tokens"] == {"code": 8, "chat": 4}
    assert rep["coverage"]["small"] == {"code": pytest.approx(5 / 8), "chat": pytest.approx(2 / 4)}  # 3,3,4,3,4 / 6,6
    # code: first half [3, 3, 4, 5] → top-1 {3}, top-2 {3, 4}; second half [3, 4, 9, 9]
    assert rep["size_sweep"]["code"] == {1: pytest.approx(1 / 4), 2: pytest.approx(2 / 4)}
    assert rep["distinct_first_half"]["code"] == 3
    assert json.loads((tmp_path / "out" / "vc.json").read_text())["draft_vocab_size"] == {"small": 5}
    assert "| small (5) | 0.500 | 0.625 |" in (tmp_path / "out" / "vc.md").read_text()
    with pytest.raises(FileNotFoundError, match="no sealed snapshot"):
        vocab_coverage.completions([tmp_path / "empty" / TID])


def test_bad_options_are_refused_naming_them_and_a_snapshot_twice_counts_once(tmp_path, capsys):
    snaps = _snapshot(tmp_path, [("code", [1], [3, 4]), ("code", [1], [3, 5])])
    (tmp_path / "d").mkdir()
    save_file({"t2d": torch.ones(V, dtype=torch.bool)}, str(tmp_path / "d" / "model.safetensors"))
    out = str(tmp_path / "o" / "v1.2")
    base = ["--snapshots", str(snaps), "--out", out]
    for bad, says in ((["--draft", str(tmp_path / "d")], "expected NAME=DIR"),
                      (["--draft", f"a={tmp_path / 'd'}", "--draft", f"a={tmp_path / 'd'}"], "given twice"),
                      (["--sizes", "0"], "positive integers"), (["--sizes", "abc"], "positive integers")):
        with pytest.raises(SystemExit):
            vocab_coverage.main(base + bad)
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vocab_coverage.main(["--snapshots", str(snaps), "--out", str(tmp_path) + "/"])
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match="above the target's vocabulary of 50"):
        vocab_coverage.main(base + ["--draft", f"a={tmp_path / 'd'}", "--sizes", "51"])
    (snap,) = [p for p in snaps.iterdir() if p.is_dir()]
    rep = vocab_coverage.main(["--snapshots", str(snap), str(snaps / ".." / snaps.name / snap.name), "--out", out,
                               "--sizes", "1"])
    assert rep["tokens"] == {"code": 4}  # the same snapshot named twice: read once
    assert (tmp_path / "o" / "v1.2.json").exists() and (tmp_path / "o" / "v1.2.md").exists()  # the prefix as given
