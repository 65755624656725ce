"""KV events from the replicas to the kv_aware router: each replica's ``KVEventFeed`` hands out
what its engine published since the last read; the ingress's ``KVEventPuller`` reads every live
replica each ``PULL_PERIOD_S`` and applies the events to the router's index.

Each reply carries a sequence number; the puller sends back the last one it applied. A replica
that sees another number (the puller is new, or a reply was lost on the way) or finds that its
event log dropped batches (``KVEventLog.dropped``) answers with a snapshot of every block it holds
(``LLMEngine.kv_events_snapshot``) instead, which replaces what the index knew of it. A replica
that left is forgotten by the router itself (``ConveyorRequestRouter.update_replicas``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("conveyor.serve")

PULL_PERIOD_S = 0.05  # how stale the index may be; a multi-turn chat's next turn comes later


class KVEventFeed:
    """The replica's side: its engine's KV events, read by one puller."""

    def __init__(self, engine: Any) -> None:
        """``engine``: the replica's LLMEngine (started with kv_events)."""
        if engine.kv_events is None:
            raise ValueError("the kv_aware router needs the replicas' KV events "
                             "(EngineArgs.kv_events)")
        self.engine = engine
        self.seq = 0  # replies handed out
        self._dropped = 0  # the log's dropped count as of the last reply

    async def read(self, after: int | None, async_engine: Any) -> dict[str, Any]:
        """The events since reply ``after`` (None: none read yet), or a snapshot."""
        log = self.engine.kv_events
        dropped = log.dropped
        if after == self.seq and dropped == self._dropped:
            events = [e for batch in log.drain() for e in batch.events]
            reset = False
        else:
            events, self._dropped = await async_engine.run_in_engine_thread(self._snapshot)
            reset = True
        self.seq += 1
        return {"seq": self.seq, "reset": reset, "events": events,
                "namespace": self.engine.kv_key_namespace}

    def _snapshot(self) -> tuple[list[Any], int]:  # in the engine thread, between steps
        return self.engine.kv_events_snapshot().events, self.engine.kv_events.dropped


class KVEventPuller:
    """The ingress's side: reads every live replica's feed into a KVAware router."""

    def __init__(self, engine: Any, router: Callable[[], Any],
                 period_s: float = PULL_PERIOD_S) -> None:
        """``engine``: the FleetEngine (``call_replica``, ``live_replicas``); ``router()``: the
        KVAware policy the request router routes with (None until Serve has built it)."""
        self.engine = engine
        self.router = router
        self.period_s = period_s
        self._after: dict[str, int] = {}  # replica -> the last reply applied
        self._failing: set[str] = set()

    async def pull_once(self) -> None:
        router = self.router()
        if router is None:
            return
        live = self.engine.live_replicas()
        for gone in set(self._after) - set(live):
            del self._after[gone]
        replies = await asyncio.gather(
            *(self.engine.call_replica("kv_events", r, self._after.get(r)) for r in live),
            return_exceptions=True)
        for r, reply in zip(live, replies, strict=True):
            if isinstance(reply, BaseException):
                if r not in self._failing:  # once per failing spell, not every period
                    logger.warning("no KV events from replica %s: %r", r, reply)
                    self._failing.add(r)
                continue  # the next read names the old reply: the replica sends a snapshot
            self._failing.discard(r)
            router.set_namespace(r, reply["namespace"])
            router.apply(r, reply["events"], reset=reply["reset"])
            self._after[r] = reply["seq"]

    async def run(self) -> None:
        while True:
            try:
                await self.pull_once()
            except Exception:
                logger.exception("reading the replicas' KV events failed")
            await asyncio.sleep(self.period_s)
