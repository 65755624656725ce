"""The OpenAI app over a fleet of replicas: FleetEngine stands where the single-process server's
AsyncEngine stands (``generate`` / ``abort_all`` / ``stop`` and the model facts the handlers
read), FleetState is the app's ServerState for it, FleetMetrics merges every replica's /metrics.

A replica that dies before a request produced anything: the request is sent again (another
replica, or Ray's replacement). One that dies mid-request: the request ends with a 503
(streams: an error chunk, then [DONE]), never with a silently truncated answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.state import ServerState
from conveyor.entrypoints.ray_serve.stats import RouterStats

logger = logging.getLogger("conveyor.serve")

MAX_ATTEMPTS = 3  # sends of one request whose replica died before it produced any output
REPLICA_CALL_TIMEOUT_S = 10.0


@dataclass
class FleetStats:
    num_total_blocks: int  # one replica's KV cache (all run the same engine flags)


class FleetEngine:
    def __init__(self, handle: Any, info: dict[str, Any], router_stats: RouterStats) -> None:
        self.handle = handle
        self.router_stats = router_stats
        self.tokenizer = info["tokenizer"]
        self.model_config = info["model_config"]
        self.max_model_len = info["max_model_len"]
        self.stats = FleetStats(info["num_total_blocks"])
        self.engine = self  # ServerState reads the model's name at engine.engine.model_config
        self.error: BaseException | None = None
        self._responses: dict[str, Any] = {}  # request id -> its replica's response stream
        self._waiting_first_output = 0

    def num_queued_requests(self) -> int:
        """Requests accepted that have not produced their first output yet."""
        return self._waiting_first_output

    async def generate(self, prompt: dict[str, Any], sampling_params: SamplingParams,
                       request_id: str, priority: int = 0,
                       fairness_key: str | None = None,
                       lora_request: Any = None) -> AsyncIterator[Any]:
        """``AsyncEngine.generate`` over the replicas (no LoRA adapters: ``conveyor serve``
        refuses them for a fleet)."""
        from ray.exceptions import RayActorError, RayTaskError

        if lora_request is not None:
            raise ValueError("LoRA adapters are not served by a Ray fleet")

        got_output = finished = False
        self._waiting_first_output += 1
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                response = self.handle.options(stream=True).generate.remote(
                    request_id=request_id, prompt=prompt, params=sampling_params,
                    priority=priority, fairness_key=fairness_key)
                self._responses[request_id] = response
                try:
                    async for delta in response:
                        if not got_output:
                            got_output = True
                            self._waiting_first_output -= 1
                        finished = delta.finished
                        yield delta
                    if not finished:
                        raise APIError(503, "the replica ended the request's stream before it "
                                       "finished", code="replica_failed")
                    return
                except RayTaskError as e:  # raised by the engine: ValueError -> 400 upstream
                    cause = e.cause if isinstance(e.cause, Exception) else e
                    raise cause from None
                except RayActorError as e:
                    if got_output or attempt == MAX_ATTEMPTS:
                        raise APIError(503, f"the replica serving this request died ({e}); "
                                       "the request did not complete, retry it",
                                       code="replica_died") from None
                    logger.warning("replica died before request %s started; sending it again "
                                   "(attempt %d)", request_id, attempt + 1)
        finally:
            if not got_output:
                self._waiting_first_output -= 1
            response = self._responses.pop(request_id, None)
            if response is not None and not finished:
                response.cancel()  # the client left (or failed): abort it on its replica

    def abort_all(self) -> int:
        responses = list(self._responses.values())
        for r in responses:
            r.cancel()
        return len(responses)

    def stop(self) -> None:
        self.abort_all()

    async def call_replica(self, method: str, replica: str) -> Any:
        response = getattr(self.handle, method).remote(replica=replica)
        return await asyncio.wait_for(response, REPLICA_CALL_TIMEOUT_S)


class FleetMetrics:
    """/metrics of the fleet: every replica's engine metrics with a ``replica`` label, plus the
    router's counters."""

    def __init__(self, engine: FleetEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def render(self) -> bytes:
        stats = self.engine.router_stats.snapshot()
        replicas = stats["replicas"]
        texts = await asyncio.gather(*(self.engine.call_replica("metrics_text", r)
                                       for r in replicas), return_exceptions=True)
        families: dict[str, Metric] = {}
        for replica, text in zip(replicas, texts, strict=True):
            if isinstance(text, BaseException):
                logger.warning("no metrics from replica %s: %r", replica, text)
                continue
            for fam in text_string_to_metric_families(text):
                merged = families.setdefault(fam.name, Metric(fam.name, fam.documentation,
                                                              fam.type))
                merged.samples += [Sample(s.name, {**s.labels, "replica": replica}, s.value,
                                          s.timestamp, s.exemplar) for s in fam.samples]
        labels = ["model_name", "replica"]
        requests = CounterMetricFamily("conveyor:router_requests",
                                       "Requests the router sent to each replica.", labels=labels)
        hits = CounterMetricFamily("conveyor:router_affinity_hits",
                                   "Requests sent to a replica because it holds their prefix.",
                                   labels=labels)
        in_flight = GaugeMetricFamily("conveyor:router_in_flight_requests",
                                      "Requests routed to each replica and not finished.",
                                      labels=labels)
        for r in sorted(set(replicas) | set(stats["requests"])):
            requests.add_metric([self.model_name, r], stats["requests"].get(r, 0))
            hits.add_metric([self.model_name, r], stats["affinity_hits"].get(r, 0))
            if r in replicas:
                in_flight.add_metric([self.model_name, r], stats["in_flight"].get(r, 0))
        live = GaugeMetricFamily("conveyor:replicas_live", "Replicas the router can route to.",
                                 labels=["model_name"])
        live.add_metric([self.model_name], len(replicas))
        out = [*families.values(), requests, hits, in_flight, live]

        class _Collected:
            def collect(self) -> list[Metric]:
                return out

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected())
        return generate_latest(registry)


class FleetState(ServerState):
    """ServerState whose engine is a fleet: ``deploy`` (run in a thread at startup) brings the
    replicas up and returns (deployment handle, router stats); whoever deployed them takes
    them down after the server stopped."""

    def __init__(self, engine_args: EngineArgs, deploy: Callable[[], tuple[Any, RouterStats]],
                 served_model_name: str | None = None,
                 max_queued_requests: int | None = None) -> None:
        super().__init__(engine_args, served_model_name, max_queued_requests)
        self._deploy = deploy

    async def load(self) -> None:
        try:
            handle, router_stats = await asyncio.to_thread(self._deploy)
            info = await handle.info.remote()
        except Exception as e:
            logger.exception("failed to start the replicas")
            self.load_error = e
            self.on_fatal()
            return
        engine = FleetEngine(handle, info, router_stats)
        name = self.served_model_name or self.engine_args.model or info["model_name"]
        self.metrics = FleetMetrics(engine, name)  # type: ignore[assignment]
        self.engine = engine  # type: ignore[assignment]
        logger.info("%d replica(s) of %s ready (router %s); serving",
                    len(router_stats.replicas), name, router_stats.policy)

    async def health(self) -> dict[str, Any]:
        self.ready_engine()
        engine: FleetEngine = self.engine  # type: ignore[assignment]
        replicas = engine.router_stats.snapshot()["replicas"]
        results = await asyncio.gather(*(engine.call_replica("health", r) for r in replicas),
                                       return_exceptions=True)
        status = {r: {"status": "ok", **res} if not isinstance(res, BaseException)
                  else {"status": f"unreachable: {res!r}"}
                  for r, res in zip(replicas, results, strict=True)}
        healthy = sum(s["status"] == "ok" for s in status.values())
        if not healthy:
            raise APIError(503, "no replica is healthy: " + (", ".join(
                f"{r}: {s['status']}" for r, s in status.items()) or "none running"),
                code="no_replicas")
        return {"status": "ok", "healthy_replicas": healthy, "replicas": status}
