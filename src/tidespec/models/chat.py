"""Chat templating beside the tokenizer: a chat's token ids through the target's own template."""
from __future__ import annotations


def chat_ids(tok, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a chat through the target's chat template."""
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  return_dict=True)
    return list(out["input_ids"])


def prompt_ids(tok, text: str) -> list[int]:
    """Chat-formatted ids for one user message, ending with the assistant generation prompt."""
    return chat_ids(tok, [{"role": "user", "content": text}], True)
