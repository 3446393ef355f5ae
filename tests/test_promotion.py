"""Promotion gate end to end on the tiny target (real MLflow server): a deliberately worse candidate
(trained on shuffled targets) is rejected, a candidate that fails the losslessness check is never
promoted (not even by hand), and `tidespec promote` / `tidespec rollback` move the champion and
redeploy it locally."""
import json

import pytest
import torch

from conftest import make_tiny_target, make_tiny_workspace
from tidespec.config import CaptureParams

pytestmark = pytest.mark.services


def _shuffled_workspace(root, ws, params, target):
    """A second workspace whose only snapshot holds ws's records with their token ids relabelled
    by a random permutation of the vocabulary: the hidden states no longer predict the labels
    (a deliberately bad training set: shuffled targets)."""
    from tidespec.capture import curate
    from tidespec.capture.snapshots import list_snapshots, seal
    from tidespec.capture.writer import CaptureWriter
    from tidespec.workspace import Workspace

    ws2 = Workspace(root)
    root.mkdir()
    (root / "params.yaml").write_text((ws.root / "params.yaml").read_text())
    idx = json.loads(ws.curated.read_text())
    recs = curate.load_records(idx["train"] + idx["val"], ws.curated.parent)
    w = CaptureWriter(ws2.capture_dir(target.target_id), target.target_id, CaptureParams(shard_max_records=4))
    sigma = torch.randperm(target.cfg.vocab_size, generator=torch.Generator().manual_seed(7)).int()
    for i, r in enumerate(recs):
        r = dict(r)
        r["input_ids"] = sigma[r["input_ids"].long()]
        w.submit(r, request_id=f"shuf{i}", workload="code", acceptance_length=1.0, prompt_id=f"s{i}")
    w.close()
    seal(ws2.capture_dir(target.target_id), ws2.snapshots, target.target_id)
    assert len(list_snapshots(ws2.snapshots, target.target_id)) == 1
    return ws2


def _force_accept_all(monkeypatch):
    """A verifier bug on engines named "candidate": every draft token is accepted (outputs are no
    longer the target's). Evaluation must catch it."""
    from tidespec.engine import speculative

    orig = speculative.after_verify

    def buggy(sl, out, *args):
        if sl.seq.version == "candidate" and sl.k:
            for i, t in enumerate(sl.drafts):
                out.logits[i, t] = float("inf")
        return orig(sl, out, *args)
    monkeypatch.setattr(speculative, "after_verify", buggy)


def test_gate_worse_rejected_lossy_never_promoted_rollback(tmp_path, mlflow_server, monkeypatch):
    from typer.testing import CliRunner

    from tidespec.adapters import registry
    from tidespec.cli import app
    from tidespec.steps import cycle, evaluate, register
    from tidespec.workspace import served_version

    (tmp_path / "main").mkdir()
    # 48 requests over a 9-token prompt alphabet: the tiny target's continuations are learnable. Its own
    # tiny target (another target id): the session's shared one has champions from other tests
    ws, params, target = make_tiny_workspace(tmp_path / "main", make_tiny_target(tmp_path / "target", seed=5),
                                             n_requests=48, max_token=12)
    tid = target.target_id
    params = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"min_relative_gain": 0.02})})

    # cycle 1: a properly trained draft becomes champion
    cycle.step_curate(ws, params, tid)
    tm = cycle.train_candidate(ws, params, ws.curated, None, ws.candidate)
    rep = evaluate.step_evaluate(ws, params, ws.candidate, None, ws.eval_prompts, ws.eval_report)
    d1 = register.step_register(params, tid, ws.candidate, rep, tm, mlflow_server, cycle.lineage(ws.curated, "rev-1"))
    assert d1["promoted"] and rep["lossless"]
    # a retried register (e.g. after a connection reset) finds its version: no second registration
    again = register.step_register(
        params, tid, ws.candidate, rep, tm, mlflow_server, cycle.lineage(ws.curated, "rev-1")
    )
    assert again["version"] == d1["version"] and again["promoted"]
    assert [h["version"] for h in registry.cycle_history(mlflow_server, tid)] == [d1["version"]]
    cycle.step_deploy(ws, mlflow_server, tid)
    # the global suffix tree's corpus (the curated window's outputs) is registered and deployed with the draft
    from tidespec.assets import sha256_file
    from tidespec.engine.suffix_tree import CORPUS_FILE, load_corpus
    corpus1 = sha256_file(ws.champion / CORPUS_FILE)
    assert tm["suffix_corpus/tokens"] == sum(len(x) for x in load_corpus(ws.champion / CORPUS_FILE)) > 0
    v1 = registry.champion(mlflow_server, tid)
    assert v1.tags["suffix_corpus_sha256"] == corpus1
    tau1 = rep["candidate"]["acceptance_length"]
    assert tau1 > 1.5  # the tiny target is learnable: the comparison below means something

    # cycle 2: trained (from scratch) on shuffled targets → worse on the same holdout → rejected
    ws2 = _shuffled_workspace(tmp_path / "shuf", ws, params, target)
    cycle.step_curate(ws2, params, tid)
    bad = tmp_path / "bad-candidate"
    tm2 = cycle.train_candidate(ws2, params, ws2.curated, None, bad)
    rep2 = evaluate.step_evaluate(ws, params, bad, ws.champion, ws.eval_prompts, tmp_path / "eval2.json")
    assert rep2["lossless"] and rep2["champion"]["acceptance_length"] == pytest.approx(tau1)
    assert rep2["candidate"]["acceptance_length"] < tau1
    d2 = register.step_register(params, tid, bad, rep2, tm2, mlflow_server, cycle.lineage(ws2.curated, "rev-shuffled"))
    assert not d2["promoted"] and d2["previous_champion"] == d1["version"]
    assert "<" in d2["reason"] and f"champion v{d1['version']}" in d2["reason"]
    assert registry.champion(mlflow_server, tid).version == d1["version"]

    # cycle 3: the trained draft again, but the verifier accepts everything → outputs differ → never promoted
    with monkeypatch.context() as m:
        _force_accept_all(m)
        rep3 = evaluate.step_evaluate(ws, params, ws.candidate, ws.champion, ws.eval_prompts, tmp_path / "eval3.json")
    assert not rep3["lossless"] and rep3["candidate"]["mismatches"] > 0
    assert rep3["candidate"]["acceptance_length"] > tau1  # its τ looks great: the gate must not care
    d3 = register.step_register(
        params, tid, ws.candidate, rep3, tm, mlflow_server, cycle.lineage(ws.curated, "rev-lossy")
    )
    assert not d3["promoted"] and "losslessness" in d3["reason"]

    # by hand: the lossy one is refused; the worse one can be forced in, then rolled back
    runner = CliRunner()
    env = {"MLFLOW_TRACKING_URI": mlflow_server}
    common = ["--root", str(ws.root), "--params", str(ws.root / "params.yaml")]
    r = runner.invoke(app, ["promote", d3["version"], "--reason", "try", *common], env=env)
    assert isinstance(r.exception, registry.RegistryError) and "never promoted" in str(r.exception)
    r = runner.invoke(app, ["promote", d2["version"], "--reason", "canary by hand", *common], env=env)
    assert r.exit_code == 0, r.output
    assert (
        registry.champion(mlflow_server, tid).version == d2["version"] and served_version(ws.champion) == d2["version"]
    )
    assert sha256_file(ws.champion / CORPUS_FILE) == sha256_file(bad / CORPUS_FILE) != corpus1  # moved with it
    r = runner.invoke(app, ["promote", d2["version"], "--reason", "again", *common], env=env)
    assert r.exit_code == 0 and "already champion; nothing changed" in r.output  # a no-op, not a new entry
    # `tidespec serve`'s engine and draft-health guard: v1 serves the holdout traffic, then v2 (the champion
    # now) the same traffic; its live first-token acceptance is clearly below v1's, so the guard rolls it back
    # through the registry (an audited decision) and deploys v1 where the champion watcher picks it up
    from tidespec.cli.serve_registry import registry_rollback
    from tidespec.engine.build import install_draft, make_engine
    from tidespec.engine.speculative import Request
    from tidespec.serve.draft_health import EngineSource, HealthReport
    from tidespec.serve.guard import LiveGuard
    from tidespec.serve.metrics import ServeMetrics
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    hold = [json.loads(x) for x in ws.eval_prompts.read_text().splitlines()]
    from tidespec.capture.recent import RecentRecords
    from tidespec.serve.judge import PairedJudge, TeacherForced
    recent = RecentRecords(len(hold))  # both versions scored on the newest served requests
    eng = make_engine(params.engine.fixed(), target, capture=recent)  # the EAGLE3 draft's own a₁
    fetch = lambda v: registry.download_version(mlflow_server, tid, v, tmp_path / "judge")  # noqa: E731
    guard = HealthReport(eng, ServeMetrics(eng.cfg.num_draft_tokens), 0, LiveGuard(
        EngineSource(eng, fetch), TeacherForced(PairedJudge(eng, recent.records, fetch)),
        registry_rollback(params, tid, ws)))
    for draft in (registry.download_version(mlflow_server, tid, d1["version"], tmp_path / "served"), ws.champion):
        install_draft(eng, draft)
        for _ in range(4):  # a round of traffic, then the server's check
            eng.generate_batch([Request(h["input_ids"], 64, workload="code") for h in hold])
            guard.check()
    assert eng.health.against_replay(d1["version"], "code").reference == pytest.approx(
        rep["candidate"]["accepted_per_pos/0"])  # v1's replayed a₁ came with its bundle (tag → version.json)
    below = guard.check()  # the trial's verdict: rolled back
    v1_live = eng.health.live(d1["version"], "code")[0]
    assert any(v.version == d2["version"] and v.reference == v1_live and v.live < v1_live for v in below)
    assert (
        registry.champion(mlflow_server, tid).version == d1["version"] and served_version(ws.champion) == d1["version"]
    )
    decision = registry.decisions(mlflow_server, tid, d2["version"])[-1]
    assert "automatic (draft health): its first" in decision and "clearly below v" in decision
    assert f"teacher-forced on the same recent traffic: v{d1['version']} − v{d2['version']} = +" in decision
    r = runner.invoke(app, ["promote", d2["version"], "--reason", "canary by hand, again", *common], env=env)
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["rollback", "--reason", "canary p99 regressed", *common], env=env)
    assert r.exit_code == 0, r.output
    assert f"champion v{d1['version']} (was v{d2['version']})" in r.output
    assert (
        registry.champion(mlflow_server, tid).version == d1["version"] and served_version(ws.champion) == d1["version"]
    )
    assert sha256_file(ws.champion / CORPUS_FILE) == corpus1  # rolled back with its draft
    # every decision recorded with its reason, on the version and its run
    hist = {h["version"]: h["decision"] for h in registry.cycle_history(mlflow_server, tid)}
    assert hist == {d1["version"]: "restored", d2["version"]: "rolled_back", d3["version"]: "rejected"}
    trail = registry.decisions(mlflow_server, tid, d2["version"])  # the audit trail keeps every decision
    assert [t.split(" ", 1)[1].split(":")[0] for t in trail] == ["rejected", "promoted", "rolled_back", "promoted",
                                                                "rolled_back"]
    assert "canary by hand" in trail[1] and "draft health" in trail[2] and "canary p99 regressed" in trail[4]
    assert "<" in trail[0]
    assert registry.decisions(mlflow_server, tid, d1["version"])[-1].endswith(
        f"restored: rollback from v{d2['version']}: canary p99 regressed")
    from mlflow import MlflowClient
    run = MlflowClient(mlflow_server).get_run(d3["run_id"])
    assert run.data.tags["decision"] == "rejected" and "losslessness" in run.data.tags["decision_reason"]


def test_promote_by_hand_refuses_a_version_never_evaluated(tmp_path, mlflow_server):
    """`tidespec promote VERSION` needs an evaluated version: what the cycle's register step writes
    after evaluate (tag lossless='True' and a finite acceptance_length). A bare registration, or
    one with a τ but no losslessness check, is refused with the fix; an evaluated one goes in."""
    import uuid

    from tidespec.adapters import registry
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    tid = uuid.uuid4().hex * 2  # a target of its own: no champion from other tests
    uri = mlflow_server

    def log(metrics, tags):
        return registry.log_candidate(uri, tid, ck, {"k": 3}, metrics, tags)[1]

    bare = log({}, {})
    tau_only = log({"acceptance_length": 2.5}, {})
    nan_tau = log({"acceptance_length": float("nan")}, {"lossless": "True"})
    lossy = log({"acceptance_length": 3.0}, {"lossless": "False"})
    good = log({"acceptance_length": 2.0}, {"lossless": "True"})
    for v in (bare, tau_only, nan_tau):
        with pytest.raises(registry.RegistryError, match="never evaluated") as e:
            registry.promote(uri, tid, v, "looks fine to me")
        assert "run `tidespec cycle`" in str(e.value) and f"v{v}" in str(e.value)
    assert "has neither" in str(pytest.raises(registry.RegistryError, registry.promote, uri, tid, bare, "x").value)
    with pytest.raises(registry.RegistryError, match="losslessness check"):
        registry.promote(uri, tid, lossy, "x")
    with pytest.raises(registry.RegistryError, match="losslessness check"):  # not even as a bootstrap
        registry.promote(uri, tid, lossy, "x", allow_unevaluated=True)
    assert registry.champion(uri, tid) is None  # nothing moved, nothing recorded
    assert all(registry.decisions(uri, tid, v) == [] for v in (bare, tau_only, nan_tau, lossy))

    d = registry.promote(uri, tid, good, "evaluated, by hand")
    assert d.promoted and d.reason == "manual: evaluated, by hand" and registry.champion(uri, tid).version == good
    # the bootstrap path (demo / bench shift: the first static draft) says so in the audit trail
    d = registry.promote(uri, tid, bare, "bootstrap", allow_unevaluated=True)
    assert d.promoted and d.previous_champion == good and "unevaluated" in d.reason
    assert registry.decisions(uri, tid, bare)[-1].endswith("promoted: manual, unevaluated (bootstrap): bootstrap")


def test_batched_evaluate_replays_the_same_tokens_and_tau(tmp_path, tiny_target_dir, monkeypatch):
    """evaluate.concurrency 4 runs each wave of 4 holdout requests as one engine batch in every arm:
    on CPU (row-consistent fp32 forwards) outputs and τ equal the one-at-a-time replay's exactly,
    lossless holds, and the report says which gate and which concurrency it used."""
    import json

    from conftest import make_tiny_workspace, random_draft
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.steps import cycle, evaluate
    (tmp_path / "ws").mkdir()
    ws, params, target = make_tiny_workspace(tmp_path / "ws", tiny_target_dir, n_requests=16)
    cycle.step_curate(ws, params, target.target_id)
    cand = save_checkpoint(random_draft(target, 64, seed=2), tmp_path / "cand")
    from tidespec.engine.speculative import Engine
    batches, real = [], Engine.generate_batch
    monkeypatch.setattr(Engine, "generate_batch", lambda self, reqs: batches.append(len(reqs)) or real(self, reqs))
    reps = {}
    for c in (1, 4):
        batches.clear()
        p = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"concurrency": c})})
        reps[c] = evaluate.step_evaluate(ws, p, cand, None, ws.eval_prompts, tmp_path / f"eval{c}.json")
        assert (reps[c]["gate"], reps[c]["concurrency"]) == ("replay", c)
        assert json.loads((tmp_path / f"eval{c}.json").read_text())["concurrency"] == c
        assert max(batches) == min(c, reps[c]["num_prompts"])  # the waves really ran as batches of c
    assert reps[1]["num_prompts"] >= 4 and reps[1]["lossless"] and reps[4]["lossless"]
    for arm in ("baseline", "candidate"):
        for m in ("acceptance_length", "new_tokens", "mismatches"):
            assert reps[1][arm][m] == reps[4][arm][m], (arm, m)
    assert reps[1]["candidate"]["num_drafts"] == reps[4]["candidate"]["num_drafts"] > 0


def test_teacher_forced_gate_compares_simulated_tau_and_replays_a_subset(tmp_path, monkeypatch):
    """evaluate.gate teacher_forced: each draft's τ is its simulated τ over the curated holdout's
    records (as `train.holdout` computes it, independently here), per-position acceptance the
    running product of the conditional ones; only `replay_subset` prompts are replayed, and a
    verifier bug there still fails losslessness. replay_subset without that gate is refused."""
    from pydantic import ValidationError

    from conftest import random_draft
    from tidespec.capture import curate
    from tidespec.config import EvaluateParams
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.steps import cycle, evaluate
    from tidespec.train.holdout import holdout_accuracy
    (tmp_path / "ws").mkdir()  # a 9-token prompt alphabet: learnable continuations (as the gate test above)
    ws, params, target = make_tiny_workspace(tmp_path / "ws", make_tiny_target(tmp_path / "target", seed=5),
                                             n_requests=32, max_token=12)
    cycle.step_curate(ws, params, target.target_id)
    cand = tmp_path / "cand"  # trained on the set: it accepts on the holdout; the random champion does not
    cycle.train_candidate(ws, params, ws.curated, None, cand)
    champ = save_checkpoint(random_draft(target, 64, seed=1), tmp_path / "champ")
    p = params.model_copy(update={"evaluate": EvaluateParams(gate="teacher_forced", replay_subset=2,
                                                             max_new_tokens=8)})
    rep = evaluate.step_evaluate(ws, p, cand, champ, ws.eval_prompts, tmp_path / "eval.json")
    idx = json.loads(ws.curated.read_text())
    recs = curate.load_records(idx["holdout"], ws.curated.parent)
    assert (rep["gate"], rep["num_prompts"], rep["holdout_records"]) == ("teacher_forced", 2, len(recs))
    assert rep["lossless"] and rep["candidate"]["new_tokens"] > 0 and "candidate" in rep["speedup"]
    k = p.engine.num_draft_tokens
    for arm, d in (("candidate", cand), ("champion", champ)):
        from tidespec.models.eagle3 import load_checkpoint
        ev = holdout_accuracy(load_checkpoint(d, target.embed.float(), target.target_id).eval(), target, recs, p.train)
        cond = ev.conditional(k)
        assert rep[arm]["acceptance_length"] == ev.simulated_tau(k)
        assert rep[arm]["accepted_per_pos/1"] == pytest.approx(cond[0] * cond[1], rel=1e-12)
    assert rep["candidate"]["acceptance_length"] > 1.0 and rep["candidate"]["accepted_per_pos/1"] > 0
    assert "replay_acceptance_length" in rep["candidate"] and "tokens_per_s" not in rep["champion"]
    _force_accept_all(monkeypatch)
    bad = evaluate.step_evaluate(ws, p, cand, champ, ws.eval_prompts, tmp_path / "eval-bad.json")
    assert not bad["lossless"] and bad["candidate"]["mismatches"] > 0
    with pytest.raises(ValidationError, match="replay_subset"):
        EvaluateParams(replay_subset=3)


def _curated_and_trained(tmp_path, n_requests: int):
    """A tiny workspace curated once (a 9-token prompt alphabet: learnable continuations) and a candidate
    trained on it: (ws, params, target, candidate dir)."""
    from tidespec.steps import cycle
    (tmp_path / "ws").mkdir()
    ws, params, target = make_tiny_workspace(tmp_path / "ws", make_tiny_target(tmp_path / "target", seed=5),
                                             n_requests=n_requests, max_token=12)
    cycle.step_curate(ws, params, target.target_id)
    cycle.train_candidate(ws, params, ws.curated, None, tmp_path / "cand")
    return ws, params, target, tmp_path / "cand"


def test_evaluate_scores_forgetting_on_the_retained_holdout_of_each_class(tmp_path):
    """The curated index's retained holdout (per class, requests never trained on): each class's
    teacher-forced simulated τ for the candidate and the champion on the same records (as
    `train.holdout` computes it, independently here), their forgetting, and the candidate's
    `retained_tau/<class>` metrics; no champion, no forgetting; no retained holdout, nothing."""
    from conftest import random_draft
    from tidespec.capture import curate
    from tidespec.config import EvaluateParams
    from tidespec.models.eagle3 import load_checkpoint, save_checkpoint
    from tidespec.steps import evaluate
    from tidespec.train.holdout import holdout_accuracy
    ws, params, target, cand = _curated_and_trained(tmp_path, 32)
    champ = save_checkpoint(random_draft(target, 64, seed=1), tmp_path / "champ")
    p = params.model_copy(update={"evaluate": EvaluateParams(max_new_tokens=8)})
    idx = json.loads(ws.curated.read_text())
    assert idx["retained_holdout"] == {}  # one snapshot: nothing has left the window
    rep = evaluate.step_evaluate(ws, p, cand, champ, ws.eval_prompts, tmp_path / "eval0.json")
    assert rep["retained"] == {} and not any(m.startswith("retained_") for m in rep["candidate"])
    idx["retained_holdout"] = {"chat": idx["holdout"]}  # an earlier class's requests, by the index's paths
    ws.curated.write_text(json.dumps(idx))
    recs = curate.load_records(idx["holdout"], ws.curated.parent)
    k = p.engine.num_draft_tokens
    tau = {a: holdout_accuracy(load_checkpoint(d, target.embed.float(), target.target_id).eval(), target, recs,
                               p.train).simulated_tau(k) for a, d in (("candidate", cand), ("champion", champ))}
    rep = evaluate.step_evaluate(ws, p, cand, champ, ws.eval_prompts, tmp_path / "eval.json")
    r = rep["retained"]["chat"]
    assert (r["records"], r["candidate"], r["champion"]) == (len(recs), tau["candidate"], tau["champion"])
    assert r["forgetting"] == pytest.approx(1 - tau["candidate"] / tau["champion"], rel=1e-12)
    assert tau["candidate"] > tau["champion"]  # the trained candidate beats the random draft: negative forgetting
    assert rep["candidate"]["retained_tau/chat"] == tau["candidate"]
    assert rep["candidate"]["retained_forgetting/chat"] == r["forgetting"]
    alone = evaluate.step_evaluate(ws, p, cand, None, ws.eval_prompts, tmp_path / "eval1.json")["retained"]["chat"]
    assert alone["champion"] is None and alone["forgetting"] is None and alone["candidate"] == tau["candidate"]


def test_a_retained_holdout_that_cannot_be_scored_leaves_the_gate_going(tmp_path, monkeypatch):
    """Reading or scoring the retained holdout failing (a shard gone, a rehydration server down) is
    reported and named, not a failed cycle."""
    from tidespec.config import EvaluateParams
    from tidespec.steps import evaluate
    ws, params, target, cand = _curated_and_trained(tmp_path, 16)
    idx = json.loads(ws.curated.read_text())
    ws.curated.write_text(json.dumps(idx | {"retained_holdout": {"chat": idx["holdout"]}}))

    def down(*a, **k):
        raise RuntimeError("extraction server exited")
    monkeypatch.setattr(evaluate, "retained_check", down)
    p = params.model_copy(update={"evaluate": EvaluateParams(max_new_tokens=8)})
    rep = evaluate.step_evaluate(ws, p, cand, None, ws.eval_prompts, tmp_path / "eval.json")
    assert rep["retained"] == {} and rep["retained_error"] == "retained holdout not scored: extraction server exited"
    assert rep["lossless"] and rep["candidate"]["acceptance_length"] > 0
