"""The goodput policy: each running request's proposer and draft length per step, for the whole
batch, over the proposers of an engine (`proposers.registry.ProposerRegistry`).

Each proposer's estimator predicts, per workload class, what its options would have accepted; the
cost model (`StepCost`) predicts the step's wall time; the search (`search.plan`) picks the options
of highest predicted tokens per ms, kept only where they beat plain decoding by the margin
(`MarginController`); a class whose draft was left off is probed now and then (`ProbeSchedule`).
The same objective as vLLM's goodput-driven speculation length (RFC #48627) and SGLang's adaptive
speculative steps. What the engine asks of it is `engine.plan.StepPolicy` (what a proposer asks,
`proposers.base.ProposerPolicy`); its reports for the benchmarks are `bench.policy_report`.
Figures behind the defaults: docs/design/policy.md.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..calibration import Calibration, draft_shape, measure_draft
from ..proposers.base import Estimator
from ..proposers.registry import ProposerRegistry, default_proposers
from .cost import StepCost
from .margin import MarginController
from .probes import ProbeSchedule
from .search import NONE, Ladder, best_alone, goodput, plan, predicted_step, step_draft_batches


@dataclass(frozen=True)
class PolicyConfig:
    """prior: starting per-position acceptance of an unseen class (worth PRIOR_CHAINS observations);
    alpha: EMA weight of one observation (the first 1/alpha are averaged); probe_every: idle steps
    before a class left off is probed (then back-off); margin: the predicted gain over plain
    decoding below which speculation stays off; margin_off: once on, the gain below which it turns
    off (None = margin); k_max: the longest chain the calibration timed (set by the policy)."""

    prior: float = 0.6
    alpha: float = 0.05
    probe_every: int = 32
    margin: float = 0.05
    margin_off: float | None = None
    k_max: int = 0

    def __post_init__(self):
        if not 0 <= self.prior <= 1 or not 0 < self.alpha <= 1:
            raise ValueError(f"the policy needs 0 <= prior <= 1 and 0 < alpha <= 1, got {self.prior}, {self.alpha}")

    @classmethod
    def from_params(cls, e) -> PolicyConfig:
        """From `EngineParams` (engine.adaptive_*)."""
        return cls(e.adaptive_prior, probe_every=e.adaptive_probe_every, margin=e.adaptive_margin,
                   margin_off=e.adaptive_margin_off)


@dataclass(frozen=True)
class StepChoice:
    """A step's plan as the policy chose it (`GoodputPolicy.choose`): options[i], request i's (kind,
    drafted tokens) (`search.NONE`: no drafts); stop_below, the early-stop threshold (0: off);
    predicted, (expected tokens, predicted ms) of the plan (`search.predicted_step`), None when the
    policy did not choose every request's option (a request outside it, a probe)."""

    options: list[tuple[str, int]]
    stop_below: float = 0.0
    predicted: tuple[float, float] | None = None


class GoodputPolicy:
    """The policy (module docstring) on a machine's `Calibration`, over the kinds of `proposers` (the
    engine's `ProposerRegistry`; default `default_proposers()`): one estimator per kind. Raises
    ValueError for settings out of range. Thread-safe: the engine's step plans while a hot-swap
    resets. Implements `engine.plan.StepPolicy`."""

    def __init__(self, calibration: Calibration, config: PolicyConfig | None = None, *,
                 proposers: ProposerRegistry | None = None, **settings):
        config = config or PolicyConfig(**settings)
        self.config = PolicyConfig(**{**config.__dict__, "k_max": calibration.k_max})
        self.cost = StepCost(calibration)
        self.k_max = calibration.k_max
        self.margins = MarginController(self.cost, config.margin, config.margin_off, config.alpha)
        self.probes = ProbeSchedule(config.probe_every)
        self.proposers = proposers if proposers is not None else default_proposers()
        self.estimators: dict[str, Estimator] = self.proposers.estimators(self.config)
        self.kinds = frozenset(self.estimators)
        self.drafting = self.proposers.kinds_where("uses_draft")
        self.gated = self.proposers.kinds_where("gated")
        self._lock = threading.Lock()

    @property
    def cal(self) -> Calibration:
        return self.cost.cal

    def estimator(self, kind: str) -> Estimator:
        """The estimator of proposer kind `kind` (KeyError for a kind of another registry)."""
        return self.estimators[kind]

    def catch_up_ms(self, s) -> float:
        """The draft's amortised catch-up over a request's backlog (`StepCost.catch_up_ms`) over the
        steps it has left at one token a step (its output room: the most steps, the smallest charge)."""
        return self.cost.catch_up_ms(s.backlog_rows, s.req.max_new_tokens - len(s.gen))

    # -- a hot-swap -------------------------------------------------------------------------------
    def ensure_draft_costs(self, target, runner) -> bool:
        """Time `runner`'s draft steps when the calibration holds another draft's (or none), so a
        hot-swapped draft is never costed as free (~0.5 s). Returns True when it measured."""
        shape = draft_shape(runner)
        if runner is None or shape == self.cal.draft_shape:
            return False
        dms = measure_draft(target, runner, self.cal.batch_sizes, self.cal.context)
        with self._lock:
            self.cost.cal = self.cal.with_draft_costs(dms, shape)
        return True

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None:
        """Forget acceptance, probes and margins (a new draft serves); keep the measured step costs.
        `replayed`: the new draft's replayed first-token acceptance per class (a₁'s prior)."""
        for est in self.estimators.values():
            est.reset(replayed)
        self.probes.reset()
        self.margins.reset()

    # -- a step -------------------------------------------------------------------------------------
    def choose(self, workloads: list[str], ladders: list[Ladder], prompt_backlogs: list[int] | None = None,
               early_stop: bool = False) -> StepChoice:
        """The step's plan (`plan_step`, probes included), the gated kinds' offers told whether they
        were chosen (`observe_offers`), its early-stop threshold when `early_stop` (`stop_below`)
        and, when the policy chose every request's option, its prediction."""
        probes: list[int] = []
        choice = self.plan_step(workloads, ladders, probes, prompt_backlogs)
        self.observe_offers(workloads, ladders, choice)
        stop = self.stop_below(ladders, choice) if early_stop else 0.0
        mine = not probes and all(lad.fixed is None for lad in ladders)
        return StepChoice(choice, stop, predicted_step(ladders, choice, self.cost) if mine else None)

    def observe_offers(self, workloads: list[str], ladders: list[Ladder], choice: list[tuple[str, int]]) -> None:
        """Per gated kind and class whose offers were computed and gave the plan an option (a step
        where none matched says nothing about whether a match would pay), whether one was chosen
        (`offered`). Requests outside the policy (`Ladder.fixed`) count for nothing."""
        chosen: dict[tuple[str, str], bool] = {}
        for w, lad, (kind, _) in zip(workloads, ladders, choice):
            if lad.fixed is not None:
                continue
            for r in lad.rungs:
                if r.kind in self.gated and r.gains:
                    chosen[(r.kind, w)] = chosen.get((r.kind, w), False) or kind == r.kind
        for (kind, w), yes in chosen.items():
            self.offered(kind, w, len(ladders), yes)

    def offer_due(self, kind: str, workload: str, b: int) -> bool:
        """Compute a gated kind's offers for the class in a batch of b (`ProbeSchedule.offer_due`)?"""
        return self.probes.offer_due(kind, workload, self.cost.bucket(b))

    def offered(self, kind: str, workload: str, b: int, chosen: bool) -> None:
        self.probes.offered(kind, workload, self.cost.bucket(b), chosen)

    def plan_step(self, workloads: list[str], ladders: list[Ladder], probes: list[int] | None = None,
                  prompt_backlogs: list[int] | None = None) -> list[tuple[str, int]]:
        """Each request's (kind, drafted tokens) for a step of this batch (`search.plan` with the
        margin of `MarginController.for_plan`), then a probe (`ProbeSchedule`) for each class whose
        requests could draft with a draft model but were all left without, when due, on one of
        them (`prompt_backlogs`: `Seq.prompt_backlog` per request). `probes`, when given, receives
        the indices of the requests a probe was forced on."""
        eager = {w for w, lad in zip(workloads, ladders) if lad.fixed is None and self._drafting_rung(lad)}
        choice = plan(ladders, self.cost, self.margins.for_plan(workloads, len(ladders), eager))
        drafted = {
            (c[0], w) for w, lad, c in zip(workloads, ladders, choice) if lad.fixed is None and c[0] in self.drafting
        }
        for kind, w in drafted:
            self.probes.drafted(kind, w)
        self.margins.drafted({w for _, w in drafted})
        idle: dict[tuple[str, str], list[int]] = {}
        for i, (w, lad, c) in enumerate(zip(workloads, ladders, choice)):
            r = self._drafting_rung(lad) if lad.fixed is None and c == NONE else None
            if r is not None and (r.kind, w) not in drafted:
                idle.setdefault((r.kind, w), []).append(i)
        for (kind, w), idx in idle.items():
            if self.probes.due(kind, w):
                i = self.probes.target(kind, w, idx, prompt_backlogs)
                choice[i] = (kind, best_alone(ladders[i], self._drafting_rung(ladders[i]), self.cost))
                if probes is not None:
                    probes.append(i)
        return choice

    def _drafting_rung(self, lad: Ladder):
        return next((r for r in lad.rungs if r.kind in self.drafting and r.gains), None)

    def stop_below(self, ladders: list[Ladder], choice: list[tuple[str, int]]) -> float:
        """Draft early stop for this step's plan: the probability (that a further drafted token is
        reached and accepted) below which drafting it costs more than it returns — its verify row and
        draft step (ms) times the plan's predicted tokens per ms. SpecDec++ (arXiv 2405.19715 §3)
        stops at a threshold on the predicted rejection probability; here it is derived from the
        step's cost model instead of tuned."""
        b = len(ladders)
        rows = b + sum(n for _, n in choice)
        chains = sum(1 for lad, (v, n) in zip(ladders, choice)
                     if n and (r := lad.rung(v)) is not None and r.drafts and r.draft_rows == 1)
        drafts = step_draft_batches(ladders, choice)
        ms = self.cost.predict(b, rows, drafts)
        # one more verify row, and one more request in a batched draft step (its logits are already paid)
        marginal = self.cost.predict(b, rows + 1, drafts) - ms + self.cost.factor(b, (rows + 1) / b) * (
            self.cal.draft_cost(chains + 1) - self.cal.draft_cost(chains))
        return max(0.0, marginal) * goodput(ladders, choice, self.cost)

    def observe_step(self, b: int, total_rows: int, draft_batches: list[int], ms: float) -> None:
        """A measured decode step of b requests, `total_rows` verified rows, one batched draft forward
        per entry of `draft_batches`, took `ms`."""
        self.cost.observe(b, total_rows, draft_batches, ms)

    def observe_realized(self, workloads: Sequence[str], speculated: bool, predicted: tuple[float, float],
                         tokens: int, ms: float) -> None:
        """The step as it ran against its plan's prediction (`MarginController.observe`)."""
        self.margins.observe(workloads, speculated, predicted, tokens, ms)
