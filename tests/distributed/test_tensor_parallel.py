"""Tensor parallelism with real processes over gloo: the same greedy tokens as one process."""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.distributed.group import free_port
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm import LLM
from conveyor.engine.llm_engine import LLMEngine
from conveyor.executor.model_executor import ModelExecutor
from conveyor.model.layers.parallel import WholeSumLinear
from conveyor.model.loader import GEMMA3_ALIAS
from engine_runs import run_to_end, samples

VOCAB = 96  # the tiny models' (conftest.py)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SHARED = ("You are a helpful assistant. Answer briefly and precisely, and think about the "
          "question before you answer it. ")
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Why is the sky blue?", "What is 17 times 23?"]


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=gen).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in lengths]


def _run(engine: LLMEngine, prompts: list, params: list[SamplingParams]) -> list[list[list[int]]]:
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
    return [done[f"r{i}"] for i in range(len(prompts))]


def _embed(engine: LLMEngine, prompts: list) -> list[torch.Tensor]:
    outputs = run_to_end(engine, [(p, PoolingParams(method="mean")) for p in prompts], "e")
    return [torch.tensor(out.embedding) for out in outputs]


def _smollm2_cases(executor: ModelExecutor) -> dict[str, list[list[list[int]]]]:
    """Both policies over one executor, with prefix hits (a shared system prompt), preemption
    (a KV cache too small for every request at once: swap, then recompute) and an n=2 fork."""
    prompts = [SHARED + q for q in QUESTIONS]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(prompts)
    prompts.append("Tell me a story about a dragon.")
    params.append(SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=12))
    results = {}
    for policy, preemption in (("prefill_first", "swap"), ("chunked", "recompute")):
        args = EngineArgs(dtype="float32", policy=policy, preemption_mode=preemption,
                          num_gpu_blocks=8, block_size=16, max_num_batched_tokens=64,
                          swap_space=0.05)
        engine = LLMEngine(args, executor=executor)
        results[policy] = _run(engine, prompts, params)
        stats = engine.get_stats()
        assert stats.scheduler.num_preemptions > 0, policy
        assert stats.scheduler.prefix_cache_hits > 0, policy
    return results


@pytest.mark.slow
def test_smollm2_tp3_equals_tp1() -> None:
    """SmolLM2-135M: 9 query heads and 3 KV heads, one of each KV head per rank. Float compute,
    deterministic: whole sums, so one process's bits (docs/parallelism.md)."""
    expected = _smollm2_cases(ModelExecutor(dtype="float32", device="cpu",
                                            weight_compute="float"))
    tp = ModelExecutor(dtype="float32", device="cpu", weight_compute="float",
                       parallel=EngineArgs(tensor_parallel_size=3,
                                           threads_per_rank=1).parallel_config())
    try:
        assert tp.model.layers[0].num_kv_heads == 1 and tp.model.layers[0].num_heads == 3
        assert isinstance(tp.model.layers[0].down_proj, WholeSumLinear)
        assert _smollm2_cases(tp) == expected
    finally:
        tp.shutdown()


INT8_TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
              "Write a haiku about the sea.",
              "List the planets of the solar system in order from the sun: Mercury, Venus,",
              "def fibonacci(n):\n    if n < 2:\n        return n\n    return"]


def _alone_and_batched(executor: ModelExecutor, dtype: str, prompts: list[list[int]]
                       ) -> tuple[list, list]:
    """Each prompt's greedy tokens and logprobs run alone, and all of them batched (chunked at
    16 tokens: prefill chunks beside decodes)."""
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=0, ignore_eos=True)
    args = EngineArgs(dtype=dtype, max_model_len=128, num_gpu_blocks=64, max_num_seqs=8,
                      enable_prefix_caching=False)
    alone = [samples(run_to_end(LLMEngine(args, executor=executor), [(p, params)])[0])
             for p in prompts]
    batched = run_to_end(LLMEngine(args.replace(policy="chunked", max_num_batched_tokens=16),
                                   executor=executor), [(p, params) for p in prompts])
    return alone, [samples(out) for out in batched]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "size", "dtype"), [
    (None, 3, "float32"), (None, 3, "bfloat16"), (GEMMA3_ALIAS, 2, "float32")],
    ids=["smollm2-tp3-float32", "smollm2-tp3-bf16", "gemma3-tp2-float32"])
def test_integer_compute_tp_is_one_process_bit_for_bit(model, size, dtype) -> None:
    """Integer compute (weight_compute int8) under tensor parallelism gives one process's
    greedy tokens and logprob bits, alone and batched: its row-parallel projections take whole
    sums (``WholeSumLinear``), where partial sums all-reduced would round differently and move
    the next layer's 8-bit activations (SmolLM2: 9 heads, 3 ranks; Gemma 3: 4 heads and Q4_K /
    Q6_K blocks, 2 ranks)."""
    one = ModelExecutor(model, dtype=dtype, device="cpu", weight_compute="int8")
    prompts = [one.tokenizer.encode(t) for t in INT8_TEXTS]
    alone, batched = _alone_and_batched(one, dtype, prompts)
    assert batched == alone
    del one
    tp = ModelExecutor(model, dtype=dtype, device="cpu", weight_compute="int8",
                       parallel=EngineArgs(tensor_parallel_size=size,
                                           threads_per_rank=1).parallel_config())
    try:
        assert isinstance(tp.model.layers[0].down_proj, WholeSumLinear)
        assert _alone_and_batched(tp, dtype, prompts) == (alone, alone)
    finally:
        tp.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_flags_give_tp1_tokens_at_tp3(dtype: str) -> None:
    """``weight_compute="auto"`` resolves by the device alone, so one process and three ranks
    compute alike (integer compute where the CPU kernels are built, its whole sums under
    tensor parallelism) and the default flags' greedy tokens do not depend on the split."""
    args = EngineArgs(dtype=dtype, max_model_len=128, num_gpu_blocks=64)
    one = LLMEngine(args)
    prompts = [one.tokenizer.encode(t) for t in INT8_TEXTS]
    params = [GREEDY] * len(prompts)
    expected = _run(one, prompts, params)
    resolved = one.executor.weight_compute
    del one
    tp = LLMEngine(args.replace(tensor_parallel_size=3, threads_per_rank=1))
    try:
        assert tp.executor.weight_compute == resolved
        assert isinstance(tp.executor.model.layers[0].down_proj, WholeSumLinear)
        assert _run(tp, prompts, params) == expected
    finally:
        tp.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_tiny_models_tp2_equal_tp1(model: str, request) -> None:
    """8 query heads; the Llama has 2 KV heads (one a rank), the Qwen3 4 (two a rank, q/k norms,
    a tied LM head). Embeddings (pooled on rank 0) agree too."""
    path = request.getfixturevalue(model)
    prompts = random_prompts(6)
    params = [GREEDY] * len(prompts)
    args = EngineArgs(model=path, dtype="float32", num_gpu_blocks=64, block_size=8)
    one = LLMEngine(args)
    expected = _run(one, prompts, params)
    vectors = _embed(one, prompts)
    engine = LLMEngine(args.replace(tensor_parallel_size=2, threads_per_rank=1))
    try:
        assert _run(engine, prompts, params) == expected
        for got, want in zip(_embed(engine, prompts), vectors, strict=True):
            assert torch.allclose(got, want, atol=1e-4)
    finally:
        engine.shutdown()


def _worker_env(rank: int, local_rank: int, port: int) -> dict[str, str]:
    return dict(os.environ, RANK=str(rank), WORLD_SIZE="4", LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.mark.slow
def test_two_nodes_on_loopback_equal_tp1(tiny_llama: str) -> None:
    """Two "machines": this process is rank 0 and starts rank 1; ranks 2 and 3 are separate
    `conveyor worker` processes joined through torchrun-style environment variables. Four
    ranks over 2 KV heads: each KV head is held by two ranks."""
    prompts = random_prompts(4, seed=1)
    params = [GREEDY] * len(prompts)
    args = EngineArgs(model=tiny_llama, dtype="float32", num_gpu_blocks=64, block_size=8)
    expected = _run(LLMEngine(args), prompts, params)
    port = free_port()
    others = [subprocess.Popen([sys.executable, "-m", "conveyor.entrypoints.cli", "worker",
                                "--threads", "1"], env=_worker_env(rank, rank - 2, port))
              for rank in (2, 3)]
    try:
        engine = LLMEngine(args.replace(tensor_parallel_size=4, nnodes=2, threads_per_rank=1,
                                        master_addr="127.0.0.1", master_port=port))
        assert engine.executor.model.layers[0].num_kv_heads == 1
        assert _run(engine, prompts, params) == expected
        engine.shutdown()
        assert [p.wait(timeout=30) for p in others] == [0, 0]
    finally:
        for p in others:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_killed_worker_raises_within_60s_and_nothing_is_left(tiny_llama: str) -> None:
    from conveyor.distributed.workers import TensorParallelError

    llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks=64, block_size=8,
              tensor_parallel_size=2, threads_per_rank=1)
    prompts = random_prompts(2)
    assert len(llm.generate(prompts, GREEDY, use_tqdm=False)) == 2
    worker = llm.llm_engine.executor.workers.procs[0]
    os.kill(worker.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="conveyor-tp-rank1"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 60
    assert not worker.is_alive()


@pytest.mark.slow
def test_garbage_collected_llm_stops_its_workers(tiny_llama: str) -> None:
    llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks=64, block_size=8,
              tensor_parallel_size=2, threads_per_rank=1)
    worker = llm.llm_engine.executor.workers.procs[0]
    assert worker.is_alive()
    del llm
    gc.collect()
    worker.join(timeout=30)
    assert worker.exitcode == 0
    assert not multiprocessing.active_children()


def test_bad_tensor_parallel_size_fails_before_any_process_starts(tiny_llama: str) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the model's 9"):
        LLM(dtype="float32", tensor_parallel_size=2)  # SmolLM2: 9 heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide"):
        LLM(tiny_llama, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        LLM(tiny_llama, tensor_parallel_size=0)
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_hung_worker_raises_after_the_timeout(tiny_llama: str) -> None:
    from conveyor.distributed.workers import TensorParallelError

    llm = LLM(tiny_llama, dtype="float32", num_gpu_blocks=64, block_size=8,
              tensor_parallel_size=2, threads_per_rank=1, distributed_timeout=5)
    worker = llm.llm_engine.executor.workers.procs[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="timed out after 5 s"):
            llm.generate(random_prompts(1), GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 30
        worker.join(timeout=30)
        assert not worker.is_alive()  # torn down (killed: a stopped process ignores SIGTERM)
    finally:
        if worker.is_alive():
            os.kill(worker.pid, signal.SIGKILL)
