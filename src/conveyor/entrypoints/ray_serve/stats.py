"""The request router's counters, read by the ingress for /metrics and /health."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RouterStats:
    """What the router did, shared with the ingress's event loop (hence the lock)."""

    policy: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    replicas: list[str] = field(default_factory=list)  # live replica ids, as Serve reports them
    requests: Counter = field(default_factory=Counter)  # replica -> generate calls routed
    affinity_hits: Counter = field(default_factory=Counter)  # replica -> of those, by affinity
    lora_requests: Counter = field(default_factory=Counter)  # (replica, adapter name) -> calls
    in_flight: Counter = field(default_factory=Counter)  # replica -> routed, not completed
    kv_router: Any = None  # the kv_aware policy, which the ingress feeds the replicas' KV events

    def snapshot(self) -> dict:
        with self.lock:
            return {"policy": self.policy, "replicas": list(self.replicas),
                    "requests": dict(self.requests), "affinity_hits": dict(self.affinity_hits),
                    "lora_requests": dict(self.lora_requests),
                    "in_flight": dict(self.in_flight)}


_STATS: dict[str, RouterStats] = {}  # deployment name -> its router's stats in this process


def stats_for(deployment_name: str) -> RouterStats:
    return _STATS.setdefault(deployment_name, RouterStats())
