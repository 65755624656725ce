"""Content keys: a block's name outside one engine's pool, derived from the whole prefix it ends.

A block's key is a 16-byte BLAKE2b digest of its parent's key and its own token ids; a first
block's parent is the *root key* of a namespace (the model's identity and the KV layout, which
the engine derives, see ``engine/kv_offload.py``) and LoRA adapter. So a key names, up to the
digest's collision resistance, one full prefix computed by one model in one layout, the same in
every process and on every machine: the connector's tiers, the files of the disk tier and the
KV events use it. Where contents are reused, the reader still compares the stored tokens and
parent key with its own (``BlockRecord``): a key alone is never trusted.

The pool's own chain (``core/prefix_hash.py``) stays the fast in-process hash; these keys are
computed only when a KV connector or KV events are on.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

KEY_BYTES = 16
_ROOT_TAG = b"conveyor-kv-root-1"


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """A full block as the tiers know it: its key, its parent's key (the root key for a first
    block) and its token ids."""

    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]


def root_key(namespace: bytes, lora_id: int) -> bytes:
    """The parent key of a first block computed in ``namespace`` under LoRA adapter ``lora_id``
    (0: none)."""
    return blake2b(_ROOT_TAG + namespace + lora_id.to_bytes(8, "little"),
                   digest_size=KEY_BYTES).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return blake2b(parent + struct.pack(f"<{len(token_ids)}I", *token_ids),
                   digest_size=KEY_BYTES).digest()


def extend_block_keys(keys: list[bytes], token_ids: list[int], block_size: int,
                      num_blocks: int, root: bytes) -> list[bytes]:
    """Extend ``keys`` (the keys of ``token_ids``' first full blocks) to ``num_blocks`` entries;
    each block is keyed once, when first needed (the list lives on the sequence)."""
    n = len(keys)
    if n < num_blocks:
        parent = keys[-1] if n else root
        for j in range(n, num_blocks):
            start = j * block_size
            parent = block_key(parent, token_ids[start:start + block_size])
            keys.append(parent)
    return keys


def block_records(keys: list[bytes], token_ids: list[int], block_size: int, start: int,
                  end: int, root: bytes):
    """Records of blocks ``start .. end - 1`` (``keys`` holds at least ``end`` keys), made one
    at a time as a caller walks them."""
    for j in range(start, end):
        yield BlockRecord(keys[j], keys[j - 1] if j else root,
                          tuple(token_ids[j * block_size:(j + 1) * block_size]))
