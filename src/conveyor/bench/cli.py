"""`conveyor bench ...`: one sub-subcommand per benchmark module, each exposing ``add_parser``."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = [
    "conveyor.bench.scheduler",  # bench scheduler
    "conveyor.bench.throughput",  # bench throughput
    "conveyor.bench.serving",  # bench serve
    "conveyor.bench.soak",  # bench soak
    "conveyor.bench.batch_interference",  # bench batch
    "conveyor.bench.doc_tables",  # bench report
    "conveyor.bench.accuracy",  # bench accuracy
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (scheduler, throughput, serve, accuracy, "
                                   "soak) and the docs' tables of their results (report)")
    inner = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    for name in BENCHMARKS:
        importlib.import_module(name).add_parser(inner)
    parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
