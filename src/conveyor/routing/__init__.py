"""Replica routing policies: which of N engine replicas serves a request.

Pure Python (no torch, no Ray): the Ray Serve request router (entrypoints/ray_serve) and the
simulator's fleet mode (sim/fleet.py) run the very same code.
"""

from conveyor.routing.policies import (
    ROUTERS,
    LeastLoaded,
    PrefixAffinity,
    RoundRobin,
    Router,
    RoutingDecision,
    make_router,
)

__all__ = ["ROUTERS", "LeastLoaded", "PrefixAffinity", "RoundRobin", "Router",
           "RoutingDecision", "make_router"]
