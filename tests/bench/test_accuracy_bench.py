"""`conveyor bench accuracy` on a short text: integer weight compute against float on SmolLM2."""

from __future__ import annotations

import json
import math

import torch

from conveyor.bench.accuracy import DEFAULT_TEXT, measure, windows
from conveyor.entrypoints.cli import main


def test_windows_cover_the_text() -> None:
    assert windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # no window of one


def test_integer_compute_stays_close_to_float() -> None:
    text = DEFAULT_TEXT.read_text()
    assert len(text.split()) > 2500  # several thousand tokens
    result = measure(None, torch.float32, text, "int8", window=64, max_tokens=128)
    assert result.tokens == 126
    assert 0 < result.kl_mean < 0.05 and result.top1_agreement > 0.85
    assert math.isfinite(result.perplexity) and 1 < result.float_perplexity < 200
    assert abs(math.log(result.perplexity / result.float_perplexity)) < 0.1


def test_cli_writes_a_result(tmp_path, capsys) -> None:
    path = tmp_path / "accuracy.json"
    assert main(["bench", "accuracy", "--max-tokens", "40", "--window", "20",
                 "--json", str(path)]) == 0
    assert "top-1 agreement" in capsys.readouterr().out
    result = json.loads(path.read_text())
    assert result["provenance"]["commit"] and result["results"][0]["tokens"] == 38
