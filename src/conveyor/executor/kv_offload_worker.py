"""KVOffloadWorker: the runner half of the offloading KV connector (``core/kv_connector``) — it
moves block contents between the model runner's KV cache and the tiers' storage
(``kv_tier_store.py``), or loads blocks another engine handed over (``kv_inbound_store.py``).

``start_step`` runs on the engine's thread before the step's block operations and forward: it
copies every block the step saves out of the cache (the pool has handed those blocks to new
contents), then queues the step's ops for a background thread, in order. That thread does the
rest while the step computes: checksums, the host-memory tier, disk reads and writes, and loads,
which it writes straight into the blocks the loading requests hold (nothing else touches them
until the load is reported). ``finished`` reports the loads done and the entries found corrupt,
truncated or missing (removed from the store), for the scheduler half.

Runs on the CPU device, in one process (the engine refuses other set-ups): the cache is reached
through a NumPy view of its bytes, so the copies neither take the GIL for long nor start torch
threads beside the forward's.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import numpy as np
import torch

from conveyor.core.kv_connector.interface import (
    ClearTier,
    DropBlock,
    KVConnectorMetadata,
    KVConnectorOp,
    KVConnectorOutput,
    LoadBlocks,
    LostEntry,
    MoveBlock,
    SaveBlock,
)
from conveyor.executor.kv_block_file import CorruptBlock
from conveyor.executor.kv_inbound_store import InboundStore
from conveyor.executor.kv_tier_store import TierStore

LOAD_WAIT_S = 0.01  # an otherwise idle step waits this long for a load to finish


class KVOffloadWorker:
    def __init__(self, runner: Any, store: TierStore | InboundStore) -> None:
        """``runner``: the ModelRunner whose ``kv_cache`` the blocks live in."""
        self.store = store
        self._runner = runner
        self._cache: tuple[Any, np.ndarray] | None = None  # (KVCache, its bytes as uint8)
        self._jobs: queue.SimpleQueue[tuple[KVConnectorOp, np.ndarray | None] | None] = \
            queue.SimpleQueue()
        self._done = threading.Condition()
        self._output = KVConnectorOutput()
        self._pending_loads = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-offload", daemon=True)
        self._thread.start()

    def _cache_bytes(self) -> np.ndarray:
        """The KV cache ``[slots, 2, blocks, block_size, heads, head_dim]`` as bytes (the last
        dimension in bytes), a view of the runner's current cache."""
        cache = self._runner.kv_cache
        if self._cache is None or self._cache[0] is not cache:
            self._cache = (cache, cache.cache.view(torch.uint8).numpy())
        return self._cache[1]

    # -- the engine's thread ---------------------------------------------------------------

    def start_step(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        cache = self._cache_bytes()
        # every save's copy first: a load queued below may be written into an evicted block
        jobs = [(op, np.ascontiguousarray(cache[:, :, op.block]).reshape(-1)
                 if isinstance(op, SaveBlock) else None) for op in meta.ops]
        with self._done:
            self._pending_loads += sum(isinstance(op, LoadBlocks) for op in meta.ops)
        for job in jobs:
            self._jobs.put(job)

    def finished(self, wait: bool = False) -> KVConnectorOutput | None:
        """What finished since the last call (None: nothing); ``wait``: wait a little for a
        load when one is pending and nothing finished yet (an otherwise idle step)."""
        with self._done:
            if wait and self._pending_loads and not self._output and self._error is None:
                self._done.wait(LOAD_WAIT_S)
            if self._error is not None:
                raise RuntimeError("the KV offload worker failed") from self._error
            out, self._output = self._output, KVConnectorOutput()
        return out if out else None

    def shutdown(self) -> None:
        """Finish the queued ops (writes included), then stop the thread."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()

    # -- the worker's thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            op, saved = job
            try:
                self._do(op, saved)
            except BaseException as e:  # a bug: the engine's thread raises it (finished)
                with self._done:
                    self._error = e
                    if isinstance(op, LoadBlocks) and op.seq_id not in self._output.finished_loads:
                        self._output.finished_loads[op.seq_id] = 0
                        self._pending_loads -= 1
                    self._done.notify_all()

    def _do(self, op: KVConnectorOp, saved: np.ndarray | None) -> None:
        store = self.store
        if isinstance(op, SaveBlock):
            try:
                store.put(op.tier, op.record, saved)
            except OSError:
                self._lost(op.record.key, op.tier, op.serial, "write failed")
        elif isinstance(op, LoadBlocks):
            self._load(op)
        elif isinstance(op, MoveBlock):
            try:
                store.move(op.key, op.source, op.dest)
            except KeyError:
                self._lost(op.key, op.dest, op.serial, "missing")
            except OSError:
                self._lost(op.key, op.dest, op.serial, "write failed")
        elif isinstance(op, DropBlock):
            store.remove(op.key, op.tier)
        elif isinstance(op, ClearTier):
            store.clear(op.tier)

    def _load(self, op: LoadBlocks) -> None:
        cache = self._cache_bytes()
        intact = 0
        for item in op.items:
            try:
                payload = self.store.read(item)
            except (CorruptBlock, KeyError, OSError) as e:
                self.store.remove(item.record.key, item.tier)
                reason = ("corrupt" if isinstance(e, CorruptBlock) else "missing"
                          if isinstance(e, (KeyError, FileNotFoundError)) else "unreadable")
                self._lost(item.record.key, item.tier, item.serial, reason)
                break
            dst = cache[:, :, item.block]
            np.copyto(dst, np.frombuffer(payload, dtype=np.uint8).reshape(dst.shape))  # type: ignore[call-overload]
            intact += 1
        with self._done:
            self._output.finished_loads[op.seq_id] = intact
            self._pending_loads -= 1
            self._done.notify_all()

    def _lost(self, key: bytes, tier: str, serial: int, reason: str) -> None:
        with self._done:
            self._output.lost.append(LostEntry(key, tier, serial, reason))
