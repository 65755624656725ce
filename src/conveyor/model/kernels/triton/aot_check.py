"""Compile every Triton kernel of the CUDA path for a GPU architecture, without a GPU: Triton
lowers it to PTX and its bundled ``ptxas`` assembles a cubin. The interpreter checks what the
kernels compute; this checks that they build for the real target (tile shapes ``tl.dot``
accepts, types, shared memory within the card's limit) with the launch constants the launchers
use. Run it where ``TRITON_INTERPRET`` is unset (an interpreted kernel cannot be compiled):

    python -m conveyor.model.kernels.triton.aot_check --arch 90 --arch 80
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
_TL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class Compiled:
    kernel: str
    dtype: str
    head_dim: int
    arch: int
    shared_bytes: int
    num_warps: int


def _signature(fn, pointers: dict[str, str], floats: tuple[str, ...],
               constants: dict[str, object]) -> dict[str, str]:
    return {a: "constexpr" if a in constants else pointers.get(a) or
            ("fp32" if a in floats else "i32") for a in fn.arg_names}


def _builds(dtype: str, head_dim: int, group: int = 3, block_size: int = 16, num_splits: int = 4):
    """(kernel, signature, constants) of each kernel as its launcher would launch it."""
    import torch
    import triton

    from conveyor.model.kernels.triton import (
        decode_attention,
        elementwise,
        kv_write,
        lora,
        prefill_attention,
        rms_norm,
    )
    from conveyor.model.kernels.triton.common import dot_dtype, dot_precision

    t = _TL[dtype]
    torch_dtype = getattr(torch, dtype)
    dot = dot_dtype(torch_dtype)
    block_d = triton.next_power_of_2(head_dim)
    cache = {"k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}"}
    tables = {"block_table_ptr": "*i32", "seq_lens_ptr": "*i32"}
    kw = dict(HEAD_DIM=head_dim, BLOCK_D=block_d)
    yield "kv_write", kv_write._kv_write_kernel, {
        "k_ptr": f"*{t}", "v_ptr": f"*{t}", "slot_ptr": "*i64", **cache}, (), dict(
        NUM_KV_HEADS=4, HEAD_DIM=head_dim, BLOCK_H=4, BLOCK_D=block_d)
    for suffix, window in (("", 0), ("_window", 512)):  # a sliding-window layer's too
        yield f"decode_split{suffix}", decode_attention._decode_split_kernel, {
            "q_ptr": f"*{t}", **cache, **tables, "part_o_ptr": "*fp32",
            "part_lse_ptr": "*fp32"}, ("scale",), dict(
            GROUP=group, BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
            MIN_SPLIT_LEN=decode_attention.MIN_TOKENS_PER_SPLIT,
            BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=32, DOT=dot,
            PRECISION=dot_precision(torch_dtype), WINDOW=window, **kw)
    yield "decode_reduce", decode_attention._decode_reduce_kernel, {
        "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": f"*{t}"}, (), dict(
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), **kw)
    yield "rms_norm", rms_norm._rms_norm_kernel, {
        "x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}"}, (
        "eps",), dict(N=576, BLOCK=1024, HAS_RESIDUAL=True)
    yield "rotary", elementwise._rotary_kernel, {
        "x_ptr": f"*{t}", "cos_ptr": f"*{t}", "sin_ptr": f"*{t}", "out_ptr": f"*{t}"}, (), dict(
        NUM_HEADS=12, HALF=head_dim // 2, BLOCK_H=16, BLOCK_D=block_d // 2)
    yield "silu_mul", elementwise._silu_mul_kernel, {
        "gate_up_ptr": f"*{t}", "out_ptr": f"*{t}"}, (), dict(N=1536, BLOCK=1024)
    yield "lora_shrink", lora._lora_shrink_kernel, {
        "x_ptr": f"*{t}", "a_ptr": "*fp32", "slot_ptr": "*i32", "u_ptr": "*fp32"}, (), dict(
        IN=1536, BLOCK_R=lora.block_r(48), BLOCK_K=lora.BLOCK_K)
    yield "lora_expand", lora._lora_expand_kernel, {
        "y_ptr": f"*{t}", "b_ptr": "*fp32", "slot_ptr": "*i32", "u_ptr": "*fp32"}, (), dict(
        OUT=3072, BLOCK_R=lora.block_r(48), BLOCK_N=lora.BLOCK_N)
    block_m, block_n = prefill_attention.prefill_tiles(torch_dtype, head_dim)
    for suffix, window in (("", 0), ("_window", 512)):
        yield f"prefill{suffix}", prefill_attention._prefill_kernel, {
            "q_ptr": f"*{t}", **cache, "out_ptr": f"*{t}", **tables,
            "query_start_ptr": "*i32"}, ("scale",), dict(
            GROUP=group, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, DOT=dot,
            PRECISION=dot_precision(torch_dtype), WINDOW=window, **kw)


def compile_all(archs: list[int], dtypes: list[str], head_dims: list[int]) -> list[Compiled]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from conveyor.model.kernels.triton.common import interpreting

    if interpreting():
        raise RuntimeError("TRITON_INTERPRET is set: interpreted kernels cannot be compiled")
    done = []
    for arch in archs:
        for dtype in dtypes:
            for head_dim in head_dims:
                for name, fn, pointers, floats, constants in _builds(dtype, head_dim):
                    src = ASTSource(fn, _signature(fn, pointers, floats, constants), constants)
                    binary = triton.compile(src, target=GPUTarget("cuda", arch, 32))
                    if "cubin" not in binary.asm:
                        raise RuntimeError(f"{name} built no cubin for sm_{arch}")
                    shared = binary.metadata.shared
                    if shared > SHARED_MEMORY_LIMIT.get(arch, 99 * 1024):
                        raise RuntimeError(f"{name} ({dtype}, head_dim {head_dim}) needs "
                                           f"{shared} bytes of shared memory on sm_{arch}")
                    done.append(Compiled(name, dtype, head_dim, arch, shared,
                                         binary.metadata.num_warps))
    return done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", type=int, action="append", help="e.g. 90 (H100), 80 (A100)")
    p.add_argument("--dtype", action="append", choices=sorted(_TL))
    p.add_argument("--head-dim", type=int, action="append")
    args = p.parse_args(argv)
    for c in compile_all(args.arch or [90], args.dtype or ["bfloat16", "float16", "float32"],
                         args.head_dim or [64, 128, 256]):
        print(f"sm_{c.arch} {c.kernel:14s} {c.dtype:9s} head_dim {c.head_dim:3d}: "
              f"{c.shared_bytes:6d} B shared, {c.num_warps} warps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
