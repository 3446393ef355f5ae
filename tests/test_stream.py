"""Streaming training data: the trainer reads a curated set through a bounded buffer
(`train.stream`), so its memory does not grow with the snapshot.

The budget is a data budget: the trainer's peak RSS (`tidespec stage train`, a fresh process)
above the same command's on a set that fits one buffer, trained for as many optimizer steps
(interpreter, torch, target, draft, AdamW state, activations and glibc's heap after that many
steps are the same in both runs). It is `train.buffer_mb` (4 MiB of prepared examples) + 20 MiB
for what else a streamed run holds at once: the records read ahead (`train.prefetch_mb` 1 MiB plus
the one being read, 256 KiB), a padded batch's copy
(batch_tokens 1,792 × 2,058 B/token = 3.5 MiB) while the previous one is freed, the index's
entries, and what glibc's heap keeps of freed buffers (the stream hands it back with
`malloc_trim` after each buffer; without that, 17–28 MiB over the baseline were measured) —
24 MiB; measured: 4–15 MiB over the baseline (7–9 before the producer thread). The snapshot
is ≥ 5 × that at rest. Holding it all, as the trainer did before, would take ~3 × its size at rest (records
+ prepared examples: 12·H + 2·Vd bytes per prepared token against 8·H at rest).
"""
import random

import pytest
import torch

from conftest import make_tiny_target
from tidespec.bench.train_scaling import stage_train_peak, synthetic_workspace
from tidespec.models.ttt import group_by_length

H, V, T = 128, 256, 256
BUFFER_MB, DATA_BUDGET_MB = 4, 24


def _workspace(root, target_dir, n_records: int, epochs: int = 1, seed: int = 0):
    """A curated workspace whose one snapshot holds `n_records` synthetic records of T tokens
    (random hidden states: their teacher logits are random, every position learnable)."""
    raw = {"target": {"source": str(target_dir)}, "draft": {"draft_vocab_size": V, "intermediate_size": 64},
           "curate": {"window": 1, "min_tokens": 4, "max_tokens": 4096, "val_fraction": 0.02, "holdout_fraction": 0.0},
           "train": {"ttt_steps": 1, "epochs": epochs, "batch_tokens": 1792, "max_seq_len": T, "min_train_tokens": 16,
                     "buffer_mb": BUFFER_MB, "prefetch_mb": 1, "threads": 1, "checkpoint_every": 0}}
    return synthetic_workspace(root, raw, n_records, T, seed=seed)


def _train_peak_mb(ws) -> tuple[float, dict]:
    """`tidespec stage train` in a fresh process: (its peak RSS in MiB, its metrics)."""
    return stage_train_peak(ws.root, {"OMP_NUM_THREADS": "1"}, timeout_s=600)


def _snapshot_mb(ws) -> float:
    return sum(f.stat().st_size for f in ws.snapshots.rglob("*.safetensors*")) / 2**20


def test_peak_rss_does_not_grow_with_the_snapshot(tmp_path):
    target_dir = make_tiny_target(tmp_path / "target", vocab_size=V, hidden_size=H, intermediate_size=64,
                                  num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=4,
                                  max_position_embeddings=512)
    big = _workspace(tmp_path / "big", target_dir, 480, seed=1)
    assert _snapshot_mb(big) >= 5 * DATA_BUDGET_MB
    p_big, m_big = _train_peak_mb(big)
    small = _workspace(tmp_path / "small", target_dir, 6, epochs=m_big["train_steps"])  # one step per epoch
    p_small, m_small = _train_peak_mb(small)
    assert m_small["train_buffers"] == 1 and m_big["train_buffers"] >= 10  # the big set streamed
    assert m_small["train_steps"] >= m_big["train_steps"]
    print(f"snapshot {_snapshot_mb(big):.0f} MiB: peak {p_big:.0f} MiB vs {p_small:.0f} MiB")
    assert p_big - p_small <= DATA_BUDGET_MB, (p_small, p_big)


def _stream(tiny_target, recs, buffer_mb, rank=0, world=1):
    from collections import Counter

    from tidespec.config import TrainParams
    from tidespec.train.source import InMemory
    from tidespec.train.stream import ExampleStream
    t2d = torch.ones(tiny_target.cfg.vocab_size, dtype=torch.bool)
    tp = TrainParams(max_seq_len=64, buffer_mb=buffer_mb, batch_tokens=96, seed=0, prefetch_mb=0)
    return ExampleStream(InMemory(recs), tiny_target, t2d, tp, Counter(), rank, world, collective=False)


def test_plan_covers_every_example_once_within_the_buffer(tiny_target):
    from conftest import tiny_records
    from tidespec.train.stream import example_bytes_per_token
    recs = tiny_records(tiny_target, n=9, T=40) + tiny_records(tiny_target, n=7, T=23, seed=1)
    per_token = example_bytes_per_token(tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size)
    whole = _stream(tiny_target, recs, 1.0)  # 1 MiB: everything fits
    assert whole.resident and [len(b) for b in whole.epoch_plan(0, random.Random(0))] == [
        len(group_by_length(whole.lengths, 96, False, random.Random(0)))]
    s = _stream(tiny_target, recs, 130 * per_token / 2**20)  # 130 tokens per buffer: 3-5 records
    assert not s.resident and s.capacity == 130
    plans = [s.epoch_plan(ep, random.Random(ep)) for ep in range(3)]
    for plan in plans:
        seen = [i for buf in plan for g in buf for i in g]
        assert sorted(seen) == list(range(len(recs)))  # each example once per epoch
        for buf in plan:
            assert sum(s.lengths[i] for g in buf for i in g) <= 130
            for g in buf:  # a batch: ≤ batch_tokens padded tokens
                assert len(g) * max(s.lengths[i] for i in g) <= 96 or len(g) == 1
    assert plans[0] != plans[1]  # the shard order is reshuffled per epoch
    # two ranks: each takes rows r::2 of every global batch, and the global token counts agree
    mb = 130 * per_token / 2**20
    r0, r1 = _stream(tiny_target, recs, mb, 0, 2), _stream(tiny_target, recs, mb, 1, 2)
    plan = s.epoch_plan(0, random.Random(0))
    b0, b1 = list(r0.batches(plan)), list(r1.batches(plan))
    assert [(b, t) for b, t, _ in b0] == [(b, t) for b, t, _ in b1] == [
        (n, sum(s.lengths[i] for i in g)) for n, g in enumerate(g for buf in plan for g in buf)]
    rows = sum((0 if x is None else x[1].shape[0]) for _, _, x in b0 + b1)
    assert rows == len(recs)


@pytest.mark.parametrize("skip", [0, 3])
def test_resumed_epoch_skips_without_changing_the_rest(tiny_target, skip):
    from conftest import tiny_records
    recs = tiny_records(tiny_target, n=12, T=30)
    s = _stream(tiny_target, recs, 0.2)
    plan = s.epoch_plan(0, random.Random(0))
    full = list(s.batches(plan))
    part = list(s.batches(plan, skip=skip))
    assert [b for b, _, _ in part] == list(range(skip, len(full)))
    for (_, _, a), (_, _, b) in zip(full[skip:], part):
        assert all(x is y is None or torch.equal(x, y) for x, y in zip(a, b))  # weight: None unweighted


def test_a_buffer_smaller_than_a_batch_is_refused(tiny_target):
    from conftest import tiny_records
    with pytest.raises(ValueError, match="train.buffer_mb .* fewer than train.batch_tokens 96: raise buffer_mb"):
        _stream(tiny_target, tiny_records(tiny_target, n=2, T=30), 0.01)


def test_streamed_schedule_counts_the_steps_it_runs(tiny_target, tmp_path):
    """The LR schedule's step count is the batches the epochs really run (the shard order, hence
    where buffers are cut, changes per epoch), and a run killed mid-way resumes at another rank
    count (the state is keyed on data and params, not on where the ranks run)."""
    from conftest import tiny_records
    from tidespec.config import DraftParams, TrainParams
    from tidespec.train.trainer import train_draft
    recs = tiny_records(tiny_target, n=11, T=33) + tiny_records(tiny_target, n=9, T=21, seed=1)
    tp = TrainParams(epochs=4, ttt_steps=2, batch_tokens=70, buffer_mb=0.15, checkpoint_every=3)
    seen = []
    m = train_draft(recs, [], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "a",
                    progress=lambda step, total, loss: seen.append((step, total)))
    assert m["train_buffers"] > 2 and m["skipped_nonfinite_steps"] == 0
    assert seen[-1][0] == seen[-1][1] == m["train_steps"]

    class Killed(Exception):
        pass

    def kill(step, total, loss):
        if step == 7:
            raise Killed()
    with pytest.raises(Killed):
        train_draft(recs, [], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "b", progress=kill)
    again = train_draft(recs, [], tiny_target, DraftParams(draft_vocab_size=64),
                        tp.model_copy(update={"nproc_per_node": 2, "max_restarts": 1}), tmp_path / "b")
    assert again["resumed_from_step"] == 6 and again["train/loss"] == m["train/loss"]
