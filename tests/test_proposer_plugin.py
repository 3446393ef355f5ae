"""A fourth proposer joins by its own code and one spec, and the goodput policy uses it.

Prompt lookup decoding (Saxena 2023; transformers' `prompt_lookup_num_tokens`): the continuation of
the last earlier occurrence of the context's trailing n-gram, proposed at no draft cost. It is
written below as a user would write a plugin — a proposer class and an estimator, declared by one
`ProposerSpec` and added to the engine's `ProposerRegistry` (and its policy's) — touching nothing in
the engine. On repetitive prompts the policy must choose it (the tiny target copies its context, so
lookups are accepted), the engine must verify it, and every output must equal target-only decoding.
An engine built with the default registry runs without it."""
from __future__ import annotations

import threading

import pytest

from conftest import random_draft
from tidespec.bench import policy_report
from tidespec.config import EngineParams
from tidespec.engine.calibration import Calibration
from tidespec.engine.policy import GoodputPolicy
from tidespec.engine.proposers import ProposerSpec, Rung, default_proposers
from tidespec.engine.proposers.base import one_hot
from tidespec.engine.speculative import Engine, Request
from tidespec.models.runner import DraftRunner


def lookup(context: list[int], n: int, most: int) -> list[int]:
    """The up to `most` tokens that followed the first occurrence of the context's last n tokens
    (earlier than the tail itself), as transformers' prompt lookup takes its first match."""
    tail = context[-n:]
    for i in range(len(context) - n):
        if context[i:i + n] == tail:
            return context[i + n:i + n + most]
    return []


class PromptLookup:
    name, uses_draft, gated = "prompt_lookup", False, False

    def __init__(self, vocab_size: int, n: int = 2, most: int = 6):
        self.vocab_size, self.n, self.most = vocab_size, n, most

    def offer(self, sl, room, policy):
        s = sl.seq
        if not s.req.speculative or room <= 0:
            return None
        sl.offers[self.name] = tokens = lookup(list(s.req.prompt_ids) + s.gen, self.n, min(room, self.most))
        if not tokens:
            return None
        if sl.learn:
            return Rung(self.name, self, policy.estimator(self.name).gains(sl.workload, len(tokens)))
        return Rung(self.name, self, fixed=(5, len(tokens), 0.0))

    def propose(self, slots):
        for sl in slots:
            sl.drafts = list(sl.offers[self.name][:sl.n])
            if sl.seq.rng is not None:
                sl.draft_probs = one_hot(self.vocab_size, sl.drafts)

    def observe(self, slot):
        pass


class LookupAcceptance:
    """Per class: accepted / reached lookup tokens (a prior of 0.5 until 8 were reached)."""

    def __init__(self, settings):
        self._st, self._lock = {}, threading.Lock()

    def acceptance(self, w: str) -> float:
        acc, n = self._st.get(w, (0.0, 0.0))
        return acc / n if n >= 8 else 0.5

    def gains(self, w: str, m: int) -> tuple[float, ...]:
        a, out, p = self.acceptance(w), [], 1.0
        for _ in range(m):
            p *= a
            out.append((out[-1] if out else 0.0) + p)
        return tuple(out)

    def observe(self, slot) -> None:
        with self._lock:
            st = self._st.setdefault(slot.workload, [0.0, 0.0])
            st[0] += slot.accepted
            st[1] += min(slot.k, slot.accepted + 1)

    def reset(self, replayed=None) -> None:
        self._st.clear()

    def report(self, w: str) -> dict:
        return {"prompt_lookup_acceptance": round(self.acceptance(w), 4)}

    def classes(self) -> set[str]:
        return set(self._st)


SPEC = ProposerSpec(PromptLookup, rung=4, estimator=LookupAcceptance, build=lambda b: PromptLookup(b.vocab_size))


@pytest.fixture
def registry():
    return default_proposers().with_spec(SPEC)


CAL = Calibration((100.0, 101.0, 102.0, 103.0, 104.0, 105.0, 106.0), 2.0, "test", 128)
PROMPTS = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [12, 13] * 6]


def _engine(target, runner, registry):
    return Engine(target, runner, EngineParams(num_draft_tokens=6, max_seq_len=256),
                  policy=GoodputPolicy(CAL, proposers=registry), registry=registry)


def test_a_registered_proposer_is_chosen_by_the_policy_and_stays_lossless(tiny_target, registry):
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=6, max_seq_len=256))
    want = [ref.generate(p, 24, speculative=False).tokens for p in PROMPTS]
    eng = _engine(tiny_target, DraftRunner(random_draft(tiny_target, 64, seed=3)), registry)  # rarely right
    assert [type(p).__name__ for p in eng.proposers] == [
        "Eagle3Chain",
        "GrammarProposer",
        "PromptLookup",
    ]  # no suffix cache
    gens = eng.generate_batch([Request(p, 24, workload="loop") for p in PROMPTS])
    assert [g.tokens for g in gens] == want
    lk = [g.by_proposer.get("prompt_lookup") for g in gens]
    assert all(s is not None and s.num_drafts > 0 for s in lk), lk  # chosen for every request
    assert sum(s.num_accepted_tokens for s in lk) > sum(s.num_drafts for s in lk)  # more than one per verify
    rep = policy_report.report(eng.policy)["loop"]
    assert rep["prompt_lookup_acceptance"] > 0.5 and "conditional_acceptance" in rep  # its estimator learned


def test_outside_the_policy_its_rank_decides_and_without_it_nothing_changes(tiny_target, registry):
    cfg = EngineParams(num_draft_tokens=6, max_seq_len=256)
    g = Engine(tiny_target, None, cfg, registry=registry).generate(PROMPTS[0], 16)  # no draft, no policy
    assert g.by_proposer["prompt_lookup"].num_drafts > 0
    plain = Engine(tiny_target, None, cfg, registry=registry.without(PromptLookup)).generate(PROMPTS[0], 16)
    assert plain.tokens == g.tokens and plain.by_proposer == {}
    assert Engine(tiny_target, None, cfg).registry.kinds == default_proposers().kinds  # the default: no plugin


def test_a_rung_or_kind_clash_is_refused(registry):
    class Other(PromptLookup):
        pass
    with pytest.raises(ValueError, match="rung 4 is PromptLookup's"):
        registry.with_spec(ProposerSpec(Other, rung=4, estimator=LookupAcceptance))
    with pytest.raises(ValueError, match="share one estimator"):
        registry.with_spec(ProposerSpec(Other, rung=9, estimator=lambda s: LookupAcceptance(s)))


def test_a_policy_built_over_another_registry_is_refused_when_the_engine_is_built(tiny_target, registry):
    policy = GoodputPolicy(CAL)  # the default proposers' estimators only
    with pytest.raises(ValueError, match=r"no estimator for proposer\(s\) \['prompt_lookup'\]"):
        Engine(tiny_target, None, EngineParams(num_draft_tokens=6, max_seq_len=256), policy=policy, registry=registry)


class Failing(PromptLookup):
    """Offers whenever a lookup exists, then fails while drafting: the step's shared part fails."""

    def offer(self, sl, room, policy):
        r = super().offer(sl, room, policy)
        return None if r is None else Rung(self.name, self, fixed=(0, len(sl.offers[self.name]), 0.0))

    def propose(self, slots):
        raise RuntimeError("plugin propose failed")


def test_a_failing_proposer_fails_its_step_and_frees_every_requests_state(tiny_target):
    from tidespec.engine.suffix_tree import SuffixCache
    registry = default_proposers().with_spec(
        ProposerSpec(Failing, rung=7, estimator=LookupAcceptance, build=lambda b: Failing(b.vocab_size)))
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=6, max_seq_len=256), suffix=SuffixCache(),
                 registry=registry)
    futs = [eng.submit(Request(p, 24, request_id=f"r{i}")) for i, p in enumerate(PROMPTS)]
    while not all(f.done() for f in futs):
        eng.step()
    assert [str(f.exception()) for f in futs] == ["plugin propose failed"] * 3
    assert eng.suffix._live == {} and eng._running == [] and eng._seqs == {}  # nothing of theirs is kept
