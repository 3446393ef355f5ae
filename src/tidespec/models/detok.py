"""Incremental detokenization with stop strings: the text of one request as its tokens arrive.

`tokenizers.decoders.DecodeStream` turns token ids into text pieces and holds back bytes until
they complete a UTF-8 character, so no piece carries half a character (U+FFFD) and the pieces
concatenate to the text. Stop strings are matched on that text, across token boundaries and inside
one step's block of accepted tokens; text that could still be the start of a stop string is held
back from streaming until it cannot (vLLM `vllm/v1/engine/detokenizer.py` semantics: the output is
cut before the stop string unless include_stop_str_in_output; the token that completes the stop
string is the last one kept).

A `TextOutput` is the engine's stop check (`Request.stop`, called on the engine thread) and the
server's text source (`release` for stream deltas, `text` for the whole); the streamed deltas and
the non-streamed text come from the same object, so they are equal by construction. An incomplete
character at the very end of an output (cut by max_tokens) is dropped, not replaced.
"""
from __future__ import annotations

import threading

from tokenizers.decoders import DecodeStream


class TextOutput:
    """Text of one request's output tokens.

    tokenizer: an HF fast tokenizer (`backend_tokenizer`) or a `tokenizers.Tokenizer`; stop: up to
    4 stop strings (non-empty); include_stop: keep the matched stop string in the text;
    skip_special_tokens: drop special tokens (EOS, chat markers) from the text, as
    `tokenizer.decode(..., skip_special_tokens=True)`; stop_token_ids: tokens that end the output
    (EOS, stop ids) — their text is left out unless include_stop, as vLLM does; prompt_ids: the
    decoder's context (its text is not output), so the first token's text is what it adds after the
    prompt (e.g. the joining space of a word-level or SentencePiece tokenizer; vLLM's incremental
    detokenizer starts from the prompt the same way). Raises ValueError for an empty stop string.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, stop_token_ids: set[int] | frozenset[int] = frozenset(),
                 prompt_ids: list[int] | None = None):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop strings must be non-empty strings")
        self._tok = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._ds = DecodeStream(ids=list(prompt_ids or []), skip_special_tokens=skip_special_tokens)
        self._stop, self._include, self._stop_ids = list(stop), include_stop, set(stop_token_ids)
        self._hold = max((len(s) for s in stop), default=1) - 1  # chars that may begin a stop string
        self._lock = threading.Lock()  # the engine thread appends, the server thread releases
        self.text = ""  # the output text so far (cut at the stop string once matched)
        self.offsets: list[int] = []  # character offset in `text` where each kept token's text starts
        self.stop_str: str | None = None
        self._sent = 0

    def __call__(self, tokens: list[int]) -> tuple[int, str] | None:
        """Add one step's tokens; returns (tokens of these to keep, stop string) when a stop
        string completes at one of them, else None (`engine.speculative.Request.stop`)."""
        with self._lock:
            if self.stop_str is not None:
                return 0, self.stop_str
            for i, t in enumerate(tokens):
                self.offsets.append(len(self.text))
                if int(t) in self._stop_ids and not self._include:
                    continue  # the engine ends the output at a stop token: its text is not output
                piece = self._ds.step(self._tok, int(t))
                if not piece:
                    continue
                start = max(0, len(self.text) - self._hold)
                self.text += piece
                hit = self._match(start)
                if hit is not None:
                    at, s = hit
                    self.text = self.text[:at + (len(s) if self._include else 0)]
                    self.stop_str = s
                    return i + 1, s
            return None

    def _match(self, start: int) -> tuple[int, str] | None:
        """The earliest stop string occurrence starting at or after `start`: (index, string)."""
        best = None
        for s in self._stop:
            at = self.text.find(s, start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        return best

    @property
    def released(self) -> int:
        """Characters of `text` already released (streamed)."""
        return self._sent

    def release(self, final: bool = False) -> str:
        """Text not yet released that can no longer turn into a stop string (everything once
        `final` or stopped): the next streaming delta, possibly ""."""
        with self._lock:
            end = len(self.text) if final or self.stop_str is not None or not self._stop else \
                max(self._sent, len(self.text) - self._hold)
            out, self._sent = self.text[self._sent:end], end
            return out


def token_text_and_bytes(tokenizer, token_id: int) -> tuple[str, bytes]:
    """(text, raw bytes) of one token for logprobs: a byte-level BPE token maps back to its exact
    bytes (possibly half a UTF-8 character, whose text is then U+FFFD), others to their text."""
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece and all(c in _BYTE_OF for c in piece) and \
            type(getattr(tokenizer.backend_tokenizer, "decoder", None)).__name__ == "ByteLevel":
        return text, bytes(_BYTE_OF[c] for c in piece)
    return text, text.encode()


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character that stands for each byte → the byte
    (Radford et al. 2019, `gpt-2/src/encoder.py` bytes_to_unicode; `tokenizers`' ByteLevel): the 188
    printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves, the other 68 for chr(256 + i)
    in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in set(printable)]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(shifted)}


_BYTE_OF = byte_level_alphabet()
