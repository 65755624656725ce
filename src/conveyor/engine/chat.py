"""Chat prompts: a conversation rendered with the tokenizer's own chat template.

The template's special tokens (``<|im_start|>``, ...) are control tokens; the same text typed
into a message's content is not: content is tokenized as plain text (transformers'
``split_special_tokens``), so a user cannot forge a role boundary.
"""

from __future__ import annotations

import threading
from typing import Any

_plain_tokenizers: dict[int, Any] = {}  # id(tokenizer) -> its backend, special tokens as text
_plain_lock = threading.Lock()


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
    text = _render(tokenizer, messages, add_generation_prompt, tools)
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    risky = [i for i, m in enumerate(messages) if any(s in m["content"] for s in specials)]
    if not risky:  # the common case: one pass (the template's special tokens parsed)
        ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        ids = _encode_apart(tokenizer, messages, add_generation_prompt, text, risky, tools)
    return {"prompt": text, "prompt_token_ids": ids}


def _render(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
            tools: list[dict[str, Any]] | None = None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                         add_generation_prompt=add_generation_prompt)


def _plain_tokenizer(tokenizer: Any) -> Any:
    """A copy of ``tokenizer``'s backend that reads special-token text as ordinary text (its own
    object: the flag is per tokenizer, and flipping a shared one would race other threads)."""
    with _plain_lock:
        plain = _plain_tokenizers.get(id(tokenizer))
        if plain is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            plain.encode_special_tokens = True
            _plain_tokenizers[id(tokenizer)] = plain
        return plain


def _encode_apart(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool,
                  text: str, risky: list[int],
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Render again with a marker in place of each risky content, so that the template's own
    text and the contents are told apart exactly; the template's parts are tokenized as usual,
    the contents as plain text. A template that does not copy such a content verbatim (it
    trims or escapes it) cannot be split safely: ValueError."""
    markers = {i: f"\ue000conveyor-content-{i}\ue001" for i in risky}
    masked = [{**m, "content": markers[i]} if i in markers else m for i, m in enumerate(messages)]
    skeleton = _render(tokenizer, masked, add_generation_prompt, tools)
    parts: list[str] = []
    rest = skeleton
    for i in risky:
        before, found, rest = rest.partition(markers[i])
        if not found:
            raise ValueError(f"messages[{i}].content holds special-token text that the chat "
                             "template does not reproduce verbatim")
        parts.append(before)
    parts.append(rest)
    if "".join(p + c for p, c in zip(parts, [messages[i]["content"] for i in risky] + [""],
                                     strict=True)) != text:
        raise ValueError("messages: a content holding special-token text is changed by the chat "
                         "template, so it cannot be kept apart from the template's tokens")
    plain = _plain_tokenizer(tokenizer)
    ids: list[int] = []
    for part, i in zip(parts, risky + [None], strict=True):
        if part:
            ids += tokenizer.encode(part, add_special_tokens=False)
        if i is not None:
            ids += plain.encode(messages[i]["content"], add_special_tokens=False).ids
    return ids
