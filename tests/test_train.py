"""Trainer robustness: resume after a kill, NaN/Inf records, too-small sets, replay buffer, other targets."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import make_tiny_workspace, tiny_records
from tidespec.capture.curate import curate
from tidespec.capture.snapshots import seal
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CaptureParams, CurateParams, DraftParams, EngineParams, TrainParams
from tidespec.models.eagle3 import load_checkpoint
from tidespec.train.resume import state_dir
from tidespec.train.trainer import train_draft

_records = tiny_records


class Killed(Exception):
    pass


def test_resume_after_kill_matches_uninterrupted_run(tiny_target, tmp_path):
    recs = _records(tiny_target, n=8)
    dp = DraftParams(draft_vocab_size=64)
    tp = TrainParams(epochs=3, ttt_steps=2, batch_tokens=80, checkpoint_every=2, lr=3e-3)
    full = train_draft(recs[:6], recs[6:], tiny_target, dp, tp, tmp_path / "full")
    assert full["resumed_from_step"] == 0 and not state_dir(tmp_path / "full").exists()

    def kill_at_5(step, total, loss):
        if step == 5:
            raise Killed()
    with pytest.raises(Killed):
        train_draft(recs[:6], recs[6:], tiny_target, dp, tp, tmp_path / "cut", progress=kill_at_5)
    assert (state_dir(tmp_path / "cut") / "state.pt").exists() and not (tmp_path / "cut").exists()
    again = train_draft(recs[:6], recs[6:], tiny_target, dp, tp, tmp_path / "cut")
    assert again["resumed_from_step"] == 4  # the last checkpoint before the kill
    assert again["train/loss"] == full["train/loss"]
    a = load_checkpoint(tmp_path / "full").state_dict()
    b = load_checkpoint(tmp_path / "cut").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_changed_params_do_not_resume_a_stale_state(tiny_target, tmp_path):
    recs = _records(tiny_target, n=6)
    dp = DraftParams(draft_vocab_size=64)
    tp = TrainParams(epochs=2, ttt_steps=2, batch_tokens=80, checkpoint_every=1)

    def kill(step, total, loss):
        if step == 3:
            raise Killed()
    with pytest.raises(Killed):
        train_draft(recs[:5], recs[5:], tiny_target, dp, tp, tmp_path / "o", progress=kill)
    m = train_draft(recs[:5], recs[5:], tiny_target, dp, tp.model_copy(update={"lr": 5e-4}), tmp_path / "o")
    assert m["resumed_from_step"] == 0


def test_nonfinite_records_are_dropped_and_counted(tiny_target, tmp_path):
    recs = _records(tiny_target, n=5)
    recs[1]["aux_hidden_states"][7, 3] = float("nan")
    recs[2]["hidden_states"][0, 0] = float("inf")
    m = train_draft(recs[:4], recs[4:], tiny_target, DraftParams(draft_vocab_size=64),
                    TrainParams(epochs=1, ttt_steps=2, batch_tokens=256), tmp_path / "d")
    assert m["dropped/non_finite"] == 2 and m["train_examples"] == 2
    sd = load_checkpoint(tmp_path / "d").state_dict()
    assert all(torch.isfinite(v.float()).all() for v in sd.values())
    with pytest.raises(ValueError, match="every training record was dropped"):
        train_draft(recs[1:3], [], tiny_target, DraftParams(draft_vocab_size=64), TrainParams(epochs=1),
                    tmp_path / "e")


def test_draft_vocab_larger_than_distinct_tokens(tiny_target, tmp_path):
    recs = _records(tiny_target, n=3, T=20)
    distinct = len({t for r in recs for t in r["input_ids"].tolist()})
    assert distinct < 200
    m = train_draft(recs[:2], recs[2:], tiny_target, DraftParams(draft_vocab_size=300),
                    TrainParams(epochs=1, ttt_steps=2), tmp_path / "v")
    d = load_checkpoint(tmp_path / "v")
    used = (torch.arange(300) + d.d2t).tolist()
    assert len(set(used)) == 300 and max(used) < 320 and m["train_examples"] == 2


def _rec(T, seed, H=8):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 100, (T,), generator=g).int(),
            "loss_mask": torch.tensor([0] * 4 + [1] * (T - 4), dtype=torch.uint8),
            "aux_hidden_states": torch.randn(T, 3 * H, generator=g).bfloat16(),
            "hidden_states": torch.randn(T, H, generator=g).bfloat16()}


def _snapshot(root, tid, wl, seeds, record_tid=None):
    w = CaptureWriter(root / "cap", record_tid or tid, CaptureParams(shard_max_records=8))
    for s in seeds:
        w.submit(_rec(12, s), request_id=f"{wl}{s}", workload=wl, acceptance_length=1.0)
    w.close()
    return seal(root / "cap", root / "snaps", record_tid or tid)


def test_replay_buffer_mixes_older_snapshots(tmp_path):
    _snapshot(tmp_path, "tid", "code", range(0, 20))
    time.sleep(0.01)
    _snapshot(tmp_path, "tid", "chat", range(100, 130))
    p = CurateParams(window=1, val_fraction=0.2, replay_fraction=0.25)
    r = curate(tmp_path / "snaps", "tid", p, tmp_path / "c.json")
    idx = json.loads((tmp_path / "c.json").read_text())
    fresh = [e for e in idx["train"] if not e.get("replay")]
    replay = [e for e in idx["train"] if e.get("replay")]
    assert {e["workload"] for e in fresh} == {"chat"} and {e["workload"] for e in replay} == {"code"}
    assert r.num_replay == len(replay) == round(len(fresh) * 0.25 / 0.75)
    assert idx["workload_mix"] == {"chat": len(fresh), "code": len(replay)}
    assert all(e["workload"] == "chat" for e in idx["val"])  # holdout stays on the current window
    none = curate(tmp_path / "snaps", "tid", p.model_copy(update={"replay_fraction": 0.0}), tmp_path / "d.json")
    assert none.num_replay == 0


def test_snapshot_of_another_target_is_refused(tmp_path):
    s = _snapshot(tmp_path, "other", "code", range(3))
    dest = tmp_path / "snaps" / "tid" / s.path.name  # misplaced under our target's directory
    dest.parent.mkdir(parents=True)
    os.replace(s.path, dest)
    with pytest.raises(ValueError, match="holds records of target other"):
        curate(tmp_path / "snaps", "tid", CurateParams(), tmp_path / "c.json")


def test_too_small_set_skips_the_cycle(tmp_path, tiny_target_dir):
    from tidespec.steps.cycle import step_curate, train_candidate
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir, n_requests=4, champion=True)
    before = (ws.champion / "model.safetensors").read_bytes()
    step_curate(ws, params, target.target_id)
    p = params.model_copy(update={"train": params.train.model_copy(update={"min_train_tokens": 10_000})})
    res = train_candidate(ws, p, ws.curated, ws.champion, ws.candidate)
    assert "below train.min_train_tokens=10000" in res["skipped"]
    assert not ws.candidate.exists() and (ws.champion / "model.safetensors").read_bytes() == before


def test_stage_train_resumes_after_kill_9(tmp_path, tiny_target_dir):
    """A real SIGKILL mid-training (`tidespec stage train` in a subprocess), then a rerun resumes."""
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir, n_requests=12)
    txt = (tmp_path / "params.yaml").read_text().replace(
        "train: {ttt_steps: 2, epochs: 2,", "train: {checkpoint_every: 1, ttt_steps: 2, epochs: 150,")
    (tmp_path / "params.yaml").write_text(txt)
    from tidespec.config import load_params
    from tidespec.steps.cycle import step_curate
    step_curate(ws, load_params(tmp_path / "params.yaml"), target.target_id)
    cmd = [sys.executable, "-m", "tidespec.cli", "stage", "train", "--root", str(tmp_path),
           "--params", str(tmp_path / "params.yaml")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    state = state_dir(ws.candidate) / "state.pt"
    deadline = time.time() + 120
    while time.time() < deadline and not state.exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists() and not ws.candidate.exists()
    saved = torch.load(state, weights_only=False)["run"]["step"]
    assert saved > 0
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads((ws.candidate / "train_metrics.json").read_text())
    assert m["resumed_from_step"] >= saved and len(m["train/loss"]) == 150
    assert not state.exists()


def test_resume_state_is_keyed_on_contents_not_paths(tiny_target, tmp_path):
    """A replaced warm start at the same path, or changed loss masks, start fresh (breaker findings)."""
    from conftest import random_draft
    from tidespec.models.eagle3 import save_checkpoint
    recs = _records(tiny_target, n=6)
    dp = DraftParams(draft_vocab_size=64)
    tp = TrainParams(epochs=2, ttt_steps=2, batch_tokens=80, checkpoint_every=1)
    save_checkpoint(random_draft(tiny_target, 64, seed=1), tmp_path / "champ")

    def kill(step, total, loss):
        if step == 3:
            raise Killed()
    with pytest.raises(Killed):
        train_draft(recs[:5], recs[5:], tiny_target, dp, tp, tmp_path / "o", init=tmp_path / "champ", progress=kill)
    save_checkpoint(random_draft(tiny_target, 64, seed=2), tmp_path / "champ")  # rollback/promote: same path
    m = train_draft(recs[:5], recs[5:], tiny_target, dp, tp, tmp_path / "o", init=tmp_path / "champ")
    assert m["resumed_from_step"] == 0
    with pytest.raises(Killed):
        train_draft(recs[:5], recs[5:], tiny_target, dp, tp, tmp_path / "p", progress=kill)
    for r in recs:
        r["loss_mask"][2] = 1 - r["loss_mask"][2]
    m = train_draft(recs[:5], recs[5:], tiny_target, dp, tp, tmp_path / "p")
    assert m["resumed_from_step"] == 0


def test_record_without_learnable_positions_is_dropped(tiny_target, tmp_path):
    recs = _records(tiny_target, n=4, T=60)
    recs[0]["loss_mask"][:] = 0
    recs[0]["loss_mask"][55:] = 1  # generated tokens all beyond max_seq_len
    tp = TrainParams(epochs=1, ttt_steps=2, max_seq_len=48, batch_tokens=48, loss_on_prompt=False)
    m = train_draft(recs[:3], recs[3:], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "d")
    assert m["dropped/no_valid_positions"] == 1 and m["train_examples"] == 2


def test_nonfinite_hyperparameters_are_refused():
    from pydantic import ValidationError
    for bad in ({"lr": float("inf")}, {"weight_decay": float("nan")}, {"threads": -1}):
        with pytest.raises(ValidationError):
            TrainParams(**bad)
    with pytest.raises(ValidationError):
        DraftParams(intermediate_size=0)


def test_skip_counts_only_new_traffic(tmp_path):
    """Replayed old records do not lift a tiny new window over train.min_train_tokens."""
    from tidespec.config import Params
    from tidespec.train.entry import skip_reason
    _snapshot(tmp_path, "tid", "code", range(0, 40))
    time.sleep(0.01)
    _snapshot(tmp_path, "tid", "chat", range(100, 102))
    cp = CurateParams(window=1, val_fraction=0.0, replay_fraction=0.9)
    curate(tmp_path / "snaps", "tid", cp, tmp_path / "c.json")
    idx = json.loads((tmp_path / "c.json").read_text())
    assert sum(e["num_tokens"] for e in idx["train"]) >= 200 and idx["num_replay"] >= 18
    p = Params(train=TrainParams(min_train_tokens=100))
    assert "24 new tokens in 2 records" in skip_reason(p.train, tmp_path / "c.json")


def test_check_decides_before_loading_the_target(tmp_path, tiny_target_dir, monkeypatch):
    """`train.entry.check` holds the set to the target's id hashed from its files on every route but
    the ranks' (each rank checks it against the target it loads): a set too small to train is
    skipped, another target's refused, and the target is never loaded to decide."""
    from tidespec.config import Params
    from tidespec.models import hf_files
    from tidespec.models import target as tmod
    from tidespec.train.entry import check
    p = Params.model_validate({"target": {"source": str(tiny_target_dir)}, "train": {"min_train_tokens": 100}})
    monkeypatch.setattr(hf_files, "read_target", lambda *a, **k: pytest.fail("check loaded the target"))
    cur = tmp_path / "c.json"
    for tid in (tmod.target_id_for(tiny_target_dir, None), "f" * 64):
        cur.write_text(json.dumps({"target_id": tid, "train": [{"num_tokens": 24}], "val": [], "dropped": {}}))
        assert "24 new tokens in 1 records" in check(p, cur, "torchrun")
        for route in ("here", "sagemaker", "work_pool"):
            if tid == "f" * 64:
                with pytest.raises(ValueError, match="curate snapshots of this target"):
                    check(p, cur, route)
            else:
                assert "24 new tokens in 1 records" in check(p, cur, route)


def test_params_file_typos_are_errors(tmp_path):
    from tidespec.config import load_params
    with pytest.raises(FileNotFoundError, match="drop --params"):
        load_params(tmp_path / "parms.yaml")
    (tmp_path / "p.yaml").write_text("train: [a\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_params(tmp_path / "p.yaml")
    assert load_params(tmp_path / "params.yaml").train.ttt_steps == 4  # the default name may be absent
    (tmp_path / "k.yaml").write_text("engin: {}\nengine: {num_draft_token: 3}\nserve: {watch_champion: 2}\n"
                                     "evaluate: {max_new_tokens: 8}\nbogus: 1\n")
    with pytest.raises(ValueError) as e:  # a misspelt key names the field it most likely meant, in its section
        load_params(tmp_path / "k.yaml")
    assert str(e.value) == (f"{tmp_path / 'k.yaml'}: invalid params: "
                            "engine.num_draft_token: Extra inputs are not permitted "
                            "(did you mean 'num_draft_tokens'?); "
                            "serve.watch_champion: Extra inputs are not permitted (did you mean 'watch_champion_s'?); "
                            "engin: Extra inputs are not permitted (did you mean 'engine'?); "
                            "bogus: Extra inputs are not permitted")
    (tmp_path / "m.yaml").write_text("deploy: {sagemaker: {role_arn: 'arn:aws:iam::123456789012:role/r', "
                                     "s3_prefix: 's3://b/p', target_model: t, profiles: {gpu: {instanc_type: x}}}}\n")
    with pytest.raises(ValueError, match=r"profiles\.gpu\.instanc_type: .*\(did you mean 'instance_type'\?\)$"):
        load_params(tmp_path / "m.yaml")  # a mapping of sections is entered by its key
    (tmp_path / "d.yaml").write_text("engine.num_draft_tokens: 3\n")
    with pytest.raises(ValueError, match=r"engine\.num_draft_tokens: .*write engine: with the rest nested"):
        load_params(tmp_path / "d.yaml")  # a section written flat


# -- simulated τ: conditional acceptance over the chains greedy speculative decoding runs ------------
def test_simulated_tau_is_conditional_over_visited_chains_not_the_unconditional_product():
    """A constructed case (k = 2): per chain start, whether draft steps 0 and 1 are right.
    Greedy speculative decoding starts at position 0; a chain with a leading run L emits
    min(L, k) + 1 tokens, so the chains start at 0, 3, 4, 7 with runs 2, 0, 2, 1: τ = 1 + 5/4."""
    from tidespec.engine.stats import simulated_acceptance_length
    from tidespec.train.holdout import HoldoutEval, chain_starts, conditional_acceptance

    right = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0], [1, 1], [0, 0], [0, 0], [1, 0]], dtype=torch.bool)
    uncond = right.float().mean(0).tolist()  # [4/8, 3/8]: step j right whatever steps < j did
    ev = HoldoutEval(uncond, 2, [(list(range(8)), right)])
    assert chain_starts(list(range(8)), [2, 0, 1, 0, 2, 0, 0, 1], 2) == [0, 3, 4, 7]
    assert ev.chains(2) == 4 and ev.conditional(2) == pytest.approx([3 / 4, 2 / 3])
    assert ev.simulated_tau(2) == pytest.approx(2.25)  # = 1 + (2 + 0 + 2 + 1) / 4
    assert ev.simulated_tau(1) == pytest.approx(1.8)  # chains at 0, 2, 4, 6, 7: runs 1, 1, 1, 0, 1
    # the old computation: Π of unconditional per-step accuracies -> 1 + 1/2 + 3/16, wrong
    assert simulated_acceptance_length(uncond) == pytest.approx(1.6875)
    # conditional, but over every position rather than the chains the engine runs -> 1 + 6/8, also not τ
    assert simulated_acceptance_length(conditional_acceptance(right)) == pytest.approx(1.75)
    assert conditional_acceptance(torch.tensor([[0, 1], [0, 1]], dtype=torch.bool)) == [0.0, 0.0]  # none reached 1
    assert HoldoutEval([], 2).simulated_tau(2) is None and HoldoutEval([], 2).conditional() == []


def test_simulated_tau_matches_greedy_engine_replay(tiny_target, tmp_path):
    """Train a draft for one epoch on the tiny target's own greedy outputs, then on held-out greedy
    outputs compare the teacher-forced simulated τ (HoldoutEval) with τ measured by the engine
    replaying the same prompts greedily with speculative decoding at the same k."""
    from tidespec.engine.speculative import Engine, Request
    from tidespec.engine.stats import SpecDecodingStats, simulated_acceptance_length
    from tidespec.models.runner import DraftRunner
    from tidespec.train.holdout import holdout_accuracy

    k, N = 3, 24
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 12, (8,), generator=g).tolist() for _ in range(52)]  # learnable: small alphabet
    cap = Engine(tiny_target, None, EngineParams(num_draft_tokens=k, max_seq_len=256, max_batch=8))
    gens = cap.generate_batch([Request(p, N, speculative=False, capture=True) for p in prompts])
    train, hold = gens[:40], gens[40:]
    tp = TrainParams(epochs=1, ttt_steps=k, batch_tokens=512, max_seq_len=128)  # a few steps: a mediocre draft
    m = train_draft([x.record for x in train], [x.record for x in hold], tiny_target, DraftParams(draft_vocab_size=64),
                    tp, tmp_path / "d")
    draft = load_checkpoint(tmp_path / "d", tiny_target.embed.float(), tiny_target.target_id)
    ev = holdout_accuracy(draft.eval(), tiny_target, [x.record for x in hold], tp)
    assert m["simulated_acceptance_length"] == pytest.approx(ev.simulated_tau(k))
    assert [m[f"val/cond_acc_{j}"] for j in range(k)] == pytest.approx(ev.conditional(k))

    eng = Engine(
        tiny_target,
        DraftRunner(load_checkpoint(tmp_path / "d", tiny_target.embed, tiny_target.target_id)),
        EngineParams(num_draft_tokens=k, max_seq_len=256),
    )
    stats = SpecDecodingStats(k)
    for p, ref in zip(prompts[40:], hold):
        out = eng.generate(p, N, speculative=True, k=k)
        assert out.tokens == ref.tokens  # lossless: the holdout text is what the engine emits
        stats = stats.merge(out.stats)
    # the engine never counts a draft accepted past max_new_tokens (the text's end), so its τ is the
    # τ over the drafts the holdout text can score
    tau_capped = stats.acceptance_length
    tau_sim = ev.simulated_tau(k)
    assert 1.5 < tau_sim < 1 + k - 0.2  # a draft that is right often, but not always: the case that matters
    # Teacher forcing on the target's own greedy tokens feeds the draft exactly the chain's inputs
    # wherever the prefix was accepted, and the walk visits the engine's chain starts: both sides count
    # the same chains with the same accepted runs. The tolerance covers rounding only (the holdout's
    # hidden states are stored in bf16, the engine's are fp32: a near-tie argmax may flip).
    assert ev.chains(k) == stats.num_drafts
    assert tau_sim == pytest.approx(tau_capped, abs=0.02)
    # the old figure, Π of unconditional per-step accuracies over every position, is off by much more
    assert abs(simulated_acceptance_length(ev.acc[:k]) - tau_capped) > 0.15


def test_no_validation_records_reports_no_val_metrics(tiny_target, tmp_path):
    """Without validation records there is no val/* and no simulated τ (never the training
    accuracy under val/, as before)."""
    recs = _records(tiny_target, n=4)
    tp = TrainParams(epochs=1, ttt_steps=2, batch_tokens=256)
    m = train_draft(recs, [], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "d")
    assert m["simulated_acceptance_length"] is None and m["val_examples"] == 0
    assert not [k for k in m if k.startswith("val/") or k == "val_positions"]
    assert 0 <= m["train/acc_0"] <= 1
    m = train_draft(recs[:3], recs[3:], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "e")
    assert 1.0 <= m["simulated_acceptance_length"] <= 3.0 and m["val_positions"] == 30  # 40 tokens, last 3/4 generated
    assert {f"val/acc_{j}" for j in range(2)} | {f"val/cond_acc_{j}" for j in range(2)} <= set(m)


def test_lk_loss_is_minus_log_the_acceptance_probability_and_trains_other_weights(tiny_target, tmp_path):
    """`train.loss: lk` (arXiv 2602.23881): per row −log Σ_v min(p, q) — 0 where the draft matches the
    target, −log 0.5 for half the mass shared, −log q(t) where the target is sure of t, by hand below —
    and its gradient moves q toward p, also on a row where the draft is confidently wrong; the knob
    reaches the trainer (other weights than kl from the same data and seed); refused with SpecForge."""
    from tidespec.models.ttt import row_loss
    p = torch.tensor([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    logits = torch.tensor([[0.0, 0.0, -30.0], [-20.0, 0.0, 0.0]], requires_grad=True)
    got = row_loss(p, logits, "lk")
    q1 = torch.softmax(logits[1].detach(), -1)
    assert got[0].item() == pytest.approx(0.0, abs=1e-6) and got[1].item() == pytest.approx(-q1[0].log().item())
    got[1].backward()  # q(t) ≈ 1e-9: still pushed up (a floor on α would stop the gradient here)
    assert logits.grad[1, 0] < -0.9 and logits.grad[1, 1] > 0.4
    half = row_loss(torch.tensor([[1.0, 0.0]]), torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_(), "lk")
    assert half.item() == pytest.approx(-torch.log(torch.tensor(0.5)).item(), rel=1e-6)
    lg = torch.zeros(1, 2, requires_grad=True)
    row_loss(torch.tensor([[0.9, 0.1]]), lg, "lk").sum().backward()
    assert lg.grad[0, 0] < 0 < lg.grad[0, 1]  # descent raises the under-drafted token's logit
    with pytest.raises(ValueError, match="train.loss 'x'"):
        row_loss(p, logits, "x")
    recs = _records(tiny_target, n=6)
    dp, tp = DraftParams(draft_vocab_size=64), TrainParams(epochs=1, ttt_steps=2, batch_tokens=80)
    w = {}
    for loss in ("kl", "lk"):
        train_draft(recs[:5], recs[5:], tiny_target, dp, tp.model_copy(update={"loss": loss}), tmp_path / loss)
        w[loss] = load_checkpoint(tmp_path / loss, tiny_target.embed, tiny_target.target_id).state_dict()
    assert any(not torch.equal(w["kl"][k], w["lk"][k]) for k in w["kl"])
    with pytest.raises(ValueError, match="train.loss lk is the embedded trainer's"):
        TrainParams(loss="lk", backend="specforge")


def test_rejected_weight_changes_what_is_learnt_says_what_it_weighed_and_warns_when_nothing(tiny_target, tmp_path,
                                                                                          caplog):
    """`train.rejected_weight` on records with `rejected_mask`: other weights than without it, and
    `train_rejected_positions` the positions it weighed; on records without one: the same weights as
    off, a warning naming the knob and 0; refused for SpecForge by name."""
    recs = _records(tiny_target, n=6)
    marked = [dict(r, rejected_mask=(torch.arange(40) % 5 == 0).to(torch.uint8)) for r in recs[:5]]
    dp, tp = DraftParams(draft_vocab_size=64), TrainParams(epochs=1, ttt_steps=2, batch_tokens=80)
    on = tp.model_copy(update={"rejected_weight": 2.0})
    w, m = {}, {}
    for name, data, params in (("off", marked, tp), ("on", marked, on), ("none", recs[:5], on)):
        m[name] = train_draft(data, recs[5:], tiny_target, dp, params, tmp_path / name)
        w[name] = load_checkpoint(tmp_path / name, tiny_target.embed, tiny_target.target_id).state_dict()
    assert any(not torch.equal(w["off"][k], w["on"][k]) for k in w["off"])
    assert all(torch.equal(w["off"][k], w["none"][k]) for k in w["off"])
    from tidespec.train.examples import prepare  # the learnable marked positions, under the trained draft's vocab
    t2d = load_checkpoint(tmp_path / "on", tiny_target.embed, tiny_target.target_id).t2d
    want = sum(int(((x.weight != 1) & x.valid).sum()) for x in prepare(marked, tiny_target, t2d, 512, False, None, 2.0))
    assert 0 < want < 5 * 8  # some marks fall on the prompt or outside the draft vocabulary
    assert m["on"]["train_rejected_positions"] == want and "train_rejected_positions" not in m["off"]
    assert m["none"]["train_rejected_positions"] == 0
    assert "train.rejected_weight 2.0 weighs nothing here" in caplog.text
    with pytest.raises(ValueError, match="train.rejected_weight 1.0 is the embedded trainer's"):
        TrainParams(rejected_weight=1.0, backend="specforge")


def test_a_new_train_field_at_its_default_keeps_the_cache_keys():
    """The static draft's cache key and the training-state key (`learning_dump`) of the shipped params
    are what they were before `train.rejected_weight` existed (a user's cached static is not rebuilt
    after an upgrade); setting it changes the training key, never the static's (no draft served its
    teacher-forced records)."""
    import hashlib
    from pathlib import Path

    import yaml

    from tidespec.config import Params
    from tidespec.steps.bootstrap import static_draft_dir

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    p = Params.model_validate(raw)

    def key(x):
        return hashlib.sha256(json.dumps(x.train.learning_dump(), sort_keys=True).encode()).hexdigest()[:12]
    assert static_draft_dir(p, "0" * 64, Path("/c")).name == "static-92d99ce7ec28"
    assert key(p) == "798c7edf9b87"
    raw["train"]["rejected_weight"] = 1.0
    w = Params.model_validate(raw)
    assert key(w) != key(p) and static_draft_dir(w, "0" * 64, Path("/c")) == static_draft_dir(p, "0" * 64, Path("/c"))
