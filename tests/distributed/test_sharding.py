"""The shard plan (which heads, columns and vocabulary rows a rank holds) and the step message,
without processes."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.step_input import StepInput
from conveyor.distributed.step import StepMessage
from conveyor.model.config import ModelConfig
from conveyor.model.device import resolve_weight_compute
from conveyor.model.kernels.block_matmul import block_matmul_available
from conveyor.model.layers.parallel import TensorParallel, check_tensor_parallel, shard_plan


def _config(heads: int = 8, kv_heads: int = 2, vocab: int = 100) -> ModelConfig:
    return ModelConfig(name="t", architecture="llama", num_layers=1, hidden_size=64,
                       intermediate_size=96, num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
                       vocab_size=vocab, max_position_embeddings=64)


def test_whole_sums_split_the_hidden_features() -> None:
    """Integer compute's row-parallel projections hold a slice of the hidden outputs each, so
    the hidden size must divide too."""
    cfg = _config()
    assert [shard_plan(cfg, r, 4, whole_sums=True).hidden for r in range(4)] == [16] * 4
    assert shard_plan(cfg, 0, 4).hidden == 0
    cfg = _config(heads=6, kv_heads=6)
    check_tensor_parallel(cfg, 6)
    with pytest.raises(ValueError, match="tensor_parallel_size 6 does not divide the model's "
                                         "hidden size 64"):
        check_tensor_parallel(cfg, 6, whole_sums=True)


def test_weight_compute_and_sums_do_not_depend_on_the_split() -> None:
    """"auto" is decided by the device alone; whole sums (one process's bits) unless float
    compute was asked to be non-deterministic."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_weight_compute("auto", cpu) == ("int8" if block_matmul_available() else "float")
    assert resolve_weight_compute("auto", cuda) == "float"
    assert resolve_weight_compute("float", cpu) == "float"
    with pytest.raises(ValueError, match="weight_compute must be one of"):
        resolve_weight_compute("int4", cpu)
    assert TensorParallel.of(0, 3, "int8").whole_sums
    assert TensorParallel.of(0, 3, "int8", deterministic=False).whole_sums
    assert TensorParallel.of(0, 3, "float").whole_sums
    assert not TensorParallel.of(0, 3, "float", deterministic=False).whole_sums


def test_kv_heads_split_or_replicated() -> None:
    cfg = _config(heads=8, kv_heads=2)
    assert [(p.num_heads, p.num_kv_heads, p.kv_head_start)
            for p in (shard_plan(cfg, r, 2) for r in range(2))] == [(4, 1, 0), (4, 1, 1)]
    # 4 ranks over 2 KV heads: ranks 0, 1 read KV head 0; ranks 2, 3 KV head 1.
    assert [shard_plan(cfg, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]


def test_vocabulary_ranges_cover_an_uneven_vocabulary() -> None:
    plans = [shard_plan(_config(vocab=100), r, 8) for r in range(8)]
    assert plans[0].vocab_start == 0 and plans[-1].vocab_end == 100
    assert all(a.vocab_end == b.vocab_start for a, b in zip(plans, plans[1:], strict=False))


@pytest.mark.parametrize(("heads", "kv_heads", "size", "message"), [
    (9, 3, 2, "does not divide the model's 9 attention heads"),
    (12, 8, 3, "neither divides nor is a multiple of the model's 8 KV heads"),
    (8, 2, 0, "must be a positive integer"),
])
def test_bad_splits_name_tensor_parallel_size(heads, kv_heads, size, message) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size") as e:
        check_tensor_parallel(_config(heads, kv_heads), size)
    assert message in str(e.value)


def test_step_message_round_trip() -> None:
    msg = StepMessage(step=StepInput(input_ids=[5, 6, 7, 8], starts=[3, 0], counts=[1, 3],
                                     block_tables=[[4, 9], [2]], logits_indices=[0, 3],
                                     swap_out=[(1, 0)], swap_in=[(2, 5), (3, 6)], copy=[(7, 8)],
                                     lora_slots=[0, 2]), extra=[7])
    back = StepMessage.unpack(*msg.pack())
    assert back.step.block_tables == [[4, 9], [2, 0]]  # padded to one width
    back.step.block_tables = msg.step.block_tables
    assert back == msg
