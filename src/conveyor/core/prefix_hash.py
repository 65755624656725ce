"""Chained block hashes for prefix caching.

A full block's hash chains its parent block's hash with its own token ids, so equal hashes mean
(up to collisions) equal prefixes. Hashes only find candidates: the block pool verifies a hit
against the stored tokens and the parent block's identity, so a collision never reuses wrong KV.
"""

from __future__ import annotations

ROOT_HASH = 0x5EED  # parent hash of a sequence's first block (on the base model)


def root_hash(lora_id: int) -> int:
    """The parent hash of a first block computed under LoRA adapter ``lora_id`` (0: none): a
    prefix computed under one adapter never matches another's or the base model's."""
    return ROOT_HASH if lora_id == 0 else hash((ROOT_HASH, lora_id))


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


def extend_block_hashes(hashes: list[int], token_ids: list[int], block_size: int,
                        num_blocks: int, root: int = ROOT_HASH) -> list[int]:
    """Extend ``hashes`` (the chain of ``token_ids``' first full blocks) to ``num_blocks`` entries.

    Each block is hashed once, when first needed; the list lives on the sequence.
    """
    n = len(hashes)
    if n < num_blocks:
        h = hashes[-1] if n else root
        for j in range(n, num_blocks):
            start = j * block_size
            h = hash_block(h, tuple(token_ids[start:start + block_size]))
            hashes.append(h)
    return hashes
