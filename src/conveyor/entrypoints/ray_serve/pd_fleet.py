"""PDFleetEngine: the OpenAI app's engine over prefill and decode replicas (``conveyor serve
--pd P:D``; docs/kv_cache.md).

A request that splits (``pd_handoff.splittable``) is routed to a prefill replica with
``max_tokens=1``; its stream carries the first token (the client's first chunk) and ends with a
``KVHandoff``: the first token, the prompt, the object refs of the prompt's blocks. The request
is then routed to a decode replica with the prompt plus that token and the rest of its output;
that replica loads the blocks instead of computing them, and its stream carries the rest. Both
halves reach the client as one stream of deltas, with the prompt and cached-token count of the
original request. A request that does not split, or that finishes at its first token, runs on
one replica (the decode replicas take whole requests).

Failures: each phase is sent again when its replica dies before it produced anything (a decode
phase too: the blocks' objects outlive the decode replica); a replica that dies later (the
prefill one between its first token and the handoff, the decode one once it has produced a
token) ends the request with a 503 (streams: an error chunk). Blocks the decode replica cannot fetch
(their prefill replica died after handing off) or verify it computes instead. A client that leaves cancels the phase running, which
aborts it on its replica; the object refs die with the request, and so do the blocks they hold.

Everything else (LoRA adapters, the KV-events feed of a kv_aware router per phase, /metrics and
/health over every replica) is the plain fleet's: this class is a FleetEngine over the decode
replicas with a second one, ``prefill``, over the prefill replicas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from conveyor.core.sampling_params import SamplingParams
from conveyor.entrypoints.ray_serve.fleet import FleetEngine
from conveyor.entrypoints.ray_serve.pd_handoff import (
    KVHandoff,
    decode_params,
    prefill_params,
    splittable,
)
from conveyor.entrypoints.ray_serve.stats import RouterStats
from conveyor.lora.request import LoRARequest


class PDFleetEngine(FleetEngine):
    def __init__(self, prefill_handle: Any, decode_handle: Any, info: dict[str, Any],
                 prefill_stats: RouterStats, decode_stats: RouterStats) -> None:
        super().__init__(decode_handle, info, decode_stats)
        self.prefill = FleetEngine(prefill_handle, info, prefill_stats)

    async def generate(self, prompt: dict[str, Any], sampling_params: SamplingParams,
                       request_id: str, priority: int = 0,
                       fairness_key: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[Any]:
        if not splittable(sampling_params, lora_request):
            async for delta in super().generate(prompt, sampling_params, request_id, priority,
                                                fairness_key, lora_request):
                yield delta
            return
        got_output = False
        self._waiting_first_output += 1
        try:
            handoff: KVHandoff | None = None
            async for item in self.prefill.stream(self.prefill.handle, request_id, dict(
                    prompt=prompt, params=prefill_params(sampling_params), priority=priority,
                    fairness_key=fairness_key, hand_off=True)):
                if isinstance(item, KVHandoff):
                    handoff = item
                    continue
                if not got_output:
                    got_output = True
                    self._waiting_first_output -= 1
                yield item
            if handoff is None:  # it finished at its first token
                return
            decode_prompt = {"prompt_token_ids": [*handoff.prompt_token_ids,
                                                  handoff.first_token]}
            async for delta in self.stream(self.handle, request_id, dict(
                    prompt=decode_prompt, params=decode_params(sampling_params),
                    priority=priority, fairness_key=fairness_key, handoff=handoff)):
                yield _as_original(delta, handoff)
        finally:
            if not got_output:
                self._waiting_first_output -= 1

    def abort_all(self) -> int:
        return super().abort_all() + self.prefill.abort_all()

    def stop(self) -> None:
        self.prefill.stop()
        super().stop()

    def router_snapshot(self) -> dict[str, Any]:
        """Both routers' counters as one (replica ids are unique across deployments)."""
        a, b = self.prefill.router_snapshot(), super().router_snapshot()
        return {"policy": b["policy"], "replicas": a["replicas"] + b["replicas"],
                **{k: {**a[k], **b[k]} for k in ("requests", "affinity_hits", "lora_requests",
                                                 "in_flight")}}

    async def call_replica(self, method: str, replica: str, *args: Any, **kwargs: Any) -> Any:
        if replica in self.prefill.live_replicas():
            return await self.prefill.call_replica(method, replica, *args, **kwargs)
        return await super().call_replica(method, replica, *args, **kwargs)

    def start_kv_events(self) -> None:
        self.prefill.start_kv_events()
        super().start_kv_events()


def _as_original(delta: Any, handoff: KVHandoff) -> Any:
    """A decode replica's delta as the original request's: its prompt, and the prompt tokens the
    prefill replica found cached (the decode replica counts the loaded ones too)."""
    metrics = delta.metrics
    if metrics is not None:
        metrics = dataclasses.replace(metrics, num_cached_tokens=handoff.num_cached_tokens)
    return dataclasses.replace(delta, prompt_token_ids=handoff.prompt_token_ids, metrics=metrics)
