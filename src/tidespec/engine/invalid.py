"""`InvalidRequest`: a request the engine cannot run, naming the field it is about."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the engine refuses. field: the `Request` field the refusal is about — prompt_ids,
    max_new_tokens (also when prompt + max_new_tokens exceed max_seq_len: the one a client lowers),
    k, sampling, workload, logit_bias, stop_token_ids, min_tokens, grammar, stop, request_id. A
    server maps it to its own parameter (`serve.serving`: max_new_tokens → max_tokens)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
