"""The checkpoint-name table (model/weights.py, read through model/registry.py) and the one-pass load (loader.load_weights):
GGUF and transformers names meet in one entry, tensor-parallel slices tile every tensor, and a
checkpoint with a tensor missing, unknown or of the wrong shape is refused by name."""

from __future__ import annotations

import pytest
import torch

from conveyor.model.backends.sdpa import TorchBackend
from conveyor.model.config import ModelConfig
from conveyor.model.layers.parallel import shard_plan
from conveyor.model.llama import LlamaForCausalLM
from conveyor.model.loader import load_weights
from conveyor.model.registry import LLAMA
from conveyor.model.weights import CheckpointTensor, Split, rank_holds, rank_slice

TORCH = TorchBackend(torch.device("cpu"))
CFG = ModelConfig(name="tiny", architecture="llama", num_layers=2, hidden_size=64,
                  intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16,
                  vocab_size=50, max_position_embeddings=64)


def test_gguf_and_transformers_names_meet_in_one_entry() -> None:
    weights = LLAMA.checkpoint_weights(CFG.num_layers)
    assert len({w.name for w in weights}) == len(weights)
    for w in weights:
        assert LLAMA.hf_tensor(w.name) == w
        gguf = w.spec.gguf if w.layer is None else f"blk.{w.layer}.{w.spec.gguf}"
        assert LLAMA.gguf_tensor(gguf) == w
    q = LLAMA.hf_tensor("model.layers.1.self_attn.q_proj.weight")
    assert (q.module, q.spec.param, q.spec.shard) == ("layers.1.qkv_proj", "weight", "q_proj")
    assert LLAMA.hf_tensor("model.layers.0.mlp.gate_proj.bias") is None
    assert LLAMA.gguf_tensor("blk.0.ffn_gate_inp.weight") is None


def _shape(w, cfg: ModelConfig) -> tuple[int, ...]:
    """A tensor's whole shape, [out, in] as transformers stores it."""
    q, kv, h, i = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                   cfg.hidden_size, cfg.intermediate_size)
    if w.spec.module.endswith(("q_norm", "k_norm")):
        return (cfg.head_dim,)
    if w.spec.module.endswith("norm"):
        return (h,)
    rows = {Split.VOCAB_ROWS: cfg.vocab_size, Split.QUERY_ROWS: q, Split.KV_ROWS: kv,
            Split.INTER_ROWS: i}.get(w.spec.split, h)
    columns = {Split.QUERY_COLUMNS: q, Split.INTER_COLUMNS: i}.get(w.spec.split, h)
    return (rows,) if w.spec.param == "bias" else (rows, columns)


@pytest.mark.parametrize("whole_sums", [False, True], ids=["partial-sums", "whole-sums"])
@pytest.mark.parametrize("size", [2, 4])
def test_rank_slices_tile_every_tensor(size, whole_sums) -> None:
    """Under whole sums the row-parallel projections' weights and biases are split by their
    output rows, every rank holding a slice."""
    plans = [shard_plan(CFG, r, size, whole_sums) for r in range(size)]
    row_parallel = (Split.QUERY_COLUMNS, Split.INTER_COLUMNS, Split.FIRST_RANK)
    for w in LLAMA.checkpoint_weights(1):
        shape = _shape(w, CFG)
        held = [r for r, p in enumerate(plans) if rank_holds(w.spec, p)]
        slices = [rank_slice(w.spec, plans[r], CFG.head_dim) for r in held]
        if whole_sums and w.spec.split in row_parallel:
            assert len(held) == size and {s.axis for s in slices} == {0}, w.name
        if w.spec.split is Split.FIRST_RANK and not whole_sums:
            assert held == [0] and slices == [None]
        elif w.spec.split is Split.REPLICATED:
            assert len(held) == size and slices == [None] * size
        elif w.spec.split is Split.KV_ROWS and size > CFG.num_kv_heads:  # KV heads shared
            assert {(s.start, s.stop) for s in slices} == {(0, 16), (16, 32)}
        else:
            covered = torch.zeros(shape[slices[0].axis], dtype=torch.int)
            for s in slices:
                covered[s.start:s.stop] += 1
            assert torch.equal(covered, torch.ones_like(covered)), w.name


def _checkpoint(cfg: ModelConfig) -> list[CheckpointTensor]:
    g = torch.Generator().manual_seed(0)
    return [CheckpointTensor(w, torch.randn(*_shape(w, cfg), generator=g))
            for w in LLAMA.checkpoint_weights(cfg.num_layers)
            if not w.spec.optional and not w.spec.module.endswith(("q_norm", "k_norm"))]


def test_one_pass_fills_every_parameter_and_drops_unfilled_biases() -> None:
    model = LlamaForCausalLM(CFG, TORCH)
    model.layers[0].qkv_proj.bias = torch.nn.Parameter(torch.zeros(128))
    tensors = _checkpoint(CFG)
    load_weights(model, tensors)
    by_name = {t.weight.name: t.dense for t in tensors}
    qkv = model.layers[1].qkv_proj.weight
    assert torch.equal(qkv, torch.cat([by_name[f"model.layers.1.self_attn.{n}_proj.weight"]
                                       for n in "qkv"]))
    assert torch.equal(model.embed_tokens.weight, by_name["model.embed_tokens.weight"])
    assert model.layers[0].qkv_proj.bias is None  # none in the checkpoint


def test_a_bad_checkpoint_is_refused_by_name() -> None:
    tensors = _checkpoint(CFG)
    missing = [t for t in tensors if t.weight.name != "model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        load_weights(LlamaForCausalLM(CFG, TORCH), missing)
    q_norm = CheckpointTensor(LLAMA.hf_tensor("model.layers.0.self_attn.q_norm.weight"), torch.ones(16))
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.0.self_attn.q_norm"):
        load_weights(LlamaForCausalLM(CFG, TORCH), tensors + [q_norm])  # a Llama layer has no q_norm
    wrong = [CheckpointTensor(t.weight, t.dense[:-1]) if t.weight.name.endswith("v_proj.weight")
             else t for t in tensors]
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_proj.weight': got shape "
                                         r"\(31, 64\), expected \(32, 64\)"):
        load_weights(LlamaForCausalLM(CFG, TORCH), wrong)
