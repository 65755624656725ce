"""A GGUF file that cannot be read (cut short, only a header, not GGUF at all) is a ValueError
that names the file and says what may be wrong, never a bare array or index error."""

from __future__ import annotations

from pathlib import Path

import pytest

from conveyor.engine.llm import LLM
from conveyor.model.loader import default_model_path, read_model_config


def _bad_files(folder: Path) -> dict[str, Path]:
    data = Path(default_model_path()).read_bytes()
    files = {"cut short": data[: len(data) // 2], "only a header": data[:1000],
             "not GGUF": b"not a gguf file at all" * 10}
    out = {}
    for i, (what, content) in enumerate(files.items()):
        path = folder / f"bad{i}.gguf"
        path.write_bytes(content)
        out[what] = path
    return out


def test_unreadable_gguf_files_are_named(tmp_path) -> None:
    files = _bad_files(tmp_path)
    for what, path in files.items():
        with pytest.raises(ValueError, match="is not a readable GGUF file") as err:
            read_model_config(str(path))
        assert str(path) in str(err.value), what
    with pytest.raises(ValueError, match="is not a readable GGUF file"):  # the engine's own load
        LLM(str(files["cut short"]))
