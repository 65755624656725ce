"""BlockManager: a sequence's KV blocks, one block table per KV-cache group — admission with
prefix-cache hits, decode slots, copy-on-write, fork, free, sliding-window release, and swap
between the GPU pool and the CPU pool.

It owns the sequence-level view (``seq.block_tables``, ``seq.block_hashes``,
``seq.num_registered_blocks``, ``seq.cpu_block_tables``); ``BlockPool`` owns the blocks, which
every group draws from. Block copies requested by copy-on-write accumulate in
``blocks_to_copy`` until the scheduler hands them to the step's SchedulerOutput.

Groups (``core/kv_cache_spec.py``; one full-attention group by default). Every group's table has
the same length: a new block index takes one block in each group. A sliding-window group (window
W) gives back the blocks that lie wholly before ``num_computed_tokens - W + 1`` (the first key
the next query reads) and puts ``NULL_BLOCK`` in their table entries (``release_skipped``): after
a prefill chunk, when a decode crosses a block boundary, before a further chunk and before a
swap-out. Its table is thus ``NULL_BLOCK`` entries followed by the blocks of the window; a
request holds at most ``window_blocks(W)`` blocks in it once a step's new blocks are computed.
While a chunk is computed, a window group holds the blocks of all the chunk's positions (the
step writes every computed position's K/V).

Prefix caching across groups. Group 0 (full attention: groups are ordered so) keeps the chain
``BlockPool`` verifies: tokens and the parent block's identity. A block of another group g at
index j is filed under ``hash((block hash j, g))`` with the key ``(*identity of group 0's block
j, g)``: that identity names, exactly, the prefix up to the block's end, so a hit in group g is
verified as exactly as group 0's. A hit is the longest prefix of h blocks cached in every group:
group 0's chain, all of ``0..h-1`` in the other full-attention groups, and in a sliding-window
group only the blocks the next query reads (indices ``first_window_block(h * block_size) ..
h - 1``, the others ``NULL_BLOCK``), shrinking h until every group agrees. A layout without a
full-attention group has nothing to anchor that chain on: prefix caching is off for it.

Keyed (``key_namespace``: a KV connector or KV events are on), group 0's blocks also carry
content keys (``core/kv_connector/keys.py``, ``seq.block_keys``), filed with the pool.
"""

from __future__ import annotations

from conveyor.core.block_pool import BlockPool, CpuBlockPool, root_identity
from conveyor.core.config import CacheConfig
from conveyor.core.kv_connector.keys import extend_block_keys, root_key
from conveyor.core.prefix_hash import extend_block_hashes, root_hash
from conveyor.core.sequence import Sequence

NULL_BLOCK = -1  # a sliding-window group's table entry whose block was given back


class BlockManager:
    def __init__(self, cache_config: CacheConfig, key_namespace: bytes | None = None) -> None:
        self.block_size = cache_config.block_size
        self.gpu = BlockPool(cache_config.num_gpu_blocks)
        self.cpu = CpuBlockPool(cache_config.num_cpu_blocks)
        specs = cache_config.specs
        self.num_groups = len(specs)
        # (group, window) of each sliding-window group; empty for full attention only
        self.window_groups = [(g, s.sliding_window) for g, s in enumerate(specs)
                              if s.sliding_window]
        self.num_full_groups = self.num_groups - len(self.window_groups)
        self.enable_prefix_caching = (cache_config.enable_prefix_caching
                                      and self.num_full_groups > 0)
        self.blocks_to_copy: list[tuple[int, int]] = []
        self._cpu_freed_after_step: list[int] = []
        self.key_namespace = key_namespace
        self._roots: dict[int, bytes] = {}

    def root_key(self, lora_id: int) -> bytes:
        """The parent key of a first block computed under ``lora_id`` (keyed only)."""
        root = self._roots.get(lora_id)
        if root is None:
            assert self.key_namespace is not None
            root = self._roots[lora_id] = root_key(self.key_namespace, lora_id)
        return root

    def block_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq``'s first ``num_blocks`` content keys (keyed only)."""
        return extend_block_keys(seq.block_keys, seq.token_ids, self.block_size, num_blocks,
                                 self.root_key(seq.group.lora_id))

    def end_step(self) -> None:
        """The step's SchedulerOutput is built: CPU blocks swapped in by it become free."""
        for c in self._cpu_freed_after_step:
            self.cpu.free(c)
        self._cpu_freed_after_step.clear()

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ sliding windows

    def first_window_block(self, num_computed: int, window: int) -> int:
        """The first block a query at position ``num_computed`` reads under ``window``."""
        first = num_computed - window + 1
        return first // self.block_size if first > 0 else 0

    def window_blocks(self, window: int) -> int:
        """Most blocks ``window`` consecutive positions span."""
        return -(-(window - 1) // self.block_size) + 1

    def release_skipped(self, seq: Sequence) -> None:
        """Give back the sliding-window blocks no query of ``seq`` reads any more (those wholly
        before ``num_computed_tokens - W + 1``); their entries become ``NULL_BLOCK``. They hold
        computed tokens, so they stay in the prefix cache (evictable)."""
        tables = seq.block_tables
        if not tables:
            return
        computed = seq.num_computed_tokens
        gpu = self.gpu
        for g, window in self.window_groups:
            table = tables[g]
            j = min(self.first_window_block(computed, window), len(table)) - 1
            while j >= 0 and table[j] != NULL_BLOCK:  # entries before it are released already
                gpu.free(table[j])
                table[j] = NULL_BLOCK
                j -= 1

    def num_live_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds once ``release_skipped`` ran (what a swap-out moves)."""
        tables = seq.block_tables
        if not tables:
            return 0
        n = len(tables[0])
        live = n * self.num_full_groups
        computed = seq.num_computed_tokens
        for _, window in self.window_groups:
            live += n - min(self.first_window_block(computed, window), n)
        return live

    # ------------------------------------------------------------------ capacity

    def blocks_to_compute(self, num_tokens: int, one_step: bool) -> int:
        """Fewest blocks a sequence of ``num_tokens`` tokens needs to be computed: in one step
        (``prefill_first``) every group holds all its blocks; in chunks (down to one token) a
        sliding-window group needs only the blocks of one window."""
        n = self.num_blocks_for(num_tokens)
        if one_step or not self.window_groups:
            return n * self.num_groups
        return n * self.num_full_groups + sum(min(n, self.window_blocks(w))
                                              for _, w in self.window_groups)

    def max_tokens(self, one_step: bool) -> int:
        """The longest sequence whose ``blocks_to_compute`` fits the whole cache."""
        total = self.gpu.num_blocks
        if one_step or not self.window_groups:
            return total // self.num_groups * self.block_size
        if not self.num_full_groups and self.blocks_to_compute(1 << 62, False) <= total:
            return 1 << 62  # windows only: any length fits
        lo, hi = 0, total  # blocks per group: the largest k with blocks_to_compute(k * bs) <= total
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_to_compute(mid * self.block_size, False) <= total:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.block_size

    def chunk_limit(self, num_computed: int) -> int:
        """The most tokens one chunk starting at ``num_computed`` (a block boundary, with the
        window blocks before it released) can compute in the whole cache: every group holds the
        chunk's blocks, a sliding-window group from ``first_window_block`` on."""
        total = self.gpu.num_blocks
        released = sum(self.first_window_block(num_computed, w) for _, w in self.window_groups)
        return (total + released) // self.num_groups * self.block_size - num_computed

    def slot_capacity(self, seq: Sequence) -> int:
        """Positions ``seq`` can hold with its blocks and the free ones (a new block index takes
        one block in every group)."""
        return (len(seq.block_tables[0]) + self.gpu.num_free // self.num_groups) * self.block_size

    # ------------------------------------------------------------------ admission

    def no_hits(self) -> list[list[int]]:
        return [[] for _ in range(self.num_groups)]

    def find_cached_prefix(self, seq: Sequence) -> list[list[int]]:
        """Per group, the registered blocks matching ``seq``'s leading full blocks (the same
        count h in every group; ``NULL_BLOCK`` before a sliding window), stopping short of its
        last token (which is always computed, so the step has logits to sample from). No hits
        for a request that wants prompt logprobs, or pools over every position (mean, cls):
        each prompt position must be computed for them."""
        if not self.may_hit(seq):
            return self.no_hits()
        group = seq.group
        bs = self.block_size
        tids = seq.token_ids
        max_blocks = (len(tids) - 1) // bs
        if max_blocks == 0:
            return self.no_hits()
        lora_id = group.lora_id
        hashes = extend_block_hashes(seq.block_hashes, tids, bs, max_blocks, root_hash(lora_id))
        gpu = self.gpu
        hits: list[int] = []
        parent = root_identity(lora_id)
        for j in range(max_blocks):
            block = gpu.lookup(hashes[j], parent, tids[j * bs:(j + 1) * bs])
            if block is None:
                break
            hits.append(block)
            parent = gpu.identity(block)  # type: ignore[assignment]
        if self.num_groups == 1:
            return [hits]
        return self._hits_in_every_group(seq, hits, hashes)

    def may_hit(self, seq: Sequence) -> bool:
        """May ``seq`` skip computing a cached prefix (``find_cached_prefix``)?"""
        group = seq.group
        return (self.enable_prefix_caching and group.sampling_params.prompt_logprobs is None
                and (group.pooling_params is None
                     or not group.pooling_params.needs_every_position))

    def _hits_in_every_group(self, seq: Sequence, anchor: list[int],
                             hashes: list[int]) -> list[list[int]]:
        """Shrink group 0's hit ``anchor`` to the longest prefix every group has cached."""
        gpu = self.gpu
        bs = self.block_size
        tids = seq.token_ids
        windows = [0] * self.num_groups
        for g, w in self.window_groups:
            windows[g] = w
        found: dict[tuple[int, int], int | None] = {}

        def cached(g: int, j: int) -> int | None:
            key = (g, j)
            if key not in found:
                ident = gpu.identity(anchor[j])
                found[key] = gpu.lookup(hash((hashes[j], g)), (*ident, g),  # type: ignore[misc]
                                        tids[j * bs:(j + 1) * bs])
            return found[key]

        h = len(anchor)
        changed = True
        while changed and h:
            changed = False
            for g in range(1, self.num_groups):
                w = windows[g]
                j = h - 1
                while j >= 0 and (not w or j >= self.first_window_block(h * bs, w)):
                    if cached(g, j) is None:
                        h = j  # the prefix must end before the missing block
                        changed = True
                    j -= 1
        tables = [anchor[:h]]
        for g in range(1, self.num_groups):
            first = self.first_window_block(h * bs, windows[g]) if windows[g] else 0
            tables.append([NULL_BLOCK] * first + [found[(g, j)] for j in range(first, h)])  # type: ignore[misc]
        return tables

    def num_new_blocks_to_admit(self, hits: list[list[int]], num_tokens: int) -> int:
        """Free blocks that admitting with ``hits`` and room for ``num_tokens`` would take: the
        new blocks of every group, and the hits that are free now (evictable)."""
        refs = self.gpu.ref_counts
        new = (self.num_blocks_for(num_tokens) - len(hits[0])) * self.num_groups
        for table in hits:
            new += sum(1 for b in table if b != NULL_BLOCK and refs[b] == 0)
        return new

    def admit(self, seq: Sequence, hits: list[list[int]], num_tokens: int) -> None:
        """Give ``seq`` the ``hits`` plus new blocks up to ``num_tokens`` slots in every group; the
        hit tokens count as computed. Blocks filled by this step's computation are registered
        now, so an identical prefix admitted later in the same step shares them."""
        gpu = self.gpu
        for hit in hits:  # every group's hits first: an evictable hit must not be allocated
            for b in hit:
                if b != NULL_BLOCK:
                    gpu.share(b)
        seq.block_tables = [list(hit) for hit in hits]
        self.reserve_slots(seq, num_tokens)
        num_hits = len(hits[0])
        seq.num_computed_tokens = num_hits * self.block_size
        seq.num_registered_blocks = num_hits
        self.register_full_blocks(seq, num_tokens)

    def admit_for_load(self, seq: Sequence, hits: list[list[int]], num_blocks: int) -> None:
        """Give ``seq`` the ``hits`` plus new blocks up to ``num_blocks`` blocks (one group),
        the new ones to be filled by a KV connector's load: they are registered only once
        loaded (``free`` then files those counted in ``num_computed_tokens``)."""
        gpu = self.gpu
        for b in hits[0]:
            gpu.share(b)
        table = list(hits[0])
        table.extend(gpu.allocate() for _ in range(num_blocks - len(table)))
        seq.block_tables = [table]
        seq.num_computed_tokens = len(hits[0]) * self.block_size
        seq.num_registered_blocks = len(hits[0])

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for ``num_tokens`` tokens (a further prefill chunk)."""
        self.reserve_slots(seq, num_tokens)
        self.register_full_blocks(seq, num_tokens)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """File every full block among ``seq``'s first ``num_tokens`` tokens in the prefix cache
        (every group's; see the module docstring for the other groups' keys)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        end = num_tokens // bs
        start = seq.num_registered_blocks
        if start >= end:
            return
        seq.num_registered_blocks = end
        gpu = self.gpu
        tables = seq.block_tables
        table = tables[0]
        others = range(1, len(tables))
        tids = seq.token_ids
        lora_id = seq.group.lora_id
        hashes = extend_block_hashes(seq.block_hashes, tids, bs, end, root_hash(lora_id))
        keys = self.block_keys(seq, end) if self.key_namespace is not None else None
        parent = gpu.identity(table[start - 1]) if start else root_identity(lora_id)
        for j in range(start, end):
            if parent is None:  # the parent lost its identity (overwritten): stop the chain
                return
            block = table[j]
            tokens = tids[j * bs:(j + 1) * bs]
            key = None if keys is None else (
                keys[j], keys[j - 1] if j else self.root_key(lora_id), lora_id)
            gpu.register(block, hashes[j], parent, tokens, key)
            parent = gpu.identity(block)
            if parent is not None:
                for g in others:
                    b = tables[g][j]
                    if b != NULL_BLOCK:
                        gpu.register(b, hash((hashes[j], g)), (*parent, g), tokens)

    # ------------------------------------------------------------------ decode

    def slot_needs_block(self, seq: Sequence) -> bool:
        """Does computing ``seq``'s last token need a free block (a new one, or a private copy)?"""
        index = (len(seq.token_ids) - 1) // self.block_size
        tables = seq.block_tables
        if index >= len(tables[0]):
            return True
        refs = self.gpu.ref_counts
        return any(refs[table[index]] > 1 for table in tables)

    def blocks_for_slot(self, seq: Sequence) -> int:
        """Free blocks ``append_slot(seq)`` takes (after ``release_skipped``)."""
        index = (len(seq.token_ids) - 1) // self.block_size
        tables = seq.block_tables
        if index >= len(tables[0]):
            return self.num_groups
        refs = self.gpu.ref_counts
        return sum(1 for table in tables if refs[table[index]] > 1)

    def append_slot(self, seq: Sequence) -> None:
        """Make the slot of ``seq``'s last token writable in every group; the caller made sure
        ``blocks_for_slot(seq)`` blocks are free. New blocks are taken at block boundaries (when
        the previous block, now full, is filed in the prefix cache, and the window blocks left
        behind are given back); a block shared with a forked sibling is copied on write."""
        index = (len(seq.token_ids) - 1) // self.block_size
        tables = seq.block_tables
        gpu = self.gpu
        if index >= len(tables[0]):
            if self.enable_prefix_caching and seq.num_registered_blocks < index:
                self.register_full_blocks(seq, index * self.block_size)
            if self.window_groups:
                self.release_skipped(seq)
            for table in tables:
                table.append(gpu.allocate())
            return
        refs = gpu.ref_counts
        for table in tables:
            src = table[index]
            if refs[src] > 1:
                dst = gpu.allocate()
                self.blocks_to_copy.append((src, dst))
                gpu.free(src)
                table[index] = dst

    def reserve_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Private blocks in every group for positions up to ``num_tokens`` (lookahead slots,
        the next slot of a swap-in); the caller made sure enough are free. Nothing is
        registered: those positions are not computed yet."""
        gpu = self.gpu
        n = self.num_blocks_for(num_tokens)
        for table in seq.block_tables:
            for _ in range(n - len(table)):
                table.append(gpu.allocate())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` positions (rejected lookahead
        slots): they hold no computed token, so they leave the prefix cache too."""
        keep = self.num_blocks_for(num_tokens)
        gpu = self.gpu
        for table in seq.block_tables:
            while len(table) > keep:
                gpu.free(table.pop(), False)

    def void_copies(self, seq: Sequence) -> dict[int, int]:
        """``seq`` is preempted in the step that copied-on-write for it: drop those copies.

        Returns {copy destination: source}: a swap-out this step must read the source (the
        executor swaps out before it copies; the source is intact until the forward runs).
        """
        held = {b for table in seq.block_tables for b in table}
        keep = []
        redirect = {}
        for src, dst in self.blocks_to_copy:
            if dst in held:
                redirect[dst] = src
            else:
                keep.append((src, dst))
        self.blocks_to_copy = keep
        return redirect

    # ------------------------------------------------------------------ fork / free

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (copy-on-write later)."""
        gpu = self.gpu
        for table in parent.block_tables:
            for b in table:
                if b != NULL_BLOCK:
                    gpu.share(b)
        child.block_tables = [list(table) for table in parent.block_tables]
        child.block_hashes = list(parent.block_hashes)
        child.block_keys = list(parent.block_keys)
        child.num_registered_blocks = parent.num_registered_blocks

    def _free_tables(self, seq: Sequence, num_computed_blocks: int) -> None:
        """One owner fewer for every block of ``seq``, tail first (evicted first); the first
        ``num_computed_blocks`` indices stay in the prefix cache."""
        tables = seq.block_tables
        gpu = self.gpu
        for j in range(len(tables[0]) - 1, -1, -1):
            keep = j < num_computed_blocks
            for table in tables:
                b = table[j]
                if b != NULL_BLOCK:
                    gpu.free(b, keep)
        seq.block_tables = []

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s GPU and CPU blocks. Full computed blocks stay in the prefix cache
        (evictable); blocks whose computation never happened are dropped from it."""
        if seq.block_tables:
            computed = seq.num_computed_tokens
            self.register_full_blocks(seq, computed)
            self._free_tables(seq, computed // self.block_size)
        seq.num_registered_blocks = 0
        if seq.cpu_block_tables:
            for table in seq.cpu_block_tables:
                for c in table:
                    if c != NULL_BLOCK:
                        self.cpu.free(c)
            seq.cpu_block_tables = []

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, seq: Sequence) -> bool:
        return self.num_live_blocks(seq) <= self.cpu.num_free

    def swap_out(self, seq: Sequence, redirect: dict[int, int] | None = None
                 ) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to the CPU pool (the window blocks it still needs; released ones
        stay ``NULL_BLOCK``); returns the (gpu, cpu) copies to perform (``redirect``: blocks
        whose data still sits in another block, see void_copies)."""
        if self.window_groups:
            self.release_skipped(seq)
        self.register_full_blocks(seq, seq.num_computed_tokens)
        mapping = []
        cpu = self.cpu
        cpu_tables = []
        for table in seq.block_tables:
            cpu_table = []
            for b in table:
                if b == NULL_BLOCK:
                    cpu_table.append(NULL_BLOCK)
                    continue
                c = cpu.allocate()
                mapping.append((redirect.get(b, b) if redirect else b, c))
                cpu_table.append(c)
            cpu_tables.append(cpu_table)
        self._free_tables(seq, len(seq.block_tables[0]))
        seq.cpu_block_tables = cpu_tables
        seq.num_registered_blocks = 0
        return mapping

    def num_blocks_to_swap_in(self, seq: Sequence, num_tokens: int) -> int:
        cpu_tables = seq.cpu_block_tables
        n = len(cpu_tables[0])
        if self.window_groups:
            live = sum(1 for table in cpu_tables for c in table if c != NULL_BLOCK)
        else:
            live = n * self.num_groups
        extra = self.num_blocks_for(num_tokens) - n
        return live + extra * self.num_groups if extra > 0 else live

    def swap_in(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Bring ``seq``'s blocks back (plus room for ``num_tokens``); returns (cpu, gpu) copies."""
        gpu = self.gpu
        mapping = []
        tables = []
        freed = self._cpu_freed_after_step
        for cpu_table in seq.cpu_block_tables:
            table = []
            for c in cpu_table:
                if c == NULL_BLOCK:
                    table.append(NULL_BLOCK)
                    continue
                b = gpu.allocate()
                mapping.append((c, b))
                table.append(b)
                # The executor swaps out before it swaps in: a CPU block read this step must not
                # be handed to a swap-out of the same step, so it is freed when the step is built.
                freed.append(c)
            tables.append(table)
        seq.cpu_block_tables = []
        seq.block_tables = tables
        self.reserve_slots(seq, num_tokens)
        seq.num_registered_blocks = 0
        # only what is computed: a block completed later is filed when its step is scheduled
        self.register_full_blocks(seq, seq.num_computed_tokens)
        return mapping
