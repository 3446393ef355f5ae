"""One view of the fleet: scripted samples of three replicas on a real MLflow server (a stable one, a
canary, one silent too long) → `adapters.registry.fleet.fleet`'s rows, `tidespec fleet status`'s table and
JSON; what a replica logs each round beside its counters (`backends.live.replica_state`: requests,
capture backlog, last seal); `tidespec fleet status` without MLflow refused naming MLFLOW_TRACKING_URI; and
the replica id as a label on every series of an embedded server's and a front door's own /metrics."""
from __future__ import annotations

import json
import time
import uuid

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from typer.testing import CliRunner

from tidespec.adapters import registry
from tidespec.adapters.registry.client import replica_rows
from tidespec.adapters.registry.fleet import ReplicaRow, fleet, utc
from tidespec.cli import app
from tidespec.cli.fleet import SEALS_LOGGED, fleet_table
from tidespec.engine.spec_counters import SpecDecodeCounters

LIVE_STATS_S = 10.0  # stale after 30 s
SEALED_S = 1_790_000_000.0  # a seal time, s since the epoch


def _version(uri, tid, tmp_path, n):
    d = tmp_path / f"{tid[:8]}-{n}"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    return registry.log_candidate(uri, tid, d, {}, {"acceptance_length": 2.0}, {"lossless": "True"})[1]


def _three_replicas(uri, tmp_path, now_ms):
    """Champion v1, canary v2; stable-1 on v1 (τ 2.5, requests, backlog, a logged seal), canary-1 on v1
    then v2 (τ 2.0, requests only), old-1 on v1 silent for 1000 s. Returns (tid, v1, v2)."""
    tid = uuid.uuid4().hex * 2
    v1, v2 = _version(uri, tid, tmp_path, 1), _version(uri, tid, tmp_path, 2)
    registry.promote(uri, tid, v1, "first")
    registry.start_canary(uri, tid, v2, "scripted")
    log = registry.log_replica_counters
    log(uri, tid, v1, "stable-1", SpecDecodeCounters(100, 300, 150, (80, 50, 20)), now_ms - 65_000,
        {"requests": 20, "capture_backlog": 500})
    log(uri, tid, v1, "stable-1", SpecDecodeCounters(200, 600, 300, (160, 100, 40)), now_ms - 5000,
        {"requests": 40, "capture_backlog": 1234, "last_seal": SEALED_S})
    log(uri, tid, v1, "canary-1", SpecDecodeCounters(50, 150, 50, ()), now_ms - 100_000, {"requests": 3})
    log(uri, tid, v2, "canary-1", SpecDecodeCounters(10, 30, 10, (6, 3, 1)), now_ms - 4000, {"requests": 7})
    log(uri, tid, v1, "old-1", SpecDecodeCounters(0, 0, 0, ()), now_ms - 1_000_000)
    return tid, v1, v2


def _rows(v1, v2, now_ms):
    return [ReplicaRow("canary-1", True, v2, 2.0, 10, 7, None, None, utc(now_ms - 4000), 4.0, False),
            ReplicaRow("old-1", False, v1, None, 0, None, None, utc((SEALED_S - 60) * 1000),
                       utc(now_ms - 1_000_000), 1000.0, True),
            ReplicaRow("stable-1", False, v1, 2.5, 200, 40, 1234, utc(SEALED_S * 1000), utc(now_ms - 5000), 5.0,
                       False)]


@pytest.mark.services
def test_fleet_rows_table_and_json_of_three_replicas(mlflow_server, tmp_path):
    uri, now_ms = mlflow_server, int(time.time() * 1000)
    tid, v1, v2 = _three_replicas(uri, tmp_path, now_ms)
    remote = {"old-1": SEALED_S - 60}  # from the DVC remote's manifests: old-1's; stable-1 keeps its logged one
    assert fleet(uri, tid, LIVE_STATS_S, remote, now_ms) == _rows(v1, v2, now_ms)

    out = Console(width=250, record=True, file=open("/dev/null", "w"))
    out.print(fleet_table(_rows(v1, v2, now_ms), tid, SEALS_LOGGED))
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in out.export_text().splitlines()
             if line.count("│") > 2 and "replica" not in line]
    assert cells == [
        ["canary-1", "yes", f"v{v2}", "2.000", "10", "7", "—", "—", f"{utc(now_ms - 4000)} (4 s ago)", "live"],
        ["old-1", "", f"v{v1}", "—", "0", "—", "—", utc((SEALED_S - 60) * 1000),
         f"{utc(now_ms - 1_000_000)} (1000 s ago)", "stale"],
        ["stable-1", "", f"v{v1}", "2.500", "200", "40", "1234", utc(SEALED_S * 1000),
         f"{utc(now_ms - 5000)} (5 s ago)", "live"]]

    params = tmp_path / "params.yaml"
    params.write_text(f"serve: {{live_stats_s: {LIVE_STATS_S}}}\n")
    r = CliRunner().invoke(app, ["fleet", "status", "--target", tid, "--params", str(params), "--root", str(tmp_path),
                                 "--json"], env={"MLFLOW_TRACKING_URI": uri, "COLUMNS": "250"})
    assert r.exit_code == 0, r.output
    got = json.loads(r.output)
    ages = [row.pop("age_s") for row in got["replicas"]]  # counted to the command's own now
    want = [{k: v for k, v in row.as_dict().items() if k != "age_s"} for row in _rows(v1, v2, now_ms)]
    want[1]["last_seal"] = None  # no DVC remote here: old-1 logged no seal
    assert got == {"target_id": tid, "stale_after_s": 3 * LIVE_STATS_S, "last_seal_from": SEALS_LOGGED,
                   "replicas": want}
    for age, ago in zip(ages, (4, 1000, 5)):
        assert ago <= age < ago + 60, ages


def test_the_last_seals_on_the_remote_are_each_replicas_newest(monkeypatch):
    from tidespec.adapters import remote_snapshots
    manifests = [{"replica_id": "a", "sealed": "2026-12-06T10:00:00.000+00:00"},
                 {"replica_id": None, "sealed": "2026-12-06T11:00:00.000+00:00"},  # sealed before replica ids
                 {"replica_id": "b", "sealed": "2026-12-06T10:30:00.000+00:00"},
                 {"replica_id": "a", "sealed": "2026-12-06T10:45:00.500+00:00"}]
    monkeypatch.setattr(remote_snapshots, "list_remote_snapshots", lambda repo, tid: manifests)
    got = remote_snapshots.last_seals("repo", "t")
    assert {r: utc(s * 1000) for r, s in got.items()} == {"a": "2026-12-06T10:45:00Z", "b": "2026-12-06T10:30:00Z"}


def test_a_replicas_last_seal_is_read_off_its_newest_local_snapshot_id(tmp_path):
    from tidespec.capture.snapshots import last_sealed, new_snapshot_id
    assert last_sealed(tmp_path, "t", "eu-1") is None
    for replica in ("eu-1", "eu-1", "eu-10", None):  # another replica's, one sealed before replica ids
        d = tmp_path / "t" / new_snapshot_id(replica)
        d.mkdir(parents=True)
        (d / "snapshot.json").write_text("{}")
        time.sleep(0.002)
    newest = sorted(p.name for p in (tmp_path / "t").iterdir() if "-eu-1-" in p.name)[-1]
    got = last_sealed(tmp_path, "t", "eu-1")
    assert utc(got * 1000) == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.strptime(newest[1:16], "%Y%m%dT%H%M%S"))
    assert abs(got - time.time()) < 60


def test_fleet_without_mlflow_is_refused_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = CliRunner().invoke(app, ["fleet", "status", "--root", str(tmp_path)])
    assert r.exit_code == 2 and "MLFLOW_TRACKING_URI" in r.output, r.output


@pytest.mark.services
def test_a_replica_logs_its_requests_backlog_and_last_seal_beside_its_counters(mlflow_server, tmp_path):
    """`report_replica` with `replica_state` (requests, capture backlog, last seal): one batch per
    version; a state key outside `REPLICA_STATE` is refused."""
    from tidespec.backends.live import replica_state, report_replica
    from tidespec.serve.guard import Track
    uri, tid = mlflow_server, uuid.uuid4().hex * 2
    v1 = _version(uri, tid, tmp_path, 1)

    class Source:
        def tracks(self):
            return {("", "code"): Track(v1, SpecDecodeCounters(10, 30, 12, (7, 4, 1)))}
    report_replica(Source(), uri, tid, "eu-1", replica_state(lambda: 9, lambda: 321, lambda: SEALED_S))
    [(_, values)] = replica_rows(uri, registry.version_info(uri, tid, v1).run_id)["eu-1"].items()
    assert values == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12, "accepted/0": 7,
                      "accepted/1": 4, "accepted/2": 1, "requests": 9, "capture_backlog": 321, "last_seal": SEALED_S}
    assert replica_state(lambda: 2, lambda: None)() == {"requests": 2.0}  # no backlog known, no seal
    with pytest.raises(ValueError, match="requests, capture_backlog, last_seal"):
        registry.log_replica_counters(uri, tid, v1, "eu-1", SpecDecodeCounters(1, 3, 1, ()), state={"reqs": 1})


def _replica_labels(text: str) -> set:
    """The replica_id label of every sample of tidespec's own series on a /metrics page."""
    return {s.labels.get("replica_id") for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("tidespec:")}


def test_every_series_of_an_embedded_server_carries_its_replica_id(tiny_target, tmp_path):
    from tidespec.config import EngineParams, ServeParams
    from tidespec.engine.speculative import Engine
    from tidespec.serve.server import build_app
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    with TestClient(build_app(eng, None, ServeParams(max_tokens=8, replica_id="eu-west-1a"))) as c:
        r = c.post("/v1/completions", json={"model": "tidespec", "prompt": [5, 17, 33], "max_tokens": 4})
        assert r.status_code == 200, r.text
        text = c.get("/metrics").text
        assert c.app.state.metrics.requests_served() == 1
    reason = r.json()["choices"][0]["finish_reason"]
    assert f'tidespec:request_success_total{{finished_reason="{reason}",replica_id="eu-west-1a"}} 1.0' in text
    assert 'tidespec:spec_decode_num_drafts_total{replica_id="eu-west-1a"}' in text
    assert _replica_labels(text) == {"eu-west-1a"}
    with TestClient(build_app(eng, None, ServeParams(max_tokens=8))) as c:  # no replica id: no label
        assert _replica_labels(c.get("/metrics").text) == {None}


def test_a_front_door_labels_its_own_series_and_leaves_the_backends():
    """The front door's own series carry the replica id; the backend's (vLLM's, SGLang's) are as it wrote them."""
    import httpx

    from tidespec.serve.frontdoor import build_frontdoor
    backend = "tidespec:spec_decode_num_drafts_total 5.0\nvllm:spec_decode_num_drafts_total 5.0\n"

    def answer(request):
        if request.url.path == "/metrics":
            return httpx.Response(200, text=backend)
        return httpx.Response(200, json={"id": "x", "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    fd = build_frontdoor("http://backend", replica_id="gpu-7")
    fd.state.proxy.client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    with TestClient(fd) as c:
        assert c.post("/v1/completions", json={"prompt": "hi", "store": False}).status_code == 200
        text = c.get("/metrics").text
    assert 'tidespec:frontdoor_requests_total{replica_id="gpu-7",route="/v1/completions",status="200"} 1.0' in text
    assert text.endswith(backend)  # the backend's page unchanged after the front door's own
    assert fd.state.proxy.metrics.requests_served() == 1
