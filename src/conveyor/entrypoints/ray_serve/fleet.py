"""The OpenAI app over a fleet of replicas: FleetEngine stands where the single-process server's
AsyncEngine stands (``generate`` / ``abort_all`` / ``stop`` and the model facts the handlers
read), FleetState is the app's ServerState for it, FleetMetrics merges every replica's /metrics.

A replica that dies before a request produced anything: the request is sent again (another
replica, or Ray's replacement). One that dies mid-request: the request ends with a 503
(streams: an error chunk, then [DONE]), never with a silently truncated answer.

LoRA adapters load on every replica: FleetEngine.add_lora installs one on each live replica or,
if any refuses it, on none; a replica that joins later (a replacement) gets the fleet's adapters
from a background task within ``LORA_SYNC_PERIOD_S``, and until then its engine loads an adapter
on the first request naming it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.stats import SchedulerStats
from conveyor.engine.args import EngineArgs
from conveyor.engine.stats import EngineStats
from conveyor.entrypoints.openai.errors import APIError
from conveyor.entrypoints.openai.state import ServerState
from conveyor.entrypoints.ray_serve.stats import RouterStats
from conveyor.lora.request import LoRARequest

logger = logging.getLogger("conveyor.serve")

MAX_ATTEMPTS = 3  # sends of one request whose replica died before it produced any output
REPLICA_CALL_TIMEOUT_S = 10.0
LORA_CALL_TIMEOUT_S = 120.0  # a replica reading an adapter's files
LORA_SYNC_PERIOD_S = 1.0  # how often replicas that joined are given the fleet's adapters


class FleetEngine:
    def __init__(self, handle: Any, info: dict[str, Any], router_stats: RouterStats) -> None:
        self.handle = handle
        self.router_stats = router_stats
        self.tokenizer = info["tokenizer"]
        self.model_config = info["model_config"]
        self.max_model_len = info["max_model_len"]
        # what the handlers read of an engine's stats: one replica's KV cache (all replicas run
        # the same engine flags)
        self.stats = EngineStats(SchedulerStats(num_total_blocks=info["num_total_blocks"]))
        self.engine = self  # ServerState reads the model's name at engine.engine.model_config
        self.error: BaseException | None = None
        self._responses: dict[str, Any] = {}  # request id -> its replica's response stream
        self._waiting_first_output = 0
        self.loras: dict[int, LoRARequest] = {}  # adapters the fleet serves, by int id
        self._installed: dict[str, set[int]] = {}  # replica -> adapters installed there
        self._lora_lock = asyncio.Lock()  # one adapter change (or replica sync) at a time
        self._sync_task: asyncio.Task[None] | None = None
        self._kv_task: asyncio.Task[None] | None = None  # start_kv_events
        self._loop: asyncio.AbstractEventLoop | None = None

    def num_queued_requests(self) -> int:
        """Requests accepted that have not produced their first output yet."""
        return self._waiting_first_output

    async def generate(self, prompt: dict[str, Any], sampling_params: SamplingParams,
                       request_id: str, priority: int = 0,
                       fairness_key: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[Any]:
        """``AsyncEngine.generate`` over the replicas; the router places a ``lora_request``'s
        request with its adapter's affinity."""
        got_output = False
        self._waiting_first_output += 1
        try:
            async for delta in self.stream(self.handle, request_id, dict(
                    prompt=prompt, params=sampling_params, priority=priority,
                    fairness_key=fairness_key, lora_request=lora_request)):
                if not got_output:
                    got_output = True
                    self._waiting_first_output -= 1
                yield delta
        finally:
            if not got_output:
                self._waiting_first_output -= 1

    async def stream(self, handle: Any, request_id: str, kwargs: dict[str, Any],
                     retry: bool = True) -> AsyncIterator[Any]:
        """The items of one ``generate`` call on ``handle``'s replicas, up to the first whose
        ``finished`` is true. With ``retry``, a call whose replica died before it produced
        anything is sent again; a replica that dies later ends it with a 503."""
        from ray.exceptions import RayActorError, RayTaskError

        got_output = finished = False
        try:
            for attempt in range(1, MAX_ATTEMPTS + 1):
                response = handle.options(stream=True).generate.remote(request_id=request_id,
                                                                       **kwargs)
                self._responses[request_id] = response
                try:
                    async for item in response:
                        got_output = True
                        finished = item.finished
                        yield item
                    if not finished:
                        raise APIError(503, "the replica ended the request's stream before it "
                                       "finished", code="replica_failed")
                    return
                except RayTaskError as e:  # raised by the engine: ValueError -> 400 upstream
                    cause = e.cause if isinstance(e.cause, Exception) else e
                    raise cause from None
                except RayActorError as e:
                    if got_output or not retry or attempt == MAX_ATTEMPTS:
                        raise APIError(503, f"the replica serving this request died ({e}); "
                                       "the request did not complete, retry it",
                                       code="replica_died") from None
                    logger.warning("replica died before request %s started; sending it again "
                                   "(attempt %d)", request_id, attempt + 1)
        finally:
            response = self._responses.pop(request_id, None)
            if response is not None and not finished:
                response.cancel()  # the client left (or failed): abort it on its replica

    def abort_all(self) -> int:
        responses = list(self._responses.values())
        for r in responses:
            r.cancel()
        return len(responses)

    def stop(self) -> None:
        for task in (self._sync_task, self._kv_task):
            if task is not None and self._loop is not None:
                self._loop.call_soon_threadsafe(task.cancel)
        self.abort_all()

    def router_snapshot(self) -> dict[str, Any]:
        """The router's counters (``RouterStats.snapshot``), for /metrics and /health."""
        return self.router_stats.snapshot()

    async def call_replica(self, method: str, replica: str, *args: Any,
                           timeout: float = REPLICA_CALL_TIMEOUT_S) -> Any:
        """``method(*args)`` on that replica; a ValueError it raised is raised as is."""
        from ray.exceptions import RayTaskError

        response = getattr(self.handle, method).remote(*args, replica=replica)
        try:
            return await asyncio.wait_for(response, timeout)
        except RayTaskError as e:
            if isinstance(e.cause, ValueError):
                raise e.cause from None
            raise

    # ------------------------------------------------------------ LoRA adapters
    def live_replicas(self) -> list[str]:
        return self.router_stats.snapshot()["replicas"]

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Serve an adapter on every live replica. If one refuses it (ValueError: a bad
        adapter) or fails, it is removed from those that took it, and the error raised."""
        async with self._lora_lock:
            replicas = self.live_replicas()
            if not replicas:
                raise APIError(503, "no replica is running to load the adapter",
                               code="no_replicas")
            results = await asyncio.gather(
                *(self.call_replica("add_lora", r, lora_request, timeout=LORA_CALL_TIMEOUT_S)
                  for r in replicas), return_exceptions=True)
            errors = [(r, e) for r, e in zip(replicas, results, strict=True)
                      if isinstance(e, BaseException)]
            if errors:
                # Every replica called, even one that timed out: it may have taken it since.
                await self._remove_from(replicas, lora_request.lora_int_id)
                replica, error = next(((r, e) for r, e in errors if isinstance(e, ValueError)),
                                      errors[0])
                if isinstance(error, ValueError):
                    raise error
                raise APIError(503, f"replica {replica} failed to load the adapter ({error!r}); "
                               "no replica serves it", code="replica_failed") from None
            self.loras[lora_request.lora_int_id] = lora_request
            for r in replicas:
                self._installed.setdefault(r, set()).add(lora_request.lora_int_id)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter on every replica (requests running under it finish under
        it); False if the fleet did not serve it."""
        async with self._lora_lock:
            served = self.loras.pop(lora_int_id, None) is not None
            await self._remove_from(self.live_replicas(), lora_int_id)
        return served

    async def _remove_from(self, replicas: list[str], lora_int_id: int) -> None:
        results = await asyncio.gather(
            *(self.call_replica("remove_lora", r, lora_int_id) for r in replicas),
            return_exceptions=True)
        for r, result in zip(replicas, results, strict=True):
            self._installed.get(r, set()).discard(lora_int_id)
            if isinstance(result, BaseException):
                logger.warning("replica %s: removing LoRA adapter %d failed: %r", r,
                               lora_int_id, result)

    async def sync_loras(self) -> None:
        """Install the fleet's adapters on replicas that joined since they were loaded."""
        async with self._lora_lock:
            live = self.live_replicas()
            for gone in set(self._installed) - set(live):
                del self._installed[gone]
            for r in live:
                installed = self._installed.setdefault(r, set())
                for lora_int_id, lora in list(self.loras.items()):
                    if lora_int_id in installed:
                        continue
                    try:
                        await self.call_replica("add_lora", r, lora,
                                                timeout=LORA_CALL_TIMEOUT_S)
                    except Exception as e:  # noqa: BLE001 - its requests load it or fail
                        logger.warning("replica %s: loading LoRA adapter %r failed: %r", r,
                                       lora.lora_name, e)
                    else:
                        logger.info("replica %s: loaded LoRA adapter %r", r, lora.lora_name)
                    installed.add(lora_int_id)  # tried: a refusal is not retried every period

    def start_kv_events(self) -> None:
        """Feed the kv_aware router the replicas' KV events (run on the server's event loop)."""
        from conveyor.entrypoints.ray_serve.kv_events import KVEventPuller

        puller = KVEventPuller(self, lambda: self.router_stats.kv_router)
        self._loop = asyncio.get_running_loop()
        self._kv_task = self._loop.create_task(puller.run())

    def start_lora_sync(self) -> None:
        """Keep the fleet's adapters on replicas that join (run on the server's event loop)."""
        self._loop = asyncio.get_running_loop()
        self._sync_task = self._loop.create_task(self._sync_loop())

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(LORA_SYNC_PERIOD_S)
            if not self.loras:
                continue
            try:
                await self.sync_loras()
            except Exception:
                logger.exception("installing LoRA adapters on new replicas failed")


class FleetMetrics:
    """/metrics of the fleet: every replica's engine metrics with a ``replica`` label, plus the
    router's counters."""

    def __init__(self, engine: FleetEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    async def render(self) -> bytes:
        stats = self.engine.router_snapshot()
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
                                   "Requests sent to a replica because it holds their prefix or "
                                   "LoRA adapter.", labels=labels)
        lora_requests = CounterMetricFamily(
            "conveyor:router_lora_requests",
            "Requests naming a LoRA adapter the router sent to each replica.",
            labels=[*labels, "lora_name"])
        for (r, lora_name), n in sorted(stats["lora_requests"].items()):
            lora_requests.add_metric([self.model_name, r, lora_name], n)
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
        out = [*families.values(), requests, hits, lora_requests, in_flight, live]

        class _Collected:
            def collect(self) -> list[Metric]:
                return out

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collected())
        return generate_latest(registry)


class FleetState(ServerState):
    """ServerState whose engine is a fleet: ``deploy`` (run in a thread at startup) brings the
    replicas up and returns (a deployment handle to ask ``info``, a function that builds the
    FleetEngine from that info); whoever deployed them takes them down after the server
    stopped."""

    def __init__(self, engine_args: EngineArgs,
                 deploy: Callable[[], tuple[Any, Callable[[dict[str, Any]], FleetEngine]]],
                 served_model_name: str | None = None,
                 max_queued_requests: int | None = None) -> None:
        super().__init__(engine_args, served_model_name, max_queued_requests)
        self._deploy = deploy

    async def load(self) -> None:
        try:
            handle, make_engine = await asyncio.to_thread(self._deploy)
            info = await handle.info.remote()
        except Exception as e:
            logger.exception("failed to start the replicas")
            self.load_error = e
            self.on_fatal()
            return
        engine = make_engine(info)
        router_stats = engine.router_stats
        name = self.served_model_name or self.engine_args.model or info["model_name"]
        self.metrics = FleetMetrics(engine, name)  # type: ignore[assignment]
        self.engine = engine  # type: ignore[assignment]
        if not await self.load_lora_modules():
            return
        if self.engine_args.enable_lora:
            engine.start_lora_sync()
        if router_stats.policy == "kv_aware":
            engine.start_kv_events()
        logger.info("%d replica(s) of %s ready (router %s); serving",
                    len(engine.router_snapshot()["replicas"]), name, router_stats.policy)

    async def health(self) -> dict[str, Any]:
        self.ready_engine()
        engine: FleetEngine = self.engine  # type: ignore[assignment]
        replicas = engine.router_snapshot()["replicas"]
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
