"""``conveyor bench throughput --device cuda``: the flags parse, a machine without a GPU is told
so before anything runs, and the roofline line names the GPU it was measured on."""

import pytest
import torch

from conveyor.bench.throughput import format_roofline
from conveyor.entrypoints.cli import build_parser, main


def test_device_cuda_parses_with_the_gpu_flags():
    args = build_parser().parse_args(["bench", "throughput", "--workload", "W1", "--device",
                                      "cuda", "--gpu-memory-utilization", "0.8",
                                      "--enforce-eager"])
    assert (args.device, args.gpu_memory_utilization, args.enforce_eager) == ("cuda", 0.8, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_device_cuda_without_a_gpu_stops_with_a_clear_message():
    with pytest.raises(SystemExit, match="torch sees no CUDA device"):
        main(["bench", "throughput", "--device", "cuda", "--num-requests", "1", "--repeats", "1"])


def test_roofline_line_names_the_gpu():
    machine = {"gemm_flops": 700e12, "mem_bandwidth": 3.0e12, "num_threads": 132,
               "dtype": "bfloat16", "device": "NVIDIA H100 80GB HBM3"}
    text = format_roofline({"machine": machine, "metric": "output tok/s", "flops": 1e12,
                            "bytes": 1e9, "time_s": 1.0, "prefill_s": 0.2, "decode_s": 0.8,
                            "output_tokens_per_s": 50000.0, "conveyor_best": 10000.0,
                            "fraction_of_roofline": 0.2})
    assert "NVIDIA H100 80GB HBM3, 132 SMs" in text and "700,000 GFLOP/s" in text
