"""The Triton kernels build for real GPUs (sm_90, sm_80) on this CPU machine: Triton lowers
them and its bundled ptxas assembles cubins, with the launchers' constants. In a subprocess,
as this directory's tests import the kernels in interpreter mode."""

import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_kernels_compile_for_h100_and_a100():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    runs = [["--arch", "90", "--dtype", "bfloat16", "--dtype", "float16", "--dtype", "float32",
             "--head-dim", "128"],
            ["--arch", "80", "--dtype", "bfloat16", "--head-dim", "64"],
            # Gemma 3's head size in float32: the largest tiles for shared memory
            ["--arch", "80", "--dtype", "float32", "--head-dim", "256"]]
    for flags in runs:
        out = subprocess.run([sys.executable, "-m", "conveyor.model.kernels.triton.aot_check",
                              *flags], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        lines = out.stdout.splitlines()
        kernels = {"kv_write", "decode_split", "decode_split_window", "decode_reduce",
                   "rms_norm", "rotary", "silu_mul", "prefill", "prefill_window",
                   "lora_shrink", "lora_expand"}
        assert len(lines) == len(kernels) * flags.count("--dtype") * flags.count("--head-dim")
        assert {line.split()[1] for line in lines} == kernels
