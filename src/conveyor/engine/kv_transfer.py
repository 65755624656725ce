"""Prefill/decode disaggregation, the engine's side: reading a prefilled prompt's KV blocks out of
a producer engine and handing them to a consumer engine's KV connector (docs/kv_cache.md).

Producer (``kv_transfer="producer"``): ``HandoffExporter`` watches the outputs of each step (an
AsyncEngine observer, in the engine's thread, right after the step): when a request it expects
finishes at its length cap (its first token, under ``max_tokens=1``), its prompt's blocks are
still in the pool's prefix cache, freed that very step and not yet reusable by another; it looks
them up (``prompt_blocks``) and copies their bytes out, with their content records. The copies
are encoded in the stored form (header with checksums, ``encode_blocks``) off the engine thread.

Consumer (``kv_transfer="consumer"``): ``KVTransfer.receive`` puts the blocks handed over in the
runner half's store and offers them to the scheduler half (``InboundKVScheduler``) under the
request's id, before the request is added; the scheduler loads them instead of computing them,
every block verified against its record, and ``release`` drops them when the request ends.
"""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass
from typing import Any

from conveyor.core.block_pool import root_identity
from conveyor.core.kv_connector.inbound import InboundKVScheduler
from conveyor.core.kv_connector.keys import BlockRecord, block_records, extend_block_keys, root_key
from conveyor.core.prefix_hash import extend_block_hashes, root_hash
from conveyor.executor.kv_block_file import encode_header

KV_TRANSFER_ROLES = ("producer", "consumer")  # EngineArgs.kv_transfer's values


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One block in its stored form: its record, the header, the payload (a buffer)."""

    record: BlockRecord
    header: bytes
    payload: Any


@dataclass(frozen=True, slots=True)
class ExportedBlocks:
    """A prompt's leading full blocks read out of a producer's pool."""

    namespace: bytes
    payload_size: int
    records: list[BlockRecord]
    payloads: list[Any]  # NumPy uint8 copies, one per record


def prompt_blocks(block_manager: Any, token_ids: list[int]) -> list[int]:
    """The pool blocks holding ``token_ids``' leading full blocks (base model), as far as the
    prefix cache has them in a row."""
    bs = block_manager.block_size
    gpu = block_manager.gpu
    n = len(token_ids) // bs
    hashes = extend_block_hashes([], token_ids, bs, n, root_hash(0))
    found: list[int] = []
    parent = root_identity(0)
    for j in range(n):
        block = gpu.lookup(hashes[j], parent, token_ids[j * bs:(j + 1) * bs])
        if block is None:
            break
        found.append(block)
        parent = gpu.identity(block)
    return found


def encode_blocks(exported: ExportedBlocks) -> list[StoredBlock]:
    """The blocks in their stored form (checksums: run it off the engine's thread)."""
    return [StoredBlock(record, encode_header(exported.namespace, record, payload,
                                              exported.payload_size), payload)
            for record, payload in zip(exported.records, exported.payloads, strict=True)]


class KVTransfer:
    """One engine's end of the handoff (the engine's thread only)."""

    def __init__(self, engine: Any, inbound_store: Any = None) -> None:
        """``engine``: an LLMEngine started with ``kv_transfer``; ``inbound_store``: a
        consumer's InboundStore."""
        self.role = engine.engine_args.kv_transfer
        self.namespace: bytes = engine.kv_key_namespace
        self.block_size = engine.engine_args.block_size
        self._engine = engine
        self._store = inbound_store
        self._root = root_key(self.namespace, 0)

    @property
    def connector(self) -> InboundKVScheduler:
        connector = self._engine.scheduler.kv_connector
        assert isinstance(connector, InboundKVScheduler)
        return connector

    def export(self, token_ids: list[int]) -> ExportedBlocks:
        """``token_ids``' leading full blocks that the pool holds, copied out."""
        engine = self._engine
        blocks = prompt_blocks(engine.scheduler.block_manager, token_ids)
        keys = extend_block_keys([], token_ids, self.block_size, len(blocks), self._root)
        records = list(block_records(keys, token_ids, self.block_size, 0, len(blocks),
                                     self._root))
        return ExportedBlocks(self.namespace,
                              engine.executor.kv_cache_bytes_per_block(self.block_size),
                              records, engine.executor.read_kv_blocks(blocks))

    def receive(self, request_id: str, blocks: list[StoredBlock]) -> None:
        """Offer ``blocks`` (a prompt's leading full blocks, in order) to request
        ``request_id``, added next; ValueError on an engine that is not a consumer."""
        if self.role != "consumer":
            raise ValueError("this engine does not take KV blocks handed over "
                             "(kv_transfer='consumer')")
        for block in blocks:
            self._store.add(block.record.key, block.header, block.payload)
        self.connector.offer(request_id, [b.record for b in blocks])

    def release(self, request_id: str) -> None:
        """``request_id`` ended: drop the blocks no other request's offer holds."""
        if self.role != "consumer":
            return
        for key in self.connector.withdraw(request_id):
            self._store.discard(key)


class HandoffExporter:
    """Reads the prompt blocks of the requests it expects out of a producer, as they finish
    (an AsyncEngine output observer; module docstring)."""

    def __init__(self, transfer: KVTransfer) -> None:
        self.transfer = transfer
        self._lock = threading.Lock()
        self._expected: dict[str, concurrent.futures.Future] = {}

    def expect(self, request_id: str) -> concurrent.futures.Future:
        """The future of ``request_id``'s blocks: ExportedBlocks when it finishes at its length
        cap, None when it finishes otherwise (stopped, aborted)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._expected[request_id] = future
        return future

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._expected.pop(request_id, None)

    def observe(self, deltas: list[Any], now: float) -> None:
        for delta in deltas:
            if not delta.finished:
                continue
            with self._lock:
                future = self._expected.pop(delta.request_id, None)
            if future is None:
                continue
            capped = all(c.finish_reason == "length" for c in delta.outputs) and delta.outputs
            try:
                future.set_result(self.transfer.export(delta.prompt_token_ids) if capped
                                  else None)
            except Exception as e:  # noqa: BLE001 - the request's handoff fails, not the engine
                future.set_exception(e)
