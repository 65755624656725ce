"""The scheduler half of a decode instance's KV connector: prompts prefilled on another instance.

A request handed off to a decode instance is added to its (real) Scheduler with the prompt and
its first token, and its prompt's full blocks are *offered* here under their content keys. The
scheduler admits it through the connector path every engine has (``core/kv_loading.py``): when
its free blocks can hold the whole request, it allocates them and ``start_load``s the offered
blocks it does not already hold; the request waits (status WAITING_FOR_KV) while they cross the
instance's inbound ``KVLink``, then is admitted with them as prefix-cache hits and computes only
the tail (the prompt's last partial block and the first token) before decoding. An offer is
consumed by the request's load (a request preempted later recomputes locally, as the prefill
instance has dropped its copy).

There is no runner half: ``finished(now)`` reports the loads whose transfer has ended by
``now``, and the fleet hands that report to ``Scheduler.update_kv_connector``.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from conveyor.core.kv_connector.interface import KVConnectorMetadata, KVConnectorOutput
from conveyor.core.kv_connector.keys import BlockRecord
from conveyor.sim.kv_link import KVLink


@dataclass(frozen=True)
class Load:
    """One request's transfer: when it was queued and ended, and how many blocks it carried."""

    start_s: float
    done_s: float
    num_blocks: int


class RemotePrefill:
    """Implements ``KVConnectorScheduler`` over one ``KVLink``."""

    def __init__(self, link: KVLink, clock: Callable[[], float]) -> None:
        self.link = link
        self.clock = clock
        self._offered: Counter[bytes] = Counter()  # key -> offers holding it
        self._offers: dict[int, list[bytes]] = {}  # seq id -> its offered keys
        self._in_flight: list[tuple[float, int, int]] = []  # heap of (done, seq id, blocks)
        self.loads: dict[int, Load] = {}  # seq id -> its load (kept until the fleet pops it)

    def offer(self, seq_id: int, keys: list[bytes]) -> None:
        """Sequence ``seq_id``'s prompt blocks, keyed in order, are on a prefill instance."""
        self._offers[seq_id] = keys
        self._offered.update(keys)

    def withdraw(self, seq_id: int) -> None:
        """Forget what is left of ``seq_id``'s offer (loaded, or the request ended)."""
        keys = self._offers.pop(seq_id, None)
        if keys:
            self._offered.subtract(keys)
            for k in keys:
                if self._offered[k] <= 0:
                    del self._offered[k]

    # ---------------------------------------------------- KVConnectorScheduler

    def lookup(self, records: Iterable[BlockRecord]) -> list[BlockRecord]:
        found = []
        for record in records:
            if record.key not in self._offered:
                break
            found.append(record)
        return found

    def start_load(self, seq_id: int, blocks: list[int], records: list[BlockRecord]) -> None:
        now = self.clock()
        done = self.link.transfer(now, len(records))
        heapq.heappush(self._in_flight, (done, seq_id, len(records)))
        self.loads[seq_id] = Load(now, done, len(records))
        self.withdraw(seq_id)

    def block_evicted(self, block: int, record: BlockRecord) -> None:
        pass  # the decode instance keeps no tier of its own

    def clear(self) -> None:
        self._offered.clear()
        self._offers.clear()

    def build_metadata(self) -> KVConnectorMetadata | None:
        return None  # no runner half: the transfer is timed here

    def update(self, output: KVConnectorOutput) -> None:
        pass

    # ---------------------------------------------------- the fleet's side

    @property
    def next_done_s(self) -> float:
        return self._in_flight[0][0] if self._in_flight else math.inf

    def finished(self, now: float) -> KVConnectorOutput | None:
        """The loads whose blocks have all arrived by ``now`` (None: none)."""
        if not self._in_flight or self._in_flight[0][0] > now:
            return None
        out = KVConnectorOutput()
        while self._in_flight and self._in_flight[0][0] <= now:
            _, seq_id, num_blocks = heapq.heappop(self._in_flight)
            out.finished_loads[seq_id] = num_blocks
        return out
