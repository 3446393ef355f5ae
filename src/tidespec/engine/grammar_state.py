"""Grammar constraints over token ids: which tokens may come next, at every verified position
(`GrammarCompiler`, `Grammar`, `GrammarState`), on llguidance.

JSON compiles compact and canonical (no free whitespace): keys and punctuation become forced tokens.
The engine masks verify row i by the state after drafts[:i] (`masks`), draws EAGLE3 drafts from the
masked distribution, cuts other drafts at the first forbidden token (`valid_prefix`), proposes the
forced tokens (`forced`), and advances the state by emitted tokens only. Each mask's work is
bounded (`STEP_LEXER_FUEL`): a pathological schema errors instead of stalling the batch. Why
llguidance over xgrammar, measured: docs/design/engine.md.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

# Each mask's and each token's work is bounded (llguidance's `LLParserLimits`): ~3.6 ms of lexer
# work (≈ 14k fuel/ms), 50k Earley items per step (llguidance's default, ≈ 2.5 ms), and at most 2000
# items in one Earley row (its default). An ordinary wide schema needs rows of ~4 items per optional
# property (300 optional properties: ~1200 items; a limit of 500 refused them); an ambiguous grammar
# grows its rows with every token (`x: "a" | x x` reaches 2000 after ~1000 tokens, its slowest mask
# 320 ms on this machine — the worst a pathological grammar costs its batch per step before the
# limit ends it). A grammar over a limit puts the request's matcher in an error state: that request
# ends (finish_reason length, `GrammarState.error`), the batch goes on, and the compiled grammar is
# dropped from the cache (`Grammar.broken`: a failed matcher can leave shared lexer state spent).
# Measured JSON schemas stay far below: < 0.15 ms per mask at p99 (bench/results/grammar-libs.md).
STEP_LEXER_FUEL = 50_000
STEP_MAX_ITEMS = 50_000
MAX_ITEMS_IN_ROW = 2_000
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept (LRU), per compiler
# `format` values llguidance enforces; JSON Schema 2020-12 makes `format` an annotation unless asserted
# (§7.2), so any other (pydantic writes uri-reference, path, binary, password, regex) constrains nothing
ENFORCED_FORMATS = frozenset({"date-time", "time", "date", "duration", "email", "hostname", "ipv4", "ipv6",
                              "uri", "uuid"})


def annotation_formats_dropped(schema):
    """`schema` with every `format` keyword outside `ENFORCED_FORMATS` removed (a copy; the rest as
    sent): such a field is generated as a plain string. A property named "format" (a schema, not a
    string) is kept."""
    if isinstance(schema, list):
        return [annotation_formats_dropped(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: annotation_formats_dropped(v) for k, v in schema.items()
            if not (k == "format" and isinstance(v, str) and v not in ENFORCED_FORMATS)}


class GrammarError(ValueError):
    """A grammar or schema the library cannot compile (the message says why)."""


def _llg():
    import llguidance
    return llguidance


@dataclass(frozen=True)
class Grammar:
    """A compiled constraint. text: llguidance's grammar (JSON of its grammar list, or Lark); key:
    sha256 of it (16 hex); template: a matcher in its start state, copied per request (`state`);
    spec: the request constraint it was compiled from (`engine.constraint`), which a captured record
    keeps so replay compiles the same grammar (None: compiled from a bare grammar)."""

    text: str
    key: str
    template: object = field(compare=False, repr=False)
    vocab_size: int = 0
    stop_ids: tuple[int, ...] = ()
    spec: dict | None = field(default=None, compare=False)
    broken: list = field(default_factory=list, compare=False, repr=False)  # errors of its matchers (shared)

    def state(self) -> GrammarState:
        """A fresh matcher for one request."""
        return GrammarState(self.template.deep_copy(), self.vocab_size, self.stop_ids, self.broken)


class GrammarCompiler:
    """Compiles JSON schemas and Lark grammars for one tokenizer; compiled grammars are cached (LRU).

    tokenizer_json: the HF `tokenizer.json` text of the target's tokenizer; vocab_size: the target's V
    (masks are `[V]`); eos_ids: the ids that end a generation (allowed where the grammar accepts).
    Building the token trie takes ~0.4 s once. Thread-safe.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: list[int] | tuple[int, ...]):
        llg = _llg()
        self.vocab_size, self.eos_ids = vocab_size, tuple(eos_ids)
        self.tok = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids) or None)
        self.limits = llg.LLParserLimits(step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
                                         max_items_in_row=MAX_ITEMS_IN_ROW)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_target(cls, target, tokenizer) -> GrammarCompiler:
        """For a `models.target.Target` (its V and EOS ids) and its tokenizer: an HF fast tokenizer
        (its `backend_tokenizer`) or a `tokenizers.Tokenizer`."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        return cls(backend.to_str(), target.cfg.vocab_size, target.cfg.eos_token_ids)

    def json_schema(self, schema: dict) -> Grammar:
        """A JSON value valid against `schema` (dict), compact (`JSON_OPTIONS`); a `format` llguidance
        does not enforce is an annotation (`annotation_formats_dropped`). Raises GrammarError
        for a schema llguidance cannot compile (unknown type, a `$ref` to nothing, unsupported keywords)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        try:
            text = _llg().LLMatcher.grammar_from_json_schema(annotation_formats_dropped(schema), overrides=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None
        return self.compile(text)

    def lark(self, grammar: str) -> Grammar:
        """A Lark grammar (llguidance's dialect: `%json {schema}` embeds a schema). Raises GrammarError."""
        return self.compile(_llg().LLMatcher.grammar_from_lark(grammar))

    def compile(self, text: str) -> Grammar:
        """A grammar in llguidance's format, compiled (cached by its text). Raises GrammarError when
        llguidance refuses it or it admits no output (no first token: a `$ref` cycle, say)."""
        with self._lock:
            hit = self._cache.get(text)
            if hit is not None and not hit.broken:
                self._cache.move_to_end(text)
                return hit
        m = _llg().LLMatcher(self.tok, text, log_level=0, limits=self.limits)
        if m.is_error():
            raise GrammarError(m.get_error())
        probe = GrammarState(m.deep_copy(), self.vocab_size, ())
        if not bool(probe.masks([], 1).any()) or probe.error:  # e.g. a schema that is only a $ref cycle
            raise GrammarError(f"the grammar admits no output: {probe.error or 'no token may start it'}")
        g = Grammar(text, hashlib.sha256(text.encode()).hexdigest()[:16], m, self.vocab_size, self.eos_ids)
        with self._lock:
            self._cache[text] = g
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return g


def schema_key(spec: dict) -> str:
    """sha256 (16 hex) of a constraint's source (response_format / tools) as compact JSON in its own key
    order (a schema's property order is the output's, so it is part of the identity): what a captured
    record keeps so replay constrains the same way."""
    return hashlib.sha256(json.dumps(spec, separators=(",", ":")).encode()).hexdigest()[:16]


class GrammarState:
    """One request's matcher. Only `advance` changes its state; `masks`, `valid_prefix` and `forced`
    leave it as they found it (a matcher that hits its work limit errors for good, wherever it was:
    the request then ends)."""

    def __init__(self, matcher, vocab_size: int, stop_ids: tuple[int, ...], broken: list | None = None):
        self.m, self.V, self.stop_ids = matcher, vocab_size, stop_ids
        self._words = (vocab_size + 31) // 32
        self._emitted_bad = False
        self._broken = broken if broken is not None else []

    @property
    def error(self) -> str | None:
        """Why the grammar cannot go on (its work limit hit, or a forbidden token emitted); None while it
        can. The first error also marks its `Grammar` broken (the compiler compiles it afresh next time)."""
        err = (self.m.get_error() or "grammar matcher error") if self.m.is_error() else \
            ("a token the grammar forbids was emitted" if self._emitted_bad else None)
        if err is not None and not self._broken:
            self._broken.append(err)
        return err

    def masks(self, prefix: list[int], n: int) -> torch.Tensor:
        """Allowed tokens `[n, V]` bool: row i after the output so far plus prefix[:len(prefix)-n+1+i]
        — i.e. the last n-1 tokens of `prefix` are the rows' drafts and the ones before them precede
        row 0. Rows after a token the grammar forbids allow everything (verification never reaches
        them: that token is masked in the row before), and so do rows after a stop id. Rows the
        matcher could not compute (its work limit hit: `error`) allow only the stop ids."""
        head = len(prefix) - (n - 1)
        ok = self.m.validate_tokens(prefix) if prefix else 0
        stop = next((i for i, t in enumerate(prefix) if t in self.stop_ids), None)
        if stop is not None:  # a stop id ends the output: it is never consumed, rows after it never reached
            ok = min(ok, stop)
        if ok < head:  # the rows' prefix itself is invalid: no row is reachable
            return torch.ones(n, self.V, dtype=torch.bool)
        bits = np.full((n, self._words), -1, dtype=np.int32)
        consumed = 0
        for t in prefix[:head]:
            if not self.m.consume_token(t):
                break
            consumed += 1
        for i in range(n):
            if head + i > ok:
                break
            if self.m.is_error():
                bits[i:] = 0
                break
            self.m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)
            if i < n - 1 and head + i < ok:
                consumed += bool(self.m.consume_token(prefix[head + i]))
        if consumed and not self.m.is_error():
            self.m.rollback(consumed)
        allowed = torch.from_numpy(
            np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.V].astype(bool)
        )
        empty = ~allowed.any(1)
        if empty.any():  # only after an error (a sound grammar that is done still allows the stop ids)
            allowed[empty.nonzero().squeeze(1)[:, None], torch.tensor(self.stop_ids or (0,))[None]] = True
        return allowed

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (after the output so far) the grammar accepts in a row."""
        return self.m.validate_tokens(tokens) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar forces next (its forced bytes, tokenized; the last token is held back
        while a longer token could still cover it): the grammar proposer's drafts."""
        if self.m.is_stopped() or self.m.is_error():
            return []
        return list(self.m.compute_ff_tokens())

    def advance(self, tokens: list[int]) -> None:
        """Record emitted tokens (up to a stop id, which ends the output and is never consumed). A
        token the grammar refuses (only after an error) sets `error`."""
        stop = next((i for i, t in enumerate(tokens) if t in self.stop_ids), len(tokens))
        toks = tokens[:stop]
        if toks and not self.m.consume_tokens(toks):
            self._emitted_bad = True

    @property
    def done(self) -> bool:
        """The grammar is complete and only a stop id may follow."""
        return self.m.is_stopped()
