"""The speculative decoding tests' run: requests added at once, run to the end, checked for
leaked blocks and for per-request acceptance counts that add up to the engine's."""

from __future__ import annotations

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from engine_runs import run_to_end


def run_greedy(executor, args: EngineArgs, prompts: list[list[int]], max_tokens: int,
               warm_up: bool = False):
    """Every request's greedy output tokens, and the engine's stats at the end. ``warm_up``:
    the prompts run first (1 token each) so that their blocks are in the prefix cache."""
    engine = LLMEngine(args, executor=executor)
    if warm_up:
        run_to_end(engine, [(p, SamplingParams(temperature=0, max_tokens=1)) for p in prompts],
                   prefix="w")
    outs = run_to_end(engine, [(p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True)) for p in prompts])
    accepted = sum(out.metrics.num_accepted_tokens for out in outs)
    stats = engine.get_stats()
    assert accepted == stats.scheduler.spec_accepted_tokens  # per request, and in the engine's counters
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks, "KV blocks leaked"
    engine.scheduler.block_manager.gpu.check_consistency()
    return [list(out.outputs[0].token_ids) for out in outs], stats
