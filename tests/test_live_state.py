"""What a serving engine serves, as the live reporter reads it from its own thread: one
`ServedDraft`, replaced whole at a swap, so a version is never credited with another's drafts."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tidespec.backends.base import ServedDraft, scrape_served
from tidespec.backends.vllm import deployment as deploy_vllm
from tidespec.engine.spec_counters import SpecDecodeCounters
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
    """While the weights change and until the new base is read, the state a reporter thread reads
    has no url (no live figures); then the new version appears with its base, never with the old
    (None) base, which logged the server's whole history as the new version's τ under a larger
    MLflow step. A load that fails restores the served state."""
    served_v1 = ServedDraft("1", URL, _draft(tmp_path / "v1", "1"))
    dep = deploy_vllm.VLLMDeployment(SimpleNamespace(), tmp_path / "state")
    dep.server, dep.served = SimpleNamespace(url=URL, cfg=SimpleNamespace(draft_swap_root=str(tmp_path))), served_v1
    total = {"now": _counters(100, 20)}  # v1's drafts: τ 1.2
    seen, fail = [], []

    def scrape(url):
        if not seen or seen[-1] != "done":  # inside a swap: what a report on the reporter thread reads now
            seen.append((dep.served, scrape_served(dep)[1] if dep.served.url is None else "readable"))
        return total["now"]

    def load(url, d):
        seen.append((dep.served, scrape_served(dep)[1] if dep.served.url is None else "readable"))
        if fail and d.name.endswith("v3"):
            raise deploy_vllm.VLLMError("worker died")
        return {"seconds": 0.01, "reset_prefix_cache": True}

    monkeypatch.setattr(deploy_vllm, "scrape", scrape)
    monkeypatch.setattr(deploy_vllm, "load_draft_in_place", load)
    res = dep.install(_draft(tmp_path / "v2", "2"))
    assert res["mode"] == "in_place" and res["draft_version"] == "2" and dep.url == URL
    assert len(seen) == 3 and all(s.url is None and s.version == "1" and c is None for s, c in seen), seen
    seen.append("done")
    assert dep.served.version == "2" and dep.served.counters_base == _counters(100, 20) and dep.served.url == URL
    total["now"] = _counters(150, 70)  # 50 drafts on v2, 50 accepted: τ 2.0
    served, now = scrape_served(dep)
    assert served.version == "2" and served.own(now) == _counters(50, 50)
    assert served.own(now).acceptance_length == 2.0
    fail.append(True)
    v2 = dep.served
    with pytest.raises(deploy_vllm.VLLMError, match="worker died; the served draft 2 was loaded again"):
        dep.install(_draft(tmp_path / "v3", "3"))
    assert dep.served is v2  # the served state back, readable


def test_a_swap_during_the_scrape_yields_no_counters():
    """Counters read while the state changed belong to no one version: dropped, never mixed; they
    are read from the server the state names."""
    before, after = ServedDraft("1", URL), ServedDraft("2", URL + "0", counters_base=_counters(10, 5))
    dep = SimpleNamespace(served=before)
    urls = []

    def scrape(url):
        urls.append(url)
        dep.served = after  # a swap lands while the scrape is in flight
        return _counters(12, 7)

    dep.scrape = scrape
    assert scrape_served(dep) == (before, None)
    dep.scrape = lambda url: urls.append(url) or _counters(12, 7)
    assert scrape_served(dep) == (after, _counters(12, 7))
    assert urls == [URL, URL + "0"]
    assert after.own(_counters(12, 7)) == _counters(2, 2)
    assert ServedDraft("1", URL).own(_counters(12, 7)) == _counters(12, 7)  # a fresh server: all its own
    assert scrape_served(SimpleNamespace(served=ServedDraft())) == (ServedDraft(), None)  # not started
