"""Request queues for waiting / swapped sequences: fcfs and priority, both fair across clients.

Fairness: every request carries a ``fairness_key`` (the server gives all the engine requests of
one HTTP request the same key; by default it is the request's own id). Within a priority, a
request is ranked by how many requests of its key were already queued when it arrived: the
first queued request of every key comes before the second of any key, and so on. So one client's
hundred prompts are admitted round-robin with everybody else's instead of all ahead of them;
with one request per key (the default) the order is plain arrival order.

Both queues offer the same small interface. Removal (abort) is lazy and O(1): the sequence's
status no longer matches the queue's, and the entry is dropped when it reaches the head.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterator

from conveyor.core.config import QueueOrder
from conveyor.core.sequence import Sequence, SequenceStatus


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Priority order: lower ``priority`` first, then earlier arrival, then earlier sequence.
    The *largest* key is the lowest-priority, latest request (the preemption victim)."""
    g = seq.group
    return (g.priority, g.arrival_time, seq.seq_id)


class _FairQueue:
    """A heap of ``(priority, rank, order..., seq)`` entries plus the per-key counts that give
    each new entry its round-robin rank; entries whose status left the queue's are dropped
    lazily at the head."""

    __slots__ = ("_heap", "_status", "_num_removed", "_queued", "_counter")

    def __init__(self, status: SequenceStatus) -> None:
        self._heap: list[tuple] = []
        self._status = status  # entries whose status differs were removed lazily
        self._num_removed = 0
        self._queued: Counter[tuple[int, str]] = Counter()  # (priority, key) -> live entries
        self._counter = itertools.count()  # enqueue order, the fcfs tie-break

    def __len__(self) -> int:
        return len(self._heap) - self._num_removed

    def __bool__(self) -> bool:
        return len(self._heap) > self._num_removed

    def _slot(self, seq: Sequence) -> tuple[int, str]:
        g = seq.group
        return (g.priority, g.fairness_key)

    def _push(self, seq: Sequence, rank: int) -> None:
        slot = self._slot(seq)
        self._queued[slot] += 1
        heapq.heappush(self._heap, (*self._order(seq, rank), seq))

    def _order(self, seq: Sequence, rank: int) -> tuple:
        raise NotImplementedError

    def append(self, seq: Sequence) -> None:
        self._push(seq, self._queued[self._slot(seq)])

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: rank 0, ahead of its priority's new arrivals."""
        self._push(seq, -1)

    def _forget(self, seq: Sequence) -> None:
        slot = self._slot(seq)
        left = self._queued[slot] - 1
        if left:
            self._queued[slot] = left
        else:
            del self._queued[slot]

    def remove(self, seq: Sequence) -> None:
        """Call after changing ``seq.status`` away from the queue's status."""
        self._num_removed += 1
        self._forget(seq)

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty queue")
        heapq.heappop(self._heap)
        self._forget(seq)
        return seq

    def take(self, seq: Sequence) -> None:
        """Remove ``seq`` (still in the queue's status) from wherever it is: the head cheaply,
        another entry by a search of the heap."""
        if self.peek() is seq:
            self.pop()
            return
        heap = self._heap
        k = next(k for k, e in enumerate(heap) if e[-1] is seq)
        heap[k] = heap[-1]
        heap.pop()
        heapq.heapify(heap)
        self._forget(seq)

    def peek(self) -> Sequence | None:
        heap = self._heap
        while heap:
            seq = heap[0][-1]
            if seq.status is self._status:
                return seq
            heapq.heappop(heap)
            self._num_removed -= 1
        return None

    def __iter__(self) -> Iterator[Sequence]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:-1])
                if e[-1].status is self._status)


class FcfsQueue(_FairQueue):
    """Arrival order, round-robin across fairness keys; preempted sequences go back to the
    front (the latest preempted first)."""

    __slots__ = ()

    def _order(self, seq: Sequence, rank: int) -> tuple:
        n = next(self._counter)
        return (0, rank, -n if rank < 0 else n)


class PriorityQueue(_FairQueue):
    """Lower ``priority`` first, then round-robin across fairness keys, then earlier arrival,
    then earlier sequence (seq_id). A preempted sequence keeps its arrival, so it is back in
    front of everything it outranks."""

    __slots__ = ()

    def _order(self, seq: Sequence, rank: int) -> tuple:
        g = seq.group
        return (g.priority, max(rank, 0), g.arrival_time, seq.seq_id)


RequestQueue = FcfsQueue | PriorityQueue


def make_queue(order: QueueOrder, status: SequenceStatus) -> RequestQueue:
    return PriorityQueue(status) if order is QueueOrder.PRIORITY else FcfsQueue(status)
