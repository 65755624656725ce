"""A tensor-parallel worker: ranks 1..N-1 of an engine. It joins the process group, takes the
engine's settings from rank 0, loads its shard, then runs every step message rank 0 sends until
told to stop; it never sees a request, a tokenizer or the scheduler.

Started by the engine (``torch.multiprocessing``, spawn) on rank 0's machine, or on another
machine with torchrun's environment: ``conveyor worker`` (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE), or ``torchrun -m conveyor.distributed.worker``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    timeout_s: float
    threads: int
    local_rank: int = 0
    parent_pid: int | None = None  # exit when this process is gone (workers the engine started)
    backend: str = "gloo"


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="conveyor-parent-watch", daemon=True).start()


def run_worker(spec: WorkerSpec) -> int:
    """The worker's whole life; returns its exit status."""
    import torch

    from conveyor.distributed.group import (
        broadcast_object,
        destroy_group,
        exchange_errors,
        init_group,
    )
    from conveyor.distributed.step import (
        ENABLE_LORA,
        INIT_CACHE,
        LORA_SLOT,
        SHUTDOWN,
        receive_lora_slot,
        receive_message,
        run_step,
    )
    from conveyor.lora.adapter import module_shapes
    from conveyor.model.device import (
        TRIM_AFTER_TOKENS,
        configure_cpu_allocator,
        resolve_device,
        resolve_dtype,
        return_freed_memory,
    )
    from conveyor.model.kv_cache import KVCache
    from conveyor.model.layers.parallel import TensorParallel
    from conveyor.model.loader import load_model

    if spec.parent_pid is not None:
        _exit_with_parent(spec.parent_pid)
    torch.set_num_threads(spec.threads)
    init_group(spec.rank, spec.world_size, spec.master_addr, spec.master_port, spec.timeout_s,
               spec.backend)
    try:
        settings = broadcast_object(None)
        error = None
        try:
            device = resolve_device(settings["device"])
            if device.type == "cuda":
                torch.cuda.set_device(spec.local_rank)
                device = torch.device("cuda", spec.local_rank)
            trim = device.type == "cpu" and configure_cpu_allocator()
            dtype = resolve_dtype(settings["dtype"], device)
            kv_dtype = resolve_dtype(settings["kv_cache_dtype"], device)
            loaded = load_model(settings["model"], dtype, device, kv_cache_dtype=kv_dtype,
                                deterministic=settings["deterministic"],
                                tp=TensorParallel(spec.rank, spec.world_size),
                                with_tokenizer=False)
            model = loaded.model
            layer = model.layers[0]
            attention_kernel = loaded.kernels.attention
            deterministic = loaded.kernels.deterministic
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            logger.exception("rank %d failed to load", spec.rank)
            error = f"{type(e).__name__}: {e}"
        if any(exchange_errors(error, spec.world_size, spec.rank)):
            return 1
        cache = None
        with torch.inference_mode():
            while True:
                msg = receive_message()
                if msg.kind == SHUTDOWN:
                    return 0
                if msg.kind == INIT_CACHE:
                    block_size, num_blocks, num_cpu_blocks = msg.extra
                    cache = None  # the old one's memory goes first
                    cache = KVCache(len(model.layers), layer.num_kv_heads, layer.head_dim,
                                    block_size, num_blocks, num_cpu_blocks, kv_dtype, device)
                    continue
                if msg.kind == ENABLE_LORA:
                    model.enable_lora(*msg.extra)
                    continue
                if msg.kind == LORA_SLOT:
                    model.set_lora_slot(*receive_lora_slot(msg, module_shapes(model.config)))
                    continue
                run_step(model, cache, msg, layer.num_heads // layer.num_kv_heads,
                         attention_kernel, dtype, device, deterministic)
                if trim and len(msg.input_ids) > TRIM_AFTER_TOKENS:
                    return_freed_memory()
    finally:
        destroy_group()


def spec_from_env(threads: int | None = None, timeout_s: float = 120.0) -> WorkerSpec:
    """torchrun's environment -> a WorkerSpec (ValueError naming the missing variable)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ValueError(f"environment variable {missing[0]} is not set (torchrun sets RANK, "
                         "WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not 0 < rank < world:
        raise ValueError(f"RANK must be in 1..WORLD_SIZE-1 for a worker (rank 0 is the engine), "
                         f"got {rank} of {world}")
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    import torch

    return WorkerSpec(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      timeout_s, threads or max(1, (os.cpu_count() or 1) // local_ranks),
                      int(os.environ.get("LOCAL_RANK", "0")),
                      backend="nccl" if torch.cuda.is_available() else "gloo")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(spec_from_env())


if __name__ == "__main__":
    sys.exit(main())
