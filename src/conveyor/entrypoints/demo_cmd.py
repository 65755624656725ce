"""`conveyor demo` (what `make run` runs): a batch of real chat prompts through LLM.chat on the
embedded model, each reply printed, then the throughput and what the scheduler did."""

from __future__ import annotations

import argparse
import sys
import time

from conveyor.engine.args import add_cli_args

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Explain what a CPU cache is in two sentences.",
    "Write a haiku about the ocean.",
    "What is 12 times 7?",
    "Why is the sky blue?",
    "Name three primary colors.",
    "Suggest a name for a friendly robot.",
    "What does a continuous-batching inference engine do?",
    "Translate 'good morning' into Spanish.",
    "List two benefits of drinking water.",
    "What is the boiling point of water at sea level?",
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo", help="run a short demonstration batch on the embedded model",
        description="Answer a batch of questions with LLM.chat in one continuously batched run, "
                    "print every answer, then the throughput and scheduler statistics.")
    parser.add_argument("--num-prompts", type=int, default=len(DEMO_QUESTIONS),
                        help=f"how many demo questions to ask (1-{len(DEMO_QUESTIONS)}, default: all)")
    parser.add_argument("--max-tokens", type=int, default=48,
                        help="most tokens per answer (default: 48)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy (default: 0)")
    add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.args import from_cli_args
    from conveyor.engine.llm import LLM

    if not 1 <= args.num_prompts <= len(DEMO_QUESTIONS):
        print(f"conveyor demo: error: --num-prompts must be in [1, {len(DEMO_QUESTIONS)}]", file=sys.stderr)
        return 2
    questions = DEMO_QUESTIONS[: args.num_prompts]
    t0 = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        llm = LLM(**vars(from_cli_args(args)))
    except ValueError as e:
        print(f"conveyor demo: error: {e}", file=sys.stderr)
        return 2
    engine = llm.llm_engine
    cfg = engine.model_config
    print(f"model: {cfg.name} ({cfg.num_params / 1e6:.0f}M params, {cfg.num_layers} layers), "
          f"device={getattr(engine.executor, 'device', '?')}, loaded in {time.perf_counter() - t0:.1f}s")
    print(f"KV cache: {engine.num_gpu_blocks} blocks x {engine.engine_args.block_size} tokens, "
          f"max_num_seqs={engine.engine_args.max_num_seqs}, policy={engine.engine_args.policy}\n")

    t1 = time.perf_counter()
    outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params,
                       use_tqdm=sys.stderr.isatty())
    elapsed = time.perf_counter() - t1

    for q, out in zip(questions, outputs, strict=True):
        c = out.outputs[0]
        print(f"Q: {q}\nA: {c.text.strip()}\n   [{len(c.token_ids)} tokens, {c.finish_reason}]\n")
    stats = engine.get_stats()
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    print(f"{len(outputs)} requests in {elapsed:.2f}s: {n_in} prompt tokens ({cached} from the prefix "
          f"cache), {n_out} output tokens -> {n_out / elapsed:.1f} output tok/s, "
          f"{(n_in + n_out) / elapsed:.1f} total tok/s")
    print(f"engine steps: {stats.num_steps}, preemptions: {stats.scheduler.num_preemptions}, "
          f"finished: {stats.finished_by_reason}")
    return 0
