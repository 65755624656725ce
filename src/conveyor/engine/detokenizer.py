"""Incremental detokenization: token ids in, text deltas out, one sequence at a time.

A byte-level BPE token can hold part of a UTF-8 character (emoji and CJK characters often
span two or three tokens), and SentencePiece tokenizers drop a word's leading space when it is
decoded alone. So text is never decoded token by token. Each step decodes a short window
``ids[prefix_offset:]`` with the tokenizer's own ``decode`` and compares it with the decode of
the already-emitted part ``ids[prefix_offset:read_offset]``; the difference is emitted only
once it no longer ends in U+FFFD (an incomplete character), and then the window slides
forward. The window starts a few prompt tokens back so the first output token decodes in
context.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT_TOKENS = 5
_TRIM_AT = 64  # drop already-emitted ids once this many pile up before the window


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode``; for a fast tokenizer whose text transformers leaves as it is (no
    ``clean_up_tokenization_spaces``), its Rust backend's own ``decode``, which is what
    transformers calls in the end: the wrapper's overhead would be paid on every call, twice per
    sequence per step."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decode = tokenizer.decode
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        decode = backend.decode
    return functools.partial(decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, emitting only clean characters."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.read_offset = len(self._ids)
        self.prefix_offset = 0
        # Do not start the context window in the middle of a character.
        while (self.prefix_offset < self.read_offset
               and self._decode(self._ids[self.prefix_offset:self.read_offset]).startswith(_REPLACEMENT)):
            self.prefix_offset += 1

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the newly complete text (possibly empty)."""
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), for a finished sequence."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_REPLACEMENT) and not final):
            return ""  # nothing printable yet: a partial character or a skipped special token
        delta = new_text[len(prefix_text):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._ids)
        if self.prefix_offset > _TRIM_AT:
            del self._ids[:self.prefix_offset]
            self.read_offset -= self.prefix_offset
            self.prefix_offset = 0
        return delta
