"""The tokenizer of a GGUF file is built from its vocabulary once and then read from the cache
folder: the cached one encodes, decodes and renders chat exactly as the one built from the file,
and a changed file (or an unwritable cache) never gets a stale or missing tokenizer."""

from __future__ import annotations

import os
import shutil

import pytest

from conveyor.model.loader import default_model_path
from conveyor.model.tokenizer import load_tokenizer

TEXTS = ["Hello world", "  spaces\n\ttabs  ", "<|im_start|>user\nhi<|im_end|>", "émoji 🚀 中文", ""]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


def _same(a, b) -> None:
    for text in TEXTS:
        ids = a.encode(text)
        assert ids == b.encode(text) and a.decode(ids) == b.decode(ids), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    assert a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids
    assert (a.eos_token_id, a.bos_token_id) == (b.eos_token_id, b.bos_token_id)


def test_cached_tokenizer_equals_the_files(cache, tmp_path, monkeypatch) -> None:
    built = load_tokenizer(default_model_path())
    (saved,) = cache.iterdir()
    assert (saved / "tokenizer.json").exists()
    import transformers

    def no_gguf(*args, **kwargs):
        if "gguf_file" in kwargs:
            raise AssertionError("the cached tokenizer was rebuilt from the GGUF file")
        return real(*args, **kwargs)

    real = transformers.PreTrainedTokenizerFast.from_pretrained
    monkeypatch.setattr(transformers.PreTrainedTokenizerFast, "from_pretrained", no_gguf)
    _same(load_tokenizer(default_model_path()), built)


def test_a_changed_file_gets_its_own_entry(cache, tmp_path) -> None:
    copy = tmp_path / "model.gguf"
    shutil.copyfile(default_model_path(), copy)
    load_tokenizer(str(copy))
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    load_tokenizer(str(copy))
    assert len(list(cache.iterdir())) == 2


def test_an_unwritable_cache_still_loads(tmp_path, monkeypatch) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the cache folder cannot be created under a file
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(blocker))
    assert load_tokenizer(default_model_path()).encode("Hello world")
