"""Prometheus exposition of a CaptureWriter's counters (prometheus-client custom collector).

Names follow vLLM's `vllm:<name>` style with the `tidespec:` prefix (`tidespec serve` registers it on /metrics):
`tidespec:capture_written_total`, `tidespec:capture_tokens_total`, `tidespec:capture_bytes_total`,
`tidespec:capture_dropped_total{reason}`, `tidespec:capture_filtered_total{reason}`,
`tidespec:capture_snapshots_sealed_total`, `tidespec:capture_publish_errors_total`,
gauges `tidespec:capture_queue_depth`, `tidespec:capture_unsealed_tokens`.
"""
from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

DROP_REASONS = ("queue_full", "disk_quota", "disk_full", "closed", "failed", "write_error")
FILTER_REASONS = ("sampled_out", "high_acceptance")


class CaptureCollector(Collector):
    """Register with `prometheus_client.REGISTRY.register(CaptureCollector(writer))`; every scrape
    reads `writer.stats()` (no counters are duplicated)."""

    def __init__(self, writer):
        self.writer = writer

    def collect(self):
        st = self.writer.stats()
        for name, doc, val in (("capture_written", "Finished requests written to capture shards.", st.written_total),
                               ("capture_tokens", "Tokens written to capture shards.", st.tokens_total),
                               ("capture_bytes", "Shard bytes written (after compression).", st.bytes_total),
                               ("capture_snapshots_sealed", "Snapshots sealed.", st.sealed_total),
                               ("capture_publish_errors", "Snapshot publish (DVC/event) failures.", st.publish_errors)):
            yield CounterMetricFamily(f"tidespec:{name}", doc, value=val)
        for name, doc, counts, reasons in (
                ("capture_dropped", "Records dropped, never written (by reason).", st.dropped, DROP_REASONS),
                ("capture_filtered", "Requests not captured by the capture filter (by reason).", st.filtered,
                 FILTER_REASONS)):
            m = CounterMetricFamily(f"tidespec:{name}", doc, labels=["reason"])
            for r in sorted(set(reasons) | set(counts)):
                m.add_metric([r], counts.get(r, 0))
            yield m
        yield GaugeMetricFamily("tidespec:capture_queue_depth", "Finished requests waiting for the writer.",
                                value=st.queue_depth)
        yield GaugeMetricFamily("tidespec:capture_unsealed_tokens", "Captured tokens not yet in a snapshot.",
                                value=st.unsealed_tokens)
