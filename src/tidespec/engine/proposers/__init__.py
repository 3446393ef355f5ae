"""Draft proposers, one module each (vLLM's `v1/spec_decode/` layout), each declaring its own spec
(`base.ProposerSpec`, the module's `SPEC`): the `Proposer` protocol, its `Rung` of options, the
step's per-request `Slot`, what a proposer may ask the policy (`ProposerPolicy`) and the draft's
catch-up (`base`); EAGLE3 chains (`eagle3`, its estimator `eagle3_estimate`), EAGLE-2 trees
(`tree`), suffix proposals (`suffix`), grammar-forced tokens (`grammar`); the collection an engine
runs (`registry.ProposerRegistry`, `registry.default_proposers`)."""
from .base import Build, Estimator, Proposer, ProposerPolicy, ProposerSpec, Rung, Slot, by_draft, catch_up
from .registry import ProposerRegistry, default_proposers

__all__ = ["Build", "Estimator", "Proposer", "ProposerPolicy", "ProposerRegistry", "ProposerSpec", "Rung", "Slot",
           "by_draft", "catch_up", "default_proposers"]
