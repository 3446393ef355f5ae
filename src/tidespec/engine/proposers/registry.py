"""The proposers an engine runs: each proposer module registers itself with one `register` call
(SpecForge style: algorithms register their own pieces); the engine builds every registered
proposer from its config (`build`), and the goodput policy one estimator per kind (`estimators`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .base import Build, Estimator, Proposer


@dataclass(frozen=True)
class Entry:
    """One registered proposer. rung: its place in every request's ladder and in a step's drafting
    order (lower first); build: the proposer for an engine (None: it does not run there, e.g. the
    suffix proposer without a suffix cache); estimator: the estimator of its kind, built from the
    policy's settings (`policy.PolicyConfig`); proposers of one kind share one."""

    cls: type
    rung: int
    build: Callable[[Build], Proposer | None]
    estimator: Callable[[object], Estimator]


_ENTRIES: dict[type, Entry] = {}


def register(cls: type, *, rung: int, estimator: Callable[[object], Estimator],
             build: Callable[[Build], Proposer | None] | None = None) -> type:
    """Register proposer class `cls` (with `name`, `uses_draft`, `gated`, `offer`, `propose`, `observe`);
    `build` defaults to `cls()`. Returns `cls`. Raises ValueError for a rung taken by another class,
    or a kind whose estimator is already another one's."""
    for e in _ENTRIES.values():
        if e.cls is not cls and e.rung == rung:
            raise ValueError(f"rung {rung} is {e.cls.__name__}'s; give {cls.__name__} another")
        if e.cls is not cls and e.cls.name == cls.name and e.estimator is not estimator:
            raise ValueError(f"proposers of kind {cls.name!r} share one estimator: {e.cls.__name__} registered "
                             f"{e.estimator!r}")
    _ENTRIES[cls] = Entry(cls, rung, build or (lambda _: cls()), estimator)
    return cls


def unregister(cls: type) -> None:
    """Remove a registered proposer (tests that register their own)."""
    _ENTRIES.pop(cls, None)


def entries() -> list[Entry]:
    """The registered proposers in rung order."""
    return sorted(_ENTRIES.values(), key=lambda e: e.rung)


def build(b: Build) -> list[Proposer]:
    """Every registered proposer that runs on an engine built from `b`, in rung order."""
    return [p for e in entries() if (p := e.build(b)) is not None]


def estimators(settings) -> dict[str, Estimator]:
    """One estimator per registered kind, built from the policy's settings."""
    out: dict[str, Estimator] = {}
    for e in entries():
        if e.cls.name not in out:
            out[e.cls.name] = e.estimator(settings)
    return out
