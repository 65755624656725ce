"""round_robin, least_loaded and prefix_affinity over replicas named by any hashable key;
``make_router`` also builds kv_aware (``kv_aware.py``), which reads the replicas' KV events.

``route(replicas, prompt_token_ids, loads, adapter)`` picks one of ``replicas``; ``loads[r]`` is
how many requests replica ``r`` holds (queued + running); ``adapter`` names the LoRA adapter the
request runs under (None: the base model). Policies keep their own memory (a cursor, a prefix
table, adapter homes) and are told about replicas that went away with ``remove``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from conveyor.core.prefix_hash import ROOT_HASH, extend_block_hashes
from conveyor.routing.base import Router, RoutingDecision
from conveyor.routing.kv_aware import KVAware


def _least_loaded(replicas: Sequence[Hashable], loads: Mapping[Hashable, int]) -> Hashable:
    return min(replicas, key=lambda r: loads.get(r, 0))  # first of equals: stable


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, replicas, prompt_token_ids, loads, adapter=None) -> RoutingDecision:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return RoutingDecision(replica)


class LeastLoaded(Router):
    name = "least_loaded"

    def __init__(self) -> None:
        self._next = 0  # rotates the start so that ties spread instead of piling on replica 0

    def route(self, replicas, prompt_token_ids, loads, adapter=None) -> RoutingDecision:
        start = self._next % len(replicas)
        self._next += 1
        return RoutingDecision(_least_loaded(list(replicas[start:]) + list(replicas[:start]),
                                             loads))


class PrefixAffinity(Router):
    """Send a prompt where its first blocks were sent before (SGLang's cache-aware router,
    Ray Serve LLM's prefix-aware router), and a LoRA adapter's request where that adapter ran
    last, unless that replica is much busier than the others.

    Each replica has an LRU table of the chained block hashes (core/prefix_hash.py, as the block
    manager's prefix cache computes them) of prompts routed to it, ``table_blocks`` entries at
    most, standing in for the replica's KV cache. An adapter's hashes start from a root of its
    own, as the engine keys an adapter's KV blocks, so a prefix matches only under the same
    adapter (or none). Each adapter has a home: the replica its last request went to, which most
    likely still holds it in one of its ``max_loras`` model slots (and in host memory), so its
    requests there wait neither for a slot nor for the disk. A request goes to the replica with the longest
    matched prefix (ties: least loaded), else to its adapter's home, taking the first of these
    whose load exceeds neither ``balance_abs`` plus the least loaded replica's load nor
    ``balance_rel`` times it; with none, to the least loaded replica (the adapter's new home).
    """

    name = "prefix_affinity"

    def __init__(self, block_size: int = 16, max_prefix_blocks: int = 64,
                 table_blocks: int = 1 << 16, balance_abs: int = 8,
                 balance_rel: float = 1.5, max_adapters: int = 1 << 12) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.table_blocks = table_blocks
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.max_adapters = max_adapters
        self._tables: dict[Hashable, OrderedDict[int, None]] = {}
        self._homes: OrderedDict[Hashable, Hashable] = OrderedDict()  # adapter -> replica
        self._fallback = LeastLoaded()

    def block_hashes(self, prompt_token_ids: Sequence[int],
                     adapter: Hashable | None = None) -> list[int]:
        num_blocks = min(len(prompt_token_ids) // self.block_size, self.max_prefix_blocks)
        root = ROOT_HASH if adapter is None else hash((ROOT_HASH, adapter))
        return extend_block_hashes([], prompt_token_ids, self.block_size, num_blocks, root)

    def home(self, adapter: Hashable) -> Hashable | None:
        """The replica the adapter's last request went to (None: none yet, or it left)."""
        return self._homes.get(adapter)

    def _matched(self, replica: Hashable, hashes: list[int]) -> int:
        table = self._tables.get(replica)
        if not table:
            return 0
        n = 0
        for h in hashes:  # chained hashes: the first miss ends the shared prefix
            if h not in table:
                break
            n += 1
        return n

    def route(self, replicas, prompt_token_ids, loads, adapter=None) -> RoutingDecision:
        hashes = self.block_hashes(prompt_token_ids, adapter)
        best, best_matched = None, 0
        for r in replicas:
            m = self._matched(r, hashes) if hashes else 0
            if m > best_matched or (m == best_matched and m and
                                    loads.get(r, 0) < loads.get(best, 0)):
                best, best_matched = r, m
        candidates = [] if best is None else [(best, best_matched)]
        home = self._homes.get(adapter) if adapter is not None else None
        if home is not None and home != best and home in replicas:
            candidates.append((home, self._matched(home, hashes) if hashes else 0))
        least = self._fallback.route(replicas, prompt_token_ids, loads).replica
        least_load = loads.get(least, 0)
        for r, m in candidates:
            load = loads.get(r, 0)
            if load <= least_load + self.balance_abs or load <= self.balance_rel * least_load:
                self._remember(r, hashes, adapter)
                return RoutingDecision(r, m, affinity_hit=True)
        matched = self._matched(least, hashes) if hashes else 0
        self._remember(least, hashes, adapter)
        return RoutingDecision(least, matched)

    def _remember(self, replica: Hashable, hashes: list[int], adapter: Hashable | None) -> None:
        table = self._tables.setdefault(replica, OrderedDict())
        for h in hashes:
            table[h] = None
            table.move_to_end(h)
        while len(table) > self.table_blocks:
            table.popitem(last=False)
        if adapter is not None:
            self._homes[adapter] = replica
            self._homes.move_to_end(adapter)
            while len(self._homes) > self.max_adapters:
                self._homes.popitem(last=False)

    def remove(self, replica: Hashable) -> None:
        self._tables.pop(replica, None)
        for adapter in [a for a, r in self._homes.items() if r == replica]:
            del self._homes[adapter]


ROUTERS = ("prefix_affinity", "round_robin", "least_loaded", "kv_aware")


def make_router(name: str, block_size: int = 16, **kwargs: object) -> Router:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_affinity":
        return PrefixAffinity(block_size=block_size, **kwargs)
    if name == "kv_aware":
        return KVAware(block_size=block_size, **kwargs)
    raise ValueError(f"unknown router {name!r}; choose from {', '.join(ROUTERS)}")
