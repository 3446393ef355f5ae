"""A SageMaker endpoint's live acceptance length as a CloudWatch metric, and the auto-rollback alarm
on it (`deploy.sagemaker.canary.alarm_acceptance`).

Neither SGLang nor vLLM publishes acceptance to CloudWatch, and their log lines ("accept len: 2.31,")
carry no value a metric filter can read. So the serving image runs a publisher beside the engine
(`python -m tidespec.backends.acceptance`, started by the entrypoints in infra/containers when
`TIDESPEC_ACCEPTANCE=1`): every `TIDESPEC_ACCEPTANCE_EVERY_S` (60) s it reads the engine's
spec-decode counters from its `/metrics` (the `scrape` it is given: `backends.sglang.metrics`,
`backends.vllm.metrics`), and once the window since its last datapoint holds ≥ 100 drafts it puts
`AcceptanceLength` (τ of that window) and `Drafts` into namespace `tidespec/SpeculativeDecoding`,
dimensions EndpointName, VariantName, DraftVersion. The version dimension keeps the new fleet's
figure apart from the old one's while both serve a canary.

The alarm (`alarm_request`) watches the new version's metric: τ below `threshold` for 2 of 2
one-minute periods trips the endpoint's `AutoRollbackConfiguration` beside the 5xx and latency
alarms; no data (too little traffic, the publisher not running) is not breaching. threshold = τ(k)
− 3·SE, τ(k) the acceptance length the version's evaluation replayed at the served window k (the
register step's tag `tau_k`), SE = sqrt(μ(k−μ)/100) with μ = τ(k) − 1: the Bhatia–Davis bound on
the variance of accepted tokens per draft (X in [0, k], mean μ) for a 100-draft window, the bound
the embedded engine's and vLLM's live checks lean on too (`engine.spec_counters`).
"""
from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence

from ...engine.spec_counters import WINDOW_DRAFTS, Z
from ...workspace import valid_tau_k

log = logging.getLogger(__name__)

NAMESPACE = "tidespec/SpeculativeDecoding"
METRIC = "AcceptanceLength"
MIN_DRAFTS = WINDOW_DRAFTS  # the live guard's window rule (`serve.guard.LiveGuard`), and its z


def dimensions(endpoint: str, version: str | None, variant: str = "AllTraffic") -> list[dict]:
    """The metric's CloudWatch dimensions."""
    return [{"Name": "EndpointName", "Value": endpoint}, {"Name": "VariantName", "Value": variant},
            {"Name": "DraftVersion", "Value": str(version or "local")}]


def threshold(tau_k: Sequence[float], k: int, min_drafts: int = MIN_DRAFTS, z: float = Z) -> float:
    """τ(k) − z·sqrt(μ(k−μ)/min_drafts), μ = τ(k) − 1 (module docstring). `tau_k`: replayed τ at
    windows 0..K; a served k above K uses τ(K), which is lower (τ grows with k): the alarm leans
    towards not firing. Raises ValueError for an empty `tau_k` or k < 1."""
    if not tau_k or k < 1 or not valid_tau_k(list(tau_k)):
        raise ValueError(f"threshold needs a chain's replayed τ(k) (1 at k = 0, never falling, ≤ k + 1) and k >= 1 "
                         f"(got {list(tau_k)}, k {k})")
    tau = float(tau_k[min(k, len(tau_k) - 1)])
    mu = tau - 1.0
    return tau - z * math.sqrt(max(mu * (k - mu), 0.0) / min_drafts)


def alarm_request(name: str, endpoint: str, version: str | None, tau_k: Sequence[float], k: int) -> dict:
    """PutMetricAlarm kwargs of the acceptance alarm `name` for draft `version` served at window k."""
    t = threshold(tau_k, k)
    return {"AlarmName": name, "Namespace": NAMESPACE, "MetricName": METRIC,
            "Dimensions": dimensions(endpoint, version), "Statistic": "Average", "Period": 60,
            "EvaluationPeriods": 2, "DatapointsToAlarm": 2, "Threshold": round(t, 4),
            "ComparisonOperator": "LessThanThreshold", "TreatMissingData": "notBreaching",
            "AlarmDescription": f"tidespec blue/green auto-rollback: live acceptance length of draft {version} "
                                f"below {t:.3f} (replayed τ at k={k} less 3 SE over {MIN_DRAFTS} drafts)"}


class Publisher:
    """Puts the engine's live acceptance into CloudWatch (module docstring). `scrape()`: the engine's
    cumulative `engine.spec_counters.SpecDecodeCounters` (None: it exports none; raises when the
    engine does not answer); `cloudwatch`: a boto3 CloudWatch client (default: a new one)."""

    def __init__(self, scrape: Callable[[], object], endpoint: str, version: str | None,
                 cloudwatch=None, min_drafts: int = MIN_DRAFTS):
        self.scrape, self.min_drafts = scrape, min_drafts
        self.dims = dimensions(endpoint, version)
        if cloudwatch is None:
            import boto3
            cloudwatch = boto3.client("cloudwatch")
        self.cw = cloudwatch
        self._start = None  # the counters at the window's start

    def publish_once(self) -> float | None:
        """Read the counters; when the window since the last datapoint holds ≥ min_drafts drafts,
        put its τ and draft count and start a new window. Returns the τ put (tokens per verify
        step), or None. Raises what `scrape` raises and botocore's errors from PutMetricData."""
        now = self.scrape()
        if now is None:
            return None
        if self._start is None or now.num_drafts < self._start.num_drafts:  # first read, or an engine restart
            self._start = now
            return None
        window = now - self._start
        if window.num_drafts < self.min_drafts:
            return None
        self._start = now
        tau = window.acceptance_length
        self.cw.put_metric_data(Namespace=NAMESPACE, MetricData=[
            {"MetricName": METRIC, "Dimensions": self.dims, "Value": tau, "Unit": "None"},
            {"MetricName": "Drafts", "Dimensions": self.dims, "Value": float(window.num_drafts), "Unit": "Count"}])
        return tau

    def run(self, every_s: float, stop: threading.Event) -> None:
        """`publish_once` every `every_s` s until `stop` is set; errors are logged, never raised (the
        engine serves on whatever happens here)."""
        while not stop.wait(every_s):
            try:
                self.publish_once()
            except Exception:
                log.exception("acceptance not published this time")
