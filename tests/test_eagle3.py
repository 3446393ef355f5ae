"""EAGLE3 draft: shapes, TTT == incremental inference, training lowers the loss, checkpoint layout."""
import dataclasses
import json
import random
from collections import Counter

import pytest
import torch

from conftest import make_tiny_target, random_draft, tiny_records
from tidespec.config import DraftParams, TrainParams
from tidespec.models.eagle3 import build_vocab, load_checkpoint, save_checkpoint
from tidespec.models.runner import DraftRunner
from tidespec.models.ttt import batches, ttt_loss
from tidespec.train.examples import prepare
from tidespec.train.trainer import init_draft, train_draft


def _draft(tiny_target, vd=64, seed=0):
    return random_draft(tiny_target, vd, Counter({i: 1000 - i for i in range(3, 200)}), seed)


_records = tiny_records


def test_forward_shapes(tiny_target):
    d = _draft(tiny_target)
    H, B, T = tiny_target.cfg.hidden_size, 2, 12
    aux = torch.randn(B, T, 3 * H)
    ids = torch.randint(0, 320, (B, T))
    hs = d.ttt_forward(aux, ids, steps=3)
    assert len(hs) == 3 and all(h.shape == (B, T, H) for h in hs)
    assert d.logits(hs[0]).shape == (B, T, 64) and d.logits(hs[0]).dtype == torch.float32
    assert d.fc.weight.shape == (H, 3 * H)
    assert d.midlayer.self_attn.q_proj.weight.shape[1] == 2 * H  # [embedding; hidden]


def test_ttt_matches_incremental_inference(tiny_target):
    """The serving path (DraftRunner) computes exactly what TTT trains: step j at row t == chain step j."""
    d = _draft(tiny_target).eval()
    H, T = tiny_target.cfg.hidden_size, 10
    torch.manual_seed(1)
    aux, ids = torch.randn(1, T, 3 * H), torch.randint(0, 320, (1, T))
    with torch.no_grad():
        hs = d.ttt_forward(aux, ids, steps=3)
    r = DraftRunner(d)
    t = 5  # row: extend rows 0..t with target features, then chain 2 steps feeding the TTT tokens
    cache = r.new_cache(64)
    h, _ = r.extend(aux[0, :t + 1], ids[0, 1:t + 2], cache)
    torch.testing.assert_close(h[-1], hs[0][0, t], atol=1e-5, rtol=1e-5)
    h1, _ = r.step(h[-1:], ids[0, t + 2:t + 3], cache)
    torch.testing.assert_close(h1[0], hs[1][0, t], atol=1e-5, rtol=1e-5)
    h2, _ = r.step(h1, ids[0, t + 3:t + 4], cache)
    torch.testing.assert_close(h2[0], hs[2][0, t], atol=1e-5, rtol=1e-5)


def test_training_step_lowers_loss(tiny_target):
    d = _draft(tiny_target)
    ex = prepare(_records(tiny_target), tiny_target, d.t2d, 64)
    batch = next(batches(ex, 4096, False, random.Random(0)))
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        loss, _, _ = ttt_loss(d, *batch, steps=3, decay=0.8)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = float(ttt_loss(d, *batch, steps=3, decay=0.8)[0].detach())
    assert last < 0.7 * first, (first, last)


def test_build_vocab_rules():
    counts = Counter({10: 5, 3: 9, 7: 1})
    d2t, t2d = build_vocab(counts, draft_vocab_size=6, vocab_size=20)  # more slots than distinct tokens
    used = torch.arange(6) + d2t
    assert used.tolist() == sorted(used.tolist()) and len(set(used.tolist())) == 6
    assert {3, 7, 10} <= set(used.tolist())
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and int(t2d.sum()) == 6
    assert t2d[used].all()
    with pytest.raises(ValueError):
        build_vocab(counts, 30, 20)


# The key set and shapes against SGLang's and vLLM's loaders: tests/test_export_compat.py.
def test_checkpoint_layout_and_roundtrip(tiny_target, tmp_path):
    d = _draft(tiny_target)
    save_checkpoint(d, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["vocab_size"] == 320 and cfg["draft_vocab_size"] == 64 and cfg["target_hidden_size"] == 64
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang, output-of-layer
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM, input-of-layer
    assert "norm_before_residual" not in cfg
    back = load_checkpoint(tmp_path / "ck", tiny_target.embed, tiny_target.target_id)
    for k, v in d.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    with pytest.raises(ValueError, match="trained for target"):
        load_checkpoint(tmp_path / "ck", tiny_target.embed, "f" * 64)


def test_bundle_holds_only_engine_files_in_its_draft_dir(tiny_target, tmp_path):
    """vLLM and SGLang load every *.safetensors in a draft dir: a bundle's draft/ holds exactly the
    two files they read; sidecars sit beside it and loading the bundle loads the same draft."""
    from tidespec.workspace import engine_dir, make_bundle
    ck = save_checkpoint(_draft(tiny_target), tmp_path / "ck")
    (ck / "suffix_corpus.safetensors").write_bytes(b"x")
    (ck / "train_metrics.json").write_text("{}")
    b = make_bundle(ck, tmp_path / "bundle")
    assert sorted(p.name for p in (b / "draft").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in b.iterdir()) == ["draft", "suffix_corpus.safetensors", "train_metrics.json"]
    assert engine_dir(b) == b / "draft" and engine_dir(ck) == ck
    again = make_bundle(b, tmp_path / "again")  # a bundle re-bundles to the same layout
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in b.iterdir())
    a, c = load_checkpoint(ck).state_dict(), load_checkpoint(b).state_dict()
    assert all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(FileExistsError):
        make_bundle(ck, b)
    (ck / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="not a draft checkpoint"):
        make_bundle(ck, tmp_path / "nope")


def test_warm_start_remaps_vocab(tiny_target, tmp_path):
    recs = _records(tiny_target, n=4)
    dp, tp = DraftParams(draft_vocab_size=64), TrainParams(epochs=1, ttt_steps=2, batch_tokens=256)
    m = train_draft(recs[:3], recs[3:], tiny_target, dp, tp, tmp_path / "a")
    assert len(m["train/loss"]) == 1 and m["train/loss"][0] > 0 and 0 <= m["val/acc_0"] <= 1
    a = load_checkpoint(tmp_path / "a", tiny_target.embed)
    shifted = Counter({i: 1000 - i for i in range(100, 300)})
    b = init_draft(tiny_target, dp, shifted, tmp_path / "a")
    ids_a = (torch.arange(64) + a.d2t).tolist()
    ids_b = (torch.arange(64) + b.d2t).tolist()
    assert ids_a != ids_b
    for i, t in enumerate(ids_b):  # kept ids keep their trained rows; new ids take the target's row
        if t in ids_a:
            assert torch.equal(b.lm_head.weight[i], a.lm_head.weight[ids_a.index(t)])
        else:
            assert torch.equal(b.lm_head.weight[i], tiny_target.lm_head_weight[t].float())


def test_shallow_targets_get_three_distinct_aux_layers(tmp_path):
    """SpecForge's [1, L//2-1, L-4] repeats a layer below 8 layers (L = 6: 1, 2, 2): the draft's fc then
    got 2H columns instead of 3H and failed inside oneDNN. Every depth gets 3 ascending layers; a
    6-layer target serves a draft losslessly; repeated ids are refused naming the setting."""
    from tidespec.config import EngineParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.target import load_target
    t6 = load_target(make_tiny_target(tmp_path / "t6", num_hidden_layers=6))[0]
    assert t6.aux_layers == (0, 2, 4)
    for n, want in ((3, (0, 1, 2)), (4, (0, 1, 2)), (5, (0, 1, 3)), (7, (0, 2, 5)), (8, (1, 3, 4)), (30, (1, 14, 26))):
        cfg = dataclasses.replace(t6.cfg, num_layers=n)
        assert cfg.default_aux_layers == want, n
    d = random_draft(t6, vd=64)
    prompt = [5, 9, 13, 17, 21, 25]
    spec = Engine(t6, DraftRunner(d), EngineParams(num_draft_tokens=3, max_seq_len=128)).generate(prompt, 24)
    plain = Engine(t6, None, EngineParams(num_draft_tokens=3, max_seq_len=128)).generate(prompt, 24, speculative=False)
    assert spec.tokens == plain.tokens and spec.stats.num_drafts > 0
    with pytest.raises(ValueError, match=r"target.aux_layers.*ascending distinct.*\(2, 2, 4\)"):
        load_target(tmp_path / "t6", aux_layers=(2, 2, 4))
    with pytest.raises(ValueError, match="2 layer\\(s\\).*at least 3 layers"):  # no setting can serve it
        load_target(make_tiny_target(tmp_path / "t2", num_hidden_layers=2))


@pytest.mark.parametrize("objective", ["kl", "lk"])
def test_a_loss_weight_scales_the_rows_held_to_its_position(tiny_target, objective):
    """`ttt_loss` with weight e_p (1 at target position p, 0 elsewhere) is the loss of the rows held
    to p alone (every TTT step's: the same batch with only p learnable, unweighted); all ones is the
    unweighted loss; the loss is linear in the weight: L(1 + 3·e_p) = L(1) + 3·L(e_p)."""
    d = _draft(tiny_target)
    recs = _records(tiny_target)
    aux, ids, tl, valid, kv, w = next(batches(prepare(recs, tiny_target, d.t2d, 64), 4096, False, random.Random(0)))
    assert w is None  # no example weighted: the unweighted path
    b, p = [(int(b), int(t)) for b, t in valid.nonzero() if t >= 4][0]  # rows p-1..p-3 hold it at steps 0..2
    e = torch.zeros(valid.shape)
    e[b, p] = 1
    only = torch.zeros_like(valid)
    only[b, p] = True

    def loss(weight, v=valid):
        with torch.no_grad():
            return float(ttt_loss(d, aux, ids, tl, v, kv, weight, 3, 0.8, objective=objective)[0])
    assert loss(e) == pytest.approx(loss(None, only), rel=1e-5) and loss(e) > 0
    assert loss(torch.ones(valid.shape)) == pytest.approx(loss(None), rel=1e-5)
    assert loss(1 + 3 * e) == pytest.approx(loss(None) + 3 * loss(e), rel=1e-5)


def test_rejected_positions_weigh_more_only_when_asked(tiny_target):
    """`prepare` gives an example weight 1 + rejected_weight at its record's `rejected_mask` positions
    and 1 elsewhere; none without rejected_weight or without a mask; a batch mixing both pads ones."""
    d = _draft(tiny_target)
    recs = _records(tiny_target, n=2)
    recs[0]["rejected_mask"] = torch.zeros(40, dtype=torch.uint8)
    recs[0]["rejected_mask"][[12, 30]] = 1
    plain, weighted = prepare(recs, tiny_target, d.t2d, 64), prepare(recs, tiny_target, d.t2d, 64, rejected_weight=2.5)
    assert all(x.weight is None for x in plain) and weighted[1].weight is None
    assert weighted[0].weight[[12, 30]].tolist() == [3.5, 3.5] and int((weighted[0].weight != 1).sum()) == 2
    *_, w = next(batches(weighted, 4096, False, random.Random(0)))
    assert w.shape == (2, 40) and int((w != 1).sum()) == 2 and float(w.sum()) == 80 + 2 * 2.5
