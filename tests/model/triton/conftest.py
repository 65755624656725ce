"""Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The variable is
read when a kernel is decorated, so it is set before the kernel modules are imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="triton is not installed")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
