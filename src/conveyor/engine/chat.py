"""Chat prompts: a conversation rendered with the tokenizer's own chat template."""

from __future__ import annotations

from typing import Any


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]],
                add_generation_prompt: bool = True) -> dict[str, Any]:
    """``{"prompt", "prompt_token_ids"}`` for ``messages`` (as ``LLMEngine.add_request`` takes)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str):
            raise ValueError(f"messages: each message needs a string 'role' and 'content', got {m!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    # The template already places any special tokens it needs.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
