"""The machine's roofline for a workload: measured GEMM rate and memory bandwidth, model FLOPs
and bytes, and the least time any engine could take.

The time model is an ideal engine on this machine: prefill computes every prompt token once
(logits only at the last position), decode runs the requests in batches of ``max_num_seqs``,
one step per output token, each step bound by the larger of its FLOPs at the measured GEMM
rate and its bytes (weights once + the KV cache it reads) at the measured bandwidth. The weight
bytes of a step are those the engine reads at that batch size when it says so
(``step_weight_bytes``: its quantized copies serve small batches), else the dtype's.

Under integer compute (``weight_compute="int8"``: a GGUF model's blocks multiplied as integers
against 8-bit activations) the linear layers' arithmetic runs at the measured int8 GEMM rate (the
fastest of ``torch._int_mm`` and Conveyor's own ``int8_block_gemm`` on Q8_0 and Q4_0 blocks:
oneDNN's integer GEMM falls back to slow code on a CPU without VNNI) and attention's at the float
one, and every step, prefill's too, reads the weights as the engine holds them: the blocks, whatever
the batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from conveyor.bench.workloads import Workload
from conveyor.model.shape import ModelShape

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class MachineRates:
    gemm_flops: float  # measured matmul FLOP/s in the model's dtype (best of a few square GEMMs)
    mem_bandwidth: float  # measured read bandwidth, bytes/s
    num_threads: int  # CPU threads; on a GPU its streaming multiprocessors
    dtype: str = "bfloat16"  # of the GEMM
    device: str = "cpu"  # where they were measured: "cpu" or the GPU's name
    # measured int8 x int8 -> int32 GEMM op/s where asked, on the CPU only (the fastest of
    # torch._int_mm and Conveyor's own integer GEMM on Q8_0 and on Q4_0 blocks); int8_source
    # names which
    int8_ops: float | None = None
    int8_source: str = "torch._int_mm"


@dataclass(frozen=True)
class Roofline:
    flops: float
    bytes: float
    prefill_s: float
    decode_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    single_stream_decode_tokens_per_s: float  # one sequence, weights read once per token

    @property
    def time_s(self) -> float:
        return self.prefill_s + self.decode_s

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "time_s": self.time_s}


def workload_roofline(shape: ModelShape, workload: Workload, rates: MachineRates,
                      weight_dtype: str = "bfloat16", max_num_seqs: int = 64,
                      max_num_batched_tokens: int = 4096, prefix_caching: bool = True,
                      step_weight_bytes: list[float] | None = None,
                      kv_dtype: str | None = None, weight_compute: str = "float") -> Roofline:
    """The ideal engine's time for ``workload`` on a machine with ``rates``.

    With ``prefix_caching`` the workload's shared prefix is computed once, not once per request.
    ``step_weight_bytes[i]`` is the weight bytes a step of ``i + 1`` tokens reads, where that
    is fewer than the dtype's (steps with more tokens read the dtype's). ``kv_dtype``: the KV
    cache's element type, when not ``weight_dtype``. ``weight_compute="int8"`` (it needs
    ``rates.int8_ops`` and ``step_weight_bytes``): the linear layers' FLOPs at the int8 rate,
    attention's at the float one, and steps with more tokens than ``step_weight_bytes`` lists
    read what its last one reads (integer compute reads the same blocks at every batch size).
    """
    if weight_compute not in ("float", "int8"):
        raise ValueError(f"weight_compute is float or int8, not {weight_compute!r}")
    integer = weight_compute == "int8"
    if integer and (rates.int8_ops is None or not step_weight_bytes):
        raise ValueError("weight_compute int8 needs rates.int8_ops and step_weight_bytes")
    small = step_weight_bytes or []
    weights = small[-1] if integer else shape.matmul_params * DTYPE_BYTES[weight_dtype]

    def weights_read(tokens: int) -> float:
        return small[tokens - 1] if tokens <= len(small) else weights

    def compute_s(flops: float, attention: float) -> float:
        """Seconds for ``flops``, ``attention`` of them attention's (in float in either mode)."""
        if not integer:
            return flops / rates.gemm_flops
        return (flops - attention) / rates.int8_ops + attention / rates.gemm_flops

    kv_tok = shape.kv_elements_per_token * DTYPE_BYTES[kv_dtype or weight_dtype]
    flops = bytes_ = 0.0

    prompt_tokens = workload.num_prompt_tokens
    shared = workload.shared_prefix_len if prefix_caching else 0
    computed = prompt_tokens - shared * (len(workload.requests) - 1)
    prefill_flops = computed * shape.linear_flops_per_token
    prefill_attention = 0.0
    for i, r in enumerate(workload.requests):
        n = len(r.prompt_token_ids)
        skip = shared if i else 0  # causal attention of the uncached positions only
        pairs = n * (n + 1) // 2 - skip * (skip + 1) // 2
        attention = shape.attention_flops_per_pair * pairs
        prefill_flops += shape.lm_head_flops + attention
        prefill_attention += attention
    prefill_steps = -(-computed // max_num_batched_tokens)
    prefill_bytes = prefill_steps * weights + computed * kv_tok
    prefill_s = max(compute_s(prefill_flops, prefill_attention),
                    prefill_bytes / rates.mem_bandwidth)
    flops += prefill_flops
    bytes_ += prefill_bytes

    decode_s = 0.0
    reqs = workload.requests
    for start in range(0, len(reqs), max_num_seqs):
        wave = reqs[start:start + max_num_seqs]
        # Each step after the first token: every live sequence reads its KV and writes one slot.
        for step in range(1, max(r.max_tokens for r in wave)):
            live = [len(r.prompt_token_ids) + step for r in wave if r.max_tokens > step]
            step_flops = sum(shape.linear_flops_per_token + shape.lm_head_flops
                             + shape.attention_flops_per_pair * c for c in live)
            step_attention = shape.attention_flops_per_pair * sum(live)
            step_bytes = weights_read(len(live)) + sum(c for c in live) * kv_tok
            decode_s += max(compute_s(step_flops, step_attention),
                            step_bytes / rates.mem_bandwidth)
            flops += step_flops
            bytes_ += step_bytes
    total = prefill_s + decode_s
    single = 1.0 / max(weights_read(1) / rates.mem_bandwidth,
                       compute_s(shape.linear_flops_per_token + shape.lm_head_flops, 0.0))
    return Roofline(flops, bytes_, prefill_s, decode_s, workload.num_output_tokens / total,
                    (prompt_tokens + workload.num_output_tokens) / total, single)


def measure_machine(dtype: str = "bfloat16", gemm_size: int = 2048, bandwidth_mib: int = 256,
                    repeats: int = 5, device: str = "cpu", int8: bool = False) -> MachineRates:
    """Short torch micro-benchmarks: best-of-``repeats`` GEMM in ``dtype`` (the engine's: a CPU
    without native bf16 runs float32) and streaming reads. On ``device="cuda"`` the GPU's
    (cuBLAS and HBM), with sizes raised to keep it busy: GEMMs of 8192, reads of 2 GiB. With
    ``int8`` on the CPU also int8 GEMMs of the same size, the fastest of ``torch._int_mm``
    (oneDNN's integer kernels, fast with VNNI) and Conveyor's ``int8_block_gemm`` on Q8_0 and
    on Q4_0 blocks (the integer path's own, on plain AVX2 too): what integer compute's matmuls
    can reach."""
    import torch

    on_gpu = device.startswith("cuda")
    if on_gpu:
        gemm_size, bandwidth_mib = max(gemm_size, 8192), max(bandwidth_mib, 2048)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)

    def timed(kernel) -> float:
        kernel()  # warm up the library's kernel selection
        best = float("inf")
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            kernel()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    a = torch.randn(gemm_size, gemm_size, device=device).to(getattr(torch, dtype))
    b = torch.randn(gemm_size, gemm_size, device=device).to(getattr(torch, dtype))
    gemm = 2.0 * gemm_size**3 / timed(lambda: torch.matmul(a, b))

    # Read bandwidth: the better of two streaming kernels over bandwidth_mib of float32
    # (a reduction and a matrix-vector product, which is what decode does with the weights).
    x = torch.ones(bandwidth_mib * 2**20 // 4, dtype=torch.float32, device=device)
    matrix = x.view(-1, 1024)
    vector = torch.ones(matrix.shape[0], dtype=torch.float32, device=device)
    best = min(timed(x.sum), timed(lambda: torch.mv(matrix.T, vector)))
    if on_gpu:
        props = torch.cuda.get_device_properties(device)
        return MachineRates(gemm, x.numel() * 4 / best, props.multi_processor_count, dtype,
                            props.name)
    int8_rates = {}
    if int8:
        # Conveyor's kernel on 8-bit and on 4-bit codes: without VNNI the 4-bit ones sum more
        # products in int16 before widening them (int8_blocks.cpp), so they run faster
        int8_rates = {source: rate for source, rate in [
            ("torch._int_mm", _int_mm_rate(gemm_size, timed)),
            *((f"Conveyor's int8_block_gemm, {quant}",
               _int8_block_gemm_rate(gemm_size, timed, quant)) for quant in ("Q8_0", "Q4_0"))]
            if rate is not None}
    int8_source = max(int8_rates, key=int8_rates.__getitem__, default="torch._int_mm")
    return MachineRates(gemm, x.numel() * 4 / best, torch.get_num_threads(), dtype,
                        int8_ops=int8_rates.get(int8_source), int8_source=int8_source)


def _int_mm_rate(size: int, timed: Callable[[Callable[[], object]], float]) -> float | None:
    """Op/s of ``torch._int_mm`` on int8 [size, size] CPU matrices (int32 products), by
    ``timed``; None where this torch lacks it or it refuses them."""
    import torch

    a = torch.randint(-128, 128, (size, size), dtype=torch.int8)
    b = torch.randint(-128, 128, (size, size), dtype=torch.int8)
    try:
        return 2.0 * size**3 / timed(lambda: torch._int_mm(a, b))
    except (AttributeError, RuntimeError, NotImplementedError):
        return None


def _int8_block_gemm_rate(size: int, timed: Callable[[Callable[[], object]], float],
                          quant: str = "Q8_0") -> float | None:
    """Op/s of Conveyor's ``int8_block_gemm`` (float32 rows rounded to 8 bits, weight blocks of
    GGUF type ``quant``, int32 sums) on [size, size] matrices, by ``timed``; None without the
    kernels."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, quants

    from conveyor.model.kernels.int8_blocks import (
        int8_block_gemm,
        int8_block_gemm_available,
        int8_panel_lanes,
    )
    from conveyor.model.layers.gguf_blocks import GGUFPart

    if not int8_block_gemm_available():
        return None
    quant_type = GGMLQuantizationType[quant]
    kind = int(quant_type)
    weight = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)
    part = GGUFPart(kind, torch.from_numpy(quants.quantize(weight, quant_type)))
    panels = part.lane_panels(int8_panel_lanes())
    x = torch.randn(size, size)
    return 2.0 * size**3 / timed(lambda: int8_block_gemm(x, [kind], [panels], [size]))
