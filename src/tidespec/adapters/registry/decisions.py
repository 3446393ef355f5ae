"""Promotion decisions in the MLflow registry: the gate (challenger → champion iff lossless and τ gains,
or → the `canary` alias under a canary rollout), promotion and rollback by hand, a canary's promotion or
rollback (`adapters.registry.rollout` decides which), each an audited decision on the version and its run,
and the champion history behind rollback."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from mlflow import MlflowClient
from mlflow.entities import RunTag

from .artifacts import _float
from .client import (
    CANARY,
    CHAMPION,
    HISTORY_MAX,
    RegistryError,
    _alias_version,
    _client,
    _exists,
    _version,
    champion_alias,
    history_tag,
    model_name,
)


@dataclass(frozen=True)
class Decision:
    """Outcome of a promotion/rollback: ``version`` is the one decided about; ``canary``: it passed the
    gate and went to the ``canary`` alias (not promoted yet)."""

    promoted: bool
    reason: str
    version: str
    previous_champion: str | None
    canary: bool = False


def _history(c: MlflowClient, name: str, workload: str = "") -> list[str]:
    raw = c.get_registered_model(name).tags.get(history_tag(workload), "")
    return [v for v in raw.split(",") if v]


def _set_history(c: MlflowClient, name: str, hist: list[str], workload: str = "") -> None:
    c.set_registered_model_tag(name, history_tag(workload), ",".join(hist))


def _of(workload: str) -> str:
    """How a decision names the alias it moved: "" for the generalist, "class 'code': " for a class."""
    return f"class {workload!r}: " if workload else ""


def _record(c: MlflowClient, name: str, version: str, decision: str, reason: str, latest: bool = True) -> None:
    """Write ``decision``/``decision_reason`` (the latest) on the version and on its run, and append
    the decision to the audit trail: tag ``decision.<n>`` = ``<UTC time> <decision>: <reason>``
    (n = 0, 1, ...; never overwritten). ``latest`` False: the audit trail only (a decision about
    another version that concerns this one, e.g. the champion a canary was compared with)."""
    mv = c.get_model_version(name, version)
    n = sum(k.startswith("decision.") for k in mv.tags)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entry = f"{at} {decision}: {reason}"[:5000]
    tags = (("decision", decision), ("decision_reason", reason[:5000])) if latest else ()
    tags += ((f"decision.{n}", entry),)
    for k, v in tags:
        c.set_model_version_tag(name, version, k, v)
    if mv.run_id:
        c.log_batch(mv.run_id, tags=[RunTag(k, v) for k, v in tags])


def decisions(tracking_uri: str, target_id: str, version: str) -> list[str]:
    """The audit trail of ``version``: every decision recorded on it, oldest first."""
    tags = _client(tracking_uri).get_model_version(model_name(target_id), str(version)).tags
    return [tags[f"decision.{i}"] for i in range(sum(k.startswith("decision.") for k in tags))]


def _make_champion(c: MlflowClient, name: str, version: str, workload: str = "") -> str | None:
    """Move the champion alias (`champion_alias(workload)`) to ``version``, append it to that alias's
    history; return the previous champion."""
    alias = champion_alias(workload)
    prev = _alias_version(c, name, alias)
    c.set_registered_model_alias(name, alias, version)
    hist = _history(c, name, workload)
    if prev and (not hist or hist[-1] != prev):  # alias moved outside tidespec: keep it traceable
        hist.append(prev)
    _set_history(c, name, (hist + [version])[-HISTORY_MAX:], workload)
    return prev


def promote_if_better(tracking_uri: str, target_id: str, version: str, candidate_tau: float,
                      champion_tau: float | None, min_relative_gain: float, lossless: bool,
                      evaluated_champion: str | None = None, workload: str = "", canary: bool = False,
                      forgetting: dict[str, float] | None = None, max_forgetting: float | None = None) -> Decision:
    """Promote ``version`` to ``champion`` iff ``lossless`` and (no champion yet or
    ``candidate_tau >= champion_tau * (1 + min_relative_gain)``); τ in tokens per target forward,
    both measured on the same holdout. ``evaluated_champion``: the champion version ``champion_tau``
    was measured on; when the alias has moved since (a manual promote/rollback during the cycle),
    the candidate is not promoted (it was not compared with the current champion). The decision is
    recorded (``_record``). MLflow aliases have no compare-and-set: two gates racing at the same
    instant can both pass; the tide-cycle deployment runs one cycle at a time. ``workload``: the
    gate of one class's champion (alias ``champion-<class>``, τ on that class's holdout); while the
    class has none, its reference is the generalist that serves it (``champion_tau`` measured on it).
    ``canary`` (``deploy.rollout: canary``; the generalist only): a candidate that passes goes to the
    ``canary`` alias instead (`start_canary`; Decision with canary=True, promoted=False), unless it is
    the first champion (no stable version to compare it with: promoted). ``forgetting`` {class: 1 −
    candidate τ / champion τ on that class's retained holdout} with ``max_forgetting``: a candidate
    that loses more than that share on any class it would serve is not promoted (None: not gated).
    Raises RegistryError if a champion exists but ``champion_tau`` is None (evaluate it first).
    """
    c = _client(tracking_uri)
    name = model_name(target_id)
    version = _version(c, name, version)
    own = _alias_version(c, name, champion_alias(workload))
    current = own or (_alias_version(c, name, CHAMPION) if workload else None)  # what serves it now
    if current is not None and champion_tau is None:
        raise RegistryError(f"{name}: champion v{current} exists but champion_tau is None; "
                            "evaluate the champion on the same holdout and pass its τ")
    if own == version:
        reason, ok = f"v{version} is already champion", False
    elif evaluated_champion is not None and current != str(evaluated_champion):
        reason, ok = (f"champion changed during the cycle (evaluated against v{evaluated_champion}, champion is now "
                      f"v{current}): not compared with the current champion, not promoted; run a new cycle"), False
    elif not lossless:
        reason, ok = "losslessness check failed: never promoted", False
    elif not math.isfinite(candidate_tau):
        reason, ok = f"candidate τ={candidate_tau} is not finite", False
    elif current is None:
        reason, ok = f"first champion (τ={candidate_tau:.4f})", True
    else:
        bar = champion_tau * (1 + min_relative_gain)
        ok = candidate_tau >= bar
        cmp = ">=" if ok else "<"
        reason = (f"τ {candidate_tau:.4f} {cmp} {bar:.4f} = champion v{current} τ {champion_tau:.4f} "
                  f"× (1 + {min_relative_gain:g})")
        lost = {w: f for w, f in (forgetting or {}).items() if max_forgetting is not None and f > max_forgetting}
        if ok and lost:
            ok, reason = False, reason + "; but it forgets " + ", ".join(
                f"{w or 'unclassified'} ({f:.1%} > {max_forgetting:.1%} on its retained holdout)"
                for w, f in sorted(lost.items()))
    reason = _of(workload) + reason
    if ok and canary and current is not None and not workload:
        return _start_canary(c, name, version, f"passed the gate: {reason}", current)
    if ok:
        _make_champion(c, name, version, workload)
    d = Decision(promoted=ok, reason=reason, version=version, previous_champion=own)
    _record(c, name, version, "promoted" if ok else "rejected", reason)
    return d


def evaluation_problem(tags: dict[str, str]) -> str | None:
    """Why version tags do not show a passed evaluation (None: they do). An evaluated version
    carries what the cycle's register step writes after `evaluate`: tag ``lossless`` (``"True"``:
    speculative greedy outputs == the target's on the holdout) and tag ``acceptance_length`` (the
    candidate's measured τ, tokens per target forward, finite)."""
    lossless, tau = tags.get("lossless"), tags.get("acceptance_length")
    if lossless == "False":
        return "failed evaluation's losslessness check (its outputs differ from the target's): it is never promoted"
    if lossless != "True" or _float(tau) is None:
        have = ", ".join(f"{k}={tags[k]!r}" for k in ("lossless", "acceptance_length") if k in tags) or "neither"
        return (f"was never evaluated (needs tags lossless='True' and a finite acceptance_length; has {have}): "
                "it is not promoted blind")
    return None


def promote(tracking_uri: str, target_id: str, version: str, reason: str, *,
            allow_unevaluated: bool = False, workload: str = "") -> Decision:
    """Make ``version`` champion by hand (no τ rule), recording ``reason``; the current champion
    is left as is (Decision with promoted=False, nothing recorded).

    Only an evaluated version is promoted (``evaluation_problem``: tags ``lossless="True"`` and a
    finite ``acceptance_length``, as the cycle's register step writes them).
    ``allow_unevaluated=True`` (bootstrap only: the first static draft, when no evaluation is
    possible yet) skips the "never evaluated" check and records ``unevaluated`` in the reason; a
    version tagged ``lossless=False`` is refused even then.
    Raises RegistryError when the version does not exist, failed the losslessness check, or was
    never evaluated (the message names the fix: pick an evaluated version, or run a cycle).
    ``workload``: make it that class's champion (alias ``champion-<class>``) instead."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    version = _version(c, name, version)
    mv = c.get_model_version(name, version)
    if _alias_version(c, name, champion_alias(workload)) == version:
        return Decision(promoted=False, reason=f"v{version} is already champion; nothing changed", version=version,
                        previous_champion=version)
    problem = evaluation_problem(dict(mv.tags))
    if problem and (mv.tags.get("lossless") == "False" or not allow_unevaluated):
        fix = ("fix the draft/engine and run a new cycle" if mv.tags.get("lossless") == "False" else
               "promote a version that a cycle evaluated and registered (its tags carry lossless and "
               "acceptance_length; see the versions in the MLflow UI), or run `tidespec cycle` to evaluate a candidate")
        raise RegistryError(f"{name} v{version} {problem}; {fix}")
    why = _of(workload) + (f"manual: {reason}" if not problem else f"manual, unevaluated (bootstrap): {reason}")
    prev = _make_champion(c, name, version, workload)
    d = Decision(promoted=True, reason=why, version=version, previous_champion=prev)
    _record(c, name, version, "promoted", d.reason)
    return d


def rollback(tracking_uri: str, target_id: str, reason: str = "", workload: str = "") -> Decision:
    """Move ``champion`` back to the previous champion in ``champion_history``; ``reason`` (why)
    is recorded with the decision. ``workload``: that class's alias and history instead; its first
    champion rolls back to none (the alias removed: the generalist serves the class again).

    Returns a Decision about the restored version (``previous_champion`` = the demoted one, which
    gets ``decision=rolled_back``). Raises RegistryError when there is no previous champion.
    """
    c = _client(tracking_uri)
    name = model_name(target_id)
    alias = champion_alias(workload)
    current = _alias_version(c, name, alias)
    if current is None:
        raise RegistryError(f"{name}: no {alias} to roll back; promote a version first")
    hist = _history(c, name, workload)
    while hist and (hist[-1] == current or not _exists(c, name, hist[-1])):  # deleted versions cannot come back
        hist.pop()
    why = f": {reason}" if reason else ""
    if not hist and workload:  # the class's first champion: back to the generalist
        c.delete_registered_model_alias(name, alias)
        _set_history(c, name, [], workload)
        _record(c, name, current, "rolled_back", f"{_of(workload)}rolled back to the generalist{why}")
        return Decision(promoted=True, reason=f"{_of(workload)}rollback from v{current} to the generalist{why}",
                        version=_alias_version(c, name, CHAMPION) or "", previous_champion=current)
    if not hist:
        raise RegistryError(f"{name}: no earlier champion than v{current} (deleted versions skipped); nothing to "
                            "roll back to (use promote to pick a version by hand)")
    target = hist[-1]
    c.set_registered_model_alias(name, alias, target)
    _set_history(c, name, hist, workload)
    reason = f"{_of(workload)}rollback from v{current}{why}"
    _record(c, name, current, "rolled_back", f"{_of(workload)}rolled back to v{target}{why}")
    _record(c, name, target, "restored", reason)
    return Decision(promoted=True, reason=reason, version=target, previous_champion=current)


# ---------------------------------------------------------------- canary rollout

CANARY_SINCE_TAG = "canary_since"  # ms since the epoch the version got the canary alias: where its windows start


def _start_canary(c: MlflowClient, name: str, version: str, reason: str, champion: str) -> Decision:
    """``version`` under the ``canary`` alias from now (tag ``canary_since``), recorded ``canary``; a
    canary it replaces before a decision is recorded ``canary_replaced``."""
    prev = _alias_version(c, name, CANARY)
    # the tag before the alias: whoever sees the alias (a replica, the rollout) reads where its windows start
    c.set_model_version_tag(name, version, CANARY_SINCE_TAG, str(int(time.time() * 1000)))
    c.set_registered_model_alias(name, CANARY, version)
    if prev is not None and prev != version:
        _record(c, name, prev, "canary_replaced", f"canary replaced by v{version} before a decision")
    _record(c, name, version, "canary", f"{reason}; served by the canary replicas beside champion v{champion} "
                                        "until its live τ is judged on the same traffic")
    return Decision(promoted=False, reason=f"canary: {reason}", version=version, previous_champion=champion,
                    canary=True)


def start_canary(tracking_uri: str, target_id: str, version: str, reason: str) -> Decision:
    """Put an evaluated ``version`` under the ``canary`` alias by hand (what the gate does under
    ``deploy.rollout: canary``), recording ``reason``. Raises RegistryError when it does not exist,
    was never evaluated (`evaluation_problem`), is the champion, or there is no champion to compare
    it with (promote the first one instead)."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    version = _version(c, name, version)
    champ = _alias_version(c, name, CHAMPION)
    problem = evaluation_problem(dict(c.get_model_version(name, version).tags))
    if problem:
        raise RegistryError(f"{name} v{version} {problem}; a canary must be an evaluated version")
    if champ is None or champ == version:
        raise RegistryError(f"{name}: v{version} cannot be a canary: " + (
            "there is no champion to compare it with (promote the first one)" if champ is None else
            "it is the champion"))
    return _start_canary(c, name, version, f"manual: {reason}", champ)


def end_canary(tracking_uri: str, target_id: str, version: str, reason: str, promote: bool) -> Decision:
    """End the canary ``version``'s rollout, recording ``reason``: ``promote`` — it becomes champion
    (history appended, as any promotion), ``promoted`` on it and ``replaced`` on the champion it
    replaces —, else rolled back — the champion untouched, ``rolled_back`` on it and ``kept`` on the
    champion —; the ``canary`` alias removed either way (the canary replicas serve the champion), the
    champion's entry in its audit trail only (its own latest decision stands). Raises RegistryError
    when ``version`` is not the canary any more (nothing changed)."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    now = _alias_version(c, name, CANARY)
    if now != str(version):
        raise RegistryError(f"{name}: v{version} is not the canary (the canary is "
                            f"{'v' + now if now else 'none'}): nothing decided; run the decision again")
    champ = _make_champion(c, name, version) if promote else _alias_version(c, name, CHAMPION)
    c.delete_registered_model_alias(name, CANARY)
    done, other = ("promoted", "replaced") if promote else ("rolled_back", "kept")
    _record(c, name, version, done, f"canary: {reason}")
    if champ is not None and champ != version:
        _record(c, name, champ, other, f"canary v{version} {done.replace('_', ' ')}: {reason}", latest=False)
    return Decision(promoted=promote, reason=f"canary {done.replace('_', ' ')}: {reason}", version=version,
                    previous_champion=champ)
