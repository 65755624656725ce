"""`conveyor serve --data-parallel-size N`: start (or join) a Ray cluster, deploy N replicas with
Ray Serve, and serve the OpenAI app over them from this process (see docs/parallelism.md).

With ``--pd P:D`` (prefill/decode disaggregation, docs/kv_cache.md) they are two deployments,
each an application of its own with its own router: P prefill replicas (``kv_transfer``
producer) and D decode replicas (consumer), served by a PDFleetEngine."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from conveyor.engine.args import EngineArgs

logger = logging.getLogger("conveyor.serve")

APP_NAME = "conveyor"
DEPLOYMENT_NAME = "ConveyorReplica"
PREFILL_APP, PREFILL_DEPLOYMENT = "conveyor-prefill", "ConveyorPrefill"
DECODE_APP, DECODE_DEPLOYMENT = "conveyor-decode", "ConveyorDecode"
MAX_ONGOING_REQUESTS = 1024  # Serve's per-replica cap; the engine's own queue does the waiting


@dataclass
class FleetConfig:
    data_parallel_size: int = 2
    router: str = "prefix_affinity"
    threads_per_replica: int = 1
    ray_address: str | None = None  # None: start a local Ray instance for this server
    num_cpus: int | None = None  # for a local instance (None: Ray's default, every core)
    pd: tuple[int, int] | None = None  # (prefill, decode) replicas; None: all alike

    def __post_init__(self) -> None:
        if self.pd is not None and sum(self.pd) != self.data_parallel_size:
            raise ValueError(f"--pd {self.pd[0]}:{self.pd[1]} is {sum(self.pd)} replicas but "
                             f"--data-parallel-size is {self.data_parallel_size}")


def pd_fleet_config(data_parallel_size: int, pd: str | None, **kwargs: object) -> FleetConfig:
    """The FleetConfig of ``--data-parallel-size`` and ``--pd P:D`` (ValueError when bad): a
    ``--data-parallel-size`` left at 1 takes P + D."""
    if pd is None:
        return FleetConfig(data_parallel_size, **kwargs)  # type: ignore[arg-type]
    from conveyor.routing.pd_split import parse_pd

    split = parse_pd(pd)
    size = sum(split) if data_parallel_size == 1 else data_parallel_size
    return FleetConfig(size, pd=split, **kwargs)  # type: ignore[arg-type]


def deploy(engine_args: EngineArgs, fleet: FleetConfig,
           served_model_name: str | None = None) -> tuple[Any, Any]:
    """Bring the replicas up (blocks until they have loaded the model); returns a deployment
    handle (to ask ``info``) and the function that builds the FleetEngine from that info.
    ``disconnect_ray`` takes them down again."""
    from ray import serve
    from ray.serve.config import ProxyLocation

    from conveyor.entrypoints.ray_serve.fleet import FleetEngine
    from conveyor.entrypoints.ray_serve.stats import stats_for

    if not ray_is_connected():  # run_fleet connected already; this is for other callers
        connect_ray(fleet)
    if fleet.router == "kv_aware":  # the router indexes what the replicas' KV events say
        engine_args = engine_args.replace(kv_events=True)
    serve.start(proxy_location=ProxyLocation.Disabled)  # HTTP is served by this process
    logger.info("deploying %d replica(s)%s (%d thread(s) each, router %s) on Ray %s",
                fleet.data_parallel_size,
                f" ({fleet.pd[0]} prefill, {fleet.pd[1]} decode)" if fleet.pd else "",
                fleet.threads_per_replica, fleet.router, fleet.ray_address or "local")
    if fleet.pd is None:
        handle = _run_app(engine_args, fleet, served_model_name, DEPLOYMENT_NAME, APP_NAME,
                          fleet.data_parallel_size)
        return handle, lambda info: FleetEngine(handle, info, stats_for(DEPLOYMENT_NAME))
    from conveyor.entrypoints.ray_serve.pd_fleet import PDFleetEngine

    num_prefill, num_decode = fleet.pd
    prefill = _run_app(engine_args.replace(kv_transfer="producer"), fleet, served_model_name,
                       PREFILL_DEPLOYMENT, PREFILL_APP, num_prefill)
    decode = _run_app(engine_args.replace(kv_transfer="consumer"), fleet, served_model_name,
                      DECODE_DEPLOYMENT, DECODE_APP, num_decode)
    return decode, lambda info: PDFleetEngine(prefill, decode, info,
                                              stats_for(PREFILL_DEPLOYMENT),
                                              stats_for(DECODE_DEPLOYMENT))


def _run_app(engine_args: EngineArgs, fleet: FleetConfig, served_model_name: str | None,
             deployment_name: str, app_name: str, num_replicas: int) -> Any:
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from conveyor.entrypoints.ray_serve.replica import ConveyorReplica
    from conveyor.entrypoints.ray_serve.router import ConveyorRequestRouter

    threads = fleet.threads_per_replica
    env = {"OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    deployment = serve.deployment(
        ConveyorReplica, name=deployment_name, num_replicas=num_replicas,
        max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=2.0,
        health_check_timeout_s=30.0, graceful_shutdown_timeout_s=5.0,
        ray_actor_options={"num_cpus": threads, "num_gpus": _gpus_per_replica(engine_args),
                           "runtime_env": {"env_vars": env}},
        request_router_config=RequestRouterConfig(
            request_router_class=ConveyorRequestRouter,
            request_router_kwargs={"policy": fleet.router, "block_size": engine_args.block_size}),
    )
    return serve.run(deployment.bind(engine_args, threads, served_model_name), name=app_name,
                     route_prefix=None)


def check_pd(engine_args: EngineArgs) -> None:
    """What the replicas would refuse under ``--pd``, refused before Ray starts (the rest:
    ``engine/kv_offload.py``, at the replicas' start)."""
    if not engine_args.enable_prefix_caching:
        raise ValueError("--pd needs prefix caching on (--enable-prefix-caching): a decode "
                         "replica admits the blocks handed over as prefix-cache hits")
    if engine_args.kv_offload_cpu_bytes or engine_args.kv_offload_disk:
        raise ValueError("--pd and KV offload (--kv-offload-*) do not combine yet: an engine "
                         "has one KV connector")
    if engine_args.kv_transfer is not None:
        raise ValueError("--pd sets each replica's --kv-transfer itself; leave it out")


def connect_ray(fleet: FleetConfig) -> None:
    """Join ``fleet.ray_address``, or start a local instance that ``disconnect_ray`` stops.
    Both run in the main thread: Ray's core worker aborts the process when the thread that
    initialised it ends first (a to_thread worker does, when the event loop closes)."""
    import ray

    ray.init(address=fleet.ray_address,
             num_cpus=fleet.num_cpus if fleet.ray_address is None else None,
             include_dashboard=False, namespace="conveyor")


def ray_is_connected() -> bool:
    import ray

    return ray.is_initialized()


def disconnect_ray(fleet: FleetConfig) -> None:
    import ray
    from ray import serve

    ours = _local_ray_pids() if fleet.ray_address is None else []
    try:
        if fleet.ray_address is None:  # ours: take Serve's controller down with the instance
            serve.shutdown()
        else:
            for app in ((PREFILL_APP, DECODE_APP) if fleet.pd else (APP_NAME,)):
                serve.delete(app)
    except Exception:
        logger.exception("taking the replicas down failed")
    logger.info("stopping Ray")
    ray.shutdown()
    _kill_survivors(ours)
    logger.info("Ray stopped")


def _local_ray_pids() -> list[int]:
    """The processes of the Ray instance this server started (its raylet's agents included)."""
    import psutil  # Ray ships it
    import ray

    pids: set[int] = set()
    node = ray._private.worker._global_node
    for infos in (node.all_processes.values() if node is not None else []):
        for info in infos:
            try:
                proc = psutil.Process(info.process.pid)
                pids.add(proc.pid)
                pids.update(child.pid for child in proc.children(recursive=True))
            except psutil.Error:
                pass
    return sorted(pids)


def _kill_survivors(pids: list[int], grace_s: float = 5.0) -> None:
    """Ray's dashboard and runtime-env agents can outlive ray.shutdown(); end them."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _gpus_per_replica(engine_args: EngineArgs) -> float:
    """Ray hides GPUs from an actor that reserved none: --device cuda reserves one per
    tensor-parallel rank."""
    if engine_args.device != "cuda":
        return 0.0
    return float(engine_args.tensor_parallel_size)


def run_fleet(engine_args: EngineArgs, fleet: FleetConfig,
              served_model_name: str | None = None, max_queued_requests: int | None = None,
              **server_kwargs: Any) -> int:
    """``conveyor serve`` over a fleet; ``server_kwargs`` are run_server's (host, port, ...)."""
    from conveyor.entrypoints.openai.server import run_server
    from conveyor.entrypoints.ray_serve.fleet import FleetState
    from conveyor.routing import make_router

    make_router(fleet.router)  # a bad name fails here, before Ray starts
    if fleet.data_parallel_size < 1 or fleet.threads_per_replica < 1:
        raise ValueError("--data-parallel-size and --threads-per-replica must be >= 1")
    if fleet.pd is not None:
        check_pd(engine_args)
    state = FleetState(engine_args, lambda: deploy(engine_args, fleet, served_model_name),
                       served_model_name, max_queued_requests)
    connect_ray(fleet)
    try:
        return run_server(engine_args, served_model_name=served_model_name,
                          max_queued_requests=max_queued_requests, state=state, **server_kwargs)
    finally:
        if ray_is_connected():
            disconnect_ray(fleet)
