"""What crosses from a prefill replica to a decode replica, and how a request's sampling
parameters split between them (prefill/decode disaggregation, docs/kv_cache.md).

The prefill replica runs the request with ``max_tokens=1``: its prefill samples the first
token. The decode replica runs the prompt plus that token with the rest of the output to make:
``max_tokens`` and ``min_tokens`` less one, the rest as given. A seeded request draws the same
numbers there (the sampler's draw depends on the seed and the token's position only), and a
repetition penalty sees the same tokens (prompt and output alike); presence and frequency
penalties count output tokens only, so a request using them is not split (it runs whole on a
decode replica), nor is one whose samples, prompt logprobs, output constraint or LoRA adapter
a split would not carry.

The blocks travel through Ray's object store: the prefill replica puts each block, in its stored
form (header with checksums, then bytes), and hands over the object refs with the records.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from conveyor.core.kv_connector.keys import BlockRecord
from conveyor.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class BlockRef:
    record: BlockRecord
    ref: Any  # a Ray ObjectRef of (header bytes, payload buffer)


@dataclass(frozen=True)
class KVHandoff:
    """The prefill replica's last stream item when the request goes on to a decode replica."""

    prompt_token_ids: list[int]
    first_token: int
    namespace: bytes  # the key namespace the blocks were computed in
    blocks: list[BlockRef]  # the prompt's leading full blocks, in order
    num_cached_tokens: int  # the prompt tokens the prefill replica found cached
    finished: bool = True  # the stream's end, as a finished RequestOutput is


def splittable(params: SamplingParams, lora_request: Any = None) -> bool:
    """Does a request with these parameters run split (prefill, then decode)?"""
    return (params.n == 1 and lora_request is None and params.prompt_logprobs is None
            and params.structured_outputs is None and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0
            and (params.max_tokens is None or params.max_tokens > 1))


def prefill_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


def decode_params(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(
        params, max_tokens=None if params.max_tokens is None else params.max_tokens - 1,
        min_tokens=max(params.min_tokens - 1, 0))
