"""Draft proposers, one module each (vLLM's `v1/spec_decode/` layout): the `Proposer` protocol and
the step's per-request `Slot` (`base`), EAGLE3 chains and the draft's catch-up (`eagle3`), EAGLE-2
trees (`tree`), suffix proposals (`suffix`), grammar-forced tokens (`grammar`)."""
from .base import Proposer, Slot, by_draft
from .eagle3 import Eagle3Chain, catch_up
from .grammar import GrammarProposer
from .suffix import SuffixProposer
from .tree import Eagle3Tree

__all__ = ["Proposer", "Slot", "by_draft", "Eagle3Chain", "Eagle3Tree", "GrammarProposer", "SuffixProposer", "catch_up"]
