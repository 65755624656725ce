"""The torch.distributed process group of a tensor-parallel engine (gloo on CPU, NCCL on CUDA):
rendezvous at ``tcp://master_addr:master_port``, and the collectives the step loop needs
beyond the model's own."""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Waits with no bound of their own: a worker idling until the next request, or the ranks
# loading their shards. A dead peer still ends them at once (its sockets close).
LONG_WAIT_S = 7 * 24 * 3600.0


@dataclass(frozen=True)
class ParallelConfig:
    """Where and how the ranks of one engine meet."""
    tensor_parallel_size: int = 1
    nnodes: int = 1  # machines; rank 0's machine starts its share of the ranks itself
    master_addr: str | None = None  # None: one machine, 127.0.0.1 and a free port
    master_port: int | None = None
    threads_per_rank: int | None = None  # None: this machine's cores / its ranks
    timeout_s: float = 120.0  # a collective that waits longer fails (a hung or lost rank)

    def __post_init__(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if self.nnodes < 1 or size % self.nnodes:
            raise ValueError(f"nnodes must be >= 1 and divide tensor_parallel_size {size}, "
                             f"got {self.nnodes}")
        if self.nnodes > 1 and not self.master_addr:
            raise ValueError("master_addr is required when nnodes > 1")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.timeout_s <= 0:
            raise ValueError(f"distributed_timeout must be > 0, got {self.timeout_s}")

    @property
    def local_ranks(self) -> int:
        return self.tensor_parallel_size // self.nnodes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


_cpu_group = None  # under NCCL: a gloo group for the step messages, which are CPU tensors


def init_group(rank: int, world_size: int, master_addr: str, master_port: int,
               timeout_s: float, backend: str = "gloo") -> None:
    global _cpu_group
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                            rank=rank, world_size=world_size, timeout=timeout)
    _cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None


def destroy_group() -> None:
    global _cpu_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _cpu_group = None


def broadcast(t: torch.Tensor, src: int, timeout_s: float | None = None) -> torch.Tensor:
    """``dist.broadcast`` with its own timeout (the group's when None)."""
    if timeout_s is None:
        dist.broadcast(t, src, group=_cpu_group)
        return t
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    opts.timeout = datetime.timedelta(seconds=timeout_s)
    group = _cpu_group or dist.distributed_c10d._get_default_group()
    group.broadcast([t], opts).wait()
    return t


def broadcast_object(obj: object, src: int = 0) -> object:
    """A small picklable object (the engine's settings, once at start) from ``src``."""
    box = [obj]
    dist.broadcast_object_list(box, src, group=_cpu_group)
    return box[0]


def exchange_errors(error: str | None, world_size: int, rank: int) -> list[str | None]:
    """Every rank's error message (None: fine), on every rank; each waits as long as the
    slowest rank takes to get here (a load)."""
    out: list[str | None] = []
    for src in range(world_size):
        buf = torch.zeros(1024, dtype=torch.uint8)
        if src == rank and error is not None:
            data = error.encode()[:1023] or b"?"
            buf[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        broadcast(buf, src, LONG_WAIT_S)
        raw = bytes(buf.tolist()).rstrip(b"\0")
        out.append(raw.decode(errors="replace") if raw else None)
    return out
