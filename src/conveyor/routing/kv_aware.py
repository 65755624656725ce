"""kv_aware: send a request to the replica holding the longest cached prefix of its prompt, as the
replicas' own KV events say, balanced against load (llm-d's precise prefix-cache scorer and
Dynamo's KV router work this way).

The router keeps a ``KVIndex`` fed with every replica's KV event batches (``apply``; a reader
that missed batches resets the replica and applies a snapshot) and each replica's key namespace
(``set_namespace``: the model and KV layout the replica's content keys are computed in). To route
a prompt it computes the prompt's block keys exactly as the engine does (``keys.py``: chained
BLAKE2b over the namespace's root key for the request's LoRA adapter, one key per full block of
the token ids the replica will be given) and looks them up. The rule:

    score(r) = sum over the prompt's leading blocks r holds of tier_weight(tier serving it)
               - load_weight * (load(r) - min load)

``tier_weight``: 1 for the pool, less for a host-memory or disk copy (loading it costs a copy
but saves the compute); ``load(r)``: requests in flight on r. The highest score wins; ties go to
the less loaded replica, then rotate. With no replica holding anything this is least_loaded.
A replica whose namespace is unknown (no events yet) matches nothing.

Thread-safe: the Ray router routes on its own event loop while the ingress applies events.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Mapping, Sequence

from conveyor.core.kv_connector.events import KVEvent
from conveyor.core.kv_connector.keys import extend_block_keys, root_key
from conveyor.routing.base import Router, RoutingDecision
from conveyor.routing.kv_index import TIERS, KVIndex, PrefixMatch

DEFAULT_TIER_WEIGHTS = {"pool": 1.0, "cpu": 0.75, "disk": 0.5}


class KVAware(Router):
    name = "kv_aware"

    def __init__(self, block_size: int = 16, load_weight: float = 2.0,
                 tier_weights: Mapping[str, float] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if load_weight < 0:
            raise ValueError(f"load_weight must be >= 0, got {load_weight}")
        weights = {**DEFAULT_TIER_WEIGHTS, **(tier_weights or {})}
        unknown = set(weights) - set(TIERS)
        if unknown:
            raise ValueError(f"tier_weights: unknown tiers {sorted(unknown)}; tiers are {TIERS}")
        self.block_size = block_size
        self.load_weight = load_weight
        self.tier_weights = tuple(weights[t] for t in TIERS)
        self.index = KVIndex()
        self._namespaces: dict[Hashable, bytes] = {}
        self._lock = threading.Lock()
        self._next = 0  # rotates ties

    # -- the replicas' side -----------------------------------------------------------------

    def set_namespace(self, replica: Hashable, namespace: bytes) -> None:
        with self._lock:
            if self._namespaces.get(replica, namespace) != namespace:
                self.index.reset(replica)  # another model or layout: its old keys mean nothing
            self._namespaces[replica] = namespace

    def apply(self, replica: Hashable, events: Iterable[KVEvent], reset: bool = False) -> None:
        """Apply a replica's events in publication order; ``reset``: they are a snapshot of all
        it holds, replacing what the index knew of it."""
        with self._lock:
            if reset:
                self.index.reset(replica)
            self.index.apply(replica, events)

    def remove(self, replica: Hashable) -> None:
        with self._lock:
            self.index.reset(replica)
            self._namespaces.pop(replica, None)

    # -- routing ----------------------------------------------------------------------------

    def prompt_keys(self, prompt_token_ids: Sequence[int], namespace: bytes,
                    adapter: Hashable | None = None) -> list[bytes]:
        """The content keys of the prompt's full blocks, as an engine in ``namespace`` keys
        them (``adapter``: the LoRA adapter's int id; None or 0: the base model)."""
        lora_id = 0 if adapter is None else int(adapter)  # type: ignore[call-overload]
        num_blocks = len(prompt_token_ids) // self.block_size
        return extend_block_keys([], list(prompt_token_ids), self.block_size, num_blocks,
                                 root_key(namespace, lora_id))

    def matches(self, replicas: Sequence[Hashable], prompt_token_ids: Sequence[int],
                adapter: Hashable | None = None) -> dict[Hashable, PrefixMatch]:
        with self._lock:
            by_ns: dict[bytes, list[Hashable]] = {}
            for r in replicas:
                ns = self._namespaces.get(r)
                if ns is not None:
                    by_ns.setdefault(ns, []).append(r)
            out = {r: PrefixMatch() for r in replicas}
            for ns, group in by_ns.items():
                keys = self.prompt_keys(prompt_token_ids, ns, adapter)
                out.update(self.index.match(keys, group))
            return out

    def route(self, replicas, prompt_token_ids, loads, adapter=None) -> RoutingDecision:
        found = self.matches(replicas, prompt_token_ids, adapter)
        least = min(loads.get(r, 0) for r in replicas)
        start = self._next % len(replicas)
        self._next += 1
        order = list(replicas[start:]) + list(replicas[:start])

        def rank(r: Hashable) -> tuple[float, int]:
            hit = sum(w * n for w, n in zip(self.tier_weights, found[r].per_tier, strict=True))
            load = loads.get(r, 0)
            return (-(hit - self.load_weight * (load - least)), load)

        best = min(order, key=rank)  # first of equals in the rotated order
        matched = found[best].blocks
        return RoutingDecision(best, matched,
                               affinity_hit=matched > min(m.blocks for m in found.values()))
