"""The live guard's evidence on the embedded engine: two draft versions scored teacher-forced on the
same recent captured records (`PairedJudge`, as `serve.guard.Evidence`: `TeacherForced`).

The guard's hint that a version is worse compares its live acceptance with its predecessor's, which
was measured on earlier traffic; a change of traffic moves that comparison by itself. Before any
rollback both versions are scored on the same records (the newest captured requests of the class,
`capture.recent.RecentRecords`): per record, each draft's τ at the engine's k with a chain started at
every generated position (`train.holdout.record_taus`: EAGLE-3's training-time test, arXiv
2503.01840 §3, on the captured hidden states; the same positions for both drafts); the paired
differences give the verdict (`engine.health.paired_comparison`, z = 3).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from ..config import TrainParams
from ..engine.health import PairedComparison, paired_comparison
from ..models.eagle3 import load_checkpoint
from ..train.holdout import record_taus

log = logging.getLogger(__name__)


class PairedJudge:
    """`judge(version, previous, workload)` → `PairedComparison` (previous − current τ over
    the class's recent records, both scored on each), or None when there is no evidence: fewer than
    `min_records` recent records of the class, or a version `load_version` cannot fetch (logged).

    engine: the serving `Engine` (its target and k); records(workload): the recent records of a class
    (`RecentRecords.records`); load_version(v): a registry version → its checkpoint dir (raises
    LookupError / OSError); tparams: `train` params (max_seq_len, batch_tokens of the scoring;
    default: records up to the engine's max_seq_len). Fewer than `min_records` usable pairs: None."""

    def __init__(self, engine, records: Callable[[str], list[dict]], load_version: Callable[[str], Path],
                 tparams: TrainParams | None = None, min_records: int = 8):
        self.engine, self.records, self.load_version = engine, records, load_version
        # records are scored whole: up to the engine's context, not the trainer's cut
        self.tparams = tparams or TrainParams(max_seq_len=engine.cfg.max_seq_len)
        self.min_records = min_records

    def __call__(self, version: str, previous: str, workload: str) -> PairedComparison | None:
        recs = self.records(workload)
        if len(recs) < self.min_records:
            return None
        target, k = self.engine.target, self.engine.cfg.num_draft_tokens
        try:
            drafts = [load_checkpoint(self.load_version(v), target.embed, target.target_id).to_device(target.device).eval()
                      for v in (version, previous)]
            cur, prev = (record_taus(d, target, recs, self.tparams, k) for d in drafts)
        except (LookupError, OSError, ValueError, RuntimeError) as e:  # no verdict: asked again at the next check
            log.error("cannot score drafts %s and %s on recent traffic: %s", version, previous, e)
            return None
        # a record one draft cannot score (no position left in its vocabulary) counts as τ 1 for it
        diffs = [(p or 1.0) - (c or 1.0) for c, p in zip(cur, prev) if c is not None or p is not None]
        return paired_comparison(diffs) if len(diffs) >= self.min_records else None


class TeacherForced:
    """`serve.guard.Evidence` from a `PairedJudge`: both versions scored on the track's class's
    recent records; `step` asks the judge each round until it has a verdict (None: too few records
    yet, or a version not fetched). Nothing is installed: a rollback moves the registry and the
    champion watcher installs the restored version."""

    what, unit = "teacher-forced on the same recent traffic", "records (τ, teacher-forced)"

    def __init__(self, judge: Callable[[str, str, str], PairedComparison | None]):
        self.judge = judge
        self._asked: dict[tuple[str, str], tuple[str, str]] = {}  # track → (version, previous)

    def begin(self, key: tuple[str, str], version: str, previous: str, reason: str) -> bool:
        self._asked[key] = (version, previous)
        return True

    def step(self, key: tuple[str, str], track=None) -> PairedComparison | None:
        version, previous = self._asked[key]
        return self.judge(version, previous, key[1])

    def finish(self, key: tuple[str, str], previous_better: bool) -> None:
        self._asked.pop(key, None)

    def abort(self, key: tuple[str, str]) -> None:
        self._asked.pop(key, None)
