"""`conveyor serve`: the OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import argparse
import os


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from uvicorn.config import LOG_LEVELS

    from conveyor.engine.args import add_cli_args
    from conveyor.entrypoints.openai.limits import ServerLimits
    from conveyor.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from conveyor.entrypoints.openai.tool_parsers import PARSERS as TOOL_PARSERS
    from conveyor.entrypoints.openai.unicode_text import INVALID_UNICODE_MODES
    from conveyor.routing.policies import ROUTERS

    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve /v1/completions, /v1/chat/completions, "
                              "/v1/messages (Anthropic), /v1/responses, /v1/embeddings, "
                              "/v1/score, /v1/rerank, /v1/models, /v1/files, /v1/batches, Ollama's /api/* routes, "
                              "/health and /metrics.")
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
                   choices=[level for level in LOG_LEVELS if level != "trace"])
    p.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log one line per HTTP request: id, status, tokens, latency "
                   "(default: on)")
    p.add_argument("--log-prompts", action="store_true",
                   help="add each request's prompt text to its access-log line")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="with --enable-lora: LoRA adapters (PEFT directories) to serve from the "
                   "start, each under the model name clients send (docs/lora.md)")
    p.add_argument("--allow-runtime-lora", action="store_true",
                   help="with --enable-lora: let clients load and unload adapters with "
                   "/v1/load_lora_adapter and /v1/unload_lora_adapter (default: off, 403)")
    p.add_argument("--lora-root", action="append", default=[], metavar="DIR",
                   help="with --allow-runtime-lora: clients may load adapters only from under "
                   "this directory (repeatable; a relative lora_path is under the first), and "
                   "are told why a load failed (default: anywhere, and never told why)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split the model's <think> reasoning from its answer: reasoning_content "
                   "in chat, reasoning items in responses, thinking blocks in messages "
                   "(default: none, all text is the answer)")
    p.add_argument("--batch-dir", default=None, metavar="DIR",
                   help="where /v1/files uploads and /v1/batches jobs are kept; unfinished jobs "
                   "resume when a server starts on it (default: $CONVEYOR_CACHE_DIR/batches)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the format the model writes tool calls in (docs/server.md; default: "
                   "the one its chat template shows)")

    sec = p.add_argument_group("security")
    sec.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; also "
                     "$CONVEYOR_API_KEY)")
    sec.add_argument("--api-key-file", default=None, metavar="PATH",
                     help="a file of accepted API keys, one a line ('#' starts a comment)")
    sec.add_argument("--metrics-require-key", action="store_true",
                     help="require the API key on /metrics too (default: /metrics is open)")
    sec.add_argument("--allowed-origins", action="append", default=[], metavar="ORIGINS",
                     help="origins a browser may call from, comma-separated or repeated, '*' "
                     "for any (default: none, no CORS headers)")
    sec.add_argument("--allowed-methods", action="append", default=[], metavar="METHODS",
                     help="CORS methods, comma-separated (default: *)")
    sec.add_argument("--allowed-headers", action="append", default=[], metavar="HEADERS",
                     help="CORS request headers, comma-separated (default: *)")
    sec.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    sec.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate")
    lim = p.add_argument_group("limits (docs/server.md)")
    lim.add_argument("--max-request-bytes", type=int, default=None,
                     help="answer 413 to a larger request body (default: 8 MiB)")
    lim.add_argument("--max-prompts-per-request", type=int, default=ServerLimits.max_prompts,
                     help="most prompts in one /v1/completions request; more is a 400 "
                     f"(default: {ServerLimits.max_prompts})")
    lim.add_argument("--max-n", type=int, default=ServerLimits.max_n,
                     help=f"most samples per prompt ('n'); more is a 400 (default: "
                     f"{ServerLimits.max_n})")
    lim.add_argument("--max-sequences-in-flight", type=int,
                     default=ServerLimits.max_sequences_in_flight,
                     help="most sequences (prompts x n) all running requests may hold; a "
                     "request beyond it gets 429 with Retry-After, one larger than it a 400 "
                     f"(default: {ServerLimits.max_sequences_in_flight})")
    lim.add_argument("--max-tools", type=int, default=ServerLimits.max_tools,
                     help="most tools in one chat, Messages or Responses request; more is a "
                     f"400 (default: {ServerLimits.max_tools})")
    lim.add_argument("--invalid-unicode", default=ServerLimits.invalid_unicode,
                     choices=INVALID_UNICODE_MODES,
                     help="text holding a lone UTF-16 surrogate (a \\ud800 escape): reject it "
                     "(400 naming the field) or replace each with U+FFFD (default: reject)")
    d = p.add_argument_group("data-parallel replicas (Ray Serve; docs/parallelism.md)")
    d.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind this endpoint; > 1 deploys them with Ray Serve "
                   "(default: 1, no Ray)")
    d.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of starting "
                   "a local one")
    d.add_argument("--router", default="prefix_affinity",
                   choices=ROUTERS,
                   help="how requests are spread over replicas (default: prefix_affinity); "
                   "kv_aware routes by the replicas' KV events (turns --kv-events on)")
    d.add_argument("--pd", default=None, metavar="P:D",
                   help="prefill/decode disaggregation: P prefill and D decode replicas; a "
                   "request's prompt runs on a prefill replica, its KV blocks move to a decode "
                   "replica through Ray's object store, and it decodes there "
                   "(--data-parallel-size defaults to P + D; docs/kv_cache.md)")
    d.add_argument("--threads-per-replica", type=int, default=1,
                   help="torch threads (and Ray CPUs) per replica (default: 1)")
    d.add_argument("--ray-num-cpus", type=int, default=None,
                   help="CPUs of the local Ray instance (default: every core)")
    add_cli_args(p, serve=True)
    p.set_defaults(func=_run)


def _split(values: list[str], default: tuple[str, ...] = ()) -> tuple[str, ...]:
    items = [v.strip() for value in values for v in value.split(",") if v.strip()]
    return tuple(items) or default


def _run(args: argparse.Namespace) -> int:
    from conveyor.engine.args import from_cli_args
    from conveyor.entrypoints.openai.access_log import AccessLogSettings
    from conveyor.entrypoints.openai.limits import DEFAULT_MAX_REQUEST_BYTES, ServerLimits
    from conveyor.entrypoints.openai.lora import parse_lora_modules
    from conveyor.entrypoints.openai.security import ServerSecurity, load_api_keys
    from conveyor.entrypoints.openai.server import run_server
    from conveyor.entrypoints.openai.server_paths import ClientPaths
    from conveyor.model.loader import check_model

    on_ray = (args.data_parallel_size > 1 or args.ray_address is not None
              or args.pd is not None)
    try:  # a wrong --model fails here, before the server listens
        check_model(args.model, keep_reader=not on_ray)  # a fleet loads it in its replicas
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise SystemExit("--max-queued-requests must be >= 1")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise SystemExit("--max-request-bytes must be >= 1")
    try:
        limits = ServerLimits(
            max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
            max_prompts=args.max_prompts_per_request, max_n=args.max_n,
            max_sequences_in_flight=args.max_sequences_in_flight, max_tools=args.max_tools,
            invalid_unicode=args.invalid_unicode)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise SystemExit("--ssl-keyfile and --ssl-certfile go together")
    for path in (args.ssl_keyfile, args.ssl_certfile):
        if path is not None and not os.path.isfile(path):
            raise SystemExit(f"no such file: {path}")
    try:
        api_keys = load_api_keys(args.api_key, args.api_key_file)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    security = ServerSecurity(api_keys=api_keys, metrics_require_key=args.metrics_require_key,
                              allowed_origins=_split(args.allowed_origins),
                              allowed_methods=_split(args.allowed_methods, ("*",)),
                              allowed_headers=_split(args.allowed_headers, ("*",)))
    try:
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if lora_modules and not args.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora and not args.enable_lora:
        raise SystemExit("--allow-runtime-lora needs --enable-lora")
    if args.lora_root and not args.allow_runtime_lora:
        raise SystemExit("--lora-root needs --allow-runtime-lora")
    try:
        lora_paths = ClientPaths.of(args.lora_root, "--lora-root")
    except ValueError as e:
        raise SystemExit(str(e)) from e
    server_kwargs = dict(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        max_queued_requests=args.max_queued_requests, shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level, security=security,
        limits=limits, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, batch_dir=args.batch_dir,
        access_log=AccessLogSettings(args.access_log, args.log_prompts),
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        lora_modules=lora_modules, allow_runtime_lora=args.allow_runtime_lora,
        lora_paths=lora_paths)
    if on_ray:
        from conveyor.entrypoints.ray_serve.launcher import pd_fleet_config, run_fleet

        try:
            fleet = pd_fleet_config(args.data_parallel_size, args.pd, router=args.router,
                                    threads_per_replica=args.threads_per_replica,
                                    ray_address=args.ray_address, num_cpus=args.ray_num_cpus)
        except ValueError as e:
            raise SystemExit(str(e)) from e
        return run_fleet(from_cli_args(args), fleet, **server_kwargs)
    return run_server(from_cli_args(args), **server_kwargs)
