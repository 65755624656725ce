"""Where a tensor-parallel worker finds its group: ``WorkerSpec`` (its rank, the group's
address, its threads and parent), from the engine or from torchrun's environment
(``spec_from_env``). The worker's life itself is ``executor/tp_worker.py``'s."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass


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


def exit_with_parent(parent_pid: int) -> None:
    """Exit this process (at once, skipping cleanup) once ``parent_pid`` is gone."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="conveyor-parent-watch", daemon=True).start()


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
