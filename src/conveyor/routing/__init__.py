"""Replica routing policies: which of N engine replicas serves a request.

Pure Python (no torch, no Ray): the Ray Serve request router (entrypoints/ray_serve) and the
simulator's fleet mode (sim/fleet.py) run the very same code. ``kv_aware`` (``kv_aware.py``)
routes by an exact index of the replicas' KV blocks (``kv_index.py``) fed by their KV events.
"""

from conveyor.routing.kv_aware import KVAware
from conveyor.routing.kv_index import KVIndex, PrefixMatch
from conveyor.routing.policies import (
    ROUTERS,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    Router,
    RoutingDecision,
    make_router,
)

__all__ = ["ROUTERS", "KVAware", "KVIndex", "LeastLoaded", "PrefixAffinity", "PrefixMatch",
           "RoundRobin", "Router", "RoutingDecision", "make_router"]
