"""A canary rollout judged on the same traffic, on a real MLflow server: replicas' cumulative counters
logged to the served versions' runs (`registry.log_replica_counters`), and the decision
(`adapters.registry.rollout.decide`) over the same windows since the `canary` alias was set — equal →
promoted after `deploy.canary_windows` windows; worse → rolled back, champion never moved, the decision on
both versions; a traffic shift that lowers both sides → promoted; too few drafts → wait. Then two real
embedded `tidespec serve` replicas following the registry, one `serve.canary: true`: the canary serves the
canary version first, the stable one keeps the champion until the decision, then follows."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import httpx
import pytest
import yaml

from conftest import health, make_tiny_target, random_draft, tiny_params_yaml, wait_until
from tidespec.adapters import registry
from tidespec.adapters.registry import rollout
from tidespec.engine.spec_counters import WINDOW_DRAFTS, SpecDecodeCounters

pytestmark = pytest.mark.services

GOOD, POOR = (160, 120, 80), (100, 50, 20)  # accepted per draft position in 200 drafts: τ 2.8 and 1.85


def _fake_version(uri, tid, tmp_path, n):
    d = tmp_path / f"{tid[:8]}-{n}"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    tags = {"lossless": "True"}
    return registry.log_candidate(uri, tid, d, {}, {"acceptance_length": 2.0 + n / 10}, tags)[1]


def _canary_over_champion(uri, tmp_path):
    """A registered model of its own with champion v1 and canary v2; returns (tid, v1, v2, since ms)."""
    tid = uuid.uuid4().hex * 2
    v1, v2 = _fake_version(uri, tid, tmp_path, 1), _fake_version(uri, tid, tmp_path, 2)
    registry.promote(uri, tid, v1, "first")
    d = registry.start_canary(uri, tid, v2, "scripted")
    assert d.canary and registry.canary(uri, tid).version == v2
    return tid, v1, v2, int(registry.version_tags(uri, tid, v2)["canary_since"])


class Replica:
    """One replica's cumulative counters, logged as it would every serve.live_stats_s."""

    def __init__(self, uri, tid, version, name, start=0):
        self.args, self.total = (uri, tid, version, name), SpecDecodeCounters(start, 3 * start, 0, (0, 0, 0))

    def log(self, at_ms, drafts=200, accepted=GOOD):
        self.total = self.total + SpecDecodeCounters(drafts, 3 * drafts, sum(accepted), tuple(accepted))
        registry.log_replica_counters(*self.args, self.total, at_ms=at_ms)


class Fleet:
    """Canary replica c1 on v2, stable replicas s1 and s2 on v1 (s1 counting since well before the
    canary, s2 restarted at the third window), each logging its first sample since the alias."""

    def __init__(self, uri, tid, since, v1, v2):
        self.since, self.n = since, 0
        self.c1, self.s1, self.s2 = Replica(uri, tid, v2, "c1"), Replica(uri, tid, v1, "s1", 5000), \
            Replica(uri, tid, v1, "s2")
        self.s1.log(since - 60_000)  # before the canary: not its windows
        for r in (self.c1, self.s1, self.s2):
            r.log(since + 10, 0)

    def window(self, canary, stable):
        """One window's traffic: 200 drafts on each side (the stable side's over two replicas)."""
        self.n += 1
        at = self.since + 1000 * self.n
        self.s1.log(at, 100, tuple(a // 2 for a in stable))
        if self.n == 3:  # s2 restarted: counts from zero again, all of it after its last sample
            self.s2.total = SpecDecodeCounters(0, 0, 0, (0, 0, 0))
        self.s2.log(at + 3, 100, tuple(a // 2 for a in stable))
        self.c1.log(at + 7, accepted=canary)


def test_equal_canary_is_promoted_after_the_windows_and_a_worse_one_rolled_back(mlflow_server, tmp_path):
    uri = mlflow_server
    tid, v1, v2, since = _canary_over_champion(uri, tmp_path)
    fleet = Fleet(uri, tid, since, v1, v2)
    for _ in range(2):
        fleet.window(GOOD, GOOD)
    r = rollout.decide(uri, tid, windows=3)
    assert r.verdict == rollout.WAIT and len(r.windows) == 2 and "2 of 3 windows" in r.reason, r
    assert [(w.canary.num_drafts, w.stable.num_drafts, w.worse) for w in r.windows] == [(200, 200, False)] * 2
    fleet.window(GOOD, GOOD)  # a third window
    assert rollout.decide(uri, tid, windows=3, act=False).verdict == rollout.PROMOTE  # status: nothing moved
    assert registry.champion(uri, tid).version == v1 and registry.canary(uri, tid).version == v2
    r = rollout.decide(uri, tid, windows=3)
    assert r.verdict == rollout.PROMOTE and r.acted and "3 windows pooled" in r.reason, r
    assert registry.champion(uri, tid).version == v2 and registry.canary(uri, tid) is None
    assert registry.version_tags(uri, tid, v2)["decision"] == "promoted"
    assert f"replaced: canary v{v2} promoted: " in registry.decisions(uri, tid, v1)[-1]
    assert registry.version_tags(uri, tid, v1)["decision"] == "promoted"  # its own latest decision stands
    assert registry.rollback(uri, tid, "back").version == v1  # promoted as any promotion: history kept
    assert rollout.decide(uri, tid, windows=3).verdict == rollout.NO_CANARY

    tid, v1, v2, since = _canary_over_champion(uri, tmp_path)
    fleet = Fleet(uri, tid, since, v1, v2)
    for _ in range(2):
        fleet.window(POOR, GOOD)
    r = rollout.decide(uri, tid, windows=3)
    assert r.verdict == rollout.ROLL_BACK and r.acted and "clearly below 2 windows in a row" in r.reason, r
    assert registry.canary(uri, tid) is None and registry.champion(uri, tid).version == v1  # never moved
    assert registry.version_tags(uri, tid, v2)["decision"] == "rolled_back"
    assert "rolled_back" in registry.decisions(uri, tid, v2)[-1]
    assert f"kept: canary v{v2} rolled back" in registry.decisions(uri, tid, v1)[-1]


def test_a_traffic_shift_moves_both_sides_and_too_few_drafts_wait(mlflow_server, tmp_path):
    uri = mlflow_server
    tid, v1, v2, since = _canary_over_champion(uri, tmp_path)
    fleet = Fleet(uri, tid, since, v1, v2)
    for both in (GOOD, POOR, POOR):  # harder traffic from window 2: both sides lower
        fleet.window(both, both)
    r = rollout.decide(uri, tid, windows=3)
    assert r.verdict == rollout.PROMOTE and not any(w.worse for w in r.windows), r
    assert registry.champion(uri, tid).version == v2

    tid, v1, v2, since = _canary_over_champion(uri, tmp_path)
    c1, s1 = Replica(uri, tid, v2, "c1"), Replica(uri, tid, v1, "s1")
    for at in (since + 1, since + 1000):
        c1.log(at, WINDOW_DRAFTS // 2, POOR)
        s1.log(at, WINDOW_DRAFTS // 2)
    r = rollout.decide(uri, tid, windows=3)
    assert r.verdict == rollout.WAIT and r.windows == () and f"a window needs {WINDOW_DRAFTS} drafts" in r.reason
    assert registry.canary(uri, tid).version == v2 and registry.champion(uri, tid).version == v1
    assert rollout.decide(uri, tid, windows=3, max_wait_s=3600).verdict == rollout.WAIT  # within its wait
    r = rollout.decide(uri, tid, windows=3, max_wait_s=0.001)  # too few drafts for longer: rolled back
    assert r.verdict == rollout.ROLL_BACK and r.acted and r.windows == (), r
    assert re.search(r"not judged within deploy.canary_max_wait_s 0.001 s \(drafts since the alias: canary "
                     rf"{WINDOW_DRAFTS // 2}, champion {WINDOW_DRAFTS // 2}\)", r.reason), r.reason
    assert registry.canary(uri, tid) is None and registry.champion(uri, tid).version == v1


def test_the_gate_of_a_canary_rollout_sets_the_canary_alias(mlflow_server, tmp_path):
    """`promote_if_better(canary=True)` (deploy.rollout: canary): the first champion is promoted (nothing
    to compare it with); a later candidate that passes goes to `canary`, the champion untouched; one that
    replaces an undecided canary is recorded on it; one that fails stays off both."""
    uri, tid = mlflow_server, uuid.uuid4().hex * 2
    v1, v2, v3, v4 = (_fake_version(uri, tid, tmp_path, n) for n in (1, 2, 3, 4))
    assert registry.promote_if_better(uri, tid, v1, 2.0, None, 0.02, True, canary=True).promoted
    d = registry.promote_if_better(uri, tid, v2, 2.5, 2.0, 0.02, True, evaluated_champion=v1, canary=True)
    assert d.canary and not d.promoted and d.reason.startswith("canary: passed the gate: τ 2.5000 >= ")
    assert registry.champion(uri, tid).version == v1 and registry.canary(uri, tid).version == v2
    assert registry.version_tags(uri, tid, v2)["decision"] == "canary"
    assert registry.promote_if_better(uri, tid, v3, 2.6, 2.0, 0.02, True, evaluated_champion=v1, canary=True).canary
    assert registry.canary(uri, tid).version == v3 and registry.version_tags(uri, tid, v2)["decision"] == \
        "canary_replaced"
    d = registry.promote_if_better(uri, tid, v4, 1.0, 2.0, 0.02, True, evaluated_champion=v1, canary=True)
    assert not d.canary and not d.promoted and registry.canary(uri, tid).version == v3
    with pytest.raises(registry.RegistryError, match="is not the canary"):
        registry.end_canary(uri, tid, v2, "stale", promote=True)


def test_a_replica_logs_each_served_version_summed_over_its_tracks(mlflow_server, tmp_path):
    """`backends.live.report_replica` over a guard source: a version's tracks (the classes it served)
    summed into one sample per version under the replica's id, read back as `rollout.replica_samples`."""
    from tidespec.backends.live import report_replica
    from tidespec.serve.guard import Track
    uri, tid = mlflow_server, uuid.uuid4().hex * 2
    v1 = _fake_version(uri, tid, tmp_path, 1)

    class Source:  # what `serve.draft_health.EngineSource` reports: one track per (slot, class)
        def tracks(self):
            return {("", "code"): Track(v1, SpecDecodeCounters(10, 30, 12, (7, 4, 1))),
                    ("", "chat"): Track(v1, SpecDecodeCounters(5, 15, 3, (3,))),
                    ("", "new"): Track(v1, None), ("x", "x"): Track(None, None)}
    assert report_replica(Source(), uri, tid, "eu-1") == {v1: SpecDecodeCounters(15, 45, 15, (10, 4, 1))}
    run = registry.version_info(uri, tid, v1).run_id
    [(_, got)] = rollout.replica_samples(uri, run)["eu-1"]
    assert got == SpecDecodeCounters(15, 45, 15, (10, 4, 1))


def _params(root, target_dir, canary: bool):
    raw = yaml.safe_load(tiny_params_yaml(target_dir))
    raw["serve"] = {"watch_champion_s": 0.5, "champion_source": "registry", "live_stats_s": 0.5, "canary": canary,
                    "replica_id": "canary-1" if canary else "stable-1"}
    raw["engine"] |= {"adaptive": False, "suffix": {"enabled": False}}  # fixed k, EAGLE3 chains alone: counted
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root / "params.yaml"


def test_a_canary_replica_serves_the_canary_first_and_the_stable_one_follows_the_decision(tmp_path, mlflow_server):
    from tidespec.adapters.services import free_port
    from tidespec.config import load_params
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.load import get_target
    target_dir = make_tiny_target(tmp_path / "target", seed=57)  # a registered model of its own
    roots = {"stable": tmp_path / "stable", "canary": tmp_path / "canary"}
    params = {k: _params(r, target_dir, k == "canary") for k, r in roots.items()}
    target = get_target(load_params(params["stable"]))[0]
    uri, tid = mlflow_server, target.target_id
    ck = save_checkpoint(random_draft(target, 64, seed=3), tmp_path / "ck")  # the same weights: the same τ
    v1, v2 = (registry.log_candidate(uri, tid, ck, {}, {"acceptance_length": 1.5}, {"lossless": "True"})[1]
              for _ in range(2))
    registry.promote(uri, tid, v1, "first")
    urls, procs = {}, {}
    try:
        for k, root in roots.items():
            port = free_port()
            urls[k] = f"http://127.0.0.1:{port}"
            procs[k] = subprocess.Popen(
                [sys.executable, "-m", "tidespec.cli", "serve", "--root", str(root), "--params", str(params[k]),
                 "--port", str(port), "--no-capture"], cwd=root, env=os.environ | {"MLFLOW_TRACKING_URI": uri},
                stdout=open(tmp_path / f"{k}.log", "w"), stderr=subprocess.STDOUT)
        for k in roots:
            assert wait_until(lambda k=k: health(urls[k]), 120, f"{k} /health", procs[k])["draft_version"] == v1
        since_ms = int(time.time() * 1000)
        registry.start_canary(uri, tid, v2, "test")
        wait_until(lambda: health(urls["canary"])["draft_version"] == v2, 30, "the canary to serve v2", procs["canary"])
        assert health(urls["canary"])["canary"] is True and health(urls["stable"])["canary"] is False

        def traffic():  # the same requests on both
            for k in roots:
                for p in ([5, 17, 33, 8], [9, 2, 41, 7, 3]):
                    r = httpx.post(f"{urls[k]}/v1/completions", json={"prompt": p, "max_tokens": 12}, timeout=60)
                    assert r.status_code == 200, r.text

        def sampled(replica, version):  # a replica logs a version's counters once it has drafted with it
            run_id = registry.version_info(uri, tid, version).run_id
            return rollout.replica_samples(uri, run_id, since_ms).get(replica)
        traffic()
        wait_until(lambda: sampled("canary-1", v2) and sampled("stable-1", v1), 30, "each replica's first sample")
        traffic()  # a window: the counters' increments after each replica's first sample

        def judged():
            d = rollout.decide(uri, tid, windows=1, min_drafts=1, act=False)
            return d if d.verdict != rollout.WAIT else None
        assert wait_until(judged, 30, "a window of both replicas' counters").verdict == rollout.PROMOTE

        def requests_logged(replica, run_id):  # requests served, logged beside the counters
            rows = registry.replica_rows(uri, run_id).get(replica, {})
            return max((v.get("requests", 0) for v in rows.values()), default=0) >= 2
        wait_until(lambda: requests_logged("canary-1", registry.version_info(uri, tid, v2).run_id), 30,
                   "the canary's requests logged")
        assert health(urls["stable"])["draft_version"] == v1  # the stable replica waits for the decision
        d = rollout.decide(uri, tid, windows=1, min_drafts=1)
        assert d.verdict == rollout.PROMOTE and d.acted, d
        wait_until(lambda: health(urls["stable"])["draft_version"] == v2, 30, "the stable replica to follow")
        assert health(urls["canary"])["draft_version"] == v2
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(60)
    for k in roots:
        out = (tmp_path / f"{k}.log").read_text()
        assert "Traceback" not in out, out
