"""Tokenizer + chat template, built by transformers from a GGUF file or an HF model directory.

Building one from a GGUF file's vocabulary takes seconds (transformers reads every token and
merge from the file's metadata), so the result is saved once, as an HF tokenizer directory, in
the cache folder (``$CONVEYOR_CACHE_DIR/tokenizers``, keyed by the file's path, size and
modification time and transformers' version), and later loads read that.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

# Used only when a model ships no chat template (e.g. tiny test models): plain ChatML.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Gemma's turns, for a Gemma vocabulary (it has GEMMA_TURN_TOKENS) whose file carries no
# template (as Gemma 3 270M's GGUF): <bos>, then per message
# "<start_of_turn>{user|model}\n{content}<end_of_turn>\n"; a system message goes at the top of
# the first user turn, as Gemma's own template puts it; contents are trimmed, as there.
GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '')"
    " + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def load_tokenizer(path: str) -> Any:
    """A transformers fast tokenizer with ``chat_template`` set, for a .gguf file or a directory."""
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        tok = _gguf_tokenizer(path)
    else:
        if not any(os.path.exists(os.path.join(path, f))
                   for f in ("tokenizer.json", "tokenizer_config.json")):
            raise ValueError(f"model directory {path} has no tokenizer: tokenizer.json "
                             "(or tokenizer_config.json) is missing")
        tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        tok.chat_template = GEMMA_CHAT_TEMPLATE if is_gemma_vocab(tok) else DEFAULT_CHAT_TEMPLATE
    return tok


def is_gemma_vocab(tok: Any) -> bool:
    """Whether ``tok`` has Gemma's turn tokens."""
    vocab = tok.get_vocab()
    return all(t in vocab for t in GEMMA_TURN_TOKENS)


def end_of_turn_id(tok: Any) -> int | None:
    """The id of Gemma's ``<end_of_turn>`` (a chat turn's end, where generation stops as at EOS),
    None for another vocabulary."""
    return tok.get_vocab()[GEMMA_TURN_TOKENS[1]] if is_gemma_vocab(tok) else None


def _gguf_tokenizer(path: str) -> Any:
    import transformers
    from transformers import PreTrainedTokenizerFast

    from conveyor.model.kernels.build import cache_dir

    path = os.path.abspath(path)
    stat = os.stat(path)
    key = hashlib.sha256("\0".join([path, str(stat.st_size), str(stat.st_mtime_ns),
                                    transformers.__version__]).encode()).hexdigest()[:16]
    saved = cache_dir() / "tokenizers" / f"{Path(path).stem}-{key}"
    if (saved / "tokenizer.json").exists():
        return PreTrainedTokenizerFast.from_pretrained(str(saved))
    directory, filename = os.path.split(path)
    tok = PreTrainedTokenizerFast.from_pretrained(directory, gguf_file=filename)
    try:  # written beside, then renamed: a concurrent loader never reads a partial one
        saved.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=saved.parent))
        tok.save_pretrained(str(partial))
        try:
            os.replace(partial, saved)
        except OSError:  # another process saved it first
            shutil.rmtree(partial, ignore_errors=True)
    except OSError:
        pass  # an unwritable cache only costs the next load the same seconds
    return tok
