"""The engine on the real target (SmolLM2-135M): speculative greedy == target-only greedy. Its own
file so the parallel suite (`make test`: pytest-xdist, one file per worker at a time) schedules this
long test beside the rest instead of behind test_engine.py's."""
import pytest

from test_engine import PROMPTS, _random_runner
from tidespec.bench import policy_report
from tidespec.config import EngineParams
from tidespec.engine.calibration import Calibration
from tidespec.engine.policy import GoodputPolicy
from tidespec.engine.speculative import Engine, Request
from tidespec.engine.stats import SpecDecodingStats
from tidespec.models.eagle3 import load_checkpoint
from tidespec.models.runner import DraftRunner


@pytest.mark.full_model
def test_lossless_on_real_target(real_target, tmp_path):
    """≥5 real prompts × 64 new tokens: speculative greedy (batched) == target-only greedy (one
    request at a time), token for token, with a randomly initialised draft and with a trained one
    (teacher-forced, few epochs), with EAGLE-2 trees and with adaptive k."""
    from tidespec.assets.prompts import sharegpt_conversations
    from tidespec.config import DraftParams, TrainParams
    from tidespec.models.chat import prompt_ids
    from tidespec.steps.bootstrap import teacher_force
    from tidespec.train.trainer import train_draft

    target, tok = real_target
    recs = teacher_force(target, tok, sharegpt_conversations(limit=24)[:16], 192)
    few = teacher_force(target, tok, sharegpt_conversations(limit=24)[:16], 192, token_budget=300)
    sizes = [len(r["input_ids"]) for r in few]  # stops at the first conversation that reaches the budget
    assert sum(sizes) >= 300 > sum(sizes[:-1]) and [len(r["input_ids"]) for r in recs[:len(few)]] == sizes
    train_draft(recs[2:], recs[:2], target, DraftParams(draft_vocab_size=2048),
                TrainParams(epochs=2, ttt_steps=3), tmp_path / "trained")
    trained = DraftRunner(load_checkpoint(tmp_path / "trained", target.embed, target.target_id))
    eng = Engine(target, None, EngineParams(num_draft_tokens=4, max_seq_len=512))
    ref = {p: eng.generate(prompt_ids(tok, p), 64, speculative=False).tokens for p in PROMPTS}
    for name, runner in (("random", _random_runner(target, 4096)), ("trained", trained)):
        eng.set_draft(runner, name)  # the prompts in one batch: each verify reads the weights once for all
        total = SpecDecodingStats(4)
        for p, g in zip(PROMPTS, eng.generate_batch([Request(prompt_ids(tok, p), 64) for p in PROMPTS])):
            assert g.tokens == ref[p], (name, p)
            assert len(g.tokens) == 64 or g.finish_reason == "stop"
            total = total.merge(g.stats)
        if name == "trained":
            assert total.num_accepted_tokens > 0  # the accept path was exercised, not only rejections
    tree = Engine(
        target,
        trained,
        EngineParams(num_draft_tokens=3, max_seq_len=512, tree={"eagle_topk": 3, "num_draft_tokens": 8}),
    )
    outs = tree.generate_batch([Request(prompt_ids(tok, p), 64) for p in PROMPTS])  # EAGLE-2 trees, batched
    assert [o.tokens for o in outs] == [ref[p] for p in PROMPTS]
    assert sum(o.stats.num_accepted_tokens for o in outs) > 0
    # batched (all prompts in one batch) and adaptive k: still the target's greedy output
    pol = GoodputPolicy(Calibration((90.0, 100.0, 110.0, 120.0, 130.0), 5.0, "test", 128), prior=0.8, alpha=0.3)
    eng = Engine(
        target,
        trained,
        EngineParams(num_draft_tokens=4, max_seq_len=512, max_batch=8, draft_early_stop=False),
        policy=pol,
    )
    gens = eng.generate_batch([Request(prompt_ids(tok, p), 64, workload="code" if "def" in p else "chat")
                               for p in PROMPTS])
    assert [g.tokens for g in gens] == [ref[p] for p in PROMPTS]
    assert sum(g.stats.num_drafts for g in gens) > 0 and set(policy_report.report(pol)) == {"code", "chat"}
