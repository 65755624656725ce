"""StatsPublisher: the engine's latest statistics, published once per step, for any number of
watchers (the playground's live scheduler pane streams them).

The engine thread calls ``publish`` with the EngineStats it builds each step anyway: that stores
a new Snapshot and bumps its version. Nothing more happens unless a watcher is waiting; then one
wake-up is scheduled on the event loop, however many watchers wait. The table of in-flight
requests is rebuilt at most every ``table_interval_s``, and only while somebody watches.
Watchers (event-loop side) await a version newer than the last one they saw, at their own pace.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from conveyor.core.sequence import SequenceStatus
from conveyor.engine.stats import EngineStats

if TYPE_CHECKING:
    from conveyor.core.sequence import SequenceGroup

# Table order: what is computing first, then what waits.
_STATE_ORDER = {"running": 0, "prefilling": 1, "swapped": 2, "waiting": 3}


@dataclass(frozen=True, slots=True)
class RequestRow:
    request_id: str
    state: str  # running / prefilling / swapped / waiting
    num_prompt_tokens: int
    num_output_tokens: int  # over all of the request's samples
    queue_s: float  # arrival -> first scheduled (-> now while never scheduled yet)
    age_s: float  # arrival -> now


@dataclass(frozen=True, slots=True)
class Snapshot:
    version: int
    time: float  # time.monotonic() when published
    stats: EngineStats
    requests: tuple[RequestRow, ...] = ()  # at most max_rows of them
    num_requests: int = 0  # unfinished requests in the engine (the table may show fewer)
    wall_time: float = field(default_factory=time.time)


def request_rows(groups: Iterable[SequenceGroup], now: float,
                 max_rows: int) -> tuple[tuple[RequestRow, ...], int]:
    """The in-flight table from the scheduler's unfinished groups (engine thread only)."""
    rows = []
    for group in groups:
        seqs = [s for s in group.seqs if not s.status.is_finished]
        if not seqs:
            continue
        rows.append(RequestRow(
            request_id=group.request_id, state=_state(seqs),
            num_prompt_tokens=len(group.prompt_token_ids),
            num_output_tokens=sum(s.num_output_tokens for s in group.seqs),
            queue_s=max(0.0, (group.metrics.first_scheduled_time or now) - group.arrival_time),
            age_s=max(0.0, now - group.arrival_time)))
    rows.sort(key=lambda r: _STATE_ORDER[r.state])  # stable: arrival order within a state
    return tuple(rows[:max_rows]), len(rows)


def _state(seqs: list) -> str:
    statuses = {s.status for s in seqs}
    if SequenceStatus.RUNNING in statuses:
        running = [s for s in seqs if s.status is SequenceStatus.RUNNING]
        if all(s.num_computed_tokens < s.num_prompt_tokens for s in running):
            return "prefilling"
        return "running"
    if SequenceStatus.SWAPPED in statuses:
        return "swapped"
    return "waiting"


class StatsPublisher:
    def __init__(self, table_interval_s: float = 0.25, max_rows: int = 64) -> None:
        self.table_interval_s = table_interval_s
        self.max_rows = max_rows
        self._lock = threading.Lock()
        self._latest = Snapshot(0, time.monotonic(), EngineStats())
        self._rows: tuple[RequestRow, ...] = ()
        self._num_requests = 0
        self._table_time = -math.inf
        self._num_watchers = 0
        self._waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def latest(self) -> Snapshot:
        return self._latest

    @property
    def num_watchers(self) -> int:
        return self._num_watchers

    # ------------------------------------------------------------ engine thread
    def publish(self, stats: EngineStats,
                groups: Callable[[], Iterable[SequenceGroup]] | None = None) -> None:
        """Store this step's stats. ``groups`` lists the unfinished requests; it is called only
        when the table is due (someone watches and it is older than ``table_interval_s``, or
        the engine has just emptied)."""
        now = time.monotonic()
        s = stats.scheduler
        idle = s.num_running + s.num_waiting + s.num_swapped == 0
        if self._num_watchers and (idle or now - self._table_time >= self.table_interval_s):
            if idle or groups is None:
                self._rows, self._num_requests = (), 0
            else:
                self._rows, self._num_requests = request_rows(groups(), now, self.max_rows)
            self._table_time = now
        with self._lock:
            self._latest = Snapshot(self._latest.version + 1, now, stats, self._rows,
                                    self._num_requests)
            loop = self._loop if self._waiters else None
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._wake_waiters)
            except RuntimeError:
                pass  # the event loop is closed: nobody is watching any more

    # ------------------------------------------------------------ event-loop side
    async def watch(self, interval_s: float,
                    heartbeat_s: float = 1.0) -> AsyncGenerator[Snapshot, None]:
        """The latest snapshot now, then each newer one, at most one per ``interval_s``; with
        nothing new for ``heartbeat_s`` (an idle engine), the latest again."""
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._num_watchers += 1
            self._table_time = -math.inf  # a new watcher gets a fresh table soon
        try:
            seen = -1
            while True:
                snapshot = self._latest
                seen = snapshot.version
                yield snapshot
                await asyncio.sleep(interval_s)
                await self._wait_newer(seen, max(0.0, heartbeat_s - interval_s))
        finally:
            with self._lock:
                self._num_watchers -= 1

    async def _wait_newer(self, version: int, timeout: float) -> None:
        assert self._loop is not None
        with self._lock:
            if self._latest.version > version:
                return
            waiter = self._loop.create_future()
            self._waiters.append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _wake_waiters(self) -> None:
        with self._lock:
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
