"""The per-class replay buffer and the time-split holdout (curate)."""
import json
import shutil
import time

from test_train import _snapshot
from tidespec.capture.curate import curate, replay_buffer_path
from tidespec.capture.replay_buffer import ReplayBuffer
from tidespec.config import CurateParams

TOKENS = 12  # every record of `_snapshot` (test_train._rec(12, seed))


def _cycle(tmp_path, wl, seeds, p, name="c.json"):
    _snapshot(tmp_path, "tid", wl, seeds)
    time.sleep(0.01)  # snapshot ids sort by time
    r = curate(tmp_path / "snaps", "tid", p, tmp_path / name)
    return r, json.loads((tmp_path / name).read_text())


def test_every_earlier_class_is_replayed_in_equal_shares_after_its_snapshots_are_gone(tmp_path):
    """code → chat → math with a window of one snapshot: the math cycle still trains on code and chat,
    equal shares, even once retention has dropped the code snapshot from local disk."""
    p = CurateParams(window=1, val_fraction=0.0, holdout_fraction=0.0, replay_fraction=0.5)
    _, idx = _cycle(tmp_path, "code", range(0, 20), p)
    assert idx["num_replay"] == 0 and idx["replay_buffer"] == {}  # nothing has left the window yet
    _, idx = _cycle(tmp_path, "chat", range(100, 120), p)
    assert {e["workload"] for e in idx["train"] if e.get("replay")} == {"code"}
    code_snap = tmp_path / "snaps" / "tid" / idx["replay_snapshots"][0].split("/")[-1]
    shutil.rmtree(code_snap)  # retention: only on the DVC remote now
    r, idx = _cycle(tmp_path, "math", range(200, 220), p)
    replay = [e for e in idx["train"] if e.get("replay")]
    fresh = [e for e in idx["train"] if not e.get("replay")]
    by = {w: sum(e["num_tokens"] for e in replay if e["workload"] == w) for w in ("code", "chat")}
    assert by == {"code": 10 * TOKENS, "chat": 10 * TOKENS}  # 50 % of 20 fresh records' tokens, halved
    assert len(fresh) == 20 and r.num_replay == 20
    assert idx["replay_buffer"] == {"chat": {"records": 20, "tokens": 240}, "code": {"records": 20, "tokens": 240}}
    assert (tmp_path / idx["replay_snapshots"][0]).resolve().name == code_snap.name  # lineage names the dropped one
    assert idx["workload_mix"] == {"math": 20, "code": 10, "chat": 10}


def test_the_buffer_is_a_uniform_sample_within_its_budget_whatever_the_arrival_order(tmp_path):
    entries = [{"snapshot": str(tmp_path / "s"), "shard": "x", "offset": i, "request_id": f"r{i}",
                "num_tokens": TOKENS, "workload": "code", "prompt_hash": f"h{i}"} for i in range(30)]
    a, b = ReplayBuffer(tmp_path / "a.json", 0), ReplayBuffer(tmp_path / "b.json", 0)
    a.absorb("s1", entries[:15], 5 * TOKENS)
    a.absorb("s2", entries[15:], 5 * TOKENS)
    b.absorb("s2", entries[15:], 5 * TOKENS)
    b.absorb("s1", entries[:15], 5 * TOKENS)
    ids = {e["request_id"] for e in a.classes["code"]}
    assert ids == {e["request_id"] for e in b.classes["code"]} and len(ids) == 5
    assert a.absorb("s1", entries[:15], 5 * TOKENS) == 0  # idempotent per snapshot
    a.save()
    again = ReplayBuffer(tmp_path / "a.json", 0)
    assert again.classes == a.classes and again.absorbed == {"s1", "s2"}
    assert {e["request_id"] for e in again.draw(100 * TOKENS, {"h3", "h7"}, tmp_path)} == ids - {"r3", "r7"}


def test_a_window_prompt_is_never_replayed(tmp_path):
    """A prompt served again (same prompt hash) in the window is not drawn from the buffer too."""
    p = CurateParams(window=1, val_fraction=0.0, holdout_fraction=0.0, replay_fraction=0.5)
    _cycle(tmp_path, "code", range(0, 10), p)
    _, idx = _cycle(tmp_path, "code", range(0, 10), p)  # the same ten prompts again
    assert idx["num_replay"] == 0 and len(idx["train"]) == 10


def test_time_split_holds_out_the_newest_traffic(tmp_path):
    p = CurateParams(window=2, val_fraction=0.0, holdout_fraction=0.25, max_holdout=32, holdout_split="time",
                     replay_fraction=0.0)
    _snapshot(tmp_path, "tid", "code", range(0, 12))
    time.sleep(0.01)
    r, idx = _cycle(tmp_path, "code", range(100, 104), p)
    assert idx["holdout_split"] == "time" and r.num_holdout == 4  # 25 % of 16
    assert {e["request_id"] for e in idx["holdout"]} == {f"code{s}" for s in range(100, 104)}
    assert {e["request_id"] for e in idx["train"]} == {f"code{s}" for s in range(12)}
    hold = [json.loads(line)["id"] for line in (tmp_path / "holdout.jsonl").read_text().splitlines()]
    assert hold == sorted(hold, reverse=True)  # newest first: max_holdout keeps the newest
    rnd = curate(tmp_path / "snaps", "tid", p.model_copy(update={"holdout_split": "random"}), tmp_path / "r.json")
    ridx = json.loads((tmp_path / "r.json").read_text())
    assert ridx["holdout_split"] == "random" and rnd.num_holdout + len(ridx["train"]) == 16
    assert {e["request_id"] for e in ridx["holdout"]} != {e["request_id"] for e in idx["holdout"]}


def test_a_snapshot_dropped_before_it_entered_the_buffer_is_counted_once(tmp_path, caplog):
    p = CurateParams(window=1, val_fraction=0.0, holdout_fraction=0.0)
    s = _snapshot(tmp_path, "tid", "code", range(0, 4))
    time.sleep(0.01)
    s.path.with_name(s.path.name + ".dvc").write_text("outs: []\n")  # tracked, then dropped by retention
    shutil.rmtree(s.path)
    _, idx = _cycle(tmp_path, "chat", range(100, 104), p)
    assert idx["replay_dropped"] == {"not_local": 1} and "left local disk" in caplog.text
    curate(tmp_path / "snaps", "tid", p, tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text())["replay_dropped"] == {}
    assert s.path.name in json.loads(replay_buffer_path(tmp_path / "snaps", "tid").read_text())["absorbed"]


def test_entries_never_trained_on_are_held_apart_as_the_retained_holdout(tmp_path):
    """`held` entries go to their own per-class bottom-k within `held_budget`, are never drawn for
    training, survive a save, and come back relative to the index's directory; a buffer file saved
    before they were kept reads as holding none."""
    def ent(i, w):
        return {"snapshot": str(tmp_path / "snaps" / "s"), "shard": "x", "offset": i, "request_id": f"r{i}",
                "num_tokens": TOKENS, "workload": w, "prompt_hash": f"h{i}"}
    (tmp_path / "replay").mkdir()
    buf = ReplayBuffer(tmp_path / "replay" / "b.json", 0)
    buf.absorb("s1", [ent(i, "code") for i in range(10)], 100 * TOKENS,
               held=[ent(i, "code") for i in range(10, 20)] + [ent(20, "chat")], held_budget=3 * TOKENS)
    assert {w: len(es) for w, es in buf.held.items()} == {"code": 3, "chat": 1}
    drawn = {e["request_id"] for e in buf.draw(1000 * TOKENS, set(), tmp_path)}
    assert drawn == {f"r{i}" for i in range(10)}  # the held entries are never trained on
    buf.save()
    again = ReplayBuffer(buf.path, 0)
    assert again.held == buf.held and again.summary() == {"code": {"records": 10, "tokens": 10 * TOKENS}}
    ret = again.retained(tmp_path / "curated")
    assert sorted(ret) == ["chat", "code"] and len(ret["code"]) == 3
    assert all(e["snapshot"] == "../snaps/s" for es in ret.values() for e in es)
    assert [e["request_id"] for e in again.retained(tmp_path, exclude={"h20"})["code"]] == [
        e["request_id"] for e in ret["code"]] and "chat" not in again.retained(tmp_path, exclude={"h20"})
    again.classes["code"].append(dict(ret["code"][0], snapshot="../snaps/s"))  # a split setting changed: trained now
    assert len(again.retained(tmp_path)["code"]) == 2
    old = json.loads(buf.path.read_text())
    del old["held"]
    buf.path.write_text(json.dumps(old))
    assert ReplayBuffer(buf.path, 0).held == {} and ReplayBuffer(buf.path, 0).retained(tmp_path) == {}


def test_curate_keeps_the_requests_it_never_trained_on_as_each_class_retained_holdout(tmp_path):
    """code, then chat with a window of one: the chat cycle's index carries code's retained holdout —
    code requests of the holdout and val buckets, none of them in either cycle's training set — within
    `retained_holdout_tokens`; 0 keeps none."""
    from tidespec.capture.curate import split_of
    p = CurateParams(window=1, val_fraction=0.2, holdout_fraction=0.3, replay_fraction=0.5,
                     retained_holdout_tokens=6 * TOKENS)
    _, first = _cycle(tmp_path, "code", range(0, 40), p, "a.json")
    assert first["retained_holdout"] == {}
    _, idx = _cycle(tmp_path, "chat", range(100, 140), p, "b.json")
    kept = idx["retained_holdout"]["code"]
    assert list(idx["retained_holdout"]) == ["code"] and len(kept) == 6
    trained = {e["request_id"] for x in (first, idx) for e in x["train"]}
    assert not trained & {e["request_id"] for e in kept}
    assert {split_of(e, p) for e in kept} <= {"holdout", "val"}
    assert all((tmp_path / e["snapshot"]).is_dir() for e in kept)  # relative to the index's directory
    from tidespec.capture.curate import class_subset
    for w, want in (("code", 6), ("chat", 0)):  # a class draft's set keeps its own class's, re-rooted
        class_subset(tmp_path / "b.json", w, 0.1, 0, tmp_path / "classes" / w / "curated.json")
        sub = json.loads((tmp_path / "classes" / w / "curated.json").read_text())["retained_holdout"]
        assert len(sub.get(w, [])) == want and set(sub) <= {w}
        assert [(tmp_path / "classes" / w / e["snapshot"]).resolve() for e in sub.get(w, [])] == [
            (tmp_path / e["snapshot"]).resolve() for e in kept][:want]
    _, none = _cycle(tmp_path, "math", range(200, 240), p.model_copy(update={"retained_holdout_tokens": 0}), "c.json")
    assert none["retained_holdout"] == {}
