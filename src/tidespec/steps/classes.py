"""The cycle's class drafts: after the generalist, one candidate per workload class in
`train.class_drafts` (`auto`: chosen from the window's traffic, `classes_to_train`), trained on its
class (plus `curate.class_replay_fraction` from the others),
warm-started from the class's champion or, for its first, from the generalist's; evaluated on its
class's holdout against what serves the class now; registered with tag `workload` and promoted to
`champion-<class>` only if τ improves (`registry.promote_if_better(workload=...)`). The deploy step
then puts each class champion under data/drafts/classes/<class>, where a running server installs it.

A class's failure never undoes the generalist's cycle or another class's: it is logged and reported.
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from ..adapters import registry
from ..capture.curate import class_subset
from ..config import Params
from ..workspace import CLASS_NAME, Workspace
from .cycle import lineage, train_candidate
from .evaluate import step_evaluate
from .register import step_register

log = logging.getLogger(__name__)
AUTO_MAX_CLASSES = 8  # `auto`: class drafts trained per cycle at most (each is a train + evaluate)


def classes_to_train(params: Params, curated: Path) -> list[str]:
    """The classes that get a candidate this cycle: `train.class_drafts` as listed; with `auto`, every
    workload class (not `default`, the label of unclassified requests) whose own requests in the
    curated training set (`curated`, the cycle's index; replay-buffer entries aside) hold at least
    `train.min_train_tokens` tokens, once the service has served two or more kinds of traffic: classes,
    unclassified (`default`) requests counting as one, in the set or in the replay buffer (its summary
    in the index, `replay_buffer`, and the entries drawn from it, `replay: true`). A service that has
    only served one kind trains the generalist on it; once it serves another, each class with the
    traffic gets a draft of its own, so the generalist goes on serving the rest. At most
    `AUTO_MAX_CLASSES`, the most tokens first. A label that is not a class name (`workspace.CLASS_NAME`:
    a request's `workload` is the client's word) is left out with a warning. Which of them takes over
    its class is the gate's decision (`evaluate.class_first_gain`, then `min_relative_gain`). Sorted by
    name."""
    if params.train.class_drafts != "auto":
        return list(params.train.class_drafts)
    index = json.loads(Path(curated).read_text())
    served = {w or "default" for w in index.get("replay_buffer") or {}}  # every class the buffer holds
    tokens = Counter()
    for e in index["train"]:
        w = e.get("workload") or "default"
        served.add(w)
        if w != "default" and not e.get("replay"):
            tokens[w] += e["num_tokens"]
    if bad := sorted(w for w in tokens if not CLASS_NAME.match(w)):
        log.warning("train.class_drafts auto: %d workload label(s) are not class names ([a-z0-9][a-z0-9_-]{0,63}), "
                    "no draft of their own: %s", len(bad), [w[:40] for w in bad[:5]])
    enough = [w for w, n in tokens.most_common() if n >= params.train.min_train_tokens and CLASS_NAME.match(w)]
    if len(enough) > AUTO_MAX_CLASSES:
        log.warning("train.class_drafts auto: %d classes have the traffic, the %d largest get a draft: left out %s",
                    len(enough), AUTO_MAX_CLASSES, enough[AUTO_MAX_CLASSES:])
    kinds = {w for w in served if CLASS_NAME.match(w)}  # `default` matches: the unclassified traffic
    return sorted(enough[:AUTO_MAX_CLASSES]) if enough and len(kinds) >= 2 else []  # enough ⊆ kinds


def class_cycles(ws: Workspace, params: Params, target_id: str, tracking_uri: str, *, snapshot_rev: str = "",
                 trigger: str = "manual", params_path: Path | None = None) -> dict[str, dict]:
    """`class_cycle` for each class of `classes_to_train`, in order. Returns {class: its result},
    {"error": message} for a class that failed (logged with its traceback; the others go on)."""
    out = {}
    for workload in classes_to_train(params, ws.curated):
        try:
            out[workload] = class_cycle(ws, params, target_id, workload, tracking_uri, snapshot_rev=snapshot_rev,
                                   trigger=trigger, params_path=params_path)
        except Exception as e:
            log.exception("class %r: cycle failed, its champion keeps serving", workload)
            out[workload] = {"error": f"{type(e).__name__}: {e}"}
    return out


def class_cycle(ws: Workspace, params: Params, target_id: str, workload: str, tracking_uri: str, *,
                snapshot_rev: str = "", trigger: str = "manual", params_path: Path | None = None) -> dict:
    """One class's curate (`curate.class_subset` of the cycle's curated set, into data/work/classes/<class>/)
    → train → evaluate → register. Returns {"curate", "train", "evaluate", "register"}, or
    {"skipped": reason} (too few new tokens of the class, or no holdout request of it: nothing
    registered, its champion keeps serving). Raises what the steps raise."""
    d = ws.work / "classes" / workload
    cur = class_subset(ws.curated, workload, params.curate.class_replay_fraction, params.curate.seed,
                       d / "curated.json")
    if cur.num_holdout == 0:
        return {"skipped": f"no holdout request of class {workload!r} in this cycle's curated set: nothing to gate on"}
    init = (registry.download_champion(tracking_uri, target_id, d / "champion", workload)
            or registry.download_champion(tracking_uri, target_id, d / "generalist"))
    tm = train_candidate(ws, params, cur.path, init, d / "candidate", params_path=params_path)
    if tm.get("skipped"):
        return {"skipped": tm["skipped"]}
    rep = step_evaluate(ws, params, d / "candidate", init, cur.holdout, d / "eval.json", curated=cur.path)
    mix = json.loads(cur.path.read_text()).get("workload_mix", {})
    dec = step_register(params, target_id, d / "candidate", rep, tm, tracking_uri, lineage(cur.path, snapshot_rev),
                        mix, None, trigger, workload=workload)
    log.info("class %r: version %s promoted=%s (%s)", workload, dec["version"], dec["promoted"], dec["reason"])
    return {"curate": {"num_train": cur.num_train, "num_holdout": cur.num_holdout, "num_replay": cur.num_replay},
            "train": {k: v for k, v in tm.items() if not isinstance(v, list)}, "evaluate": rep, "register": dec}
