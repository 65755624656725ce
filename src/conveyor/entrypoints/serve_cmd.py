"""`conveyor serve`: the OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from conveyor.engine.args import add_cli_args

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve /v1/completions, /v1/chat/completions, "
                              "/v1/models, /health and /metrics.")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: --model, or the model's name)")
    p.add_argument("--max-queued-requests", type=int, default=None,
                   help="answer 503 when this many requests already wait (default: no limit)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGINT/SIGTERM before "
                   "they are aborted (default: 30)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="log every HTTP request (default: off)")
    d = p.add_argument_group("data-parallel replicas (Ray Serve; docs/parallelism.md)")
    d.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind this endpoint; > 1 deploys them with Ray Serve "
                   "(default: 1, no Ray)")
    d.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of starting "
                   "a local one")
    d.add_argument("--router", default="prefix_affinity",
                   choices=["prefix_affinity", "round_robin", "least_loaded"],
                   help="how requests are spread over replicas (default: prefix_affinity)")
    d.add_argument("--threads-per-replica", type=int, default=1,
                   help="torch threads (and Ray CPUs) per replica (default: 1)")
    d.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (default: every core)")
    add_cli_args(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from conveyor.engine.args import from_cli_args
    from conveyor.entrypoints.openai.server import run_server

    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise SystemExit("--max-queued-requests must be >= 1")
    if args.data_parallel_size > 1 or args.ray_address is not None:
        from conveyor.entrypoints.ray_serve.launcher import FleetConfig, run_fleet

        fleet = FleetConfig(args.data_parallel_size, args.router, args.threads_per_replica,
                            args.ray_address, args.ray_num_cpus)
        return run_fleet(from_cli_args(args), fleet, host=args.host, port=args.port,
                         served_model_name=args.served_model_name,
                         max_queued_requests=args.max_queued_requests,
                         shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                         access_log=args.access_log)
    return run_server(from_cli_args(args), host=args.host, port=args.port,
                      served_model_name=args.served_model_name,
                      max_queued_requests=args.max_queued_requests,
                      shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                      access_log=args.access_log)
