"""Prefect flow `tide_capture`: production traffic (SageMaker Data Capture) → rehydrated records →
snapshots (thin: logic in `tidespec.capture.ingest`, S3 in `tidespec.adapters.s3_capture`). Deployed
by prefect.yaml (`tide-capture`, entrypoint `flows/capture.py:tide_capture`, interval schedule);
`tidespec ingest` runs it in-process. A sealed snapshot publishes like live capture: `dvc add` +
push and the `tidespec.capture.threshold` event that starts `tide_cycle`."""
from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from tidespec.config import load_params
from tidespec.workspace import Workspace


@flow(name="tide_capture", log_prints=True)
def tide_capture(root: str = ".", params_path: str = "params.yaml", publish: bool = True, seal: bool = False) -> dict:
    """Ingest every new capture object of the configured sources (`ingest.sources`, else the
    deploy profiles' data capture prefixes and `tidespec serve`'s text capture) into `root`'s
    snapshots. `publish`: seal → DVC + event (needs `root` to be a DVC repo). `seal`: seal what is
    unsealed at the end even below `capture.seal_min_tokens` (the `tidespec.capture.text` trigger sets
    it: the front door counted that many tokens of `usage.total_tokens`, and the rehydrated records
    hold a few fewer, so a seal on the writer's own count could wait for the next burst). Returns
    per-source counts. A run with no new objects does nothing (the ledger)."""
    # here, not at import: `prefect deploy` loads this file for the flow's parameters only
    from tidespec.adapters.publish import Publisher
    from tidespec.adapters.s3_capture import S3Objects, default_sources
    from tidespec.backends.vllm import rehydrator_for
    from tidespec.capture.ingest import ingest_source
    from tidespec.capture.writer import CaptureWriter
    from tidespec.models.hf_files import target_id
    from tidespec.models.load import get_target
    log = get_run_logger()
    ws, params = Workspace(Path(root).resolve()), load_params(params_path)
    sources = default_sources(params, target_id(params), ws)
    if not sources:  # checked before loading the target: a schedule with nothing configured costs nothing
        why = ("no capture source: set ingest.sources, enable deploy.sagemaker.data_capture, or serve with "
               "capture.mode: text")
        log.warning("ingest skipped: %s", why)
        return {"skipped": why}
    target, tok = get_target(params)
    pub = None
    if publish:
        if not (ws.root / ".dvc").is_dir():
            raise ValueError(f"{ws.root} is not a DVC repo: `dvc init` and add a remote, or run with publish=False")
        pub = Publisher.for_workspace(ws, params)
    writer = CaptureWriter(ws.ingest_dir(target.target_id), target.target_id, params.capture,
                           snapshots_root=ws.snapshots, on_seal=pub, replica_id=params.serve.replica())
    store = S3Objects()  # the S3 client is built on first use: a local-directory source needs no AWS
    try:  # ingest.rehydrate_backend: the prefill in this process, or vLLM's hidden-state extraction
        with rehydrator_for(params, target, ws.state) as rehydrator:
            reports = [ingest_source(src, store, ws, params, target, tok, writer, progress=log.info,
                                     rehydrator=rehydrator) for src in sources]
        if seal and writer.seal_now() is not None:
            log.info("sealed what the text event announced (seal=True)")
    finally:
        writer.close()  # flushes; waits for the publisher (DVC + event) of what sealed
    for r in reports:
        log.info("%s: %s objects, %s records (%s regenerated), skipped %s", r["source"], r["objects"], r["records"],
                 r["regenerated"], r["skipped"])
    return {"sources": reports, "published": list(pub.published) if pub else []}
