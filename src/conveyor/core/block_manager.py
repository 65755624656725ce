"""BlockManager: a sequence's KV blocks — admission with prefix-cache hits, decode slots,
copy-on-write, fork, free, and swap between the GPU pool and the CPU pool.

It owns the sequence-level view (``seq.block_table``, ``seq.block_hashes``,
``seq.num_registered_blocks``, ``seq.cpu_block_table``); ``BlockPool`` owns the blocks.
Block copies requested by copy-on-write accumulate in ``blocks_to_copy`` until the scheduler
hands them to the step's SchedulerOutput.
"""

from __future__ import annotations

from conveyor.core.block_pool import BlockPool, CpuBlockPool, root_identity
from conveyor.core.config import CacheConfig
from conveyor.core.prefix_hash import extend_block_hashes, root_hash
from conveyor.core.sequence import Sequence


class BlockManager:
    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.gpu = BlockPool(cache_config.num_gpu_blocks)
        self.cpu = CpuBlockPool(cache_config.num_cpu_blocks)
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.blocks_to_copy: list[tuple[int, int]] = []
        self._cpu_freed_after_step: list[int] = []

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

    # ------------------------------------------------------------------ admission

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Registered blocks matching ``seq``'s leading full blocks, stopping short of its last
        token (which is always computed, so the step has logits to sample from). No hits for a
        request that wants prompt logprobs, or pools over every position (mean, cls): each
        prompt position must be computed for them."""
        group = seq.group
        if (not self.enable_prefix_caching or group.sampling_params.prompt_logprobs is not None
                or (group.pooling_params is not None and group.pooling_params.needs_every_position)):
            return []
        bs = self.block_size
        tids = seq.token_ids
        max_blocks = (len(tids) - 1) // bs
        if max_blocks == 0:
            return []
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
        return hits

    def num_new_blocks_to_admit(self, hits: list[int], num_tokens: int) -> int:
        """Free blocks that admitting with ``hits`` and room for ``num_tokens`` would take."""
        refs = self.gpu.ref_counts
        return self.num_blocks_for(num_tokens) - len(hits) + sum(1 for b in hits if refs[b] == 0)

    def admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> None:
        """Give ``seq`` the ``hits`` plus new blocks up to ``num_tokens`` slots; the hit tokens
        count as computed. Blocks filled by this step's computation are registered now, so an
        identical prefix admitted later in the same step shares them."""
        gpu = self.gpu
        for b in hits:
            gpu.share(b)
        table = list(hits)
        for _ in range(self.num_blocks_for(num_tokens) - len(hits)):
            table.append(gpu.allocate())
        seq.block_table = table
        seq.num_computed_tokens = len(hits) * self.block_size
        seq.num_registered_blocks = len(hits)
        self.register_full_blocks(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Room for ``num_tokens`` tokens (a further prefill chunk, or a swap-in's next slot)."""
        table = seq.block_table
        gpu = self.gpu
        for _ in range(self.num_blocks_for(num_tokens) - len(table)):
            table.append(gpu.allocate())
        self.register_full_blocks(seq, num_tokens)

    def register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """File every full block among ``seq``'s first ``num_tokens`` tokens in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        end = num_tokens // bs
        start = seq.num_registered_blocks
        if start >= end:
            return
        seq.num_registered_blocks = end
        gpu = self.gpu
        table = seq.block_table
        tids = seq.token_ids
        lora_id = seq.group.lora_id
        hashes = extend_block_hashes(seq.block_hashes, tids, bs, end, root_hash(lora_id))
        parent = gpu.identity(table[start - 1]) if start else root_identity(lora_id)
        for j in range(start, end):
            if parent is None:  # the parent lost its identity (overwritten): stop the chain
                return
            block = table[j]
            gpu.register(block, hashes[j], parent, tids[j * bs:(j + 1) * bs])
            parent = gpu.identity(block)

    # ------------------------------------------------------------------ decode

    def slot_needs_block(self, seq: Sequence) -> bool:
        """Does computing ``seq``'s last token need a free block (a new one, or a private copy)?"""
        pos = len(seq.token_ids) - 1
        table = seq.block_table
        index = pos // self.block_size
        return index >= len(table) or self.gpu.ref_counts[table[index]] > 1

    def append_slot(self, seq: Sequence) -> None:
        """Make the slot of ``seq``'s last token writable; the caller made sure a block is free
        when ``slot_needs_block(seq)``. New blocks are taken at block boundaries (when the
        previous block, now full, is filed in the prefix cache); a block shared with a forked
        sibling is copied on write."""
        pos = len(seq.token_ids) - 1
        table = seq.block_table
        index = pos // self.block_size
        gpu = self.gpu
        if index >= len(table):
            if self.enable_prefix_caching and seq.num_registered_blocks < index:
                self.register_full_blocks(seq, index * self.block_size)
            table.append(gpu.allocate())
        elif gpu.ref_counts[table[index]] > 1:
            src = table[index]
            dst = gpu.allocate()
            self.blocks_to_copy.append((src, dst))
            gpu.free(src)
            table[index] = dst

    def reserve_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Private blocks for positions up to ``num_tokens`` (lookahead slots); the caller made
        sure enough are free. Nothing is registered: those positions are not computed yet."""
        table = seq.block_table
        gpu = self.gpu
        for _ in range(self.num_blocks_for(num_tokens) - len(table)):
            table.append(gpu.allocate())

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks past the first ``num_tokens`` positions (rejected lookahead
        slots): they hold no computed token, so they leave the prefix cache too."""
        table = seq.block_table
        keep = self.num_blocks_for(num_tokens)
        gpu = self.gpu
        while len(table) > keep:
            gpu.free(table.pop(), False)

    def void_copies(self, seq: Sequence) -> dict[int, int]:
        """``seq`` is preempted in the step that copied-on-write for it: drop those copies.

        Returns {copy destination: source}: a swap-out this step must read the source (the
        executor swaps out before it copies; the source is intact until the forward runs).
        """
        table = set(seq.block_table)
        keep = []
        redirect = {}
        for src, dst in self.blocks_to_copy:
            if dst in table:
                redirect[dst] = src
            else:
                keep.append((src, dst))
        self.blocks_to_copy = keep
        return redirect

    # ------------------------------------------------------------------ fork / free

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks (copy-on-write later)."""
        gpu = self.gpu
        for b in parent.block_table:
            gpu.share(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s GPU and CPU blocks. Full computed blocks stay in the prefix cache
        (evictable); blocks whose computation never happened are dropped from it."""
        table = seq.block_table
        if table:
            computed = seq.num_computed_tokens
            self.register_full_blocks(seq, computed)
            num_computed_blocks = computed // self.block_size
            gpu = self.gpu
            for j in range(len(table) - 1, -1, -1):  # tail first: it is evicted first
                gpu.free(table[j], j < num_computed_blocks)
            seq.block_table = []
        seq.num_registered_blocks = 0
        if seq.cpu_block_table:
            for b in seq.cpu_block_table:
                self.cpu.free(b)
            seq.cpu_block_table = []

    # ------------------------------------------------------------------ swap

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.cpu.num_free

    def swap_out(self, seq: Sequence, redirect: dict[int, int] | None = None
                 ) -> list[tuple[int, int]]:
        """Move ``seq``'s blocks to the CPU pool; returns the (gpu, cpu) copies to perform
        (``redirect``: blocks whose data still sits in another block, see void_copies)."""
        self.register_full_blocks(seq, seq.num_computed_tokens)
        mapping = []
        gpu, cpu = self.gpu, self.cpu
        for b in seq.block_table:
            c = cpu.allocate()
            mapping.append((redirect.get(b, b) if redirect else b, c))
        for b in reversed(seq.block_table):
            gpu.free(b)
        seq.cpu_block_table = [c for _, c in mapping]
        seq.block_table = []
        seq.num_registered_blocks = 0
        return mapping

    def num_blocks_to_swap_in(self, seq: Sequence, num_tokens: int) -> int:
        return max(len(seq.cpu_block_table), self.num_blocks_for(num_tokens))

    def swap_in(self, seq: Sequence, num_tokens: int) -> list[tuple[int, int]]:
        """Bring ``seq``'s blocks back (plus room for ``num_tokens``); returns (cpu, gpu) copies."""
        gpu = self.gpu
        mapping = []
        table = []
        for c in seq.cpu_block_table:
            b = gpu.allocate()
            mapping.append((c, b))
            table.append(b)
        # The executor swaps out before it swaps in: a CPU block read this step must not be
        # handed to a swap-out of the same step, so it is freed when the step is built.
        self._cpu_freed_after_step.extend(seq.cpu_block_table)
        seq.cpu_block_table = []
        for _ in range(self.num_blocks_for(num_tokens) - len(table)):
            table.append(gpu.allocate())
        seq.block_table = table
        seq.num_registered_blocks = 0
        # only what is computed: a block completed later is filed when its step is scheduled
        self.register_full_blocks(seq, seq.num_computed_tokens)
        return mapping
