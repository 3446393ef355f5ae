"""Draft proposers, one module each (vLLM's `v1/spec_decode/` layout), each registering itself
(`registry.register`): the `Proposer` protocol, its `Rung` of options and the step's per-request
`Slot` (`base`); EAGLE3 chains and the draft's catch-up (`eagle3`, its estimator `eagle3_estimate`),
EAGLE-2 trees (`tree`), suffix proposals (`suffix`), grammar-forced tokens (`grammar`)."""
from . import eagle3, grammar, suffix, tree  # noqa: F401 - each registers its proposer
from .base import Build, Estimator, Proposer, Rung, Slot, by_draft
from .eagle3 import catch_up
from .registry import entries, register, unregister

__all__ = ["Build", "Estimator", "Proposer", "Rung", "Slot", "by_draft", "catch_up", "entries", "register",
           "unregister"]
