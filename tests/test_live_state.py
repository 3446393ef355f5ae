"""What a serving engine serves, as the live reporter reads it from its own thread: one
`ServedDraft`, replaced whole at a swap, so a version is never credited with another's drafts."""
from __future__ import annotations

import json
from types import SimpleNamespace

from tidespec.adapters.spec_counters import SpecDecodeCounters
from tidespec.steps.deploy import vllm as deploy_vllm
from tidespec.steps.deploy.live import ServedDraft, scrape_served
from tidespec.workspace import write_version

URL = "http://127.0.0.1:9"


def _draft(path, version: str):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (path / "model.safetensors").write_bytes(b"weights")
    write_version(path, version, run_id="r")
    return path


def _counters(drafts: int, accepted: int) -> SpecDecodeCounters:
    return SpecDecodeCounters(drafts, 3 * drafts, accepted, ())


def test_an_in_place_swap_publishes_the_version_with_its_counters_base(tmp_path, monkeypatch):
    """The reporter thread may read between the load and the base's scrape: it must see the old
    version then (its drafts up to now), never the new version with the old (None) base, which
    logged the server's whole history as the new version's τ under a larger MLflow step."""
    served_v1 = ServedDraft("1", URL, _draft(tmp_path / "v1", "1"))
    dep = deploy_vllm.VLLMDeployment(SimpleNamespace(), tmp_path / "state")
    dep.server, dep.served = SimpleNamespace(url=URL, cfg=SimpleNamespace(draft_swap_root=str(tmp_path))), served_v1
    total = {"now": _counters(100, 20)}  # v1's drafts: τ 1.2
    seen = []

    def scrape(url):
        seen.append(dep.served)  # what a report on the reporter thread would read at this instant
        return total["now"]

    monkeypatch.setattr(deploy_vllm, "scrape", scrape)
    monkeypatch.setattr(deploy_vllm, "load_draft_in_place",
                        lambda url, d: {"seconds": 0.01, "reset_prefix_cache": True})
    res = dep.install(_draft(tmp_path / "v2", "2"))
    assert res["mode"] == "in_place" and res["draft_version"] == "2"
    assert seen == [served_v1]  # during the swap the state read is v1's, whole
    assert dep.served.version == "2" and dep.served.counters_base == _counters(100, 20)
    total["now"] = _counters(150, 70)  # 50 drafts on v2, 50 accepted: τ 2.0
    served, now = scrape_served(dep)
    assert served.version == "2" and served.own(now) == _counters(50, 50)
    assert served.own(now).acceptance_length == 2.0


def test_a_swap_during_the_scrape_yields_no_counters():
    """Counters read while the state changed belong to no one version: dropped, never mixed."""
    before, after = ServedDraft("1", URL), ServedDraft("2", URL, counters_base=_counters(10, 5))
    dep = SimpleNamespace(served=before)

    def scrape():
        dep.served = after  # a swap lands while the scrape is in flight
        return _counters(12, 7)

    dep.scrape = scrape
    assert scrape_served(dep) == (before, None)
    dep.scrape = lambda: _counters(12, 7)
    assert scrape_served(dep) == (after, _counters(12, 7))
    assert after.own(_counters(12, 7)) == _counters(2, 2)
    assert ServedDraft("1", URL).own(_counters(12, 7)) == _counters(12, 7)  # a fresh server: all its own
    assert scrape_served(SimpleNamespace(served=ServedDraft())) == (ServedDraft(), None)  # not started
