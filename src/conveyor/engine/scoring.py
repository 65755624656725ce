"""Scores between texts from their embeddings (``LLM.score``, ``/v1/score``, ``/v1/rerank``).

An embedding model scores a pair by the cosine similarity of the two texts' vectors (a
bi-encoder, as sentence-transformers' ``similarity``); one text against many, or two lists
pairwise, as vLLM's score API pairs them.
"""

from __future__ import annotations

import numpy as np


def score_inputs(text_1: str | list[str],
                 text_2: str | list[str]) -> tuple[list[str], list[tuple[int, int]]]:
    """The texts to embed (``text_1``'s, then ``text_2``'s) and the pairs of their indices to
    score: one ``text_1`` against each ``text_2``, or two lists of one length pairwise.
    ValueError for anything else."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must each hold at least one text")
    n = len(first)
    if n == 1:
        return first + second, [(0, n + j) for j in range(len(second))]
    if n != len(second):
        raise ValueError(f"text_1 has {n} texts and text_2 {len(second)}: give one "
                         "text_1, or as many as text_2 (scored pairwise)")
    return first + second, [(j, n + j) for j in range(len(second))]


def pair_scores(vectors: list[list[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of each pair of ``vectors`` (in float64; 0 where one is zero).
    Each vector is converted on its own, so that thousands of them never hold the GIL (and a
    server's event loop and engine thread) for more than one vector at a time."""
    rows = np.stack([np.asarray(v, dtype=np.float64) for v in vectors])
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    first = np.fromiter((i for i, _ in pairs), dtype=np.int64, count=len(pairs))
    second = np.fromiter((j for _, j in pairs), dtype=np.int64, count=len(pairs))
    dots = np.einsum("ij,ij->i", rows[first], rows[second])
    denom = norms[first] * norms[second]
    return np.divide(dots, denom, out=np.zeros_like(dots), where=denom > 0).tolist()
