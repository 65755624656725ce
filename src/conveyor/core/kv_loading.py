"""Loading a waiting request's prefix through the KV connector: the scheduler's side.

A policy asks ``start_load`` about the sequence it is about to admit, once its pool hits are
known. When the connector can load blocks past them (under the pool hits' own rules: never the
block of the last prompt token, nothing for a request that must compute every position, only
base-model requests), and free blocks allow (for the whole prompt, beside what the sequences
loading already will need: a load is worth its blocks only if the sequence can then be
computed), the sequence leaves ``waiting`` with status WAITING_FOR_KV: it holds its pool hits and fresh blocks for the loaded ones, and the
step's connector metadata carries the load. A loading sequence takes a seat as admission
counts them (the policy checks it before asking). The other requests go on being scheduled
meanwhile, so the load overlaps their steps.

When the runner half reports the load finished (``finish_loads``), its intact leading blocks are
filed in the prefix cache, every block of the sequence is released (the filed ones stay cached)
and the sequence goes back to the front of ``waiting`` (sequences reported together keep their
queue order): its next admission finds the loaded
blocks as ordinary pool hits, and its prefill starts after them. A sequence loads at most once
per admission (``seq.kv_load_tried``, reset by ``Scheduler.admit``): were its loaded blocks
evicted before it is admitted, it computes them rather than load again, so no request waits on
loads for ever.

A sequence aborted while loading keeps its blocks until its load is reported finished: the
runner may still be writing into them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conveyor.core.kv_connector.interface import KVConnectorOutput
from conveyor.core.kv_connector.keys import block_records
from conveyor.core.request_queue import priority_key
from conveyor.core.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from conveyor.core.scheduler_interface import SchedulerInterface

WAITING = SequenceStatus.WAITING
WAITING_FOR_KV = SequenceStatus.WAITING_FOR_KV


def start_load(sched: SchedulerInterface, seq: Sequence, hits: list[list[int]]) -> bool:
    """Start loading ``seq``'s blocks past ``hits`` (its pool hits) if the connector has them;
    True when ``seq`` left ``waiting`` for that."""
    connector = sched.kv_connector
    bm = sched.block_manager
    if connector is None or seq.kv_load_tried or seq.group.lora_id or not bm.may_hit(seq):
        return False
    bs = bm.block_size
    num_hits = len(hits[0])
    end = (len(seq.token_ids) - 1) // bs
    if num_hits >= end:
        return False
    reserved = sum(bm.num_blocks_for(len(s.token_ids)) - len(s.block_tables[0])
                   for s in sched.loading.values() if s.status is WAITING_FOR_KV)
    if bm.num_new_blocks_to_admit(hits, len(seq.token_ids)) + reserved > bm.gpu.num_free:
        return False
    keys = bm.block_keys(seq, end)
    found = connector.lookup(block_records(keys, seq.token_ids, bs, num_hits, end,
                                           bm.root_key(0)))
    if not found:
        return False
    sched.waiting.take(seq)
    bm.admit_for_load(seq, hits, num_hits + len(found))
    seq.status = WAITING_FOR_KV
    seq.kv_load_tried = True
    sched.loading[seq.seq_id] = seq
    connector.start_load(seq.seq_id, seq.block_tables[0][num_hits:], found)
    return True


def finish_loads(sched: SchedulerInterface, output: KVConnectorOutput) -> None:
    """Apply the loads ``output`` reports finished (see the module docstring)."""
    bm = sched.block_manager
    ready = []
    for seq_id, num_intact in output.finished_loads.items():
        seq = sched.loading.pop(seq_id, None)
        if seq is None:
            continue
        if seq.status is not WAITING_FOR_KV:  # aborted while loading
            bm.free(seq)
            continue
        seq.num_computed_tokens += num_intact * bm.block_size
        bm.free(seq)  # files the intact loaded blocks, then releases every block (cached)
        seq.num_computed_tokens = 0
        seq.status = WAITING
        ready.append(seq)
    for seq in sorted(ready, key=priority_key, reverse=True):  # the first in order last
        sched.waiting.push_front(seq)
