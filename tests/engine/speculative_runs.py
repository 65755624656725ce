"""The speculative decoding tests' run: requests added at once, run to the end, checked for
leaked blocks and for per-request acceptance counts that add up to the engine's."""

from __future__ import annotations

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine


def run_greedy(executor, args: EngineArgs, prompts: list[list[int]], max_tokens: int,
               warm_up: bool = False):
    """Every request's greedy output tokens, and the engine's stats at the end. ``warm_up``:
    the prompts run first (1 token each) so that their blocks are in the prefix cache."""
    engine = LLMEngine(args, executor=executor)
    if warm_up:
        for i, p in enumerate(prompts):
            engine.add_request(f"w{i}", p, SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished_requests():
            engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                     ignore_eos=True))
    done = {}
    accepted = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
                accepted += out.metrics.num_accepted_tokens
    stats = engine.get_stats()
    assert accepted == stats.spec_accepted_tokens  # per request, and in the engine's counters
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    engine.scheduler.block_manager.gpu.check_consistency()
    return [done[str(i)] for i in range(len(prompts))], stats
