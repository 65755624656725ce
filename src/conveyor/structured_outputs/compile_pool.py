"""CompilePool: grammar compiles in a few worker processes, each with a time limit.

A job waits in one queue for the first free slot. A slot's process (``compile_worker.py``)
starts with its first job, the first slot's when the pool is made, so a second process exists
only once compiles have overlapped. A compile that runs past ``timeout_s``, or whose job is
cancelled because no request waits for it any more, is stopped by killing its process, which
returns every byte it held; a fresh one takes its place at once. The compiled grammar comes
back as xgrammar's JSON and is rebuilt here, off the engine's thread.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import xgrammar as xgr

from conveyor.core.structured_outputs_params import StructuredOutputsParams

POLL_S = 0.05  # how often a busy worker's thread checks its job's deadline and cancellation


@dataclass
class CompileJob:
    params: StructuredOutputsParams
    future: Future[xgr.CompiledGrammar] = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop the job: dropped if it has not started, its process killed if it has."""
        self.cancelled.set()
        self.future.cancel()


class _Worker:
    """One compile process and the socket to it."""

    def __init__(self, info_json: str) -> None:
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.structured_outputs.compile_worker",
             str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send(info_json)
        self.ready = False

    def wait_ready(self) -> None:
        if not self.ready:
            if self.conn.recv() != "ready":
                raise RuntimeError("the grammar compile worker did not start")
            self.ready = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()


class CompilePool:
    def __init__(self, info: xgr.TokenizerInfo, workers: int, timeout_s: float,
                 max_grammar_bytes: int) -> None:
        self.info = info
        self.timeout_s = timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self._info_json = info.serialize_json()
        self._pending: deque[CompileJob] = deque()
        self._busy = [False] * workers  # per slot
        self._closed = False
        self._cond = threading.Condition()
        self._workers: dict[int, _Worker] = {}  # by slot
        self._threads = [threading.Thread(target=self._serve, args=(i,),
                                          name=f"grammar-compile-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, params: StructuredOutputsParams) -> CompileJob:
        job = CompileJob(params)
        with self._cond:
            self._pending.append(job)
            self._cond.notify_all()
        return job

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _next_job(self, index: int) -> CompileJob | None:
        """The next job for slot ``index``: a slot takes one only while every slot before it is
        busy, so the later processes start only when compiles overlap. None: shut down."""
        with self._cond:
            while not self._closed:
                if self._pending and all(self._busy[:index]):
                    self._busy[index] = True
                    job = self._pending.popleft()
                    if self._pending:  # this slot is busy now: a later one may take the next
                        self._cond.notify_all()
                    return job
                self._cond.wait()
            return None

    def _done(self, index: int) -> None:
        with self._cond:
            self._busy[index] = False
            self._cond.notify_all()

    def pids(self) -> list[int]:
        """The compile processes now running."""
        return [w.proc.pid for w in list(self._workers.values()) if w.alive()]

    def _serve(self, index: int) -> None:
        worker = self._start(index) if index == 0 else None
        while (job := self._next_job(index)) is not None:
            try:
                worker = self._compile(index, worker, job)
            finally:
                self._done(index)
        if worker is not None:
            worker.kill()

    def _compile(self, index: int, worker: _Worker | None, job: CompileJob) -> _Worker | None:
        """Run ``job`` on slot ``index``'s process (started if need be); the process after."""
        if job.cancelled.is_set() or not job.future.set_running_or_notify_cancel():
            return worker
        if worker is None or not worker.alive():
            worker = self._start(index)
        try:
            worker.wait_ready()
            outcome = self._run(worker, job)
        except (EOFError, OSError, RuntimeError) as e:
            outcome = ValueError(f"structured_outputs.{job.params.kind}: the grammar "
                                 f"compiler failed ({type(e).__name__}: {e})")
        if isinstance(outcome, Exception):
            worker.kill()
            job.future.set_exception(outcome)
            return self._start(index)  # ready before the next job comes
        status, payload = outcome
        if status == "ok":
            job.future.set_result(xgr.CompiledGrammar.deserialize_json(payload, self.info))
        else:
            job.future.set_exception(ValueError(payload))
        return worker

    def _start(self, index: int) -> _Worker:
        worker = self._workers[index] = _Worker(self._info_json)
        return worker

    def _run(self, worker: _Worker, job: CompileJob) -> tuple[str, str] | Exception:
        """The worker's answer, or why it was stopped (the caller kills the worker then)."""
        worker.conn.send((job.params, self.max_grammar_bytes))
        deadline = time.monotonic() + self.timeout_s
        while not worker.conn.poll(POLL_S):
            if job.cancelled.is_set():
                return ValueError(f"structured_outputs.{job.params.kind}: the compile was "
                                  "cancelled: no request waits for it")
            if time.monotonic() > deadline:
                return ValueError(f"structured_outputs.{job.params.kind} did not compile "
                                  f"within {self.timeout_s:g} s "
                                  "(--structured-outputs-compile-timeout)")
            if not worker.alive():
                raise RuntimeError(f"the worker exited with {worker.proc.returncode}")
        return worker.conn.recv()
