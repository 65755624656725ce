"""`conveyor bench throughput --tensor-parallel-size 1,2`: the sizes parse as a sweep, and a
TP row reports rank 0's all-reduce time and count per step."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from conveyor.bench.throughput import add_parser, run_conveyor
from conveyor.engine.args import EngineArgs


def test_sizes_parse_as_a_sweep() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--tensor-parallel-size", "1,3"])
    assert args.tensor_parallel_size == [1, 3]
    with pytest.raises(SystemExit):
        parser.parse_args(["throughput", "--tensor-parallel-size", "0"])


@pytest.mark.slow
@pytest.mark.parametrize(("changes", "collectives"), [
    ({}, 2 * 2 * 2 + 1),  # whole sums: two layers x (o_proj + down) x two all-gathers
    ({"weight_compute": "float", "deterministic": False}, 2 * 2 + 1),  # partial sums
], ids=["whole-sums", "partial-sums"])
def test_tp_row_reports_all_reduce_per_step(tiny_llama_long: str, changes: dict,
                                            collectives: int) -> None:
    args = EngineArgs(model=tiny_llama_long, dtype="float32", num_gpu_blocks=256,
                      tensor_parallel_size=2, threads_per_rank=1, **changes)
    result = run_conveyor({"engine_args": dataclasses.asdict(args), "workload": "W1", "seed": 0,
                           "num_requests": 2, "repeats": 1})
    tp = result.extra["tensor_parallel"]
    assert "TP 2" in result.config
    assert tp["size"] == 2 and tp["steps"] > 0
    # the row-parallel projections' collectives + the embedding's all-reduce, every step
    assert tp["all_reduces_per_step"] == collectives
    assert 0 < tp["all_reduce_ms_per_step"] < tp["step_ms"]
