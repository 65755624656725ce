"""The stored form of one KV block, shared by the host-memory and disk tiers: a header, then the
block's bytes (every layer's K and V, as the KV cache lays out one block).

Header, little-endian: magic ``CVKVBLK1``; namespace (16 bytes: the model and KV layout the
bytes belong to); the block's content key, its parent's key (16 bytes each); the token count and
token ids (uint32); the payload's length (uint64) and BLAKE2b-128 checksum; and a BLAKE2b-128
checksum of everything before it. ``verify`` accepts a stored block only when all of it holds
together and matches what the reader expects: the header's checksum, the namespace, the key,
parent and tokens equal to the reader's record, the key equal to the digest of that parent and
those tokens, the payload's length and checksum. Anything else is ``CorruptBlock``: the reader
treats the block as a miss.
"""

from __future__ import annotations

import struct
from hashlib import blake2b

from conveyor.core.kv_connector.keys import KEY_BYTES, BlockRecord, block_key

MAGIC = b"CVKVBLK1"
_HEAD = struct.Struct(f"<8s{KEY_BYTES}s{KEY_BYTES}s{KEY_BYTES}sI")  # magic, namespace, key, parent, n
_PAYLOAD = struct.Struct(f"<Q{KEY_BYTES}s")  # payload length, payload checksum
# then the header's own checksum (KEY_BYTES)


class CorruptBlock(Exception):
    """A stored block that does not verify (the message says what is wrong)."""


def checksum(data: object) -> bytes:
    return blake2b(data, digest_size=KEY_BYTES).digest()  # type: ignore[arg-type]


def header_size(block_size: int) -> int:
    return _HEAD.size + 4 * block_size + _PAYLOAD.size + KEY_BYTES


def encode_header(namespace: bytes, record: BlockRecord, payload: object,
                  payload_size: int) -> bytes:
    n = len(record.token_ids)
    body = (_HEAD.pack(MAGIC, namespace, record.key, record.parent, n)
            + struct.pack(f"<{n}I", *record.token_ids)
            + _PAYLOAD.pack(payload_size, checksum(payload)))
    return body + checksum(body)


def decode_header(header: bytes) -> tuple[bytes, BlockRecord, int, bytes]:
    """(namespace, record, payload length, payload checksum) of a header whose own checksum
    holds; else CorruptBlock."""
    if len(header) < _HEAD.size or header[:len(MAGIC)] != MAGIC:
        raise CorruptBlock("not a KV block header")
    _, namespace, key, parent, n = _HEAD.unpack_from(header)
    if len(header) != _HEAD.size + 4 * n + _PAYLOAD.size + KEY_BYTES:
        raise CorruptBlock(f"header of {len(header)} bytes for {n} tokens")
    if checksum(header[:-KEY_BYTES]) != header[-KEY_BYTES:]:
        raise CorruptBlock("header checksum mismatch")
    tokens = struct.unpack_from(f"<{n}I", header, _HEAD.size)
    size, payload_sum = _PAYLOAD.unpack_from(header, _HEAD.size + 4 * n)
    return namespace, BlockRecord(key, parent, tokens), size, payload_sum


def verify(header: bytes, payload: object, payload_len: int, expected: BlockRecord,
           namespace: bytes, payload_size: int) -> None:
    """CorruptBlock unless ``header`` + ``payload`` (``payload_len`` bytes) is ``expected``'s
    block of ``payload_size`` bytes in ``namespace`` (module docstring)."""
    ns, record, size, payload_sum = decode_header(header)
    if ns != namespace:
        raise CorruptBlock("another model's or KV layout's block")
    if record != expected:
        raise CorruptBlock("key, parent key or tokens differ from the requested block's")
    if block_key(record.parent, record.token_ids) != record.key:
        raise CorruptBlock("key does not match its parent key and tokens")
    if size != payload_size or payload_len != payload_size:
        raise CorruptBlock(f"payload of {payload_len} bytes (header says {size}), "
                           f"expected {payload_size}")
    if checksum(payload) != payload_sum:
        raise CorruptBlock("payload checksum mismatch")
