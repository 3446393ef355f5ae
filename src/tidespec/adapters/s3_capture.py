"""SageMaker Data Capture objects on S3: where the endpoints write them, and how they are listed and
read for the ingest (`capture.ingest.ingest_source`, the `tide_capture` flow).

An endpoint with data capture on (`deploy.sagemaker.data_capture`) writes JSON Lines objects under
`<destination>/<endpoint>/<variant>/yyyy/mm/dd/hh/…jsonl` (AWS SageMaker Developer Guide, "Capture
data from real-time endpoint"); keys carry the hour, so key order is time order.
"""
from __future__ import annotations

from ..capture.ingest import LocalDir
from ..config import Params
from ..workspace import Workspace
from . import aws
from .sagemaker_deploy import data_capture_config, endpoint_name


def default_sources(params: Params, target_id: str, ws: Workspace | None = None) -> list[str]:
    """`ingest.sources`, else `<data capture destination>/<endpoint>/` of every deploy.sagemaker
    profile (data capture on), plus, with a workspace, the text capture of `tidespec serve`
    (`ws.text_capture_dir`: the embedded engine's with `capture.mode: text`, or a front door's before
    vLLM or SGLang, which captures text whatever the mode) when it exists."""
    if params.ingest.sources:
        return [s.rstrip("/") + "/" if s.startswith("s3://") else s for s in params.ingest.sources]
    out = []
    sm = params.deploy.sagemaker
    dc = data_capture_config(sm) if sm is not None else None
    if dc is not None:
        out = [f"{dc['DestinationS3Uri'].rstrip('/')}/{endpoint_name(sm, target_id, p)}/" for p in sorted(sm.profiles)]
    if ws is not None and ws.text_capture_dir(target_id).is_dir():
        out.append(str(ws.text_capture_dir(target_id)))
    return out


class S3Objects:
    """The capture objects of a source (`capture.ingest.ObjectStore`): `s3://bucket/prefix/` listed
    and read with the S3 client `s3` (default: `aws.client("s3")`, built on first use); a local
    directory as `capture.ingest.LocalDir` reads it. Raises AWS errors, ValueError for a bad URI."""

    def __init__(self, s3=None):
        self._s3 = s3

    @property
    def s3(self):
        if self._s3 is None:
            self._s3 = aws.client("s3")
        return self._s3

    def list_objects(self, source: str) -> list[dict]:
        """Capture objects (`*.jsonl`) under `source`, oldest key first: [{"key", "etag", "size"}] (the
        key is the S3 key)."""
        if not source.startswith("s3://"):
            return LocalDir().list_objects(source)
        bucket, prefix = aws.parse_s3_uri(source)
        out = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [{"key": o["Key"], "etag": o["ETag"].strip('"'), "size": o["Size"]}
                    for o in page.get("Contents", []) if o["Key"].endswith(".jsonl")]
        return sorted(out, key=lambda o: o["key"])

    def read_object(self, source: str, key: str) -> bytes:
        """The bytes of one capture object (S3 GetObject, or the local file)."""
        if not source.startswith("s3://"):
            return LocalDir().read_object(source, key)
        return self.s3.get_object(Bucket=aws.parse_s3_uri(source)[0], Key=key)["Body"].read()
