"""The goodput policy: adaptive num_draft_tokens (k), proposer choice and the speculation
off-switch, per workload class and per batch.

Acceptance (Leviathan et al. 2023, arXiv 2211.17192 §3.4): with k drafts a step emits
τ(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j tokens on average, a_j the conditional acceptance at draft position
j — a running mean that starts from a prior worth PRIOR_CHAINS observations, then (after 1/alpha
observations) an EMA, per workload class over verify steps that reached position j. The prior of
a₁ is the draft's first-token acceptance its evaluation replayed on the class (its holdout), else
`prior`: the first few chains of a new draft (which a short request's first steps draft at any
luck) no longer decide alone — four rejections in a row had set a₁ to 0 and left the class off
until a probe, on a class where the draft is accepted more often than not. A suffix proposal's
expected accepted tokens are the sum of its chain scores (SuffixDecoding, arXiv 2411.04975 §4)
times a per-class correction, measured accepted over predicted (shrunk towards 1 by one
pseudo-proposal, so it never locks at 0).

Cost and choice (`engine.goodput`): a step's wall time is predicted for the whole batch from the
calibrated (batch, rows) grid (`engine.calibration`), re-fitted online from measured steps; each
request's proposer and length maximise the step's predicted tokens per second, and speculation
stays on only if that beats plain decoding by `margin` (default 5 %): near break-even the
prediction's error is larger than the gain, and a wrong "on" costs up to the whole draft overhead.
Hysteresis: the EAGLE3 draft turns on where the predicted gain reaches `margin` and, once on for
every class in the batch (each drafted last step), stays on while it reaches `margin_off` (≤ margin),
so a load that sits where the two predictions cross (a batch of 4 that pays, 5 that does not) does
not switch the draft on and off every step — each switch back on costs a catch-up of the rows the
draft missed. A class that was not drafting (or a step of suffix proposals only) gets the full margin.
A class with speculation off still probes (with the best k ≥ 1 of a request alone), so a draft that
improves (hot-swap) or a workload that turns structured is noticed: first after `probe_every` of its
idle steps, then, while each probe leaves the class off, after twice as many (up to
`PROBE_BACKOFF` × probe_every, exponential back-off): a draft that stays useless under load costs
one probe (a catch-up of the rows it missed, k drafts, k verify rows) per 512 steps, not per 32.

Realized margin: what the cost model leaves out — the engine's own work per step (planning, suffix
proposals, bookkeeping of accepted rows; the draft's catch-up over a long backlog, which the plan
charges amortised over the request's steps left, `StepCost.catch_up_ms`, but no step's prediction
counts) — and the optimism of a plan chosen because its prediction was high, are measured instead
of modelled. Per workload class and calibrated
batch size, every decode step's realized tokens per ms (accepted drafts + one per request ÷ the
step's wall time) is compared with its plan's prediction (the draft's catch-up of a backlog
excluded: it is paid once), separately for steps the policy chose that speculated and steps that did
not (probe steps and steps with a request outside the policy are not counted; a step counts for
every class it ran) — each step's ratio clipped to [½, 2], a running mean then an EMA, shrunk
towards 1 by REALIZED_PRIOR steps, the speculative evidence aging while plain steps run. The margin
a plan must clear becomes (1 + margin) · ρ_plain / ρ_spec − 1 for the class of the batch where it is
highest, never below `margin`, and `margin` for a class until both kinds were seen at that batch
size. Where speculative steps realize 10 % less of their prediction than plain ones (ρ after the
shrink), a plan must predict 1.05 / 0.9 = 1.17× to run: the predicted gain must pay for what the
prediction missed (on 2 CPU cores at 8 requests, the hybrid's plans predicted 1.2× and realized ≈
1.0×: `bench/inprocess_ab.py --breakdown`). Per class because the optimism is a class's (how far its
suffix proposals' scores and its acceptance estimate run ahead of what is accepted): pooled over
classes, code's accurate plans at 8 requests held the margin at 5 % while math's realized 0.9× of
plain decoding at every pass of an in-process A/B.

Suffix proposals are gated the same way, per class and batch size (the calibrated size nearest
to the batch): computing them (a trie match and a scan of the request's context, or its own trie
once built: `suffix.OWN_TREE_AFTER`) is pure overhead in a step that does not choose them — at 16
requests on a CPU, 2 % of the step time when the plan chose none. A class whose proposals the plan left unchosen
for `probe_every` consecutive steps at that batch size stops computing them (a step where none of
its requests' tries matched is not counted: repetition comes in bursts); a probe step computes
them again after `probe_every` steps, then after twice as many while each probe is left unchosen
(up to PROBE_BACKOFF × probe_every); one chosen proposal turns them back on every step.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence

from .calibration import Calibration, draft_shape, measure_draft
from .goodput import NONE, Ladder, StepCost, goodput, plan, step_draft_batches
from .stats import simulated_acceptance_length


CONF_BINS = 10  # draft-confidence bins for the early stop's acceptance estimate
GRAMMAR_PRIOR = 0.95  # acceptance of a grammar-forced token before any was measured
PRIOR_CHAINS = 4  # observations the starting acceptance of a class is worth
SUFFIX_PRIOR = 1.0  # pseudo-proposals at correction 1.0 that a class's measured suffix correction is shrunk towards
REALIZED_PRIOR = 8  # steps the neutral realized / predicted ratio (1.0) is worth, per batch size and kind
REALIZED_CLIP = 2.0  # one step's realized / predicted goodput is clipped to [1/2, 2] (a stalled step is one step)
PROBE_BACKLOG = 64  # a probe skips a request whose draft has more prompt rows to read (2 × default probe_every)
PROBE_BACKOFF = 16  # a class left off probes at most this many times less often than probe_every
TREE = "#tree"  # suffix of a class's key for the per-depth acceptance of its EAGLE-2 trees


def predicted_tau(acc: list[float], k: int) -> float:
    """τ(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j from conditional per-position acceptance `acc` (first k used)."""
    return simulated_acceptance_length(acc[:k])


def first_token_priors(replayed: Mapping[str, tuple[float, float]], prior: float) -> dict[str, float]:
    """a₁'s starting value per class from a draft's replayed first-token acceptance {class: (a₁,
    chains)} ("" = over all classes): the overall a₁ shrunk towards `prior`, a class's towards the
    overall one, each by PRIOR_CHAINS pseudo-chains — (n·a + PRIOR_CHAINS·fallback) / (n + PRIOR_CHAINS)
    — so a class replayed on two chains, both rejected, does not start at 0 (off until a probe); one
    replayed on no chain starts from the fallback. Raises ValueError for an entry that is not
    (a₁ in [0, 1], chains >= 0)."""
    def shrunk(w: str, fallback: float) -> float:
        try:
            a, n = (float(x) for x in replayed[w])
        except (TypeError, ValueError):
            raise ValueError(f"replayed[{w!r}] = {replayed[w]!r}: expected (first-token acceptance, chains)") from None
        if not (0.0 <= a <= 1.0 and 0.0 <= n < math.inf):
            raise ValueError(f"replayed[{w!r}] = ({a}, {n}): first-token acceptance must be in [0, 1] and chains >= 0")
        return (n * a + PRIOR_CHAINS * fallback) / (n + PRIOR_CHAINS)

    overall = shrunk("", prior) if "" in replayed else prior
    out = {w: shrunk(w, overall) for w in replayed if w}
    return out | ({"": overall} if "" in replayed else {})


def _argmax(xs: list[float], lo: int = 0) -> int:
    return max(range(lo, len(xs)), key=xs.__getitem__)


class AdaptiveK:
    """The goodput policy: per workload class, an EMA of the EAGLE3 draft's conditional
    per-position acceptance and a correction of the suffix proposer's scores; per step, each
    request's proposer and draft length for the whole batch (`engine.goodput.plan`).

    prior: initial a_j for an unseen class (optimistic, so a new class tries speculation; worth
    PRIOR_CHAINS observations; a₁ starts from the draft's replayed acceptance where `reset` gave one);
    alpha: EMA weight of one observation (the first 1/alpha observations are averaged);
    probe_every: with speculation off, the class's n-th idle step runs the best k ≥ 1 to keep the
    estimate fresh (then back-off, see the module docstring); margin: the predicted gain over plain
    decoding (0.05 = 5 %) below which speculation stays off; margin_off: once on, the gain below
    which it turns off (None = margin: no hysteresis). Raises ValueError for values out of range.
    Thread-safe.
    """

    def __init__(self, calibration: Calibration, prior: float = 0.6, alpha: float = 0.05,
                 probe_every: int = 32, margin: float = 0.05, margin_off: float | None = None):
        margin_off = margin if margin_off is None else margin_off
        if not 0 <= prior <= 1 or not 0 < alpha <= 1 or probe_every < 1 or not 0 <= margin < 1:
            raise ValueError("AdaptiveK needs 0 <= prior <= 1, 0 < alpha <= 1, probe_every >= 1, 0 <= margin < 1")
        if not 0 <= margin_off <= margin:
            raise ValueError(f"margin_off {margin_off} must be in [0, margin {margin}] (engine.adaptive_margin_off "
                             "<= engine.adaptive_margin: the band speculation stays on in)")
        self.cal = calibration
        self.cost = StepCost(calibration)
        self.k_max = calibration.k_max
        self.prior, self.alpha, self.probe_every, self.margin = prior, alpha, probe_every, margin
        self.margin_off = margin_off
        self._on: set[str] = set()  # classes the EAGLE3 draft drafted for last step (probes aside): hysteresis
        self._gap: dict[str, int] = {}  # class → idle steps between its probes now (back-off)
        self._turn: dict[str, int] = {}  # class → probes run (rotates over its requests)
        self._acc: dict[str, list[float]] = {}
        self._obs: dict[str, list[int]] = {}  # observations per position (running mean until 1/alpha)
        self._steps: dict[str, int] = {}
        self._suffix: dict[str, list] = {}  # class → [mean accepted, mean expected, observations] of suffix proposals
        self._grammar: dict[str, list] = {}  # class → [accepted, proposed] forced tokens (decayed sums)
        self._conf: dict[str, list[list[float]]] = {}  # class → per confidence bin [P(accept), observations]
        self._tree: dict[str, dict[int, list]] = {}  # class → nodes verified → [mean accepted, observations]
        self._sfx_gate: dict[tuple[str, int], list[int]] = {}  # (class, batch size) → [misses, gap, idle]
        self._first: dict[str, float] = {}  # class → the served draft's replayed first-token acceptance ("": all)
        # (class, batch size, speculated) → [mean realized / predicted tokens per ms, steps (aged)]: running mean, then EMA
        self._real: dict[tuple[str, int, bool], list[float]] = {}
        self._lock = threading.Lock()

    def ensure_draft_costs(self, target, runner) -> bool:
        """Time `runner`'s draft steps when the calibration holds another draft's (or none: an engine
        that started without a draft), so a hot-swapped draft is never costed as free. Returns True
        when it measured."""
        shape = draft_shape(runner)
        if runner is None or shape == self.cal.draft_shape:
            return False
        dms = measure_draft(target, runner, self.cal.batch_sizes, self.cal.context)
        with self._lock:
            self.cal = self.cal.with_draft_costs(dms, shape)
            self.cost.cal = self.cal
        return True

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None:
        """Forget acceptance (after a draft hot-swap); keep the measured step costs. `replayed`: the
        new draft's first-token acceptance its evaluation replayed and the chains it counted, per
        class ("" = over all classes): a₁'s prior (`first_token_priors`)."""
        first = first_token_priors(replayed or {}, self.prior)
        with self._lock:
            self._first = first
            self._acc.clear()
            self._obs.clear()
            self._steps.clear()
            self._gap.clear()
            self._turn.clear()
            self._on = set()
            self._suffix.clear()
            self._grammar.clear()
            self._conf.clear()
            self._tree.clear()
            self._sfx_gate.clear()
            self._real.clear()

    def _start(self, workload: str) -> list[float]:
        """The prior per-position acceptance of a class (call with the lock held)."""
        a1 = self.prior if workload.endswith(TREE) else self._first.get(workload, self._first.get("", self.prior))
        return [a1] + [self.prior] * (self.k_max - 1)

    def acceptance(self, workload: str) -> list[float]:
        """The class's conditional acceptance at draft positions 1..k_max (its prior until observed)."""
        with self._lock:
            return list(self._acc.get(workload) or self._start(workload))

    def eagle_gains(self, workload: str, k_max: int | None = None) -> tuple[float, ...]:
        """Expected accepted drafts τ(k) − 1 for k = 1..k_max (cumulative products of the class's
        conditional acceptance)."""
        acc, out, p = self.acceptance(workload), [], 1.0
        for a in acc[:self.k_max if k_max is None else min(k_max, self.k_max)]:
            p *= a
            out.append((out[-1] if out else 0.0) + p)
        return tuple(out)

    def tree_gains(self, workload: str, nodes: int, depth_of) -> tuple[float, ...]:
        """Expected accepted tokens of an EAGLE-2 tree verifying n = 1..nodes drafted nodes
        (`engine.tree`), depth `depth_of(n)`: the measured mean for that n (running mean, then EMA)
        where measured, else τ(depth) − 1 from the class's per-depth conditional acceptance of its
        trees (a tree's best path is at least the chain); made non-decreasing in n."""
        chain = self.eagle_gains(workload + TREE)
        with self._lock:
            seen = {n: v[0] for n, v in self._tree.get(workload, {}).items()}
        out, best = [], 0.0
        for n in range(1, nodes + 1):
            d = min(depth_of(n), len(chain))
            g = seen.get(n, chain[d - 1] if d else 0.0)
            best = max(best, g)
            out.append(best)
        return tuple(out)

    def observe_tree(self, workload: str, nodes: int, depth: int, accepted: int) -> None:
        """A verified tree of `nodes` drafted nodes and `depth`: `accepted` tokens on its accepted path."""
        if nodes < 1:
            return
        self.observe(workload + TREE, depth, accepted)
        with self._lock:
            st = self._tree.setdefault(workload, {}).setdefault(nodes, [0.0, 0])
            st[1] += 1
            st[0] += max(self.alpha, 1.0 / st[1]) * (accepted - st[0])

    def suffix_correction(self, workload: str) -> float:
        """Measured accepted / expected (by the suffix scores) for this class's suffix proposals,
        shrunk towards 1.0 by SUFFIX_PRIOR pseudo-proposals: (w·r + 1) / (w + 1), r the measured
        ratio, w its weight (proposals seen, at most 1/alpha: the EMA's memory). One wrong proposal
        halves it and it never reaches 0 — a class whose first proposals failed still takes a
        strong one where rows are cheap, and learns again (at 0 its proposals were never chosen,
        hence never measured: one early miss turned the proposer off for the class for good).
        1.0 until measured; at most 2."""
        with self._lock:
            acc, exp, n = self._suffix.get(workload, (1.0, 1.0, 0))
        if exp <= 0 or n == 0:
            return 1.0
        w = min(n, 1.0 / self.alpha)
        return min(2.0, (w * acc / exp + SUFFIX_PRIOR) / (w + SUFFIX_PRIOR))

    def suffix_gains(self, workload: str, scores: tuple[float, ...] | list[float]) -> tuple[float, ...]:
        """Expected accepted tokens for the first m = 1..len tokens of a suffix proposal whose
        chain scores (cumulative conditional frequencies) are `scores`, corrected by the class's
        measured ratio; a position adds at most 1."""
        c, out = self.suffix_correction(workload), []
        for x in scores:
            out.append((out[-1] if out else 0.0) + min(1.0, c * x))
        return tuple(out)

    def observe_suffix(self, workload: str, expected: float, accepted: int) -> None:
        """A verified suffix proposal: its expected accepted tokens (sum of chain scores) and the
        accepted count (running means of both for the first 1/alpha proposals, then EMAs: the
        correction is a ratio of means and is learned from the first proposals on)."""
        if expected > 0:
            with self._lock:
                st = self._suffix.setdefault(workload, [0.0, 0.0, 0])
                st[2] += 1
                w = max(self.alpha, 1.0 / st[2])  # a running mean first (as the acceptance), then an EMA
                st[0] += w * (accepted - st[0])
                st[1] += w * (expected - st[1])

    def suffix_due(self, workload: str, b: int) -> bool:
        """Should this step compute the class's suffix proposals, in a batch of b requests? Yes until
        the plan left them unchosen for `probe_every` consecutive steps at this batch size; then only
        on a probe step (see the module docstring). Counts one idle step when it answers no."""
        with self._lock:
            st = self._sfx_gate.get((workload, self.cost.bucket(b)))
            if st is None or st[0] < self.probe_every:
                return True
            st[2] += 1
            if st[2] < st[1]:
                return False
            st[2] = 0
            return True

    def observe_suffix_plan(self, workload: str, b: int, chosen: bool) -> None:
        """A step that computed the class's suffix proposals (batch of b): did the plan choose one? A
        miss counts towards turning them off; a probe left unchosen doubles the gap to the next one."""
        with self._lock:
            st = self._sfx_gate.setdefault((workload, self.cost.bucket(b)), [0, self.probe_every, 0])
            if chosen:
                st[:] = [0, self.probe_every, 0]
                return
            st[0] += 1
            if st[0] > self.probe_every:  # it was off: this was a probe
                st[1] = min(2 * st[1], PROBE_BACKOFF * self.probe_every)

    def suffix_off_at(self, workload: str) -> list[int]:
        """The batch sizes at which the class's suffix proposals are off (probed only)."""
        with self._lock:
            return sorted(b for (w, b), st in self._sfx_gate.items() if w == workload and st[0] >= self.probe_every)

    def grammar_acceptance(self, workload: str) -> float:
        """Per-token acceptance of grammar-forced tokens in this class: accepted / proposed (decayed
        sums); 0.95 until 8 tokens were measured (forced bytes are certain, only the target's
        tokenization of them can differ)."""
        with self._lock:
            acc, n = self._grammar.get(workload, (0.0, 0.0))
        return acc / n if n >= 8 else GRAMMAR_PRIOR

    def grammar_gains(self, workload: str, m: int) -> tuple[float, ...]:
        """Expected accepted tokens for the first 1..m forced tokens: Σ_{i≤j} a^i (a token is
        reached only if the ones before it were accepted)."""
        a, out, p = self.grammar_acceptance(workload), [], 1.0
        for _ in range(m):
            p *= a
            out.append((out[-1] if out else 0.0) + p)
        return tuple(out)

    def observe_grammar(self, workload: str, proposed: int, accepted: int) -> None:
        """A verified grammar proposal: `proposed` forced tokens, the first `accepted` accepted. The
        tokens verification reached count (accepted + the first rejected one), decayed by 1 − alpha."""
        reached = min(proposed, accepted + 1)
        if reached < 1:
            return
        with self._lock:
            st = self._grammar.setdefault(workload, [0.0, 0.0])
            st[0] = (1 - self.alpha) * st[0] + accepted
            st[1] = (1 - self.alpha) * st[1] + reached

    def accept_given_confidence(self, workload: str, conf: float) -> float:
        """P(a drafted token is accepted | the ones before it were, the draft's probability of it
        is `conf`), per class and confidence bin (CONF_BINS bins on [0, 1]): the draft's own
        confidence until the bin has been observed (EAGLE-2, arXiv 2406.16858 §4: a draft's
        confidence approximates its acceptance rate), then a running mean / EMA of what was accepted."""
        b = min(int(conf * CONF_BINS), CONF_BINS - 1)
        with self._lock:
            bins = self._conf.get(workload)
            return conf if bins is None or bins[b][1] == 0 else bins[b][0]

    def observe_confidence(self, workload: str, confs: list[float], accepted: int) -> None:
        """A verified EAGLE3 chain: the draft's probability of each drafted token and how many were
        accepted. Positions up to the first rejection are observations (later ones were never tested)."""
        with self._lock:
            bins = self._conf.setdefault(workload, [[0.0, 0] for _ in range(CONF_BINS)])
            for j, c in enumerate(confs[:accepted + 1]):
                x = bins[min(int(c * CONF_BINS), CONF_BINS - 1)]
                x[1] += 1
                x[0] += max(self.alpha, 1.0 / x[1]) * (float(j < accepted) - x[0])

    def stop_below(self, ladders: list[Ladder], choice: list[tuple[str, int]]) -> float:
        """Draft early stop for this step's plan: the probability (that a further drafted token is
        reached and accepted) below which drafting it costs more than it returns — its verify row and
        draft step, in ms, times the plan's predicted tokens per ms. Chains stop there
        (`engine.proposers.eagle3`), as SpecDec++ (arXiv 2405.19715 §3) stops at a threshold on the
        predicted rejection probability, here derived from the step's cost model instead of tuned."""
        b = len(ladders)
        rows = b + sum(n for _, n in choice)
        chains = sum(1 for lad, (v, n) in zip(ladders, choice) if v == "eagle3" and n and lad.draft_rows == 1)
        drafts = step_draft_batches(ladders, choice)
        ms = self.cost.predict(b, rows, drafts)
        # one more verify row, and one more request in a batched draft step (its logits are already paid)
        marginal = self.cost.predict(b, rows + 1, drafts) - ms + self.cost.factor(b, (rows + 1) / b) * (
            self.cal.draft_cost(chains + 1) - self.cal.draft_cost(chains))
        return max(0.0, marginal) * goodput(ladders, choice, self.cost)

    def predicted_tokens_per_s(self, workload: str) -> list[float]:
        """Predicted tokens/s of one request alone for k = 0..k_max."""
        ms = self.step_ms()
        gains = (0.0, *self.eagle_gains(workload))
        return [1000 * (1 + gains[k]) / ms[k] for k in range(self.k_max + 1)]

    def step_ms(self) -> list[float]:
        """Current cost estimate (ms) of one request's step alone with k = 0..k_max drafts.

        Each (batch, rows) cell of the cost model is re-fitted separately, so a load spike during
        k = 0 steps could make plain decoding look dearer than verifying k + 1 tokens after k draft
        steps — physically impossible, and it made a per-k model predict speed-ups far above τ
        (3.9× at τ 1.05 on a noisy machine). The factor applied to k drafts is the largest over
        0..k (`StepCost.factor`): the predicted speed-up is then at most τ(k) · T_cal(0)/T_cal(k)
        whatever the spikes."""
        return [self.cost.predict(1, k + 1, [1] * k) for k in range(self.k_max + 1)]

    def observe_time(self, k: int, ms: float, alpha: float = 0.1) -> None:
        """A measured single-request step with k drafts took `ms` (`observe_step` for batches)."""
        if 0 <= k <= self.k_max:
            self.cost.observe(1, k + 1, [1] * k, ms, alpha)

    def observe_step(self, b: int, total_rows: int, draft_batches: list[int], ms: float) -> None:
        """A measured decode step of b requests, `total_rows` verified rows, one batched draft
        forward per entry of `draft_batches`, took `ms`."""
        self.cost.observe(b, total_rows, draft_batches, ms)

    def observe_realized(self, workloads: Sequence[str], speculated: bool, predicted: tuple[float, float],
                         tokens: int, ms: float) -> None:
        """A decode step of len(workloads) requests (each one's class) as it ran: its plan's
        `predicted` (expected tokens, ms) against the tokens it verified (accepted drafts + one per
        request) and its wall time in ms (plan to the proposers' bookkeeping, the draft's catch-up
        excluded: a backlog is paid once, not by this step's plan). `speculated`: the plan verified
        drafts. The step's ratio (realized ÷ predicted tokens per ms) is clipped to
        [1/REALIZED_CLIP, REALIZED_CLIP] (a stalled step is one step) and counts for every class in
        the step. A plain step also ages the speculative evidence of its classes at its batch size
        (its weight × (1 − alpha/4)), so a margin raised by steps long past relaxes towards `margin`
        and speculation is tried again. Non-finite or non-positive values are ignored."""
        b = len(workloads)
        p_tok, p_ms = predicted
        if b < 1 or tokens < 1 or not all(math.isfinite(x) and x > 0 for x in (p_tok, p_ms, ms)):
            return
        x = min(REALIZED_CLIP, max(1 / REALIZED_CLIP, (tokens / p_tok) * (p_ms / ms)))
        bucket = self.cost.bucket(b)
        with self._lock:
            for w in set(workloads):
                st = self._real.setdefault((w, bucket, speculated), [1.0, 0.0])
                st[1] += 1
                st[0] += max(self.alpha, 1.0 / st[1]) * (x - st[0])
                if not speculated and (w, bucket, True) in self._real:
                    self._real[(w, bucket, True)][1] *= 1 - self.alpha / 4

    def realized_ratio(self, workload: str, b: int, speculated: bool) -> float | None:
        """ρ: the class's mean realized ÷ predicted tokens per ms over the steps at b's calibrated
        batch size that did (or did not) speculate (a running mean, then an EMA), shrunk towards 1
        by REALIZED_PRIOR steps (weight: steps seen, aged, at most 1/alpha). None when none was seen."""
        with self._lock:
            st = self._real.get((workload, self.cost.bucket(b), speculated))
            rho, n = (st[0], st[1]) if st is not None else (None, 0.0)
        if rho is None:
            return None
        w = min(n, 1.0 / self.alpha)
        return (w * rho + REALIZED_PRIOR) / (w + REALIZED_PRIOR)

    def margin_at(self, workloads: Iterable[str], b: int, margin: float) -> float:
        """The margin a plan of b requests of these classes must clear: `margin` raised by what
        speculation realized of its predictions relative to plain decoding at this batch size,
        (1 + margin) · ρ_plain / ρ_spec − 1 for the class where that is highest; never below
        `margin`, and `margin` for a class until both kinds of step were seen there (without plain
        steps to compare with, the engine's own work would be blamed on speculation)."""
        return max([margin, *(self._class_margin(w, b, margin) for w in set(workloads))])

    def _class_margin(self, workload: str, b: int, margin: float) -> float:
        """(1 + margin) · ρ_plain / ρ_spec − 1 of one class at b, `margin` where that is lower or a
        kind of step was not seen."""
        plain, spec = self.realized_ratio(workload, b, False), self.realized_ratio(workload, b, True)
        return margin if plain is None or spec is None or plain <= spec else (1 + margin) * plain / spec - 1

    def realized(self) -> dict[str, dict[int, dict[str, float]]]:
        """Per class and calibrated batch size seen: ρ of plain and speculative steps and the margin
        a plan of that class there must clear (`margin_at`)."""
        with self._lock:
            seen = sorted({(w, b) for w, b, _ in self._real})
        def r(x: float | None) -> float | None:
            return None if x is None else round(x, 4)
        out: dict[str, dict[int, dict[str, float]]] = {}
        for w, b in seen:
            out.setdefault(w, {})[b] = {"plain": r(self.realized_ratio(w, b, False)),
                                        "speculative": r(self.realized_ratio(w, b, True)),
                                        "margin": round(self.margin_at([w], b, self.margin), 4)}
        return out

    def _pick(self, tps: list[float]) -> int:
        k = _argmax(tps, lo=1)
        return k if tps[k] > (1 + self.margin) * tps[0] else 0

    def best_k(self, workload: str) -> int:
        """The k ≥ 1 with the highest predicted tokens/s of a request alone if it beats plain
        decoding by `margin`, else 0 (speculation off); no probing."""
        return self._pick(self.predicted_tokens_per_s(workload))

    def _probe(self, workload: str) -> bool:
        """Count one idle step of the class; True when it is due a probe (then the next gap doubles,
        up to PROBE_BACKOFF × probe_every)."""
        with self._lock:
            n = self._steps[workload] = self._steps.get(workload, 0) + 1
            gap = self._gap.get(workload, self.probe_every)
            if n < gap:
                return False
            self._steps[workload] = 0
            self._gap[workload] = min(2 * gap, PROBE_BACKOFF * self.probe_every)
            return True

    def _speculated(self, workload: str) -> None:
        """The plan chose the EAGLE3 draft for the class (not a probe): probing restarts at probe_every."""
        with self._lock:
            self._gap.pop(workload, None)
            self._steps.pop(workload, None)

    def choose(self, workload: str) -> int:
        """k for the next step of a request of this class running alone (0 = plain decoding; with
        speculation off, probes the best k ≥ 1 when one is due: `probe_every` idle steps, then back-off)."""
        tps = self.predicted_tokens_per_s(workload)
        k = self._pick(tps)
        return _argmax(tps, lo=1) if k == 0 and self._probe(workload) else k

    def plan_step(self, workloads: list[str], ladders: list[Ladder], probes: list[int] | None = None,
                  prompt_backlogs: list[int] | None = None) -> list[tuple[str, int]]:
        """Each request's (proposer, drafted tokens) for a step of this batch (`goodput.plan`, with
        the hysteresis margin: `margin` to turn the draft on, `margin_off` to keep it on while every
        class that could draft drafted last step). A class
        whose requests could draft with EAGLE3 but were all left without: a probe when due (see the
        module docstring) on one of its requests without a proposal this step, so the EAGLE3
        acceptance estimate stays fresh (suffix and grammar proposals do not refresh it): rotating
        over those whose draft has read its prompt or has at most `PROBE_BACKLOG` rows of it to read
        (`prompt_backlogs`, `Seq.prompt_backlog`: a probe's draft first catches up over them, and a
        long prompt's catch-up cost more than the probe measured), else the one with the fewest.
        `probes`, when given, receives the indices of the requests a probe was forced on."""
        eager = {w for w, lad in zip(workloads, ladders) if lad.fixed is None and lad.eagle}
        with self._lock:
            margin = self.margin_off if eager and eager <= self._on else self.margin
        choice = plan(ladders, self.cost, self.margin_at(workloads, len(ladders), margin))
        drafted = {w for w, lad, c in zip(workloads, ladders, choice) if lad.fixed is None and c[0] == "eagle3"}
        for w in drafted:  # the class's EAGLE3 estimate is being refreshed: no probe due, back-off forgotten
            self._speculated(w)
        idle: dict[str, list[int]] = {}  # class → requests that could draft but were left without
        for i, (w, lad, c) in enumerate(zip(workloads, ladders, choice)):
            if w not in drafted and lad.fixed is None and lad.eagle and c == NONE:
                idle.setdefault(w, []).append(i)
        with self._lock:
            self._on = drafted
        for w, idx in idle.items():
            if self._probe(w):
                with self._lock:
                    self._turn[w] = self._turn.get(w, -1) + 1
                    j = self._turn[w] % len(idx)
                i = self._probe_target(idx[j:] + idx[:j], prompt_backlogs)
                choice[i] = ("eagle3", self.probe_size(ladders[i]))
                if probes is not None:
                    probes.append(i)
        return choice

    @staticmethod
    def _probe_target(order: list[int], prompt_backlogs: list[int] | None) -> int:
        """The first request in the rotation `order` with at most PROBE_BACKLOG prompt rows left to
        read (0: its draft read the prompt); the one with the fewest when none (none given: the first)."""
        if prompt_backlogs is None:
            return order[0]
        cheap = [r for r in order if prompt_backlogs[r] <= PROBE_BACKLOG]
        return cheap[0] if cheap else min(order, key=lambda r: prompt_backlogs[r])

    def probe_size(self, ladder: Ladder) -> int:
        """The EAGLE3 option (k, or tree nodes) ≥ 1 a probe runs: the one of highest predicted
        tokens/s for this request alone (its own ladder: chains and trees alike)."""
        g = [goodput([ladder], [("eagle3", n)], self.cost) for n in range(1, len(ladder.eagle) + 1)]
        return 1 + _argmax(g)

    def observe(self, workload: str, k: int, accepted: int) -> None:
        """One verify step: k drafts, the first `accepted` accepted. Updates positions 1..min(accepted+1, k)."""
        if k < 1:
            return
        with self._lock:
            acc = self._acc.setdefault(workload, self._start(workload))
            obs = self._obs.setdefault(workload, [PRIOR_CHAINS] * self.k_max)
            for j in range(min(accepted + 1, k, self.k_max)):
                obs[j] += 1
                acc[j] += max(self.alpha, 1.0 / obs[j]) * (float(j < accepted) - acc[j])

    def k_by_batch(self, workload: str) -> dict[int, int]:
        """The EAGLE3 k the policy would give every request of a batch of b requests of this class
        (no suffix proposals), for each calibrated batch size b."""
        out = {}
        for b in self.cal.batch_sizes:
            ch = plan([Ladder(self.eagle_gains(workload))] * b, self.cost, self.margin_at([workload], b, self.margin))
            out[b] = max(n for _, n in ch)
        return out

    def report(self) -> dict[str, dict]:
        """Per class: chosen k alone and by batch size, predicted speed-up over plain decoding alone,
        conditional acceptance, the suffix correction."""
        out = {}
        with self._lock:
            classes = sorted(set(self._acc) | set(self._suffix) | set(self._grammar) | {w for w, _ in self._sfx_gate})
        for w in classes:
            if w.endswith(TREE):  # EAGLE-2 trees: accepted tokens learned per tree size
                with self._lock:
                    seen = {n: round(v[0], 4) for n, v in sorted(self._tree.get(w[:-len(TREE)], {}).items())}
                out[w] = {"conditional_acceptance_by_depth": [round(a, 4) for a in self.acceptance(w)],
                          "accepted_by_tree_size": seen}
                continue
            tps = self.predicted_tokens_per_s(w)
            k = self._pick(tps)
            out[w] = {"k": k, "speculation": k > 0, "predicted_speedup": tps[k] / tps[0],
                      "k_by_batch": self.k_by_batch(w),
                      "step_ms": [round(x, 2) for x in self.step_ms()],
                      "conditional_acceptance": [round(a, 4) for a in self.acceptance(w)],
                      "suffix_correction": round(self.suffix_correction(w), 4),
                      "suffix_off_at_batch": self.suffix_off_at(w),
                      "grammar_acceptance": round(self.grammar_acceptance(w), 4)}
        return out
