"""The offloading connector's runner half on a small real KV cache (no model): blocks saved to
the host tier, moved to disk and loaded back into other blocks arrive bit for bit; every way a
stored block can be wrong (payload, header, another namespace, truncated, too long, missing) is
refused and removed; a scan adopts good files and deletes bad ones."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from conveyor.core.kv_connector.interface import (
    DropBlock,
    KVConnectorMetadata,
    LoadBlocks,
    LoadItem,
    MoveBlock,
    SaveBlock,
)
from conveyor.core.kv_connector.keys import BlockRecord, block_key, root_key
from conveyor.executor.kv_block_file import CorruptBlock, encode_header, header_size, verify
from conveyor.executor.kv_offload_worker import KVOffloadWorker
from conveyor.executor.kv_tier_store import TierStore
from conveyor.model.kv_cache import KVCache

NS = b"n" * 16
ROOT = root_key(NS, 0)
BS = 4


def record(tokens: tuple[int, ...], parent: bytes = ROOT) -> BlockRecord:
    return BlockRecord(block_key(parent, tokens), parent, tokens)


@pytest.fixture
def cache() -> KVCache:
    kv = KVCache(3, 2, 8, BS, 8, 0, torch.bfloat16, torch.device("cpu"))
    kv.cache.copy_(torch.randn(kv.cache.shape))
    return kv


def worker(cache: KVCache, disk: str | None) -> KVOffloadWorker:
    payload = cache.cache[:, :, 0].numel() * cache.cache.element_size()
    return KVOffloadWorker(SimpleNamespace(kv_cache=cache), TierStore(NS, payload, BS, disk))


def run(w: KVOffloadWorker, *ops) -> dict[int, int]:
    """Carry ``ops`` out as one step's; what finished, with the lost entries in ``w.lost``."""
    w.start_step(KVConnectorMetadata(list(ops)))
    w.shutdown()  # waits for the queue; a worker is single-use here
    out = w.finished()
    w.lost = out.lost if out else []
    return out.finished_loads if out else {}


def test_blocks_round_trip_through_host_memory_and_disk(cache, tmp_path):
    a = record((1, 2, 3, 4))
    b = BlockRecord(block_key(a.key, (5, 6, 7, 8)), a.key, (5, 6, 7, 8))
    before = cache.cache[:, :, [2, 5]].clone()
    w = worker(cache, str(tmp_path))
    w.start_step(KVConnectorMetadata([SaveBlock(2, a, "cpu", 1), SaveBlock(5, b, "disk", 2),
                                      MoveBlock(a.key, "cpu", "disk", 1)]))
    cache.cache[:, :, [2, 5]] = 0  # the step's new owners write the blocks: the saves copied
    loaded = run(w, LoadBlocks(9, (LoadItem(6, a, "disk", 1), LoadItem(7, b, "disk", 2))))
    assert loaded == {9: 2} and not w.lost
    assert torch.equal(cache.cache[:, :, [6, 7]], before)
    assert sorted(os.listdir(tmp_path)) == sorted([a.key.hex() + ".kvb", b.key.hex() + ".kvb"])
    assert sorted(TierStore(NS, 0, BS, str(tmp_path)).scan(), key=lambda r: r.key) == \
        sorted([a, b], key=lambda r: r.key)


def test_a_load_stops_at_the_first_bad_block_and_removes_it(cache, tmp_path):
    a = record((1, 2, 3, 4))
    b = BlockRecord(block_key(a.key, (5, 6, 7, 8)), a.key, (5, 6, 7, 8))
    c = BlockRecord(block_key(b.key, (9, 9, 9, 9)), b.key, (9, 9, 9, 9))
    w = worker(cache, str(tmp_path))
    w.start_step(KVConnectorMetadata([SaveBlock(0, a, "disk", 1), SaveBlock(1, b, "disk", 2),
                                      SaveBlock(2, c, "disk", 3)]))
    w.shutdown()
    path = tmp_path / (b.key.hex() + ".kvb")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    w = worker(cache, str(tmp_path))
    items = tuple(LoadItem(4 + i, r, "disk", i + 1) for i, r in enumerate((a, b, c)))
    assert run(w, LoadBlocks(3, items)) == {3: 1}
    assert [(e.key, e.reason) for e in w.lost] == [(b.key, "corrupt")]
    assert not path.exists() and (tmp_path / (c.key.hex() + ".kvb")).exists()


def test_a_missing_entry_is_lost_not_an_error(cache):
    a = record((1, 2, 3, 4))
    w = worker(cache, None)
    assert run(w, LoadBlocks(1, (LoadItem(0, a, "cpu", 7),)), DropBlock(a.key, "cpu")) == {1: 0}
    assert [(e.key, e.tier, e.serial, e.reason) for e in w.lost] == [(a.key, "cpu", 7, "missing")]


def stored(rec: BlockRecord, payload: bytes, namespace: bytes = NS) -> tuple[bytes, bytes]:
    return encode_header(namespace, rec, payload, len(payload)), payload


@pytest.mark.parametrize("damage", ["payload", "header", "namespace", "key", "tokens", "short",
                                    "long"])
def test_every_damage_is_refused(damage):
    rec = record((1, 2, 3, 4))
    payload = bytes(range(256)) * 4
    header, data = stored(rec, payload)
    verify(header, data, len(data), rec, NS, len(payload))  # undamaged, it passes
    expected = rec
    if damage == "namespace":
        header, data = stored(rec, payload, b"x" * 16)
    elif damage == "payload":
        data = b"\1" + data[1:]
    elif damage == "header":
        header = header[:30] + bytes([header[30] ^ 1]) + header[31:]
    elif damage == "key":  # a header whose key is not its parent's and tokens' digest
        bad = BlockRecord(b"k" * 16, rec.parent, rec.token_ids)
        header, data = stored(bad, payload)
        expected = bad
    elif damage == "tokens":  # a sound block, but not the one asked for
        expected = BlockRecord(rec.key, rec.parent, (1, 2, 3, 5))
    elif damage == "short":
        data = data[:-1]
    elif damage == "long":
        data = data + b"\0"
    with pytest.raises(CorruptBlock):
        verify(header, data, len(data), expected, NS, len(payload))


def test_a_scan_deletes_bad_headers_and_orphaned_temporary_files(tmp_path):
    rec = record((1, 2, 3, 4))
    header, payload = stored(rec, b"\0" * 64)
    (tmp_path / (rec.key.hex() + ".kvb")).write_bytes(header + payload)
    bad = tmp_path / ("ab" * 16 + ".kvb")
    bad.write_bytes(header[:20] + b"\0" * (len(header) - 20) + payload)
    orphan = tmp_path / f".{rec.key.hex()}.999999999.tmp"
    orphan.write_bytes(b"partial")
    mine = tmp_path / f".{rec.key.hex()}.{os.getpid()}.tmp"
    mine.write_bytes(b"being written")
    assert TierStore(NS, 64, BS, str(tmp_path)).scan() == [rec]
    assert not bad.exists() and not orphan.exists() and mine.exists()
    assert len(header) == header_size(BS)
