"""cycle.lineage: the data lineage every registered version carries, never empty."""
import json

import pytest

from conftest import make_tiny_workspace


def test_lineage_of_a_curated_set(tmp_path, tiny_target_dir):
    from tidespec.steps import cycle
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir)
    cycle.step_curate(ws, params, target.target_id)
    (snap,) = [p for p in (ws.snapshots / target.target_id).iterdir() if p.is_dir()]
    got = cycle.lineage(ws.curated)
    revs = json.loads(got["snapshot_revs"])
    assert list(revs) == [snap.name] and revs[snap.name].startswith("untracked:")  # no DVC here
    assert got["snapshot_rev"] == revs[snap.name] and got["holdout_split"] == params.curate.holdout_split
    assert cycle.lineage(ws.curated, "ev-rev")["snapshot_rev"] == "ev-rev"  # the event's rev wins
    # a DVC-tracked snapshot: its .dvc md5
    (snap.parent / (snap.name + ".dvc")).write_text("outs:\n- md5: abc123.dir\n  path: x\n")
    assert json.loads(cycle.lineage(ws.curated)["snapshot_revs"]) == {snap.name: "abc123.dir"}
    (snap.parent / (snap.name + ".dvc")).unlink()
    # an index that names no snapshot, or whose untracked snapshot is gone: refused, naming the fix
    idx = json.loads(ws.curated.read_text())
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps(idx | {"snapshots": [], "replay_snapshots": []}))
    with pytest.raises(ValueError, match="names no snapshot"):
        cycle.lineage(empty)
    (snap / "manifest.jsonl").rename(snap / "gone.jsonl")
    with pytest.raises(FileNotFoundError, match="snapshots pull"):
        cycle.lineage(ws.curated)


def test_register_refuses_empty_lineage(tmp_path):
    from tidespec.config import Params
    from tidespec.steps import register
    for data in ({}, {"snapshot_rev": "x"}, {"snapshot_rev": "x", "snapshot_revs": "{}"}):
        with pytest.raises(ValueError, match="lineage"):
            register.step_register(Params(), "t" * 64, tmp_path, {"candidate": {}}, {}, "http://127.0.0.1:9", data)


def test_params_are_frozen_as_the_files_bytes(tmp_path):
    """`cycle.freeze_params` (what tide_cycle calls once per run): the params file's own bytes, copied
    to data/work/params-<sha>.yaml, load back as the same params — also when a cross-field rule
    depends on which keys were set (engine.adaptive: false leaves draft_early_stop unset); a later
    edit of params.yaml leaves the frozen copy as it was; a missing params.yaml freezes the defaults."""
    from tidespec.config import Params, load_params
    from tidespec.steps import cycle
    from tidespec.workspace import Workspace
    ws, pp = Workspace(tmp_path), tmp_path / "params.yaml"
    text = "# tuned by hand\nengine: {adaptive: false}\ntrain: {lr: 0.0123}\n"
    pp.write_text(text)
    params, frozen = cycle.freeze_params(ws, pp)
    assert frozen == ws.work / f"params-{params.sha()}.yaml" and frozen.read_text() == text
    assert load_params(frozen).sha() == params.sha() == load_params(pp).sha() and params.train.lr == 0.0123
    pp.write_text("train: {lr: 0.5}\n")  # edited while the cycle runs
    assert frozen.read_text() == text and load_params(frozen).train.lr == 0.0123
    assert cycle.freeze_params(ws, pp)[1] != frozen  # the next cycle freezes the new params
    pp.unlink()
    default, f0 = cycle.freeze_params(ws, pp)
    assert default.sha() == Params().sha() and load_params(f0).sha() == Params().sha()
    pp.write_text("engine: {num_draft_tokens: 0}\n")
    with pytest.raises(ValueError, match=f"^{pp}: invalid params"):
        cycle.freeze_params(ws, pp)
    assert not list(ws.work.glob(".params-*"))  # no temp copy left behind
