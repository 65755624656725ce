"""Request queues for waiting / swapped sequences: fcfs (a deque) and priority (a heap).

Both offer the same small interface. Removal (abort) is lazy and O(1): the sequence's status
no longer matches the queue's, and the entry is dropped when it reaches the head.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator

from conveyor.core.sequence import Sequence, SequenceStatus


def priority_key(seq: Sequence) -> tuple[int, float, int]:
    """Priority order: lower ``priority`` first, then earlier arrival, then earlier sequence.
    The *largest* key is the lowest-priority, latest request (the preemption victim)."""
    g = seq.group
    return (g.priority, g.arrival_time, seq.seq_id)


class _LazyRemovalQueue:
    """What both queues share: entries whose status left the queue's are counted as removed and
    dropped when they reach the head."""

    __slots__ = ("_items", "_status", "_num_removed")

    def __init__(self, items: deque[Sequence] | list, status: SequenceStatus) -> None:
        self._items = items
        self._status = status  # entries whose status differs were removed lazily
        self._num_removed = 0

    def __len__(self) -> int:
        return len(self._items) - self._num_removed

    def __bool__(self) -> bool:
        return len(self._items) > self._num_removed

    def remove(self, seq: Sequence) -> None:
        """Call after changing ``seq.status`` away from the queue's status."""
        self._num_removed += 1

    def pop(self) -> Sequence:
        seq = self.peek()
        if seq is None:
            raise IndexError("pop from an empty queue")
        self._drop_head()
        return seq

    def peek(self) -> Sequence | None:
        while self._items:
            seq = self._head()
            if seq.status is self._status:
                return seq
            self._drop_head()
            self._num_removed -= 1
        return None

    def _head(self) -> Sequence:
        raise NotImplementedError

    def _drop_head(self) -> None:
        raise NotImplementedError


class FcfsQueue(_LazyRemovalQueue):
    """Arrival order; preempted sequences go back to the front."""

    __slots__ = ()

    def __init__(self, status: SequenceStatus) -> None:
        super().__init__(deque(), status)

    def append(self, seq: Sequence) -> None:
        self._items.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def _head(self) -> Sequence:
        return self._items[0]

    def _drop_head(self) -> None:
        self._items.popleft()

    def __iter__(self) -> Iterator[Sequence]:
        return (s for s in self._items if s.status is self._status)


class PriorityQueue(_LazyRemovalQueue):
    """Lower ``priority`` first, then earlier arrival, then earlier sequence (seq_id); the heap
    holds ``(*priority_key(seq), seq)``."""

    __slots__ = ()

    def __init__(self, status: SequenceStatus) -> None:
        super().__init__([], status)

    def append(self, seq: Sequence) -> None:
        heapq.heappush(self._items, (*priority_key(seq), seq))

    # A preempted sequence keeps its key, so it is back "in front" of everything it outranks.
    push_front = append

    def _head(self) -> Sequence:
        return self._items[0][3]

    def _drop_head(self) -> None:
        heapq.heappop(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return (e[3] for e in sorted(self._items) if e[3].status is self._status)


RequestQueue = FcfsQueue | PriorityQueue


def make_queue(kind: str, status: SequenceStatus) -> RequestQueue:
    return PriorityQueue(status) if kind == "priority" else FcfsQueue(status)
