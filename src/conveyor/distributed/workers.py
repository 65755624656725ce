"""Rank 0's side of a tensor-parallel engine: it starts the workers of its own machine
(``torch.multiprocessing``, spawn), meets every rank in the process group, hands them the
engine's settings, sends each step message, and tears them all down.

A worker that dies, fails to load, or hangs past the group's timeout turns the next (or
current) step into a ``TensorParallelError``; a watchdog thread notices local workers that exit,
so the error names them. Teardown (``shutdown``, garbage collection, interpreter exit) asks the
workers to stop, then terminates and finally kills what is left; workers also exit on their own
when rank 0's process is gone.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from conveyor.distributed.group import (
    ParallelConfig,
    backend_for,
    broadcast,
    broadcast_object,
    destroy_group,
    exchange_errors,
    free_port,
    init_group,
)
from conveyor.distributed.step import SHUTDOWN, StepMessage, send_message
from conveyor.distributed.worker import WorkerSpec

# How long a failed collective waits for a worker's death to show (see failure()).
DEATH_GRACE_S = 2.0

logger = logging.getLogger(__name__)


class TensorParallelError(RuntimeError):
    """A rank failed: the engine cannot go on (every later step would fail too)."""
    engine_fatal = True  # AsyncEngine stops instead of failing just the step's requests


def threads_per_rank(parallel: ParallelConfig) -> int:
    return parallel.threads_per_rank or max(1, (os.cpu_count() or 1) // parallel.local_ranks)


def _teardown(procs: list, state: dict, stop: threading.Event) -> None:
    stop.set()
    if state["closed"]:
        return
    state["closed"] = True
    if state["healthy"]:
        try:
            send_message(StepMessage(kind=SHUTDOWN))
        except Exception:  # noqa: BLE001 - a rank is already gone: terminate below
            pass
    destroy_group()
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def _watch(procs: list, state: dict, stop: threading.Event) -> None:
    while not stop.wait(0.2):
        if any(p.exitcode is not None for p in procs) and not state["closed"]:
            state["healthy"] = False
            for p in procs:
                if p.exitcode is not None:
                    logger.error("tensor-parallel worker %s exited with code %s", p.name,
                                 p.exitcode)
            return


class TensorParallelWorkers:
    def __init__(self, parallel: ParallelConfig, settings: dict[str, Any],
                 target: Callable[[WorkerSpec], None]) -> None:
        """Start this machine's workers (each process runs ``target``) and meet every rank;
        ``settings`` (model, resolved dtype and KV cache dtype, device) go to every worker."""
        import torch.multiprocessing as mp

        self.parallel = parallel
        size = parallel.tensor_parallel_size
        addr = parallel.master_addr or "127.0.0.1"
        port = parallel.master_port or free_port()
        backend = backend_for(settings["device"])
        threads = threads_per_rank(parallel)
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=target, name=f"conveyor-tp-rank{rank}",
                                  daemon=True,
                                  args=(WorkerSpec(rank, size, addr, port, parallel.timeout_s,
                                                   threads, rank, os.getpid(), backend),))
                      for rank in range(1, parallel.local_ranks)]
        self._state = {"closed": False, "healthy": True}
        self._stop_watch = threading.Event()
        self._finalizer = weakref.finalize(self, _teardown, self.procs, self._state,
                                           self._stop_watch)
        for p in self.procs:
            p.start()
        # The thread holds no reference to self, so garbage collection still tears down.
        threading.Thread(target=_watch, args=(self.procs, self._state, self._stop_watch),
                         name="conveyor-tp-watchdog", daemon=True).start()
        self._rendezvous(size, addr, port, backend)
        try:
            broadcast_object(settings)
        except Exception as e:
            raise self.failure(e) from e

    def _rendezvous(self, size: int, addr: str, port: int, backend: str) -> None:
        """Meet every rank; fail at once if a local worker dies first (a worker that cannot
        start would otherwise cost the whole rendezvous timeout)."""
        outcome: list[BaseException | None] = []

        def meet() -> None:
            try:
                init_group(0, size, addr, port, self.parallel.timeout_s, backend)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome.append(e)

        thread = threading.Thread(target=meet, name="conveyor-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive() and not self.dead_workers():
            thread.join(0.1)
        if thread.is_alive():
            raise self.failure(RuntimeError("before joining the process group"))
        if outcome[0] is not None:
            raise self.failure(outcome[0]) from outcome[0]

    def dead_workers(self) -> list[str]:
        return [f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode is not None]

    def failure(self, cause: BaseException | None = None) -> TensorParallelError:
        """The error to raise for ``cause`` (a failed collective), naming the dead workers; the
        workers are torn down."""
        self._state["healthy"] = False
        dead = self.dead_workers()
        # A killed worker's sockets close before its exit can be collected: give a collective's
        # connection error a moment to be explained by the death that caused it.
        deadline = time.monotonic() + (DEATH_GRACE_S if cause is not None else 0.0)
        while not dead and time.monotonic() < deadline:
            time.sleep(0.05)
            dead = self.dead_workers()
        what = (f"worker {', '.join(dead)} died" if dead
                else f"a rank failed or timed out after {self.parallel.timeout_s:g} s")
        self.shutdown()
        return TensorParallelError(f"tensor parallelism: {what}"
                                   + (f": {cause}" if cause is not None else ""))

    def check_loaded(self, own_error: str | None) -> None:
        """After rank 0 loaded its shard: raise if any rank could not load its own."""
        try:
            errors = exchange_errors(own_error, self.parallel.tensor_parallel_size, 0)
        except Exception as e:
            raise self.failure(e) from e
        failed = [f"rank {r}: {err}" for r, err in enumerate(errors) if err is not None]
        if failed:
            self._state["healthy"] = False
            self.shutdown()
            raise TensorParallelError("tensor parallelism: loading the model failed on "
                                      + "; ".join(failed))

    def send(self, msg: StepMessage) -> None:
        if self._state["closed"] or not self._state["healthy"]:
            raise self.failure()
        try:
            send_message(msg)
        except Exception as e:
            raise self.failure(e) from e

    def send_tensor(self, t: torch.Tensor) -> None:
        """Broadcast ``t`` after a message whose ranks expect it (LORA_SLOT)."""
        try:
            broadcast(t, 0)
        except Exception as e:
            raise self.failure(e) from e

    def shutdown(self) -> None:
        self._finalizer()
