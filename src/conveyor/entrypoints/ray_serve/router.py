"""A Ray Serve RequestRouter that places each engine request with a conveyor.routing policy.

It runs in the process that holds the deployment handle (the HTTP ingress). ``generate`` calls
are routed by the policy over the replicas' in-flight counts (routed minus completed, kept here)
and the LoRA adapter they name (its ``lora_int_id``: an adapter loaded again under the same name
starts afresh); calls that name a ``replica`` (metrics, health, info, adapter loads) go to that
replica only, busy or idle.
Under ``kv_aware`` the ingress feeds the policy the replicas' KV events (``kv_events.py``).
Counters for /metrics live in a RouterStats that the ingress reads: stats.py, because Ray Serve
ships this module to the router pickled by value, with module globals of its own.
"""

from __future__ import annotations

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from conveyor.entrypoints.ray_serve.stats import stats_for
from conveyor.routing import make_router

ROUTED_METHOD = "generate"


class ConveyorRequestRouter(RequestRouter):
    # No FIFOMixin: it hands the replica chosen for one request to whichever request waits
    # longest, so a call naming a replica (or a prefix-affinity choice) could land elsewhere.
    # Ray's default matching gives each request the replica chosen for it.

    def initialize_state(self, policy: str = "prefix_affinity", block_size: int = 16,
                         **policy_kwargs: object) -> None:
        self._policy = make_router(policy, block_size=block_size, **policy_kwargs)
        self._stats = stats_for(self._deployment_id.name)
        self._stats.policy = policy
        if policy == "kv_aware":
            self._stats.kv_router = self._policy
        # request id -> (replica chosen by prefix or adapter affinity, the adapter's name)
        self._decisions: dict[str, tuple[str | None, str | None]] = {}
        self._routed_to: dict[str, str] = {}  # internal request id -> replica of a generate

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = sorted(r.replica_id.unique_id for r in replicas)
        with self._stats.lock:
            gone = set(self._stats.replicas) - set(live)
            self._stats.replicas = live
            for rid in gone:
                self._stats.in_flight.pop(rid, None)
        for rid in gone:
            self._policy.remove(rid)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas or pending_request is None:
            return [candidate_replicas] if candidate_replicas else []
        pending_request.routing_context.should_backoff = True
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        target = pending_request.kwargs.get("replica")
        if target is not None:
            return [[by_id[target]]] if target in by_id else []
        if pending_request.metadata.call_method != ROUTED_METHOD:
            return [candidate_replicas]
        prompt = pending_request.kwargs.get("prompt") or {}
        lora = pending_request.kwargs.get("lora_request")
        ids = sorted(by_id)
        with self._stats.lock:
            loads = {rid: self._stats.in_flight.get(rid, 0) for rid in ids}
        decision = self._policy.route(ids, prompt.get("prompt_token_ids") or [], loads,
                                      adapter=lora.lora_int_id if lora is not None else None)
        self._decisions[pending_request.metadata.internal_request_id] = (
            decision.replica if decision.affinity_hit else None,
            lora.lora_name if lora is not None else None)
        chosen = by_id[decision.replica]
        # The rest are a fallback rank, used only if the chosen replica refuses (full or dying).
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: object) -> None:
        if pending_request.metadata.call_method != ROUTED_METHOD:
            return
        request_id = pending_request.metadata.internal_request_id
        rid = replica_id.unique_id
        affinity, lora_name = self._decisions.pop(request_id, (None, None))
        self._routed_to[request_id] = rid
        with self._stats.lock:
            self._stats.requests[rid] += 1
            self._stats.in_flight[rid] += 1
            if affinity == rid:
                self._stats.affinity_hits[rid] += 1
            if lora_name is not None:
                self._stats.lora_requests[rid, lora_name] += 1

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        rid = self._routed_to.pop(internal_request_id, None)
        if rid is None:
            return
        with self._stats.lock:
            if self._stats.in_flight.get(rid, 0) > 0:
                self._stats.in_flight[rid] -= 1
