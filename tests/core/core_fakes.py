"""Test doubles for the scheduler: a deterministic fake model over a simulated paged KV cache,
an independent reference of each request's tokens, and the invariant checks."""

from __future__ import annotations

import itertools

from conveyor.core.block_manager import NULL_BLOCK
from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from conveyor.core.kv_connector.interface import (
    ClearTier,
    DropBlock,
    KVConnectorMetadata,
    KVConnectorOutput,
    LoadBlocks,
    LostEntry,
    MoveBlock,
    SaveBlock,
)
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import SequenceGroup, SequenceStatus

VOCAB = 23
EOS = 0


def hybrid_groups(num_full: int, windows: list[int]) -> tuple[KVCacheGroup, ...]:
    """A layout of one layer per group: ``num_full`` full-attention groups, then one
    sliding-window group per entry of ``windows``."""
    full = [KVCacheGroup(FullAttentionSpec(), (i,)) for i in range(num_full)]
    return tuple(full + [KVCacheGroup(SlidingWindowSpec(w), (num_full + i,))
                         for i, w in enumerate(windows)])


def fake_token(token_ids: list[int], sample_index: int) -> int:
    """The fake model: next token = a hash of the sequence so far and its sample index."""
    return hash((tuple(token_ids), sample_index)) % VOCAB


def fingerprints(token_ids: list[int], upto: int) -> list[int]:
    """What the K/V at each position stands for: a chain over the prefix up to it."""
    out = []
    h = 17
    for t in token_ids[:upto]:
        h = hash((h, t))
        out.append(h)
    return out


class FakeExecutor:
    """Executes SchedulerOutputs against a simulated KV cache and checks every read.

    Each slot holds (KV-cache group, fingerprint of the prefix it was computed for). Block
    operations run in the contract's order (swap out, swap in, copy), then every scheduled token
    is written into each group's table, then each group's tables are read back over what its
    layers attend to (the whole prefix, or a sliding window from the step's first query): a wrong
    prefix-cache hit (in any group), a missing copy-on-write, a lost swap, an unallocated or
    released (``NULL_BLOCK``) block shows up as a mismatch. Blocks keep stale contents when
    freed, as real memory does.
    """

    def __init__(self, sched: Scheduler) -> None:
        cc = sched.cache_config
        self.sched = sched
        self.bs = cc.block_size
        self.windows = [spec.sliding_window for spec in cc.specs]
        Slot = tuple[int, int] | None
        self.gpu: list[list[Slot]] = [[None] * cc.block_size for _ in range(cc.num_gpu_blocks)]
        self.cpu: list[list[Slot]] = [[None] * cc.block_size for _ in range(cc.num_cpu_blocks)]

    def execute(self, out: SchedulerOutput) -> list[list[int]]:
        bs = self.bs
        refs = self.sched.block_manager.gpu.ref_counts
        for g, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu[g])
        for c, g in out.blocks_to_swap_in:
            self.gpu[g] = list(self.cpu[c])
        for s, d in out.blocks_to_copy:
            assert refs[d] >= 1, f"copy into free block {d}"
            self.gpu[d] = list(self.gpu[s])
        fps_of = []
        for i, seq in enumerate(out.seqs):
            start, n = seq.num_computed_tokens, out.num_new_tokens[i]
            tokens = seq.token_ids + seq.spec_token_ids  # a decode's proposal follows it
            assert n >= 1 and start + n <= len(tokens), (seq, n)
            assert not seq.spec_token_ids or start + n == len(tokens), (seq, n)
            assert len(seq.block_tables) == len(self.windows), seq
            fps = fingerprints(tokens, start + n)
            fps_of.append(fps)
            for g, table in enumerate(seq.block_tables):
                assert len(table) * bs >= start + n, f"{seq}: no slot for its tokens in group {g}"
                for p in range(start, start + n):
                    b = table[p // bs]
                    assert b != NULL_BLOCK and refs[b] >= 1, f"{seq} writes free block {b}"
                    # a write into a shared block (a missing copy-on-write) shows up when a
                    # sharer reads the slot back: now or at its next step
                    self.gpu[b][p % bs] = (g, fps[p])
        sampled = []
        for i, seq in enumerate(out.seqs):
            fps = fps_of[i]
            start = seq.num_computed_tokens
            for g, table in enumerate(seq.block_tables):
                window = self.windows[g]
                first = max(0, start - window + 1) if window else 0
                for p in range(first, len(fps)):
                    b = table[p // bs]
                    assert b != NULL_BLOCK, f"{seq}: group {g} released the block of position {p}"
                    got = self.gpu[b][p % bs]
                    assert got == (g, fps[p]), f"{seq}: wrong K/V at position {p} in group {g}"
            k = out.num_samples(i)
            if seq.spec_token_ids:
                sampled.append(verify_greedy(seq.token_ids, seq.spec_token_ids, seq.index))
            elif k == 0:
                sampled.append([])
            elif k == 1:
                sampled.append([fake_token(seq.token_ids, seq.index)])
            else:
                sampled.append([fake_token(seq.token_ids, j) for j in range(k)])
        return sampled


class FakeConnectorRunner:
    """The KV connector's runner half over a FakeExecutor's simulated cache: tiers are dicts of
    block contents by key. Ops run in order, saves reading their blocks first; a load is
    reported finished ``load_delay`` steps later (its blocks are written at once: nothing reads
    them before). ``corrupt(key)``: the next read of that entry fails verification."""

    def __init__(self, executor: FakeExecutor, load_delay: int = 1) -> None:
        self.ex = executor
        self.tiers: dict[str, dict[bytes, list]] = {"cpu": {}, "disk": {}}
        self.load_delay = load_delay
        self._loads: list[list] = []  # [steps left, seq_id, intact blocks]
        self._lost: list = []
        self.bad: set[bytes] = set()

    def corrupt(self, key: bytes) -> None:
        self.bad.add(key)

    def run(self, meta: KVConnectorMetadata | None) -> None:
        if meta is None:
            return
        gpu = self.ex.gpu
        saved = {id(op): list(gpu[op.block]) for op in meta.ops if isinstance(op, SaveBlock)}
        for op in meta.ops:
            if isinstance(op, SaveBlock):
                self.tiers[op.tier][op.record.key] = saved[id(op)]
            elif isinstance(op, MoveBlock):
                if op.key in self.tiers[op.source]:
                    self.tiers[op.dest][op.key] = self.tiers[op.source].pop(op.key)
                else:  # removed by a failed load the scheduler has not heard of yet
                    self._lost.append(LostEntry(op.key, op.dest, op.serial, "missing"))
            elif isinstance(op, DropBlock):
                self.tiers[op.tier].pop(op.key, None)
            elif isinstance(op, ClearTier):
                self.tiers[op.tier].clear()
            elif isinstance(op, LoadBlocks):
                intact = 0
                for item in op.items:
                    key = item.record.key
                    if key in self.bad or key not in self.tiers[item.tier]:
                        self.bad.discard(key)
                        self.tiers[item.tier].pop(key, None)
                        self._lost.append(LostEntry(key, item.tier, item.serial, "corrupt"))
                        break
                    gpu[item.block] = list(self.tiers[item.tier][key])
                    intact += 1
                self._loads.append([self.load_delay, op.seq_id, intact])

    def finished(self) -> KVConnectorOutput | None:
        out = KVConnectorOutput(lost=self._lost)
        self._lost = []
        for load in self._loads:
            load[0] -= 1
            if load[0] <= 0:
                out.finished_loads[load[1]] = load[2]
        self._loads = [load for load in self._loads if load[0] > 0]
        return out if out else None


def connector_step(sched: Scheduler, executor: FakeExecutor, runner: FakeConnectorRunner
                   ) -> tuple[SchedulerOutput, list[SequenceGroup]]:
    """One schedule / connector ops / execute / update / connector report / KV events."""
    out = sched.schedule()
    runner.run(out.kv_connector_metadata)
    finished = sched.update(out, executor.execute(out))
    report = runner.finished()
    if report is not None:
        sched.update_kv_connector(report)
    if sched.kv_events is not None:
        sched.kv_events.flush(0.0)
    return out, finished


def verify_greedy(token_ids: list[int], drafts: list[int], sample_index: int) -> list[int]:
    """The fake model's exact greedy verification: the proposed tokens it agrees with, then its
    own next token."""
    tokens = list(token_ids)
    for d in drafts:
        tok = fake_token(tokens, sample_index)
        if tok != d:
            return tokens[len(token_ids):] + [tok]
        tokens.append(tok)
    return tokens[len(token_ids):] + [fake_token(tokens, sample_index)]


class OracleProposer:
    """Proposes the fake model's own continuation (sample 0), each token right with probability
    ``accuracy`` (else a random token), so verification accepts some and rejects others."""

    def __init__(self, seed: int, accuracy: float) -> None:
        import random

        self.rng = random.Random(seed)
        self.accuracy = accuracy

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        tokens = list(token_ids)
        for _ in range(self.rng.randint(0, k)):
            right = fake_token(tokens, 0)
            tokens.append(right if self.rng.random() < self.accuracy else self.rng.randrange(VOCAB))
        return tokens[len(token_ids):]


def reference_outputs(prompt: list[int], sp: SamplingParams, max_len: int,
                      eos: frozenset[int] = frozenset({EOS})) -> list[list[int]]:
    """Each sample's output tokens, generated alone with the stop rules (no scheduler)."""
    stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos))
    if sp.max_tokens is not None:
        max_len = min(max_len, len(prompt) + sp.max_tokens)
    min_len = len(prompt) + sp.min_tokens
    outs = []
    for k in range(sp.n):
        toks = list(prompt)
        while True:
            tok = fake_token(toks, k)
            toks.append(tok)
            if (tok in stop and len(toks) >= min_len) or len(toks) >= max_len:
                break
        outs.append(toks[len(prompt):])
    return outs


def blocks_to_compute(cc: CacheConfig, num_tokens: int, one_step: bool) -> int:
    """Fewest blocks in which a sequence of ``num_tokens`` can be computed (computed here, not
    read off the block manager): every group's blocks in one step; in chunks down to one token,
    a sliding-window group holds at most the blocks one window of positions spans."""
    bs = cc.block_size
    n = -(-num_tokens // bs)
    total = 0
    for spec in cc.specs:
        w = spec.sliding_window
        if one_step or not w:
            total += n
        else:
            total += min(n, max(len({p // bs for p in range(s, s + w)}) for s in range(bs)))
    return total


def seq_limit(sc: SchedulerConfig, cc: CacheConfig) -> int:
    """Longest sequence the configuration can compute (computed here, not read off the scheduler)."""
    one_step = sc.policy == "prefill_first"
    limit = sc.max_model_len
    while limit and blocks_to_compute(cc, limit, one_step) > cc.num_gpu_blocks:
        limit -= 1
    if one_step:
        limit = min(limit, sc.max_num_batched_tokens)
    return limit


def check_tables(tables: list[list[int]], windows: list[int], what: object) -> None:
    """One table per group, all of one length; released entries only lead window groups'."""
    assert len(tables) == len(windows), what
    assert len({len(t) for t in tables}) == 1, f"{what}: tables of different lengths"
    for table, window in zip(tables, windows, strict=True):
        live = [b for b in table if b != NULL_BLOCK]
        assert window or len(live) == len(table), f"{what}: a full-attention table lost a block"
        assert table[len(table) - len(live):] == live, f"{what}: a released block after a live one"


def check_invariants(sched: Scheduler) -> None:
    """Ref counts == owners (over every group); free + used == total; CPU pool likewise; queue
    membership; each sequence's tables agree in length, released entries only before a window."""
    bm = sched.block_manager
    gpu = bm.gpu
    gpu.check_consistency()
    windows = [spec.sliding_window for spec in sched.cache_config.specs]
    live = [s for g in sched.unfinished_groups() for s in g.seqs if not s.status.is_finished]
    # aborted while their prefix loads: they hold their blocks until the load is reported
    aborted_loading = [s for s in sched.loading.values() if s.status.is_finished]
    owners = [0] * gpu.num_blocks
    cpu_used = 0
    for s in live + aborted_loading:
        # no lookahead slot outlives its step: a sequence holds blocks for its tokens only
        assert not s.spec_token_ids, s
        if s.block_tables:
            check_tables(s.block_tables, windows, s)
            assert len(s.block_tables[0]) <= bm.num_blocks_for(len(s.token_ids)), s
            for table, window in zip(s.block_tables, windows, strict=True):
                # a window group holds one window's blocks between steps (docs/kv_cache.md)
                assert not window or sum(1 for b in table if b != NULL_BLOCK) \
                    <= max(len({p // bm.block_size for p in range(q, q + window)})
                           for q in range(bm.block_size)), (s, window, table)
        for table in s.block_tables:
            for b in table:
                if b != NULL_BLOCK:
                    owners[b] += 1
        if s.cpu_block_tables:
            check_tables(s.cpu_block_tables, windows, s)
        cpu_used += sum(1 for t in s.cpu_block_tables for c in t if c != NULL_BLOCK)
        if s.status is SequenceStatus.WAITING:
            assert not s.block_tables and not s.cpu_block_tables, s
        elif s.status is SequenceStatus.SWAPPED:
            assert not s.block_tables and s.cpu_block_tables, s
        elif s.status is SequenceStatus.WAITING_FOR_KV or s in aborted_loading:
            assert sched.loading.get(s.seq_id) is s and s.block_tables, s
        else:
            assert s.status is SequenceStatus.RUNNING and not s.cpu_block_tables, s
    assert owners == gpu.ref_counts, "ref counts differ from owners"
    used = sum(1 for r in gpu.ref_counts if r)
    assert used + gpu.num_free == gpu.num_blocks
    assert cpu_used + bm.cpu.num_free == bm.cpu.num_blocks
    running = [s for s in sched.running if s.status is SequenceStatus.RUNNING]
    in_run = running + sched.prefilling
    assert len(set(map(id, in_run))) == len(in_run), "a sequence is queued twice"
    assert {id(s) for s in live if s.status is SequenceStatus.RUNNING} == set(map(id, in_run))
    assert len(sched.waiting) == sum(1 for s in live if s.status is SequenceStatus.WAITING)
    assert len(sched.swapped) == sum(1 for s in live if s.status is SequenceStatus.SWAPPED)


def run_to_completion(sched: Scheduler, executor: FakeExecutor | None = None,
                      max_steps: int = 100_000, check: bool = False) -> dict[str, SequenceGroup]:
    """Step until nothing is left; returns finished groups by request id (each exactly once)."""
    executor = executor or FakeExecutor(sched)
    finished: dict[str, SequenceGroup] = {}
    cfg = sched.config
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finished
        out = sched.schedule()
        assert len(out.seqs) <= cfg.max_num_seqs
        assert sum(out.num_new_tokens) == out.num_batched_tokens <= cfg.max_num_batched_tokens
        sampled = executor.execute(out)
        for g in sched.update(out, sampled):
            assert g.request_id not in finished, f"{g.request_id} finished twice"
            finished[g.request_id] = g
        if check:
            check_invariants(sched)
    raise AssertionError(f"no completion after {max_steps} steps: {sched.stats}")


def make_scheduler(*, block_size: int = 4, num_gpu_blocks: int = 64, num_cpu_blocks: int = 0,
                   prefix_caching: bool = True, eos: tuple[int, ...] = (EOS,),
                   kv_cache_groups: tuple[KVCacheGroup, ...] = (), **sched_kw) -> Scheduler:
    """A small scheduler with a fake clock (1.0, 2.0, ...); SchedulerConfig fields as keywords."""
    kw = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 256}
    kw.update(sched_kw)
    ticks = itertools.count(1)
    return Scheduler(SchedulerConfig(**kw),
                     CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                                 num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=prefix_caching,
                                 kv_cache_groups=kv_cache_groups),
                     eos_token_ids=eos, clock=lambda: float(next(ticks)))


def step(sched: Scheduler, executor: FakeExecutor,
         proposer: OracleProposer | None = None) -> tuple[SchedulerOutput, list[SequenceGroup]]:
    """One schedule / execute / update; with ``proposer``, its proposals after the step (for
    every sequence that sampled) go to ``update_draft_token_ids`` as the runner's do."""
    out = sched.schedule()
    finished = sched.update(out, executor.execute(out))
    if proposer is not None:
        sched.update_draft_token_ids(out, [proposer.propose(seq.token_ids, sched.speculative.num_speculative_tokens)
                                           for seq in out.seqs])
    return out, finished


def ids(seqs) -> list[str]:
    return [s.group.request_id for s in seqs]
