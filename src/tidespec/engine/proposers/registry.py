"""The proposers an engine runs (`ProposerRegistry`): a value built with the engine and handed to
its goodput policy and its plan, never a global. Each proposer module declares its own spec
(`ProposerSpec`, its `SPEC`: SpecForge style, algorithms declare their own pieces); the default
collection lists them (`default_proposers`), and a plugin joins by a registry that holds its spec
too (`ProposerRegistry.with_spec`).
"""
from __future__ import annotations

from collections.abc import Iterable

from .base import Build, Estimator, Proposer, ProposerSpec
from .eagle3 import SPEC as CHAIN
from .grammar import SPEC as GRAMMAR
from .suffix import SPEC as SUFFIX
from .tree import SPEC as TREE


class ProposerRegistry:
    """Proposer specs in rung order, immutable. Raises ValueError for a rung taken by two classes, or
    for two classes of one kind with different estimators."""

    def __init__(self, specs: Iterable[ProposerSpec]):
        self.specs: tuple[ProposerSpec, ...] = tuple(sorted(specs, key=lambda e: e.rung))
        for i, e in enumerate(self.specs):
            for o in self.specs[:i]:
                if o.cls is e.cls:
                    raise ValueError(f"{e.cls.__name__} is listed twice")
                if o.rung == e.rung:
                    raise ValueError(f"rung {e.rung} is {o.cls.__name__}'s; give {e.cls.__name__} another")
                if o.cls.name == e.cls.name and o.estimator is not e.estimator:
                    raise ValueError(f"proposers of kind {e.cls.name!r} share one estimator: {o.cls.__name__} "
                                     f"declared {o.estimator!r}")

    def with_spec(self, spec: ProposerSpec) -> ProposerRegistry:
        """This registry with `spec` too (a plugin). Raises ValueError as the constructor does."""
        return ProposerRegistry((*self.specs, spec))

    def without(self, cls: type) -> ProposerRegistry:
        """This registry without proposer class `cls`."""
        return ProposerRegistry(e for e in self.specs if e.cls is not cls)

    @property
    def kinds(self) -> tuple[str, ...]:
        """The proposer kinds (`Proposer.name`), each once, in rung order."""
        return tuple(dict.fromkeys(e.cls.name for e in self.specs))

    def kinds_where(self, attr: str) -> set[str]:
        """The kinds of the proposers whose class attribute `attr` (`uses_draft`, `gated`) is true."""
        return {e.cls.name for e in self.specs if getattr(e.cls, attr)}

    def build(self, b: Build) -> list[Proposer]:
        """Every proposer that runs on an engine built from `b`, in rung order."""
        return [p for e in self.specs if (p := e.make(b)) is not None]

    def estimators(self, settings) -> dict[str, Estimator]:
        """One estimator per kind, built from the policy's settings (`policy.PolicyConfig`)."""
        out: dict[str, Estimator] = {}
        for e in self.specs:
            if e.cls.name not in out:
                out[e.cls.name] = e.estimator(settings)
        return out


def default_proposers() -> ProposerRegistry:
    """tidespec's proposers: EAGLE3 chains and EAGLE-2 trees, suffix proposals, grammar-forced tokens."""
    return ProposerRegistry((CHAIN, TREE, SUFFIX, GRAMMAR))
