"""Scores between texts from their embeddings (``LLM.score``, ``/v1/score``, ``/v1/rerank``).

An embedding model scores a pair by the cosine similarity of the two texts' vectors (a
bi-encoder, as sentence-transformers' ``similarity``); one text against many, or two lists
pairwise, as vLLM's score API pairs them.
"""

from __future__ import annotations

import math


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[int, int]]:
    """Index pairs into (``text_1`` as a list, ``text_2`` as a list): one against each, or two
    lists of one length pairwise. ValueError for anything else."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    if len(first) == 1:
        return [(0, j) for j in range(len(second))]
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one "
                         "text_1, or as many as text_2 (scored pairwise)")
    return [(j, j) for j in range(len(second))]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return dot / norm if norm > 0 else 0.0
