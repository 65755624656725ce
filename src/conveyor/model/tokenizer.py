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
        tok.chat_template = DEFAULT_CHAT_TEMPLATE
    return tok


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
