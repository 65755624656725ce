"""Tokenizer + chat template, built by transformers from a GGUF file or an HF model directory."""

from __future__ import annotations

import os
from typing import Any

# Used only when a model ships no chat template (e.g. tiny test models): plain ChatML.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def load_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer with ``chat_template`` set, for a .gguf file or a directory."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if path.endswith(".gguf"):
        directory, filename = os.path.split(os.path.abspath(path))
        tok = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=filename)
    else:
        if not any(os.path.exists(os.path.join(path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"model directory {path} has no tokenizer: tokenizer.json "
                             "(or tokenizer_config.json) is missing")
        tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok
