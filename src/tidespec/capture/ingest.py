"""Production traffic back into snapshots: capture objects → exchanges → rehydrated records → the
capture writer (then sealed, DVC-tracked and announced like live capture).

`ingest_source(source, store, ws, params, target, tok, writer)` reads every object of a source not
in its ledger (`capture.exchange.parse_object`), builds prompt ids with the target's chat template
and generated ids from the response (or the target's own greedy output, marked `regenerated`), and
rebuilds each record with one prefill (`Rehydrator`: here, or a vLLM server's extraction). Exactly
once across kills: a per-source ledger line per finished object (written after the writer flushed
its records), and dedupe by event id against every request id already captured, sealing or sealed.
Returns counts by outcome and skip reason. Details: docs/design/capture.md.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Protocol

from ..config import Params
from ..config.sagemaker import parse_s3_uri
from ..engine.build import make_engine
from ..engine.constraint import grammar_for, spec_of_request
from ..engine.grammar_state import GrammarCompiler, GrammarError
from ..engine.speculative import Engine
from ..workspace import Workspace
from .exchange import parse_object
from .rehydrate import completion_ids, regenerate, rehydrate, request_prompt_ids, token_record
from .snapshots import list_snapshots
from .store import read_manifest, read_rows
from .writer import CaptureWriter

log = logging.getLogger(__name__)
FLUSH_EVERY = 16  # records between writer flushes (below any sane capture.queue_size: nothing is dropped)


def ledger_path(ws: Workspace, source: str) -> Path:
    """The source's ledger file (under the workspace state dir)."""
    return ws.state / "ingest" / (hashlib.sha256(source.encode()).hexdigest()[:16] + ".jsonl")


def read_ledger(path: Path) -> dict[str, dict]:
    """Object key → its ledger entry; a torn last line (a kill mid-append) is ignored."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            done[e["key"]] = e
    return done


def append_ledger(path: Path, entry: dict) -> None:
    """Append one object's entry and fsync (after its records are on disk)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())


def captured_ids(capture_dir: Path, snapshots_root: Path, target_id: str) -> set[str]:
    """Request ids already written for this target: the capture dir's manifest and sealing
    manifests, and every local snapshot's manifest."""
    ids = {r.request_id for r in read_manifest(capture_dir)}
    for f in Path(capture_dir).glob("sealing-*.jsonl"):
        ids |= {r.request_id for r in read_rows(f)}
    for snap in list_snapshots(snapshots_root, target_id):
        ids |= {r.request_id for r in read_manifest(snap)}
    return ids


class ObjectStore(Protocol):
    """Where capture objects are listed and read (a source: an S3 prefix URI or a local directory)."""

    def list_objects(self, source: str) -> list[dict]:
        """Capture objects (`*.jsonl`) under `source`, oldest key first: [{"key", "etag", "size"}]."""

    def read_object(self, source: str, key: str) -> bytes:
        """The bytes of one capture object."""


class LocalDir:
    """A local directory of capture objects (the text capture of `tidespec serve`, `capture.mode:
    text`): its `*.jsonl` files; the key is the path relative to it, the etag its size and mtime."""

    def list_objects(self, source: str) -> list[dict]:
        if source.startswith("s3://"):
            raise ValueError(f"{source} is an S3 prefix: read it with adapters.s3_capture.S3Objects")
        root = Path(source)
        return sorted(({"key": str(p.relative_to(root)), "etag": f"{p.stat().st_size}-{p.stat().st_mtime_ns}",
                        "size": p.stat().st_size} for p in root.rglob("*.jsonl") if p.is_file()),
                      key=lambda o: o["key"])

    def read_object(self, source: str, key: str) -> bytes:
        return (Path(source) / key).read_bytes()


def _workload(params: Params, source: str) -> str:
    """`ingest.workload`, else the endpoint name: the last part of the source prefix (or directory)."""
    if params.ingest.workload:
        return params.ingest.workload
    prefix = parse_s3_uri(source)[1] if source.startswith("s3://") else source
    return prefix.rstrip("/").rsplit("/", 1)[-1] or "endpoint"


CRASH_ENV = "TIDESPEC_CRASH_AT"
_crash_hits: Counter = Counter()


def crash_point(name: str) -> None:
    """Fault injection for the exactly-once tests: when $TIDESPEC_CRASH_AT is "<name>:<n>", the n-th
    time this process reaches `name` it kills itself with SIGKILL (no cleanup, no flush: a kill -9 at
    exactly that point). Points: `ingest.record` (a record handed to the writer, maybe not on disk),
    `ingest.flushed` (an object's records on disk, its ledger line not written), `ingest.ledger` (the
    ledger line written). A no-op otherwise."""
    want = os.environ.get(CRASH_ENV)
    if not want or want.rpartition(":")[0] != name:
        return
    _crash_hits[name] += 1
    if _crash_hits[name] == int(want.rpartition(":")[2]):
        os.kill(os.getpid(), signal.SIGKILL)


class Rehydrator(Protocol):
    """Turns exchanges (prompt ids, generated ids) into capture records, a batch at a time: the
    embedded target (`EmbeddedRehydrator`) or an engine elsewhere (`backends.vllm.VLLMRehydrator`:
    vLLM's hidden-state extraction). Returns per exchange its record or the ValueError that skips it."""

    batch_size: int

    def __call__(self, exchanges: list[tuple[list[int], list[int]]]) -> list[dict | ValueError]: ...


class EmbeddedRehydrator:
    """One prefill per exchange through the target in this process (`capture.rehydrate.rehydrate`);
    `tokens_only`: no prefill, the tokens-only record (`capture.rehydrate.token_record`,
    `ingest.mode: online`)."""

    batch_size = 1

    def __init__(self, target, tokens_only: bool = False):
        self.target, self.tokens_only = target, tokens_only

    def __call__(self, exchanges: list[tuple[list[int], list[int]]]) -> list[dict | ValueError]:
        out = []
        for p, g in exchanges:
            try:
                out.append((token_record if self.tokens_only else rehydrate)(self.target, p, g))
            except ValueError as e:  # ids outside the target's vocabulary (another tokenizer's traffic)
                out.append(e)
        return out


def ingest_source(source: str, store: ObjectStore | None, ws: Workspace, params: Params, target, tok,
                  writer: CaptureWriter, progress=None, rehydrator: Rehydrator | None = None) -> dict:
    """Ingest every object of `source` (S3 prefix or local directory) not in its ledger; `store` lists
    and reads them (None: `LocalDir`, a local directory); `rehydrator` rebuilds the records (None:
    `EmbeddedRehydrator`), `batch_size` exchanges at a time; with `ingest.mode: online` nothing is
    rehydrated here (tokens-only records: the train step rebuilds their hidden states). Returns
    counts: objects, records, rehydrated, regenerated, skipped {reason: n} (parse reasons +
    `duplicate_event`, `too_long`, `unsupported_request`, `unsupported_response`, `empty_response`),
    and `stopped` (why) when the capture writer refused a record: that object gets no ledger line
    and is read again next time.
    Raises AWS errors (listing/reading) and ValueError for a target without a tokenizer or a bad
    S3 URI; the ledger and the records stay consistent."""
    if tok is None:
        raise ValueError(f"target {params.target.source} has no tokenizer: endpoint text cannot be tokenized")
    store = store if store is not None else LocalDir()
    if params.ingest.mode == "online":  # tokens at rest: the train step rehydrates them (`train.online`)
        rehydrator = EmbeddedRehydrator(target, tokens_only=True)
    rehydrator = rehydrator or EmbeddedRehydrator(target)
    led = ledger_path(ws, source)
    done = read_ledger(led)
    seen = captured_ids(writer.dir, ws.snapshots, writer.target_id)
    engine = make_engine(params.engine.fixed(), target)  # regenerates missing responses
    rep = {"source": source, "objects": 0, "records": 0, "rehydrated": 0, "regenerated": 0, "skipped": Counter()}
    for obj in store.list_objects(source):
        if done.get(obj["key"], {}).get("etag") == obj["etag"]:
            continue  # read as it is; an object that grew since (a live hourly text file) is read again
        exchanges, reasons = parse_object(store.read_object(source, obj["key"]), model=params.ingest.served_model)
        rep["skipped"].update({k: v for k, v in reasons.items() if k != "missing_response"})
        items = _exchange_ids(exchanges, seen, params, target, tok, engine, rep["skipped"])
        workload, n_obj, dropped0 = _workload(params, source), 0, writer.stats().dropped_total
        for i in range(0, len(items), rehydrator.batch_size):
            batch = items[i:i + rehydrator.batch_size]
            for (ex, _prompt, gen, origin), rec in zip(batch, rehydrator([(p, g) for _, p, g, _ in batch])):
                if isinstance(rec, ValueError):
                    rep["skipped"]["unsupported_request"] += 1
                    continue
                text = {"prompt": json.dumps(ex.request.get("messages", ex.request.get("prompt"))),
                        "completion": ex.response_text or tok.decode(gen, skip_special_tokens=True)}
                # acceptance_length 0.0: no serving-time τ for endpoint traffic (acceptance_rate None: not filtered)
                if not writer.submit(rec, request_id=ex.event_id, workload=workload, acceptance_length=0.0,
                                     prompt_id=ex.event_id, text=text, origin=origin, constraint=_spec(ex)):
                    # the writer refused it (disk quota/full, closed; counted there): stop here without a ledger
                    # line, so the next run reads this object again (what was written is deduplicated by event id)
                    writer.flush()
                    rep["stopped"] = (f"capture writer dropped {ex.event_id} in {obj['key']} (disk quota or full): "
                                      "the object stays unread; free space or seal, then ingest again")
                    rep["skipped"] = dict(rep["skipped"])
                    return rep
                crash_point("ingest.record")
                seen.add(ex.event_id)
                rep[origin] += 1
                n_obj += 1
                if n_obj % FLUSH_EVERY == 0:
                    writer.flush()
        writer.flush()  # this object's records are on disk before its ledger line
        if writer.stats().dropped_total > dropped0:  # a batch dropped at write time (quota, full disk, error)
            rep["stopped"] = (f"capture writer dropped records of {obj['key']} (disk quota or full): the object "
                              "stays unread; free space or seal, then ingest again")
            rep["skipped"] = dict(rep["skipped"])
            return rep
        crash_point("ingest.flushed")
        append_ledger(led, {"key": obj["key"], "etag": obj["etag"], "records": n_obj, "skipped": dict(reasons)})
        crash_point("ingest.ledger")
        rep["objects"] += 1
        rep["records"] += n_obj
        if progress:
            progress(f"{obj['key']}: {n_obj} records, skipped {dict(reasons)}")
    rep["skipped"] = dict(rep["skipped"])
    return rep


def _spec(ex) -> dict | None:
    """The exchange's constraint spec (its `response_format` / `tools`), None for free text or completions."""
    return spec_of_request(ex.request) if ex.route == "chat" else None


@functools.lru_cache(maxsize=4)
def _compiler(target, tok) -> GrammarCompiler:
    return GrammarCompiler.for_target(target, tok)


def _exchange_ids(exchanges, seen: set[str], params: Params, target, tok, engine: Engine,
                  skipped: Counter) -> list[tuple]:
    """(exchange, prompt ids, generated ids, origin) of each exchange to rehydrate, in order; the
    others counted in `skipped` by reason (duplicate_event, unsupported_request, too_long,
    unsupported_response, empty_response). A missing response is the target's own (regenerated)."""
    eos = target.cfg.eos_token_ids[0]
    out, here = [], set()
    for ex in exchanges:
        if ex.event_id in seen or ex.event_id in here:
            skipped["duplicate_event"] += 1
            continue
        try:
            prompt = request_prompt_ids(tok, ex.route, ex.request)
        except ValueError:
            skipped["unsupported_request"] += 1
            continue
        room = target.cfg.max_position - len(prompt)
        if room < 2:  # stated rule: a prompt that leaves no room for a response is skipped, not cut
            skipped["too_long"] += 1
            continue
        origin = "rehydrated"
        if ex.response_text is None:
            n_new = min(params.ingest.max_new_tokens, engine.cfg.max_seq_len - len(prompt) - 1)
            if n_new < 1:
                skipped["too_long"] += 1
                continue
            try:  # a constrained request is regenerated under its grammar, as it was served
                grammar = None if _spec(ex) is None else grammar_for(_spec(ex), _compiler(target, tok))
            except (GrammarError, KeyError, TypeError):
                skipped["unsupported_request"] += 1
                continue
            gen, origin = regenerate(engine, prompt, n_new, grammar=grammar), "regenerated"
        else:
            try:
                gen = completion_ids(tok, ex.response_text, ex.finish_reason, eos)[:room]  # cut at the context
            except ValueError:  # e.g. finish_reason tool_calls: the text is not all the target generated
                skipped["unsupported_response"] += 1
                continue
        if not gen:
            skipped["empty_response"] += 1
            continue
        here.add(ex.event_id)
        out.append((ex, prompt, gen, origin))
    return out
