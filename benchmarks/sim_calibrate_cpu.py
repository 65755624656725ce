"""Measure this machine's rates for the simulator's ``this-cpu`` hardware spec.

Run: ``.venv/bin/python benchmarks/sim_calibrate_cpu.py`` (about 20 s). It prints, with torch
on the CPU in bf16 (the engine's default dtype here):

* peak matrix rate: the best GFLOP/s of bf16 GEMMs at the engine's shapes (SmolLM2 MLP and
  attention projections at prefill-sized batches);
* memory bandwidth: bytes/s of streaming reductions over a 1 GiB tensor (read-only traffic);
* GEMV rate: a decode-sized bf16 matmul (8 rows) over a 256 MiB weight, i.e. the bandwidth a
  decode step really sees, giving ``memory_efficiency``;
* attention rate: torch's scaled_dot_product_attention (causal prefill) in GFLOP/s, giving
  ``attention_efficiency``;

and a YAML fragment to paste into ``src/conveyor/sim/specs/hardware/this-cpu.yaml``.
Lives outside ``conveyor.sim`` because the simulator itself never imports torch.
"""

from __future__ import annotations

import time

import torch


def best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_gflops() -> float:
    rates = []
    for m, k, n in [(512, 576, 1536), (1024, 576, 1536), (1024, 1536, 576), (2048, 2048, 2048)]:
        a = torch.randn(m, k, dtype=torch.bfloat16)
        b = torch.randn(k, n, dtype=torch.bfloat16)
        t = best_time(lambda a=a, b=b: a @ b)
        rates.append(2 * m * k * n / t / 1e9)
    return max(rates)


def stream_gbs() -> float:
    x = torch.ones(256 * 1024 * 1024, dtype=torch.float32)  # 1 GiB
    t = best_time(lambda: x.sum())
    return x.numel() * 4 / t / 1e9


def gemv_gbs() -> float:
    w = torch.randn(8192, 16384, dtype=torch.bfloat16)  # 256 MiB
    x = torch.randn(8, 16384, dtype=torch.bfloat16)
    t = best_time(lambda: x @ w.T)
    return w.numel() * 2 / t / 1e9


def attention_gflops() -> float:
    heads, dim, length = 9, 64, 512
    q = torch.randn(8, heads, length, dim, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    t = best_time(lambda: sdpa(q, k, v, is_causal=True))
    pairs = length * (length + 1) / 2
    return 8 * heads * 4 * dim * pairs / t / 1e9


def main() -> None:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    gemm, stream, gemv, attn = gemm_gflops(), stream_gbs(), gemv_gbs(), attention_gflops()
    print(f"torch {torch.__version__}, {threads} threads")
    print(f"bf16 GEMM peak     {gemm:8.1f} GFLOP/s")
    print(f"stream read        {stream:8.1f} GB/s")
    print(f"bf16 GEMV (decode) {gemv:8.1f} GB/s")
    print(f"bf16 SDPA (causal) {attn:8.1f} GFLOP/s")
    print("\n# this-cpu.yaml fragment")
    print(f"peak_matrix_tflops: {gemm / 1000:.3f}")
    print(f"memory_bandwidth_gbs: {stream:.1f}")
    print(f"memory_efficiency: {min(1.0, gemv / stream):.2f}")
    print(f"attention_efficiency: {min(1.0, attn / gemm):.2f}")


if __name__ == "__main__":
    main()
