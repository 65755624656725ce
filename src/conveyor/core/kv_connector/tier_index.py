"""TierIndex: what one offload tier holds, as the scheduler half knows it — a bounded LRU of
entries by content key. The bytes themselves are the runner half's."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from conveyor.core.kv_connector.keys import BlockRecord


@dataclass(frozen=True, slots=True)
class TierEntry:
    record: BlockRecord
    serial: int  # names this stored copy (a later copy under the same key has another)


class TierIndex:
    def __init__(self, name: str, capacity: int) -> None:
        """``capacity``: most blocks the tier holds."""
        self.name = name
        self.capacity = capacity
        self._entries: OrderedDict[bytes, TierEntry] = OrderedDict()  # least recent first

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[TierEntry]:
        """Least recently used first."""
        return iter(self._entries.values())

    @property
    def full(self) -> bool:
        return len(self._entries) >= self.capacity

    def match(self, record: BlockRecord) -> TierEntry | None:
        """The entry for ``record``'s key whose tokens and parent key equal ``record``'s."""
        entry = self._entries.get(record.key)
        if (entry is None or entry.record.token_ids != record.token_ids
                or entry.record.parent != record.parent):
            return None
        return entry

    def get(self, key: bytes) -> TierEntry | None:
        return self._entries.get(key)

    def touch(self, key: bytes) -> None:
        self._entries.move_to_end(key)

    def add(self, entry: TierEntry) -> None:
        """The most recently used entry (the caller made room)."""
        self._entries[entry.record.key] = entry

    def remove(self, key: bytes) -> TierEntry:
        return self._entries.pop(key)

    def pop_lru(self) -> TierEntry:
        return self._entries.popitem(last=False)[1]

    def clear(self) -> None:
        self._entries.clear()
