"""Grammar-constrained decoding in the engine (llguidance): every output valid, speculation exact.

The tiny target with its byte-level tokenizer (`add_tiny_tokenizer`): a random model, so the grammar
alone decides whether the output is valid, and a random draft is mostly wrong — every drafted token
the grammar forbids must be cut or masked, never emitted.
"""
import json
from collections import Counter

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from conftest import random_draft
from tidespec.config import EngineParams
from tidespec.engine import grammar_state as grammar_mod
from tidespec.engine.calibration import Calibration
from tidespec.engine.grammar_state import GrammarCompiler, GrammarError
from tidespec.engine.policy import GoodputPolicy
from tidespec.engine.sampling import SamplingParams, warp
from tidespec.engine.speculative import Engine, Request
from tidespec.engine.stats import SpecDecodingStats
from tidespec.engine.suffix_tree import SuffixCache
from tidespec.models.runner import DraftRunner

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["alpha", "beta", "gamma"]}, "ok": {"type": "boolean"},
    "tag": {"type": "string", "maxLength": 4}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["kind", "ok", "tag", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok_target(tiny_tok_target_dir):
    from tidespec.models.target import load_target
    return load_target(tiny_tok_target_dir)


@pytest.fixture(scope="module")
def compiler(tok_target):
    target, tok = tok_target
    return GrammarCompiler.for_target(target, tok)


def _text(tok, ids):
    return tok.decode(ids, skip_special_tokens=True)


def _engines(target):
    cal = Calibration((100.0, 101.0, 102.0, 103.0, 104.0), 1.0, "test", 128)
    runner = DraftRunner(random_draft(target, 64))
    return {
        "eagle3 k=3": Engine(target, runner, EngineParams(num_draft_tokens=3, max_seq_len=256)),
        "suffix": Engine(target, None, EngineParams(max_seq_len=256), suffix=SuffixCache()),
        "grammar only": Engine(target, None, EngineParams(max_seq_len=256)),
        "hybrid": Engine(target, runner, EngineParams(num_draft_tokens=3, max_seq_len=256), suffix=SuffixCache()),
        "policy": Engine(
            target,
            runner,
            EngineParams(num_draft_tokens=4, max_seq_len=256, draft_early_stop=False),
            policy=GoodputPolicy(cal, prior=0.9, alpha=0.2),
            suffix=SuffixCache(),
        ),
    }


def test_constrained_output_is_valid_and_speculation_is_exact(tok_target, compiler):
    target, tok = tok_target
    g = compiler.json_schema(SCHEMA)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("name a thing", '{"kind": "beta", "ok": true}')]
    prompts.append([5, 6, 7, 8])
    ref = Engine(target, None, EngineParams(max_seq_len=256))
    base = [ref.generate_batch([Request(p, 80, speculative=False, grammar=g)])[0] for p in prompts]
    for b in base:
        assert b.finish_reason == "stop" and b.grammar_error is None
        jsonschema.validate(json.loads(_text(tok, b.tokens)), SCHEMA)
    unconstrained = ref.generate(prompts[0], 30, speculative=False)
    with pytest.raises(ValueError):  # the random target alone does not write JSON
        json.loads(_text(tok, unconstrained.tokens))
    via = {}
    for name, eng in _engines(target).items():
        gens = eng.generate_batch([Request(p, 80, grammar=g, workload="json") for p in prompts])
        assert [x.tokens for x in gens] == [b.tokens for b in base], name
        for x in gens:
            for proposer, st in x.by_proposer.items():
                via[(name, proposer)] = via.get((name, proposer), 0) + st.num_accepted_tokens
    # forced keys and punctuation are proposed and accepted, by the grammar proposer alone and in the hybrids
    assert via[("grammar only", "grammar")] >= 20
    assert via[("hybrid", "grammar")] >= 20 and via[("policy", "grammar")] >= 20


def test_masks_leave_the_state_and_cut_drafts_the_grammar_forbids(tok_target, compiler):
    target, tok = tok_target
    V = target.cfg.vocab_size
    st = compiler.lark('start: "ab" /[xy]/ "c"').state()
    a, b, x, y, c, z = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abxycz")
    m = st.masks([a, b, x], 4)  # rows after [], [a], [a, b], [a, b, x]
    assert [row.nonzero().squeeze(1).tolist() for row in m] == [[a], [b], sorted([x, y]), [c]]
    m2 = st.masks([a, z, x], 3)  # rows after [a], [a, z], [a, z, x]: z is forbidden, rows after it are
    assert m2[0].nonzero().squeeze(1).tolist() == [b] and bool(m2[1:].all())  # never reached (all allowed)
    assert st.valid_prefix([a, b, x, c]) == 4 and st.valid_prefix([a, z, x]) == 1
    assert st.forced() == [a, b] or st.forced() == [a]  # forced bytes "ab" (the last may be held back)
    st.advance([a, b])
    assert st.masks([], 1)[0].nonzero().squeeze(1).tolist() == sorted([x, y])
    st.advance([x, c])
    eos = target.cfg.eos_token_ids[0]
    assert st.done and st.masks([], 1)[0].nonzero().squeeze(1).tolist() == [eos]
    assert m.shape == (4, V)
    # the engine cuts a proposal before its first forbidden token: no verify row is spent on it
    from tidespec.engine.accept import cut_to_grammar
    from tidespec.engine.proposers.base import Slot
    from tidespec.engine.request import Seq
    g = compiler.lark('start: "ab" /[xy]/ "c"')
    seq = Seq(Request([5], 8, grammar=g), "r", None, None, V, False, {eos})
    sl = Slot(seq, drafts=[a, b, z, c], draft_probs=[torch.zeros(V)] * 4)
    cut_to_grammar([sl])
    assert sl.drafts == [a, b] and len(sl.draft_probs) == 2


def test_sampled_constrained_marginal_is_exact(tok_target, compiler):
    """Token 2 is the first one speculation decides: its distribution equals the constrained target's
    marginal Σ_t1 p̃(t1) p̃(t2 | t1), p̃ the masked, warped distribution."""
    T, tok = tok_target
    g = compiler.lark("start: /[a-h][a-h0-3]z/")
    sp = SamplingParams(temperature=1.5)
    prompt = [8, 20, 45]
    st = g.state()

    def row(logits, prefix):
        return warp(logits.masked_fill(~st.masks(prefix, 1)[0], float("-inf")), sp)

    c = T.new_cache(16)
    p1 = row(T.forward(torch.tensor(prompt), c, need_hidden=False).logits[-1], [])
    marg = torch.zeros(T.cfg.vocab_size)
    for t1 in p1.nonzero().squeeze(-1).tolist():
        c.crop(3)
        marg += p1[t1] * row(T.forward(torch.tensor([t1]), c, need_hidden=False).logits[0], [t1])
    # the draft's vocabulary holds half of the allowed letters and many forbidden tokens: its masked q
    # drafts allowed tokens, an unmasked one would draft forbidden ones (then cut: not exact)
    allowed = tok.encode("abcd0123z", add_special_tokens=False)
    freq = Counter({t: 1000 for t in allowed} | {t: 10 for t in range(3, 3 + 50)})
    eng = Engine(
        T,
        DraftRunner(random_draft(T, 64, counts=freq)),
        EngineParams(num_draft_tokens=2, max_seq_len=16),
        suffix=SuffixCache(),
    )
    N, pvalues, drafted = 2000, [], 0
    for block in range(2):  # a second, independent block of seeds only if the first lands in the 1 % tail
        counts = torch.zeros(T.cfg.vocab_size)
        for i in range(N):
            gen = eng.generate_batch([Request(prompt, 2, sampling=SamplingParams(1.5, seed=block * N + i),
                                              grammar=g)])[0]
            counts[gen.tokens[1]] += 1
            drafted += gen.by_proposer.get("eagle3", SpecDecodingStats(0)).num_draft_tokens
        assert counts[marg == 0].sum() == 0  # never a token the grammar forbids
        keep = marg * N >= 5
        obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
        exp = torch.cat([marg[keep] * N, (marg[~keep].sum() * N).view(1)])
        obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
        pvalues.append(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)
        if pvalues[-1] > 0.01:
            break
    assert pvalues[-1] > 0.01, pvalues  # a wrong sampler fails both blocks; a right one both with chance 1e-4
    assert drafted > N / 2  # the EAGLE3 chain drafted (under the mask) in most requests


def test_a_grammar_over_its_work_limit_ends_the_request_not_the_batch(tok_target, monkeypatch, compiler):
    target, tok = tok_target
    """An ambiguous grammar's Earley rows grow with every token; past `MAX_ITEMS_IN_ROW` its matcher
    errors (instead of masks growing without bound): that request ends with finish_reason length."""
    monkeypatch.setattr(grammar_mod, "MAX_ITEMS_IN_ROW", 20)
    starved = GrammarCompiler.for_target(target, tok)
    heavy = starved.lark('start: x+\nx: "a" | "b" | x x')
    eng = Engine(target, None, EngineParams(max_seq_len=256), suffix=SuffixCache())
    ok_g = compiler.json_schema(SCHEMA)
    bad, good = eng.generate_batch([Request([10, 11], 40, grammar=heavy), Request([10, 11], 80, grammar=ok_g)])
    assert bad.finish_reason == "length" and "max is 20" in (bad.grammar_error or "") and len(bad.tokens) < 40
    assert good.finish_reason == "stop" and good.grammar_error is None


def test_bad_grammars_and_combinations_are_refused(tok_target, compiler):
    target, _ = tok_target
    for schema, why in [({"type": "strin"}, "strin"), ({"properties": {"a": {"$ref": "#/defs/x"}}}, "defs/x")]:
        with pytest.raises(GrammarError, match=why):
            compiler.json_schema(schema)
    with pytest.raises(GrammarError):
        compiler.lark("start: undefined_rule")
    eng = Engine(target, None, EngineParams(max_seq_len=64))
    g = compiler.json_schema(SCHEMA)
    with pytest.raises(ValueError, match="min_tokens"):
        eng.generate_batch([Request([5], 8, grammar=g, sampling=SamplingParams(0.0, min_tokens=3))])
    assert compiler.json_schema(dict(SCHEMA)) is g  # compiled once (cache by grammar text)
