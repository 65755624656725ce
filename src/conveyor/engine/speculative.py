"""Speculative decoding's parts from EngineArgs: the scheduler's config, and the executor's
proposer (an n-gram lookup, or a draft model with its own KV cache)."""

from __future__ import annotations

from typing import Any

from conveyor.core.spec_decode.config import SpeculativeConfig
from conveyor.core.spec_decode.ngram import NgramProposer
from conveyor.engine.args import EngineArgs


def build_speculative(args: EngineArgs, executor: Any, num_gpu_blocks: int,
                      num_cpu_blocks: int) -> SpeculativeConfig | None:
    """The scheduler's config (None when speculative decoding is off), its proposer given to
    ``executor``. A draft model is loaded here, with a KV cache of ``num_gpu_blocks`` (and
    ``num_cpu_blocks``) like the target's."""
    if args.speculative_model is not None and args.speculative_method != "draft_model":
        raise ValueError("speculative_model is the draft model of speculative_method="
                         f"'draft_model', got speculative_method={args.speculative_method!r}")
    if args.speculative_method is None:
        return None
    config = SpeculativeConfig(method=args.speculative_method,
                               num_speculative_tokens=args.num_speculative_tokens,
                               prompt_lookup_min=args.ngram_prompt_lookup_min,
                               prompt_lookup_max=args.ngram_prompt_lookup_max,
                               disable_by_batch_size=args.speculative_disable_by_batch_size)
    if config.method == "ngram":
        executor.use_proposer(config, NgramProposer(config.prompt_lookup_min,
                                                    config.prompt_lookup_max))
        return config
    from conveyor.executor.draft_proposer import DraftModelProposer
    from conveyor.executor.model_executor import ModelExecutor

    draft = ModelExecutor(args.speculative_model, dtype=args.dtype, device=args.device,
                          seed=args.seed, kv_cache_dtype=args.kv_cache_dtype,
                          max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
                          deterministic=args.deterministic)
    proposer = DraftModelProposer(draft, executor.model_config.vocab_size,
                                  executor.kv_cache_groups)
    proposer.initialize_cache(args.block_size, num_gpu_blocks, num_cpu_blocks)
    executor.use_proposer(config, proposer)
    return config
