"""InboundStore: the bytes of KV blocks handed to this engine by another (a prefill engine), in
their stored form (``kv_block_file.py``: header, then payload), by content key, until the
requests they came with end.

The engine's thread adds and discards blocks; the KV connector's worker thread reads them for a
load (``kv_offload_worker.py``), and every read verifies the block against the record the
scheduler asked for, as the offload tiers do: a block that does not verify is a miss (its tokens
are computed), never wrong KV. Single dict operations need no lock of their own (the GIL makes
them atomic), and a payload read stays alive for its reader after a discard.
"""

from __future__ import annotations

from conveyor.core.kv_connector.interface import LoadItem
from conveyor.executor.kv_block_file import verify


class InboundStore:
    def __init__(self, namespace: bytes, payload_size: int) -> None:
        """``namespace``: the key namespace of this engine's model and layout; a block of another
        does not verify. ``payload_size``: bytes of one block."""
        self.namespace = namespace
        self.payload_size = payload_size
        self._blocks: dict[bytes, tuple[bytes, object]] = {}  # key -> (header, payload buffer)

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, key: bytes, header: bytes, payload: object) -> None:
        self._blocks[key] = (header, payload)

    def discard(self, key: bytes) -> None:
        self._blocks.pop(key, None)

    # -- the worker's side (the store interface of KVOffloadWorker) ------------------------

    def read(self, item: LoadItem) -> object:
        """``item``'s verified payload; CorruptBlock, or KeyError when it is gone."""
        header, payload = self._blocks[item.record.key]
        verify(header, payload, memoryview(payload).nbytes, item.record,  # type: ignore[arg-type]
               self.namespace, self.payload_size)
        return payload

    def remove(self, key: bytes, tier: str) -> None:
        self.discard(key)
