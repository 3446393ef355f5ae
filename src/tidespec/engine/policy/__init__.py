"""The goodput policy (`GoodputPolicy`): the cost model (`cost`), the plan search (`search`), probes
and offer gates (`probes`), the margin a plan must clear (`margin`)."""
from .cost import StepCost, draft_batches
from .policy import GoodputPolicy, PolicyConfig, StepChoice
from .search import NONE, Ladder, goodput, plan, predicted_step

__all__ = ["NONE", "GoodputPolicy", "Ladder", "PolicyConfig", "StepChoice", "StepCost", "draft_batches", "goodput",
           "plan", "predicted_step"]
