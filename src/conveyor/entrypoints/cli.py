"""The `conveyor` command: one subcommand per module, each exposing ``add_parser(subparsers)``.

Subcommand modules must import nothing heavy (torch, transformers) at module level, so that
``conveyor --help`` stays instant; they import inside the function they register.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "conveyor.entrypoints.demo_cmd",  # demo
    "conveyor.entrypoints.generate_cmd",  # generate
    "conveyor.entrypoints.chat_cmd",  # chat
    "conveyor.entrypoints.serve_cmd",  # serve
    "conveyor.entrypoints.run_batch_cmd",  # run-batch
    "conveyor.entrypoints.models_cmd",  # pull, list, rm (the Hugging Face cache)
    "conveyor.entrypoints.worker_cmd",  # worker (tensor-parallel rank of another machine)
    "conveyor.bench.cli",  # bench {scheduler,throughput,serve}
    "conveyor.sim.cli",  # simulate
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="conveyor", description="Conveyor: a continuous-batching LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
