"""TierStore: the bytes of the offload tiers — host memory (a dict by content key) and the disk
tier's directory (one file per block, named by its key). Only the offload worker's thread uses
it, after ``scan``.

Both tiers hold a block in its stored form (``kv_block_file.py``), and every read verifies it.
A file is written under a temporary name and renamed into place, so a crash leaves no partial
file under a block's name (leftover temporary files of dead processes are removed at ``scan``);
a file damaged afterwards fails verification and is removed by the reader.
"""

from __future__ import annotations

import os

from conveyor.core.kv_connector.events import CPU, DISK
from conveyor.core.kv_connector.interface import LoadItem
from conveyor.core.kv_connector.keys import BlockRecord
from conveyor.executor.kv_block_file import CorruptBlock, decode_header, encode_header, verify
from conveyor.executor.kv_block_file import header_size as stored_header_size

SUFFIX = ".kvb"


class TierStore:
    def __init__(self, namespace: bytes, payload_size: int, block_size: int,
                 disk_dir: str | None) -> None:
        """``payload_size``: bytes of one block; ``disk_dir``: the disk tier's directory
        (existing), None without one."""
        self.namespace = namespace
        self.payload_size = payload_size
        self.header_size = stored_header_size(block_size)
        self.disk_dir = disk_dir
        self._host: dict[bytes, tuple[bytes, object]] = {}  # key -> (header, payload buffer)

    def _path(self, key: bytes) -> str:
        assert self.disk_dir is not None
        return os.path.join(self.disk_dir, key.hex() + SUFFIX)

    # -- writing ---------------------------------------------------------------------------

    def put(self, tier: str, record: BlockRecord, payload: object) -> None:
        """Store ``payload`` (a buffer of ``payload_size`` bytes) as ``record`` in ``tier``."""
        header = encode_header(self.namespace, record, payload, self.payload_size)
        if tier == CPU:
            self._host[record.key] = (header, payload)
        else:
            self._write(record.key, header, payload)

    def move(self, key: bytes, source: str, dest: str) -> None:
        """Host memory -> disk; KeyError when the host holds no such block."""
        if (source, dest) != (CPU, DISK):
            raise ValueError(f"cannot move a block from {source!r} to {dest!r}")
        header, payload = self._host.pop(key)
        self._write(key, header, payload)

    def _write(self, key: bytes, header: bytes, payload: object) -> None:
        path = self._path(key)
        tmp = os.path.join(self.disk_dir, f".{key.hex()}.{os.getpid()}.tmp")  # type: ignore[arg-type]
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)  # type: ignore[arg-type]
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise

    def remove(self, key: bytes, tier: str) -> None:
        if tier == CPU:
            self._host.pop(key, None)
        else:
            _unlink(self._path(key))

    def clear(self, tier: str) -> None:
        if tier == CPU:
            self._host.clear()
            return
        for name in os.listdir(self.disk_dir):  # type: ignore[arg-type]
            if name.endswith(SUFFIX):
                _unlink(os.path.join(self.disk_dir, name))  # type: ignore[arg-type]

    # -- reading ---------------------------------------------------------------------------

    def read(self, item: LoadItem) -> object:
        """``item``'s verified payload (a buffer); CorruptBlock, or KeyError /
        FileNotFoundError when the tier no longer holds it."""
        if item.tier == CPU:
            header, payload = self._host[item.record.key]
        else:
            with open(self._path(item.record.key), "rb") as f:
                header = f.read(self.header_size)
                payload = bytearray(self.payload_size)
                n = f.readinto(payload)
                if n == self.payload_size and f.read(1):
                    raise CorruptBlock("file longer than a block")
            if n != self.payload_size:
                raise CorruptBlock(f"truncated: {n} of {self.payload_size} payload bytes")
        verify(header, payload, memoryview(payload).nbytes, item.record,  # type: ignore[arg-type]
               self.namespace, self.payload_size)
        return payload

    def scan(self) -> list[BlockRecord]:
        """The disk tier's blocks, least recently written first, read from their headers
        (payloads are verified when loaded). Files whose header does not verify are removed,
        and so are temporary files left by processes that no longer run."""
        if self.disk_dir is None:
            return []
        found = []
        for entry in os.scandir(self.disk_dir):
            if entry.name.endswith(".tmp"):
                _remove_orphan_tmp(entry.path, entry.name)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                with open(entry.path, "rb") as f:
                    namespace, record, _, _ = decode_header(f.read(self.header_size))
                mtime = entry.stat().st_mtime_ns
            except CorruptBlock:
                _unlink(entry.path)
                continue
            except OSError:
                continue
            if namespace == self.namespace and entry.name == record.key.hex() + SUFFIX:
                found.append((mtime, record))
        found.sort(key=lambda pair: pair[0])
        return [record for _, record in found]


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_orphan_tmp(path: str, name: str) -> None:
    """``.<key>.<pid>.tmp``: remove it unless process ``pid`` still runs (it may be writing)."""
    try:
        pid = int(name.split(".")[-2])
        os.kill(pid, 0)
    except ProcessLookupError:
        _unlink(path)
    except (ValueError, IndexError, PermissionError):
        pass
