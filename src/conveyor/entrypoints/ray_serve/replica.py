"""One data-parallel replica: an LLMEngine driven by an AsyncEngine inside a Ray Serve replica.

The ingress calls ``generate`` (streamed: one RequestOutput delta per item) through the
ConveyorRequestRouter; ``info``, ``metrics_text``, ``health``, ``kv_events``, ``add_lora`` and ``remove_lora``
name the replica they want. Cancelling a ``generate`` call (the client left) closes the stream,
which aborts the engine request.

Under prefill/decode disaggregation (``pd_fleet.py``) a replica is a producer or a consumer
(``EngineArgs.kv_transfer``): ``generate(hand_off=True)`` on a producer prefills and hands the
request over, ``generate(handoff=...)`` on a consumer takes it over (``pd_replica.py``).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.lora.request import LoRARequest


class ConveyorReplica:
    def __init__(self, engine_args: EngineArgs, threads: int = 1,
                 served_model_name: str | None = None) -> None:
        os.environ.setdefault("TQDM_DISABLE", "1")
        import torch

        from conveyor.engine.llm_engine import LLMEngine
        from conveyor.entrypoints.openai.metrics import ServerMetrics

        torch.set_num_threads(threads)
        if engine_args.tensor_parallel_size > 1 and engine_args.threads_per_rank is None:
            # The replica's Ray CPUs are shared by its ranks, not the machine's cores.
            engine_args = engine_args.replace(
                threads_per_rank=max(1, threads // engine_args.tensor_parallel_size))
        self.engine = LLMEngine(engine_args)
        self.engine_args = engine_args
        self.model_name = served_model_name or engine_args.model or self.engine.model_config.name
        self.metrics = ServerMetrics(self.model_name)
        self._async_engine: Any = None
        self._loras: dict[int, str] = {}  # adapters the ingress installed: int id -> name
        self._kv_feed: Any = None  # KVEventFeed, built at the first kv_events call
        self._exporter: Any = None  # a producer's HandoffExporter

    def _started(self) -> Any:
        """The AsyncEngine, started on the replica's event loop at the first call."""
        if self._async_engine is None:
            from conveyor.engine.async_engine import AsyncEngine

            observers = [self.metrics.observe]
            if self.engine_args.kv_transfer == "producer":
                from conveyor.engine.kv_transfer import HandoffExporter

                self._exporter = HandoffExporter(self.engine.kv_transfer)
                observers.append(self._exporter.observe)
            engine = AsyncEngine(self.engine, observers=observers)
            self.metrics.attach(engine)
            engine.start(asyncio.get_running_loop())
            self._async_engine = engine
        return self._async_engine

    async def generate(self, request_id: str, prompt: dict[str, Any], params: SamplingParams,
                       priority: int = 0, fairness_key: str | None = None,
                       lora_request: LoRARequest | None = None, hand_off: bool = False,
                       handoff: Any = None) -> AsyncIterator[Any]:
        """The request's deltas; ``hand_off`` (a producer): then its KVHandoff; ``handoff`` (a
        consumer): the KVHandoff it continues from."""
        if hand_off or handoff is not None:
            async for item in self._pd_stream(request_id, prompt, params, priority,
                                              fairness_key, hand_off, handoff):
                yield item
            return
        # An adapter the ingress has not installed here yet (this replica just started) is
        # loaded by the engine on its first request.
        async with aclosing(self._started().generate(
                prompt, params, request_id, priority, fairness_key,
                lora_request=lora_request)) as deltas:
            async for delta in deltas:
                yield delta

    async def _pd_stream(self, request_id: str, prompt: dict[str, Any], params: SamplingParams,
                         priority: int, fairness_key: str | None, hand_off: bool,
                         handoff: Any) -> AsyncIterator[Any]:
        from conveyor.entrypoints.ray_serve.pd_replica import decode_stream, prefill_stream

        engine = self._started()
        role = self.engine_args.kv_transfer
        if hand_off:
            if role != "producer":
                raise ValueError("this replica is not a prefill replica (kv_transfer='producer')")
            stream = prefill_stream(engine, self._exporter, request_id, prompt, params,
                                    priority, fairness_key)
        else:
            if role != "consumer":
                raise ValueError("this replica is not a decode replica (kv_transfer='consumer')")
            stream = decode_stream(engine, self.engine.kv_transfer, request_id, handoff, prompt,
                                   params, priority, fairness_key)
        async with aclosing(stream) as items:
            async for item in items:
                yield item

    async def add_lora(self, lora_request: LoRARequest, replica: str | None = None) -> None:
        """Serve an adapter (ValueError for a bad one, as ``AsyncEngine.add_lora``)."""
        await self._started().add_lora(lora_request)
        self._loras[lora_request.lora_int_id] = lora_request.lora_name

    async def remove_lora(self, lora_int_id: int, replica: str | None = None) -> bool:
        """Stop serving an adapter; its running requests finish under it."""
        self._loras.pop(lora_int_id, None)
        return await self._started().remove_lora(lora_int_id)

    async def info(self, replica: str | None = None) -> dict[str, Any]:
        engine = self._started()
        return {"model_name": self.model_name, "max_model_len": engine.max_model_len,
                "model_config": engine.model_config, "tokenizer": engine.tokenizer,
                "num_total_blocks": engine.stats.scheduler.num_total_blocks, "pid": os.getpid()}

    async def kv_events(self, after: int | None = None, replica: str | None = None,
                        ) -> dict[str, Any]:
        """The engine's KV events since reply ``after``, or a snapshot (``kv_events.py``)."""
        engine = self._started()
        if self._kv_feed is None:
            from conveyor.entrypoints.ray_serve.kv_events import KVEventFeed

            self._kv_feed = KVEventFeed(self.engine)
        return await self._kv_feed.read(after, engine)

    async def metrics_text(self, replica: str | None = None) -> str:
        self._started()
        return self.metrics.render().decode()

    async def health(self, replica: str | None = None) -> dict[str, Any]:
        s = self._started().stats.scheduler
        return {"pid": os.getpid(), "node": os.uname().nodename, "running": s.num_running,
                "waiting": s.num_waiting, "kv_usage": round(s.kv_usage, 4),
                "loras": sorted(self._loras.values()),
                "role": {"producer": "prefill", "consumer": "decode"}.get(
                    self.engine_args.kv_transfer or "", "any")}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; an exception marks the replica unhealthy and
        gets it replaced."""
        if self._async_engine is not None and self._async_engine.error is not None:
            raise RuntimeError(f"the engine thread died: {self._async_engine.error}")
