"""The capture store: the record format, safetensors shards and the JSONL manifest.

A record per finished request: `input_ids [T] int32`, `loss_mask [T] uint8`, `aux_hidden_states
[T, 3H] bf16`, `hidden_states [T, H] bf16` (`validate_record`); a tokens-only record (`ingest.mode:
online`) holds the first two alone, its manifest row says `tokens_only`, and the train step
rebuilds its hidden states from the target as it trains (`train.online`). A shard is written to a temp name,
fsynced and renamed, and its manifest lines are appended and fsynced only after the rename: a
reader trusts the manifest only, so it never sees a torn shard. `capture.compression: zstd`
byte-shuffles bf16 and compresses the shard as a whole (`*.safetensors.zst`). `capture.hidden_dtype:
fp8_e4m3` keeps the two hidden-state fields at rest as float8 e4m3 with a per-row fp32 scale
(`{i}.{field}.scale [T]`, the row's absmax / 448): half bf16's bytes; readers get bf16 back
(`read_record`), each element within 2⁻⁴ of its value relative to itself, or 2⁻⁹ × the row's scale
below e4m3's smallest normal. Sealing, recovery and locks: `capture.snapshots`. Measurements:
docs/design/capture.md.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

log = logging.getLogger(__name__)
FIELDS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
TOKEN_FIELDS = FIELDS[:2]  # what a tokens-only record holds
HIDDEN_FIELDS = FIELDS[2:]
DTYPES = {"input_ids": torch.int32, "loss_mask": torch.uint8,
          "aux_hidden_states": torch.bfloat16, "hidden_states": torch.bfloat16}
CODECS = ("none", "zstd")
HIDDEN_DTYPES = ("bf16", "fp8_e4m3", "fp8_e4m3_b32")  # the hidden-state fields at rest (`capture.hidden_dtype`)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
FP8_BLOCK = 32  # values per scale of `fp8_e4m3_b32` (the last block of a row may be shorter)
FP8_SCALE_BLOCK = {"fp8_e4m3": None, "fp8_e4m3_b32": FP8_BLOCK}  # fp8 hidden dtype → values per scale (None: a row)
MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class ManifestRow:
    request_id: str
    ts: str  # UTC ISO-8601
    workload: str
    target_id: str
    num_tokens: int
    acceptance_length: float  # serving-time τ
    shard: str  # file name relative to the manifest's directory
    offset: int  # record index inside the shard
    prompt_hash: str = ""
    prompt_id: str = ""
    acceptance_rate: float | None = None  # serving-time accepted / drafted (None: served without drafts)
    text: dict | None = None  # {"prompt", "completion"} only with capture.store_text: true
    origin: str = "live"  # live (served here) | rehydrated (endpoint text → one prefill) | regenerated (no response)
    constraint: dict | None = None  # a constrained request's spec (response_format / tools, `engine.constraint`)
    tokens_only: bool = False  # input_ids + loss_mask at rest, no hidden states (`ingest.mode: online`)
    # positions whose next token the target emitted in place of a draft-model proposal it rejected (the
    # distribution there is what the draft got wrong), ascending; the embedded engine's; None: not recorded
    rejected: list[int] | None = None


def utc_now() -> str:
    """Now, UTC ISO-8601 with milliseconds (manifest `ts`)."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def parse_ts(ts: str) -> float:
    """UTC ISO-8601 → POSIX seconds."""
    return datetime.fromisoformat(ts).timestamp()


def prompt_hash(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    """sha256 (16 hex) of the prompt tokens (loss_mask == 0 prefix)."""
    p = input_ids[loss_mask == 0].to(torch.int32).numpy().tobytes()
    return hashlib.sha256(p).hexdigest()[:16]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as fh:
        os.fsync(fh.fileno())


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` created 0600 (never world-readable, not even briefly), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(path, 0o600)


def is_tokens_only(r: dict) -> bool:
    """True for a tokens-only record: neither hidden-state field present."""
    return isinstance(r, dict) and not any(f in r for f in HIDDEN_FIELDS)


def validate_record(r: dict) -> int:
    """Check one capture record against the contract; returns T. Raises ValueError naming the fix:
    all four fields (or, for a tokens-only record, `input_ids` and `loss_mask` alone), torch tensors
    on CPU-readable devices, `input_ids`/`loss_mask` `[T]` integer (ids in [0, 2**31), mask 0/1),
    `aux_hidden_states` `[T, 3H]` and `hidden_states` `[T, H]` floating point, T >= 1."""
    fix = "submit Generation.record of a capture=True request (CaptureWriter.submit_generation)"
    fields = TOKEN_FIELDS if is_tokens_only(r) else FIELDS
    if not isinstance(r, dict) or any(f not in r for f in fields):
        missing = [f for f in fields if not isinstance(r, dict) or f not in r]
        raise ValueError(f"capture record lacks {missing}: {fix}")
    bad = [f for f in fields if not isinstance(r[f], torch.Tensor) or r[f].is_meta]
    if bad:
        raise ValueError(f"capture record fields {bad} are not materialised torch tensors: {fix}")
    ids, mask = r["input_ids"], r["loss_mask"]
    T = ids.shape[0] if ids.dim() == 1 else -1
    if T < 1 or mask.shape != (T,):
        raise ValueError(f"capture record shapes input_ids {tuple(ids.shape)}, loss_mask {tuple(mask.shape)}: "
                         f"need [T], [T] with T >= 1; {fix}")
    if fields is FIELDS:
        aux, hid = r["aux_hidden_states"], r["hidden_states"]
        if hid.dim() != 2 or hid.shape[0] != T or aux.shape != (T, 3 * hid.shape[1]):
            raise ValueError(f"capture record shapes input_ids {tuple(ids.shape)}, aux_hidden_states "
                             f"{tuple(aux.shape)}, hidden_states {tuple(hid.shape)}: need [T], [T, 3H], [T, H]; {fix}")
        if not (aux.is_floating_point() and hid.is_floating_point()):
            raise ValueError(f"hidden states must be floating point (got {aux.dtype}, {hid.dtype}); {fix}")
    if ids.is_floating_point() or ids.is_complex() or mask.is_floating_point():
        raise ValueError(f"input_ids/loss_mask must be integer tensors (got {ids.dtype}, {mask.dtype}); {fix}")
    if int(ids.min()) < 0 or int(ids.max()) >= 2 ** 31:
        raise ValueError(f"input_ids outside [0, 2**31): token ids of the target's vocab expected; {fix}")
    if mask.numel() and int(mask.max()) > 1 or int(mask.min()) < 0:
        raise ValueError(f"loss_mask must hold 0/1 (1 = generated token); {fix}")
    return T


# -- shard codec ------------------------------------------------------------------------------
def _shuffle(t: torch.Tensor) -> torch.Tensor:
    """bf16 `[...]` → uint8 `[2, numel]` (high bytes, low bytes)."""
    b = t.contiguous().view(torch.int16).flatten().view(torch.uint8).view(-1, 2)
    return torch.stack([b[:, 1], b[:, 0]]).contiguous()


def _unshuffle(planes: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return torch.stack([planes[1], planes[0]], dim=1).contiguous().view(torch.bfloat16).view(shape)


def to_fp8(t: torch.Tensor, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, D]` floating → (`[T, D]` float8 e4m3, fp32 scale `[T]`, or `[T, ceil(D / block)]` with a
    `block`): each row (each block of `block` values of a row) divided by the absmax of its finite
    values / 448 (none, or all zero: by 1), rounded to nearest (torch's cast); an inf or NaN element
    comes back NaN (e4m3 has no inf), the other values unharmed. Per-row scaling as in the FP8 formats
    paper (Micikevicius et al. 2022, arXiv 2209.05433 §4); per block of 32 as the OCP Microscaling
    formats (MX v1.0 §5; an fp32 scale here, not E8M0), so one outlier dimension coarsens its block only.
    Raises ValueError for a tensor that is not 2-D floating point, or a block < 1."""
    if t.dim() != 2 or not t.is_floating_point():
        raise ValueError(f"fp8 storage takes [T, D] floating point hidden states, got {t.dtype} {tuple(t.shape)}")
    if block is not None and block < 1:
        raise ValueError(f"fp8 block of {block} values: must be >= 1")
    x = t.detach().to("cpu", torch.float32)
    T, D = x.shape
    b = D if block is None else block
    nb = -(-D // b) if D else 0
    finite = torch.isfinite(x)
    mag = torch.nn.functional.pad(torch.where(finite, x.abs(), 0.0), (0, nb * b - D)).view(T, nb, b)
    amax = mag.amax(dim=2) if nb else torch.zeros(T, 0)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0).clamp_min(torch.finfo(torch.float32).tiny)  # [T, nb]
    q = torch.where(finite, x / scale.repeat_interleave(b, dim=1)[:, :D], float("nan"))
    if block is None:
        scale = scale[:, 0] if nb else torch.ones(T)
    return q.to(FP8).contiguous(), scale.contiguous()


def from_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`to_fp8`'s inverse, as bf16 `[T, D]` (what the other codecs store): a `[T]` scale per row, a
    `[T, ceil(D / FP8_BLOCK)]` one per block. Raises ValueError for another scale shape (a corrupt shard)."""
    T, D = q.shape
    if scale.shape == (T,):
        return (q.to(torch.float32) * scale[:, None]).to(torch.bfloat16)
    if scale.shape != (T, -(-D // FP8_BLOCK)):
        raise ValueError(f"fp8 scale of shape {tuple(scale.shape)} for values {tuple(q.shape)}: one per row or "
                         f"per block of {FP8_BLOCK} expected")
    return (q.to(torch.float32) * scale.repeat_interleave(FP8_BLOCK, dim=1)[:, :D]).to(torch.bfloat16)


def shard_hidden_dtype(path: Path) -> str:
    """How shard `path` stores its hidden states (`HIDDEN_DTYPES`; "bf16" for a shard written before
    `capture.hidden_dtype` existed). Raises what reading the shard raises."""
    path = Path(path)
    if path.name.endswith(".zst"):
        meta = _header_meta(_zst_bytes(path))
    else:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    return meta.get("hidden_dtype", "bf16")


def encode_shard(records: list[dict[str, torch.Tensor]], compression: str = "none",
                 validated: bool = False, hidden_dtype: str = "bf16") -> bytes:
    """Serialise records (per store.FIELDS, or TOKEN_FIELDS for a tokens-only record; cast to
    DTYPES, or the hidden states to float8 with their scales for `hidden_dtype="fp8_e4m3"`) as one
    shard's bytes. Keys `{i}.{field}` (and `{i}.{field}.scale`).
    `validated`: the caller already ran `validate_record` on each (the writer does, at submit).
    Raises ValueError for an unknown codec or hidden dtype, or a record breaking the contract."""
    if compression not in CODECS:
        raise ValueError(f"capture.compression must be one of {CODECS}, got {compression!r}")
    if hidden_dtype not in HIDDEN_DTYPES:
        raise ValueError(f"capture.hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype!r}")
    tensors, shapes = {}, {}
    for i, r in enumerate(records):
        if not validated:
            validate_record(r)
        for f in TOKEN_FIELDS if is_tokens_only(r) else FIELDS:  # a copy: records may share storage
            if hidden_dtype != "bf16" and f in HIDDEN_FIELDS:
                tensors[f"{i}.{f}"], tensors[f"{i}.{f}.scale"] = to_fp8(r[f], FP8_SCALE_BLOCK[hidden_dtype])
                continue
            t = r[f].detach().to("cpu", DTYPES[f], copy=True).contiguous()
            if compression == "zstd" and t.dtype == torch.bfloat16:
                shapes[f"{i}.{f}"] = list(t.shape)
                t = _shuffle(t)
            tensors[f"{i}.{f}"] = t
    meta = {"records": str(len(records)), "codec": compression, "hidden_dtype": hidden_dtype}
    if compression == "none":
        return st_save(tensors, metadata=meta)
    import zstandard
    meta["shapes"] = json.dumps(shapes)
    return zstandard.ZstdCompressor(level=1).compress(st_save(tensors, metadata=meta))


def shard_name(stem: str, compression: str) -> str:
    """`<stem>.safetensors`, or `<stem>.safetensors.zst` for `compression="zstd"`."""
    return f"{stem}.safetensors" + (".zst" if compression == "zstd" else "")


def write_shard(directory: Path, name: str, records: list[dict[str, torch.Tensor]] | bytes,
                compression: str = "none") -> Path:
    """Atomically write `records` (or their `encode_shard` bytes) as one shard `directory/name`
    (0600): temp file, fsync, rename, fsync dir. Returns the final path. Raises ValueError
    (codec/record), OSError (disk)."""
    data = records if isinstance(records, bytes) else encode_shard(records, compression)
    tmp = directory / f".{name}.tmp"
    write_private(tmp, data)
    final = directory / name
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def _zst_bytes(path: str | Path) -> bytes:
    """A `.safetensors.zst` shard's safetensors bytes."""
    import zstandard
    with open(path, "rb") as fh:
        return zstandard.ZstdDecompressor().decompress(fh.read())


@functools.lru_cache(maxsize=4)
def _decoded(path: str, mtime_ns: int) -> dict[str, torch.Tensor]:
    raw = _zst_bytes(path)
    shapes = json.loads(_header_meta(raw).get("shapes", "{}"))
    t = st_load(raw)
    return {k: (_unshuffle(v, shapes[k]) if k in shapes else v) for k, v in t.items()}


def _header_meta(raw: bytes) -> dict:
    """`__metadata__` of a safetensors buffer (8-byte little-endian header length, JSON header)."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]).get("__metadata__", {})


class CorruptShard(ValueError):
    """A shard listed in a manifest cannot be read (truncated, overwritten, bit rot)."""


def _field(get, key: str) -> torch.Tensor:
    """Tensor `key` through `get` (a shard's lookup), a float8 one restored to bf16 with its scale."""
    t = get(key)
    return from_fp8(t, get(f"{key}.scale")) if t.dtype == FP8 else t


def read_record(directory: Path, row: ManifestRow, fields: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """Load one record's tensors (see module docstring for shapes/dtypes: hidden states come back as
    bf16 whatever `capture.hidden_dtype` stored), either codec; `fields`: which (an uncompressed shard
    reads only those bytes; None: all the record holds, plus `rejected_mask` `[T]` uint8 (1 at the row's
    `rejected` positions) when the row has them).
    Raises FileNotFoundError (shard missing) or CorruptShard naming the shard and the fix."""
    rec = _read_fields(Path(directory) / row.shard, row, fields or (TOKEN_FIELDS if row.tokens_only else FIELDS))
    if fields is None and row.rejected is not None:
        rec["rejected_mask"] = rejected_mask(row.rejected, row.num_tokens)
    return rec


def checked_positions(positions, num_tokens: int) -> list[int]:
    """`positions` (a row's `rejected`) as distinct ascending ints. Raises ValueError for one outside
    a record of `num_tokens` tokens."""
    out = sorted({int(i) for i in positions})
    if out and (out[0] < 0 or out[-1] >= num_tokens):
        raise ValueError(f"rejected positions {out[:4]}... outside a record of {num_tokens} tokens")
    return out


def rejected_mask(positions: list[int], num_tokens: int) -> torch.Tensor:
    """`[num_tokens]` uint8, 1 at `positions` (a row's `rejected`). Raises ValueError for a position
    outside the record."""
    mask = torch.zeros(num_tokens, dtype=torch.uint8)
    mask[checked_positions(positions, num_tokens)] = 1
    return mask


def _read_fields(path: Path, row: ManifestRow, fields: tuple[str, ...]) -> dict[str, torch.Tensor]:
    directory = path.parent
    try:
        if row.shard.endswith(".zst"):
            t = _decoded(str(path), path.stat().st_mtime_ns)
            return {k: _field(t.__getitem__, f"{row.offset}.{k}") for k in fields}
        with safe_open(str(path), framework="pt") as f:
            # copied out: a tensor safetensors maps from the file keeps the whole shard mapped while it
            # lives, and records queued by the trainer's producer thread kept every shard resident
            return {k: _field(lambda key: f.get_tensor(key).clone(), f"{row.offset}.{k}") for k in fields}
    except FileNotFoundError:
        raise
    except Exception as e:  # safetensors/zstd raise their own types
        raise CorruptShard(f"shard {path} (record {row.request_id}, offset {row.offset}) is unreadable "
                           f"({type(e).__name__}: {e}); restore the snapshot with `tidespec snapshots pull "
                           f"{Path(directory).name}` (or `dvc pull`), or move it out of the snapshots dir") from e


# -- manifest ---------------------------------------------------------------------------------
def append_manifest(manifest: Path, rows: list[ManifestRow]) -> None:
    """Append rows as JSON lines and fsync (after the shard rename). The file is created 0600."""
    data = "".join(json.dumps(asdict(r)) + "\n" for r in rows).encode()
    fd = os.open(manifest, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, data)  # one write; a crash may still tear it: `trim_torn_tail` on restart
        os.fsync(fd)
    finally:
        os.close(fd)


def trim_torn_tail(manifest: Path) -> int:
    """Cut a partial last line (a crash mid-append: a row never acknowledged) so the next append
    starts on a fresh line. Returns the bytes removed."""
    if not manifest.exists():
        return 0
    with open(manifest, "rb+") as fh:
        data = fh.read()
        if not data or data.endswith(b"\n"):
            return 0
        keep = data.rfind(b"\n") + 1
        fh.truncate(keep)
        os.fsync(fh.fileno())
    return len(data) - keep


def read_rows(path: Path) -> list[ManifestRow]:
    """Rows of a manifest file (capture, snapshot or `sealing-*`); unparsable lines are skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(ManifestRow(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):  # a torn last line (crash mid-append)
            continue
    return rows


def read_manifest(directory: Path) -> list[ManifestRow]:
    """Rows of `directory/manifest.jsonl`; a torn last line (crash mid-append) is ignored."""
    return read_rows(Path(directory) / MANIFEST)


def iter_records(directory: Path) -> Iterator[tuple[ManifestRow, dict[str, torch.Tensor]]]:
    """(row, tensors) for every manifest row of `directory`; raises as `read_record`."""
    for row in read_manifest(directory):
        yield row, read_record(directory, row)


