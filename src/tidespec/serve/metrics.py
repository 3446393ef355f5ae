"""What the servers count, and its Prometheus exporter, kept apart as vLLM keeps
`SpecDecodingStats` apart from `SpecDecodingProm` (`vllm/v1/spec_decode/metrics.py`).

Stats: `FinishedRequestStats` is what one finished (or aborted) request adds, read off its
`Generation`; no Prometheus in it. Exporters: `ServeMetrics` (`tidespec serve`) and `FrontdoorMetrics`
(the front door) own a `CollectorRegistry` each (several servers per process in tests) and turn stats
into series named after vLLM's (`vllm/v1/metrics/loggers.py`) with the prefix `tidespec:`. Both
servers count tokens under the same names (`TokenCounters`: `tidespec:prompt_tokens_total`,
`tidespec:generation_tokens_total`) and serve them with `metrics_response`, every series labelled
with the server's `replica_id` (`Labelled`: as vLLM labels every series with `model_name` and
`engine`, one label added at exposition, so the counters keep their own labels).
"""
from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from ..engine.speculative import Generation
from .workload import CLASSES

PREFIX = "tidespec:"
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
TAU_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)  # acceptance length, tokens per step
BACKEND_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WORKLOAD_COUNTERS = (("num_drafts", "Draft-verify steps by workload class."),
                     ("num_draft_tokens", "Draft tokens proposed by workload class."),
                     ("num_accepted_tokens", "Draft tokens accepted by workload class."))
MAX_WORKLOAD_LABELS = 32  # client-named workload label values on /metrics (beyond the server's own classes)
OVERFLOW_LABEL = "other"  # the label of client-named classes past MAX_WORKLOAD_LABELS
DRAFT_COUNTERS = (("num_drafts", "EAGLE3 draft-verify steps by draft version and workload class (prequential: each "
                   "request is scored by the draft that served it, before any cycle trains on it)."),
                  ("num_draft_tokens", "EAGLE3 draft tokens proposed by draft version and workload class."),
                  ("num_accepted_tokens", "EAGLE3 draft tokens accepted by draft version and workload class."))
PROPOSER_COUNTERS = (("num_drafts", "Draft-verify steps by proposer kind."),
                     ("num_draft_tokens", "Draft tokens proposed by proposer."),
                     ("num_accepted_tokens", "Draft tokens accepted by proposer."))


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request's contribution. Counts are tokens; `acceptance_length` τ = 1 + accepted
    / drafts, in tokens per draft-verify step (None when the request never drafted); `accepted_per_pos[i]`:
    drafts whose position i was accepted; `by_proposer`: proposer kind → its (num_drafts,
    num_draft_tokens, num_accepted_tokens), `by_draft_model` the same summed over the kinds that ran
    the draft model (`Generation.draft_stats`; None when none did); `itl_s`: inter-token latencies, s."""

    prompt_tokens: int
    generation_tokens: int
    finished_reason: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    acceptance_length: float | None
    by_proposer: dict[str, tuple[int, int, int]]
    itl_s: tuple[float, ...]
    workload: str = "default"
    draft_version: str | None = None  # the EAGLE3 draft that served it (None: none)
    by_draft_model: tuple[int, int, int] | None = None

    @classmethod
    def of(cls, g: Generation) -> FinishedRequestStats:
        """The stats of a finished (or aborted) request's Generation."""
        st, draft = g.stats, g.draft_stats
        return cls(prompt_tokens=g.prompt_len, generation_tokens=len(g.tokens), finished_reason=g.finish_reason,
                   num_drafts=st.num_drafts, num_draft_tokens=st.num_draft_tokens,
                   num_accepted_tokens=st.num_accepted_tokens,
                   accepted_per_pos=tuple(st.num_accepted_tokens_per_pos),
                   acceptance_length=st.acceptance_length if st.num_drafts else None,
                   by_proposer={name: _counts(ps) for name, ps in g.by_proposer.items()},
                   itl_s=tuple(ms / 1000 for ms in g.timing.itl_ms()), workload=g.workload,
                   draft_version=g.draft_version, by_draft_model=_counts(draft) if draft is not None else None)


def _counts(ps) -> tuple[int, int, int]:
    """(num_drafts, num_draft_tokens, num_accepted_tokens) of a `SpecDecodingStats`."""
    return tuple(getattr(ps, n) for n, _ in PROPOSER_COUNTERS)


def usage_tokens(usage: dict | None) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of an OpenAI `usage` object (0 for a missing or null one)."""
    usage = usage or {}
    return usage.get("prompt_tokens", 0) or 0, usage.get("completion_tokens", 0) or 0


class TokenCounters:
    """`tidespec:prompt_tokens_total` and `tidespec:generation_tokens_total`, the same names in both
    servers; `help_suffix` says where the counts come from."""

    def __init__(self, registry: CollectorRegistry, help_suffix: str = ""):
        self.prompt = Counter(f"{PREFIX}prompt_tokens", f"Prompt tokens processed{help_suffix}.", registry=registry)
        self.generation = Counter(f"{PREFIX}generation_tokens", f"Tokens generated{help_suffix}.", registry=registry)

    def add(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Count tokens of one request (or one backend answer)."""
        self.prompt.inc(prompt_tokens)
        self.generation.inc(generation_tokens)


class Labelled(Collector):
    """`registry`'s series, each sample with `labels` added to its own: the replica id on every
    series of a server, as Prometheus' constant labels, without a label name on each counter."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry, self.labels = registry, labels

    def collect(self):
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s._replace(labels=s.labels | self.labels) for s in family.samples]
            yield out


def replica_labels(replica_id: str | None) -> dict[str, str]:
    """The labels a server adds to every series of its own: {"replica_id": id} ({} without one)."""
    return {"replica_id": replica_id} if replica_id else {}


def metrics_response(registry: CollectorRegistry, labels: dict[str, str] | None = None) -> Response:
    """`GET /metrics`: the registry in Prometheus' text format, `labels` on every sample (`Labelled`)."""
    return Response(generate_latest(Labelled(registry, labels) if labels else registry), media_type=CONTENT_TYPE_LATEST)


def counted(counter: Counter, keep=lambda labels: True) -> float:
    """The sum of `counter`'s values over its label sets whose labels pass `keep` ({name: value} → bool)."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total") and keep(s.labels))


class ServeMetrics:
    """Prometheus exporter of `tidespec serve`: spec-decode counters (overall, per draft position
    0..k-1, per proposer, per workload class: τ of a class = 1 + accepted / drafts), tokens,
    finished and refused requests, inter-token latency (s), τ per request, requests in the engine,
    the served draft. `k`: draft positions labelled up front; `replica_id`: the label on every series
    at exposition (`labels`; None: none). The server's own classes
    (`serve.workload.CLASSES`) always get their label; at most MAX_WORKLOAD_LABELS client-named classes
    get theirs, later ones count as "other" (clients name classes: the series must stay bounded)."""

    def __init__(self, k: int, replica_id: str | None = None):
        r = self.registry = CollectorRegistry()
        self.labels = replica_labels(replica_id)
        p = PREFIX
        self.num_drafts = Counter(f"{p}spec_decode_num_drafts", "Draft-verify steps.", registry=r)
        self.num_draft_tokens = Counter(f"{p}spec_decode_num_draft_tokens", "Draft tokens proposed.", registry=r)
        self.num_accepted = Counter(f"{p}spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=r)
        self.per_pos = Counter(f"{p}spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position.",
                               ["position"], registry=r)
        self.tokens = TokenCounters(r)
        self.success = Counter(f"{p}request_success", "Finished requests.", ["finished_reason"], registry=r)
        self.rejected = Counter(f"{p}request_rejected", "Requests refused (queue full).", registry=r)
        self.itl = Histogram(f"{p}inter_token_latency_seconds", "Time between emitted tokens.", registry=r,
                             buckets=ITL_BUCKETS_S)
        self.running = Gauge(f"{p}num_requests_running", "Requests waiting or running in the engine.", registry=r)
        self.draft_info = Gauge(f"{p}draft_info", "The served generalist draft (value 1).", ["version"], registry=r)
        self.class_draft_info = Gauge(f"{p}class_draft_info", "A workload class's own served draft (value 1).",
                                      ["workload", "version"], registry=r)
        self.by_proposer = [Counter(f"{p}spec_decode_{name}_by_proposer", help_, ["proposer"], registry=r)
                            for name, help_ in PROPOSER_COUNTERS]
        self.by_workload = [Counter(f"{p}spec_decode_{name}_by_workload", help_, ["workload"], registry=r)
                            for name, help_ in WORKLOAD_COUNTERS]
        self.by_draft = [Counter(f"{p}spec_decode_{name}_by_draft", help_, ["version", "workload"], registry=r)
                         for name, help_ in DRAFT_COUNTERS]
        self.requests_by_workload = Counter(f"{p}request_success_by_workload", "Finished requests by workload class.",
                                            ["workload"], registry=r)
        self._workloads: set[str] = set()
        self.request_tau = Histogram(
            f"{p}request_spec_decode_acceptance_length", "Acceptance length τ of each finished request that "
            "drafted (1 + accepted / drafts).", registry=r, buckets=TAU_BUCKETS)
        for i in range(k):
            self.per_pos.labels(position=str(i))

    def observe(self, st: FinishedRequestStats) -> None:
        """Add one finished request."""
        self.num_drafts.inc(st.num_drafts)
        self.num_draft_tokens.inc(st.num_draft_tokens)
        self.num_accepted.inc(st.num_accepted_tokens)
        for i, n in enumerate(st.accepted_per_pos):
            self.per_pos.labels(position=str(i)).inc(n)
        self.tokens.add(st.prompt_tokens, st.generation_tokens)
        self.success.labels(finished_reason=st.finished_reason).inc()
        if st.acceptance_length is not None:
            self.request_tau.observe(st.acceptance_length)
        for proposer, counts in st.by_proposer.items():
            for counter, n in zip(self.by_proposer, counts):
                counter.labels(proposer=proposer).inc(n)
        w = self.label(st.workload)
        self.requests_by_workload.labels(workload=w).inc()
        for counter, n in zip(self.by_workload, (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)):
            counter.labels(workload=w).inc(n)
        if st.draft_version is not None and st.by_draft_model is not None:
            for counter, n in zip(self.by_draft, st.by_draft_model):
                counter.labels(version=st.draft_version, workload=w).inc(n)
        for s in st.itl_s:
            self.itl.observe(s)

    def label(self, workload: str) -> str:
        """The label value of a class: itself for the server's own classes and the first
        MAX_WORKLOAD_LABELS client-named ones, else "other". Thread-safe enough: a set add."""
        if workload in CLASSES:
            return workload
        if workload not in self._workloads and len(self._workloads) < MAX_WORKLOAD_LABELS:
            self._workloads.add(workload)
        return workload if workload in self._workloads else OVERFLOW_LABEL

    def requests_served(self) -> float:
        """Requests finished so far, whatever their finish reason (`tidespec:request_success_total`)."""
        return counted(self.success)

    def set_running(self, n: int) -> None:
        """Requests waiting or running in the engine now."""
        self.running.set(n)

    def set_drafts(self, versions: dict[str, str | None]) -> None:
        """The served drafts' versions ({class: version}, "" the generalist: `Engine.draft_versions`):
        `draft_info{version}` = 1 for the generalist ("None" without one) and
        `class_draft_info{workload,version}` = 1 per class with a draft of its own; stale series removed."""
        self.draft_info.clear()
        self.draft_info.labels(version=str(versions.get("", None))).set(1)
        self.class_draft_info.clear()
        for w, v in sorted(versions.items()):
            if w:
                self.class_draft_info.labels(workload=self.label(w), version=str(v)).set(1)


class FrontdoorMetrics:
    """Prometheus exporter of the front door: requests by route and backend status, backend time
    per request (s, to the last byte), tokens from the backend's `usage`; `replica_id`: the label on
    every series at exposition (`labels`; None: none)."""

    def __init__(self, replica_id: str | None = None):
        r = self.registry = CollectorRegistry()
        self.labels = replica_labels(replica_id)
        self.requests = Counter(f"{PREFIX}frontdoor_requests", "Requests forwarded, by route and backend status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram(f"{PREFIX}frontdoor_latency_seconds", "Backend time per request (to the last byte).",
                                 ["route"], registry=r, buckets=BACKEND_LATENCY_BUCKETS_S)
        self.tokens = TokenCounters(r, " (backend usage)")

    def observe(self, route: str, status: int, latency_s: float, usage: dict | None) -> None:
        """One exchange the backend answered: its status, `latency_s` s, its OpenAI `usage` (or None)."""
        self.count(route, status)
        self.latency.labels(route=route).observe(latency_s)
        self.tokens.add(*usage_tokens(usage))

    def requests_served(self) -> float:
        """Requests the backend answered with a 2xx status so far (`tidespec:frontdoor_requests_total`)."""
        return counted(self.requests, lambda labels: labels["status"].startswith("2"))

    def count(self, route: str, status: int) -> None:
        """One request by status only (the backend did not answer: 502, 504)."""
        self.requests.labels(route=route, status=str(status)).inc()
