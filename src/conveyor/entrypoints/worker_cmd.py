"""``conveyor worker``: one tensor-parallel rank on a machine other than rank 0's.

Run it with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK,
LOCAL_WORLD_SIZE), one process per rank, while the first machine runs ``conveyor serve
--tensor-parallel-size N --nnodes M --master-addr ... --master-port ...``. The model, dtype and
the rest come from rank 0; the model path must exist here too.
"""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="run one tensor-parallel rank for another machine's engine",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: this machine's cores / LOCAL_WORLD_SIZE)")
    p.add_argument("--distributed-timeout", type=float, default=120.0,
                   help="seconds a collective waits for a rank before failing (default: 120)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    import logging

    from conveyor.distributed.worker import spec_from_env
    from conveyor.executor.tp_worker import run_worker

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = spec_from_env(args.threads, args.distributed_timeout)
    return run_worker(spec)
