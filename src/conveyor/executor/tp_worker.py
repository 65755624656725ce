"""A tensor-parallel worker's life: ranks 1..N-1 of an engine. It joins the process group,
takes the engine's settings from rank 0, loads its shard into a ``ModelRunner``, then runs
every message rank 0 sends until told to stop; it never sees a request, a tokenizer or the
scheduler.

Started by the engine (``torch.multiprocessing``, spawn: ``worker_process``) on rank 0's
machine, or on another machine with torchrun's environment: ``conveyor worker`` (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK, LOCAL_WORLD_SIZE), or ``torchrun -m
conveyor.executor.tp_worker``.
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from conveyor.distributed.group import broadcast_object, destroy_group, exchange_errors, init_group
from conveyor.distributed.step import (
    ENABLE_LORA,
    INIT_CACHE,
    LORA_SLOT,
    SHUTDOWN,
    receive_lora_slot,
    receive_message,
)
from conveyor.distributed.worker import WorkerSpec, exit_with_parent, spec_from_env
from conveyor.executor.model_runner import ModelRunner
from conveyor.lora.adapter import module_shapes
from conveyor.model.device import configure_cpu_allocator, resolve_device, resolve_dtype
from conveyor.model.layers.parallel import TensorParallel
from conveyor.model.loader import load_model

logger = logging.getLogger(__name__)


def worker_process(spec: WorkerSpec) -> None:
    """A worker process's target (the engine starts its machine's workers with it)."""
    os._exit(run_worker(spec))


def run_worker(spec: WorkerSpec) -> int:
    """The worker's whole life; returns its exit status."""
    if spec.parent_pid is not None:
        exit_with_parent(spec.parent_pid)
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
                                weight_compute=settings["weight_compute"],
                                tp=TensorParallel.of(spec.rank, spec.world_size,
                                                     settings["weight_compute"],
                                                     settings["deterministic"]),
                                with_tokenizer=False)
            runner = ModelRunner(loaded, device, trim_after_long_steps=trim)
        except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
            logger.exception("rank %d failed to load", spec.rank)
            error = f"{type(e).__name__}: {e}"
        if any(exchange_errors(error, spec.world_size, spec.rank)):
            return 1
        with torch.inference_mode():
            while True:
                msg = receive_message()
                if msg.kind == SHUTDOWN:
                    return 0
                if msg.kind == INIT_CACHE:
                    runner.init_cache(*msg.extra, kv_dtype)
                elif msg.kind == ENABLE_LORA:
                    runner.enable_lora(*msg.extra)
                elif msg.kind == LORA_SLOT:
                    runner.set_lora_slot(*receive_lora_slot(msg, module_shapes(runner.config)))
                else:
                    runner.forward(msg.step)
    finally:
        destroy_group()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(spec_from_env())


if __name__ == "__main__":
    sys.exit(main())
