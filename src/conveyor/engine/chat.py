"""Chat prompts: a conversation rendered with the tokenizer's own chat template."""

from __future__ import annotations

from typing import Any


def chat_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """``{"prompt", "prompt_token_ids"}`` for ``messages`` (as ``LLMEngine.add_request`` takes);
    ``tools`` (OpenAI tool definitions) go to templates that render them."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(
                m.get("content"), str):
            raise ValueError(f"messages: each message needs a string 'role' and 'content', got {m!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt)
    # The template already places any special tokens it needs.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
