"""Named, seeded benchmark workloads (W1, W2, W3, S1, C1): the same requests for every system measured.

Prompts are random token ids drawn from the ordinary part of the vocabulary (ids below
``FIRST_TOKEN_ID`` hold the special tokens of Llama-family tokenizers), so a workload needs
only a vocabulary size, not a tokenizer. Every request is greedy with ``ignore_eos`` so each
system generates exactly ``max_tokens`` tokens. See docs/benchmarks.md for the table.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

FIRST_TOKEN_ID = 256  # leave the special / byte tokens at the bottom of the vocabulary alone


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    seed: int
    requests: list[BenchRequest] = field(default_factory=list)
    shared_prefix_len: int = 0  # tokens every prompt starts with (W2)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def max_seq_len(self) -> int:
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)


@dataclass(frozen=True)
class WorkloadSpec:
    description: str
    num_requests: int
    prompt_len: tuple[int, int]  # inclusive range of each request's own (unshared) tokens
    output_len: int
    shared_prefix_len: int = 0
    # copy-heavy (C1): each prompt ends with its own first this-many tokens again, so the model
    # goes on copying its prompt, as when asked to repeat or edit a text
    repeat_len: int = 0


SPECS: dict[str, WorkloadSpec] = {
    "W1": WorkloadSpec("64 requests, prompts uniform in [32, 256] tokens, 128 output tokens",
                       64, (32, 256), 128),
    "W2": WorkloadSpec("64 requests sharing a 512-token prefix + 32-64 unique tokens, "
                       "64 output tokens", 64, (32, 64), 64, shared_prefix_len=512),
    "W3": WorkloadSpec("16 requests, prompts uniform in [1500, 2000] tokens, 64 output tokens",
                       16, (1500, 2000), 64),
    "S1": WorkloadSpec("1 request, 128-token prompt, 256 output tokens (single stream)",
                       1, (128, 128), 256),
    "C1": WorkloadSpec("1 request, copy-heavy: a 384-token prompt that restarts its first 32 "
                       "tokens, 256 output tokens (single stream)", 1, (352, 352), 256,
                       repeat_len=32),
}


def is_single_stream(name: str) -> bool:
    """One request at a time (S1, C1): the bench reports time to first token and decode tok/s."""
    return SPECS[name].num_requests == 1


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(n)]


def make_workload(name: str, vocab_size: int, seed: int = 0,
                  num_requests: int | None = None) -> Workload:
    """Build workload ``name``; ``num_requests`` (optional) truncates or extends its request count."""
    if name not in SPECS:
        raise ValueError(f"workload must be one of {sorted(SPECS)}, got {name!r}")
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    spec = SPECS[name]
    rng = random.Random(seed)
    prefix = _random_tokens(rng, spec.shared_prefix_len, vocab_size)
    requests = []
    for _ in range(num_requests or spec.num_requests):
        length = rng.randint(*spec.prompt_len)
        own = _random_tokens(rng, length, vocab_size)
        own += own[:spec.repeat_len]
        requests.append(BenchRequest(prefix + own, spec.output_len))
    return Workload(name, spec.description, seed, requests, spec.shared_prefix_len)


def warmup_workload(workload: Workload, num_requests: int = 2, max_tokens: int = 4) -> Workload:
    """A few of ``workload``'s requests, cut short: run once before timing to warm kernels up."""
    reqs = [BenchRequest(r.prompt_token_ids, min(r.max_tokens, max_tokens))
            for r in workload.requests[:num_requests]]
    return Workload(workload.name + "-warmup", workload.description, workload.seed, reqs,
                    workload.shared_prefix_len)
