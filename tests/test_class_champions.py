"""Champions per workload class in the MLflow registry (alias champion-<class>), deployed beside the
generalist, installed and dropped by a running server's class watcher, rolled back per class."""
import uuid
from dataclasses import replace

import pytest

from conftest import random_draft
from tidespec.adapters import registry
from tidespec.config import EngineParams
from tidespec.engine.speculative import Engine
from tidespec.models.eagle3 import save_checkpoint
from tidespec.models.runner import DraftRunner
from tidespec.serve.admin import ClassChampionWatcher, DraftInstaller
from tidespec.serve.metrics import ServeMetrics
from tidespec.steps.cycle import step_deploy
from tidespec.workspace import Workspace


def _draft(target, seed):
    d = random_draft(target, 64, seed=seed)
    d.config = replace(d.config, target_id="")  # registered under a target id of this test's own
    return d


def _log(uri, tid, target, tmp_path, seed, tau, workload=""):
    ck = save_checkpoint(_draft(target, seed), tmp_path / f"ck{seed}")
    tags = {"lossless": "True"} | ({"workload": workload} if workload else {})
    return registry.log_candidate(uri, tid, ck, {"k": 3}, {"acceptance_length": tau}, tags)[1]


def test_a_class_champion_is_gated_against_what_serves_the_class_deployed_served_and_rolled_back(
        tmp_path, tiny_target, mlflow_server):
    uri, tid = mlflow_server, uuid.uuid4().hex * 2  # a registered model of its own
    gen = _log(uri, tid, tiny_target, tmp_path, 0, 1.5)
    registry.promote(uri, tid, gen, "generalist")
    code = _log(uri, tid, tiny_target, tmp_path, 1, 2.0, "code")
    d = registry.promote_if_better(uri, tid, code, 2.0, 1.5, 0.02, True, evaluated_champion=gen, workload="code")
    assert d.promoted and d.reason.startswith("class 'code': τ 2.0000 >= 1.5300 = champion v" + gen)
    assert registry.champion(uri, tid).version == gen  # the generalist's alias did not move
    assert registry.class_champions(uri, tid) == {"code": code}
    worse = _log(uri, tid, tiny_target, tmp_path, 2, 2.01, "code")
    d = registry.promote_if_better(uri, tid, worse, 2.01, 2.0, 0.02, True, evaluated_champion=code, workload="code")
    assert not d.promoted and "< 2.0400" in d.reason and d.previous_champion == code
    with pytest.raises(registry.RegistryError, match="lower-case letters"):
        registry.promote(uri, tid, code, "x", workload="Code Review")

    ws = Workspace(tmp_path / "ws")
    dep = step_deploy(ws, uri, tid)
    assert dep["version"] == gen and dep["classes"] == {"code": code}
    assert (ws.class_champions / "code" / "draft" / "model.safetensors").exists()
    assert step_deploy(ws, uri, tid).get("classes") is None  # already deployed: nothing to do

    eng = Engine(tiny_target, DraftRunner(_draft(tiny_target, 0)), EngineParams(adaptive=False),
                 draft_version=gen)
    metrics = ServeMetrics(3)
    watcher = ClassChampionWatcher(ws.class_champions, 3600, eng, DraftInstaller(eng, metrics.set_drafts))
    try:
        assert watcher.check() == {"code": code} and eng.draft_versions == {"": gen, "code": code}
        assert watcher.check() == {}  # nothing changed
        text = metrics.registry.get_sample_value("tidespec:class_draft_info", {"workload": "code", "version": code})
        assert text == 1.0
        d = registry.rollback(uri, tid, "live acceptance fell", workload="code")  # its first: to the generalist
        assert d.previous_champion == code and registry.class_champions(uri, tid) == {}
        assert registry.decisions(uri, tid, code)[-1].endswith("class 'code': rolled back to the generalist: "
                                                                "live acceptance fell")
        assert step_deploy(ws, uri, tid)["classes"] == {"code": None}
        assert watcher.check() == {"code": None} and eng.draft_versions == {"": gen}
        assert metrics.registry.get_sample_value("tidespec:class_draft_info",
                                                 {"workload": "code", "version": code}) is None
    finally:
        watcher.close()


def test_the_generalist_is_held_to_forgetting_on_the_classes_it_serves_and_a_class_draft_on_its_own(monkeypatch):
    """A class with a champion of its own is not the generalist's to forget; unclassified traffic always
    is; a class draft answers for its class alone; classes without a champion measured are left out."""
    from tidespec.steps import register

    def champion(uri, tid, w=""):  # as the registry: a label that is no class name has no alias
        if w and not registry.CLASS_NAME.match(w):
            raise registry.RegistryError(f"not a class name: {w!r}")
        return object() if w == "code" else None
    monkeypatch.setattr(register.registry, "champion", champion)
    rep = {"retained": {"code": {"forgetting": 0.3}, "chat": {"forgetting": 0.04}, "": {"forgetting": 0.01},
                        "math": {"forgetting": None}, "My App": {"forgetting": 0.2}}}
    assert register._served_forgetting("uri", "tid", rep, "") == {"chat": 0.04, "": 0.01, "My App": 0.2}
    assert register._served_forgetting("uri", "tid", rep, "code") == {"code": 0.3}
    assert register._served_forgetting("uri", "tid", {}, "") == {}
    monkeypatch.setattr(register.registry, "champion", None)  # not gated: no registry call at all
    assert register._served_forgetting("uri", "tid", rep, "", gated=False) == {}
