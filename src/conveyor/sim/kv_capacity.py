"""How many long requests run at once in one KV-cache budget: a model's hybrid KV-cache groups
(``core/kv_cache_spec.py``) against one uniform full-attention group of every layer.

Pure Python: the real Scheduler and BlockManager step with a stand-in executor (every sample is
token 0, no clock), so the figure is exactly what the engine's admission allows. Both layouts get
the same bytes: a hybrid block holds ``layers_per_group`` layers, a uniform block every layer, so
the hybrid pool has ``num_layers / layers_per_group`` times as many blocks.

    python -m conveyor.sim.kv_capacity --model gemma3-270m --prompt-len 8000 --kv-gib 1
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from conveyor.core.config import CacheConfig, SchedulerConfig, SchedulingPolicy
from conveyor.core.kv_cache_spec import KVCacheGroup, kv_cache_groups, layers_per_group
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.sim.specs import ModelSpec, load_model


@dataclass(frozen=True)
class Capacity:
    """One layout's run: its pool and the most requests that decoded in one step."""

    layout: str  # "hybrid" | "uniform"
    num_groups: int
    num_blocks: int
    max_concurrent: int
    num_preemptions: int


def block_bytes(model: ModelSpec, block_size: int, layers: int) -> float:
    """K and V of ``block_size`` tokens in ``layers`` layers."""
    return 2 * layers * model.num_kv_heads * model.head_dim * model.kv_cache_bytes * block_size


def run_layout(model: ModelSpec, hybrid: bool, kv_bytes: float, prompt_len: int,
               output_len: int, num_requests: int, block_size: int = 16,
               policy: SchedulingPolicy = SchedulingPolicy.CHUNKED,
               max_num_batched_tokens: int = 2048) -> Capacity:
    """Add ``num_requests`` distinct prompts of ``prompt_len`` tokens (``output_len`` tokens
    each) and step until all finish; the peak is the most decodes of one step."""
    groups: tuple[KVCacheGroup, ...] = kv_cache_groups(model.attention_windows) if hybrid else ()
    if len(groups) == 1:
        groups = ()
    layers = layers_per_group(groups, model.num_layers)
    num_blocks = int(kv_bytes // block_bytes(model, block_size, layers))
    max_len = prompt_len + output_len
    if policy is SchedulingPolicy.PREFILL_FIRST:
        max_num_batched_tokens = max(max_num_batched_tokens, max_len)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=max(num_requests, 1), max_model_len=max_len,
                        max_num_batched_tokens=max(max_num_batched_tokens, num_requests),
                        policy=policy),
        CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, kv_cache_groups=groups),
        clock=lambda: 0.0)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    for i in range(num_requests):  # distinct prompts: no prefix-cache hits
        sched.add_request(f"r{i}", [i] + [1] * (prompt_len - 1), params)
    peak = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        peak = max(peak, out.num_decodes)
        sched.update(out, [[0] * out.num_samples(i) for i in range(len(out.seqs))])
    return Capacity("hybrid" if hybrid else "uniform", max(1, len(groups)), num_blocks, peak,
                    sched.num_preemptions)


def compare(model: ModelSpec, kv_bytes: float, prompt_len: int, output_len: int,
            **kw: object) -> tuple[Capacity, Capacity]:
    """(hybrid, uniform) on the same bytes, with enough requests to fill the hybrid pool."""
    hybrid_groups = kv_cache_groups(model.attention_windows)
    layers = layers_per_group(hybrid_groups, model.num_layers)
    block_size = int(kw.get("block_size", 16))  # type: ignore[call-overload]
    # a hybrid request needs at least its full-attention blocks: more requests than fit
    blocks = kv_bytes // block_bytes(model, block_size, layers)
    full_groups = sum(1 for g in hybrid_groups if not g.spec.sliding_window) or 1
    num_requests = int(blocks // (full_groups * -(-prompt_len // block_size))) + 2
    return (run_layout(model, True, kv_bytes, prompt_len, output_len, num_requests, **kw),  # type: ignore[arg-type]
            run_layout(model, False, kv_bytes, prompt_len, output_len, num_requests, **kw))  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conveyor.sim.kv_capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma3-270m", help="a built-in sim model spec or a path")
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV-cache budget (GiB)")
    p.add_argument("--prompt-len", type=int, default=8000)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--policy", default="chunked", choices=SchedulingPolicy.values())
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    model = load_model(args.model)
    hybrid, uniform = compare(model, args.kv_gib * 2**30, args.prompt_len, args.output_len,
                              block_size=args.block_size,
                              policy=SchedulingPolicy.parse(args.policy, "--policy"),
                              max_num_batched_tokens=args.max_num_batched_tokens)
    print(f"{model.name}: {args.kv_gib:g} GiB of KV cache, {args.prompt_len}-token prompts + "
          f"{args.output_len} output tokens, policy {args.policy}, block size {args.block_size}")
    for c in (hybrid, uniform):
        print(f"  {c.layout:7} {c.num_groups} group(s) x {c.num_blocks:,} blocks: "
              f"{c.max_concurrent} requests at once ({c.num_preemptions} preemptions)")
    ratio = hybrid.max_concurrent / max(uniform.max_concurrent, 1)
    print(f"  hybrid / uniform: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
