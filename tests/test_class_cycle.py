"""The cycle's class drafts (steps.classes): a class's candidate trains on its class plus a small share of
the others, warm-starts from the generalist, is gated on its class's holdout against the generalist,
registers with tag workload, deploys under data/drafts/classes and serves its class."""
import json

from conftest import make_tiny_target, make_tiny_workspace
from tidespec.config import EngineParams


def test_a_class_draft_is_trained_gated_against_the_generalist_registered_and_served(tmp_path, mlflow_server,
                                                                                        monkeypatch):
    from tidespec.adapters import registry
    from tidespec.cli.serve import _install_class_drafts
    from tidespec.engine.speculative import Engine
    from tidespec.models.load import runner_for
    from tidespec.steps import classes, cycle, evaluate, register
    (tmp_path / "ws").mkdir()  # 32 requests alternating code / chat over a 9-token prompt alphabet (learnable)
    ws, params, target = make_tiny_workspace(tmp_path / "ws", make_tiny_target(tmp_path / "target", seed=7),
                                             n_requests=32, max_token=12, workloads=("code", "chat"))
    tid, uri = target.target_id, mlflow_server
    params = params.model_copy(update={  # sizes for speed: the gate's verdict is not what is tested here
        "train": params.train.model_copy(update={"class_drafts": ["code", "math", "chat"], "epochs": 1}),
        "evaluate": params.evaluate.model_copy(update={"max_new_tokens": 8, "min_relative_gain": 0.5}),
        "curate": params.curate.model_copy(update={"class_replay_fraction": 0.2})})
    cycle.step_curate(ws, params, tid)
    tm = cycle.train_candidate(ws, params, ws.curated, None, ws.candidate)
    rep = evaluate.step_evaluate(ws, params, ws.candidate, None, ws.eval_prompts, ws.eval_report)
    gen = register.step_register(params, tid, ws.candidate, rep, tm, uri, cycle.lineage(ws.curated))
    assert gen["promoted"]
    cycle.step_deploy(ws, uri, tid)

    real = classes.class_cycle
    monkeypatch.setattr(classes, "class_cycle", lambda ws_, p, t, workload, *a, **k: (
        (_ for _ in ()).throw(RuntimeError("chat trainer died")) if workload == "chat"
        else real(ws_, p, t, workload, *a, **k)))
    res = classes.class_cycles(ws, params, tid, uri)
    assert res["chat"] == {"error": "RuntimeError: chat trainer died"}  # reported; code went on
    assert res["math"]["skipped"].startswith("no holdout request of class 'math'")
    sub = json.loads((ws.work / "classes" / "code" / "curated.json").read_text())
    own = [e for e in sub["train"] if not e.get("replay")]
    other = [e for e in sub["train"] if e.get("replay")]
    assert {e["workload"] for e in own} == {"code"} and {e["workload"] for e in other} == {"chat"}
    n_own = sum(e["num_tokens"] for e in own)
    assert abs(sum(e["num_tokens"] for e in other) - n_own * 0.2 / 0.8) <= max(e["num_tokens"] for e in other)
    held = [json.loads(x) for x in (ws.work / "classes" / "code" / "holdout.jsonl").read_text().splitlines()]
    assert held and {h["workload"] for h in held} == {"code"}
    code = res["code"]
    assert code["evaluate"]["lossless"] and code["evaluate"]["champion_version"] == gen["version"]  # vs the generalist
    dec = code["register"]
    assert dec["reason"].startswith("class 'code': τ ") and f"champion v{gen['version']} τ" in dec["reason"]
    assert dec["reason"].endswith("× (1 + 0)")  # a class's first draft: evaluate.class_first_gain, not the 0.5
    tags = registry.version_tags(uri, tid, dec["version"])
    assert tags["workload"] == "code" and registry.champion(uri, tid).version == gen["version"]
    if not dec["promoted"]:  # the gate is honest: promote it by hand to exercise serving
        registry.promote(uri, tid, dec["version"], "test", workload="code")
    assert cycle.step_deploy(ws, uri, tid)["classes"] == {"code": dec["version"]}
    eng = Engine(target, runner_for(ws.champion, target), EngineParams(num_draft_tokens=3, max_seq_len=256),
                 draft_version=gen["version"])
    _install_class_drafts(eng, ws.class_champions)  # what `tidespec serve` does at start
    assert eng.draft_versions == {"": gen["version"], "code": dec["version"]}
    # the generalist's very weights registered for a class (a class with all the traffic trains the same
    # draft): a version of its own, gated per class, never the generalist's registration found again
    same = register.step_register(params, tid, ws.candidate, code["evaluate"], tm, uri, cycle.lineage(ws.curated),
                                  workload="code")
    assert same["version"] not in (gen["version"], dec["version"]) and same["reason"].startswith("class 'code':")
    again = register.step_register(params, tid, ws.candidate, rep, tm, uri, cycle.lineage(ws.curated))
    assert again["version"] == gen["version"]  # the generalist's retry still finds its own


def test_stage_classes_without_class_drafts_writes_none(tmp_path, tiny_target_dir):
    """`tidespec stage classes` (dvc.yaml's last stage) with `train.class_drafts` empty: classes.json is {}
    and the generalist is named as serving every class; before curate, an error naming that stage."""
    from typer.testing import CliRunner

    from tidespec.cli import app
    from tidespec.steps.cycle import step_curate
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir, n_requests=6)
    args = ["stage", "classes", "--root", str(tmp_path), "--params", str(tmp_path / "params.yaml")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and "run the curate stage first" in str(r.exception), r.output
    step_curate(ws, params, target.target_id)
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert json.loads((ws.work / "classes.json").read_text()) == {}
    assert "the generalist serves every class" in r.output


def test_auto_gives_a_draft_to_each_class_with_enough_traffic_of_its_own(tmp_path, tiny_target_dir):
    """`train.class_drafts: auto`: the classes whose own requests in the curated training set (replay
    entries and unclassified `default` ones aside) reach `train.min_train_tokens`, sorted, once the
    service has served two kinds of traffic (classes, or unclassified requests, in the set or in the
    replay buffer); none while it has only served one; a list is taken as written; another string is
    refused."""
    import pytest

    from conftest import shipped_params
    from tidespec.config import Params
    from tidespec.steps.classes import classes_to_train

    raw = shipped_params(tiny_target_dir)
    raw["train"] |= {"class_drafts": "auto", "min_train_tokens": 100}
    p = Params.model_validate(raw)

    def picked(entries, buffer=None):
        (tmp_path / "c.json").write_text(json.dumps({"replay_buffer": buffer or {}, "train": [
            {"workload": e[0], "num_tokens": e[1]} | ({"replay": True} if e[2:] else {}) for e in entries]}))
        return classes_to_train(p, tmp_path / "c.json")
    assert picked([("math", 60), ("math", 40), ("code", 100), ("chat", 99), ("default", 500)]) == ["code", "math"]
    assert picked([("code", 100), ("chat", 60), ("chat", 60, True)]) == ["code"]  # replayed tokens are not its traffic
    assert picked([("code", 5000), ("math", 10, True)]) == ["code"]  # traffic moved to code: code gets its own
    assert picked([("code", 5000), ("code", 900, True), ("X!", 9, True)]) == []
    assert picked([("code", 5000), ("default", 900, True)]) == ["code"]  # unclassified traffic served before
    assert picked([("code", 5000), ("", 90)]) == ["code"]  # and now: no label is `default`
    assert picked([("code", 5000), ("chat", 10)]) == ["code"]  # chat was served, if too little to train on
    assert picked([("code", 5000), ("Chat", 900)]) == []  # not a class name: not a class served
    assert picked([("code", 5000)], buffer={"chat": {"records": 3, "tokens": 900}}) == ["code"]  # none drawn
    assert picked([("code", 5000)], buffer={"code": {"records": 3, "tokens": 900}, "Chat": {}}) == []
    assert picked([("code", 100), ("chat", 99), ("structured", 100)]) == ["code", "structured"]
    assert picked([("code", 5000)]) == []
    assert picked([("code", 100), ("../x", 900), ("Chat", 900), ("math", 100)]) == ["code", "math"]  # not class names
    many = [(f"c{i:02d}", 100 + i) for i in range(10)]  # the 8 largest
    assert picked(many) == [f"c{i:02d}" for i in range(2, 10)]
    raw["train"]["class_drafts"] = ["structured", "code"]
    assert classes_to_train(Params.model_validate(raw), tmp_path / "c.json") == ["structured", "code"]
    for bad in ("all", ["code", "code"]):
        raw["train"]["class_drafts"] = bad
        with pytest.raises(ValueError, match="class_drafts"):
            Params.model_validate(raw)
