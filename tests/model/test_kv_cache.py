"""KVCache memory: the swap pool costs resident memory only once swapping writes to it."""

import sys

import pytest
import torch

from conveyor.model.kv_cache import KVCache


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_swap_pool_is_resident_only_where_written():
    before = resident_mb()
    # 2 layers x K/V x 4 GPU blocks, and a 256 MiB CPU pool of 4,096 blocks.
    cache = KVCache(2, 4, 64, 16, num_blocks=4, num_cpu_blocks=4096, dtype=torch.float32,
                    device=torch.device("cpu"))
    assert cache.cpu_pool.numel() * 4 == 256 * 2**20
    assert resident_mb() - before < 64
    cache.cache.normal_()
    cache.swap_out([(1, 7)])
    cache.cache.zero_()
    cache.swap_in([(7, 2)])
    torch.testing.assert_close(cache.cache[:, :, 2], cache.cpu_pool[:, :, 7])
    assert cache.cache[:, :, 2].abs().sum() > 0
