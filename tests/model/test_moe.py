"""Mixtures of experts (``model/moe.py``): tiny random Qwen3-MoE, OLMoE and Mixtral built with
transformers generate transformers' greedy tokens in float32; written to GGUF (Q8_0) they run on
integer compute; under both a token's logprob bits do not depend on what it is batched with or
how its prompt is chunked; what does not run yet says so."""

from __future__ import annotations

import copy

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine
from conveyor.executor.model_executor import ModelExecutor
from conveyor.model.moe import SparseMoE
from engine_runs import run_to_end, samples
from tiny_models import VOCAB, save_tiny_causal_lm, write_gguf

KINDS = ["qwen3_moe", "olmoe", "mixtral"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Each kind's transformers model, its directory, a float32 float-compute executor over the
    directory and one over its Q8_0 GGUF file under integer compute (with the directory's
    tokenizer: the file has none)."""
    from transformers import AutoTokenizer

    import conveyor.model.tokenizer as tokenizer

    out = {}
    for kind in KINDS:
        path = str(tmp_path_factory.mktemp(kind))
        ref = save_tiny_causal_lm(kind, path)
        gguf = f"{path}/{kind}-q8_0.gguf"
        write_gguf(ref, kind, gguf, "Q8_0")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tokenizer, "load_tokenizer",
                          lambda _, path=path: AutoTokenizer.from_pretrained(path))
            integer = ModelExecutor(gguf, dtype="float32", device="cpu", weight_compute="auto")
        out[kind] = (ref, path, {"float": ModelExecutor(path, dtype="float32", device="cpu",
                                                        weight_compute="float"),
                                 "int8": integer})
    return out


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (int(n),), generator=g).tolist()
            for n in torch.randint(4, 40, (count,), generator=g)]


def engine(executor: ModelExecutor, **args) -> LLMEngine:
    return LLMEngine(EngineArgs(dtype="float32", max_model_len=256, num_gpu_blocks=256,
                                max_num_seqs=16, **args), executor=copy.copy(executor))


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_transformers(models, kind) -> None:
    ref, _, executors = models[kind]
    executor = executors["float"]
    asks = prompts(3, seed=1)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    got = run_to_end(engine(executor), [(p, params) for p in asks])
    for prompt, out in zip(asks, got, strict=True):
        ids = list(prompt)
        with torch.no_grad():  # transformers' greedy argmax, EOS included as any token
            for _ in range(64):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == ids[len(prompt):]


@pytest.mark.parametrize("compute", ["float", "int8"])
@pytest.mark.parametrize("kind", KINDS)
def test_logprob_bits_alone_batched_and_chunked(models, kind, compute) -> None:
    """One request alone, the same among 15 others, and with its prompt prefilled in chunks of
    64 and of 512 tokens beside decodes (chunked policy): the same tokens and logprob bits, in
    float (the HF directory) and under integer compute (the Q8_0 file)."""
    executor = models[kind][2][compute]
    if executor.weight_compute != compute:
        pytest.skip("integer compute needs the C++ kernels")
    g = torch.Generator().manual_seed(7)
    long = torch.randint(3, VOCAB, (150,), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=0, ignore_eos=True)
    alone = samples(run_to_end(engine(executor), [(long, params)])[0])
    others = [(p, params) for p in prompts(15, seed=3)]
    for args in ({}, {"policy": "chunked", "max_num_batched_tokens": 64},
                 {"policy": "chunked", "max_num_batched_tokens": 512}):
        batch = run_to_end(engine(executor, **args), [*others[:8], (long, params), *others[8:]])
        assert samples(batch[8]) == alone, args


def test_a_tokens_output_ignores_its_batch() -> None:
    """The block itself, its projections in this CPU's float format: a token's routed sum is the
    same bits alone and among others."""
    from functools import partial

    from conveyor.model.config import ModelConfig
    from conveyor.model.device import select_kernels
    from conveyor.model.layers.formats import linear_format
    from conveyor.model.layers.linear import DenseMethod, Linear

    kernels = select_kernels(torch.device("cpu"), torch.float32, 16, weight_compute="float")
    if kernels.linear is DenseMethod:
        pytest.skip("no batch-invariant float format here (the C++ kernels do not build)")

    cfg = ModelConfig(name="moe", architecture="mixtral", num_layers=1, hidden_size=32,
                      intermediate_size=16, num_heads=2, num_kv_heads=2, head_dim=16,
                      vocab_size=8, max_position_embeddings=8, num_experts=6,
                      num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True)
    block = SparseMoE(cfg, kernels.backend)
    g = torch.Generator().manual_seed(0)
    block.gate.load("weight", None, torch.randn(6, 32, generator=g))
    for expert in block.experts:
        expert.gate_up_proj.load("weight", "gate_proj", torch.randn(16, 32, generator=g))
        expert.gate_up_proj.load("weight", "up_proj", torch.randn(16, 32, generator=g))
        expert.down_proj.load("weight", None, torch.randn(32, 16, generator=g))
    for linear in block.modules():
        if isinstance(linear, Linear):
            linear.process_weights_after_loading(partial(linear_format, kernels, torch.float32))
    x = torch.randn(40, 32, generator=g)
    together = block(x)
    for i in (0, 17, 39):
        assert torch.equal(block(x[i:i + 1]), together[i:i + 1])
    experts, weights = block.route(x)
    assert experts.shape == (40, 3) and torch.allclose(weights.sum(-1), torch.ones(40))


def test_what_does_not_run_yet_says_so(models) -> None:
    from types import SimpleNamespace

    from conveyor.model.moe import MoEForCausalLM

    executor = models["mixtral"][2]["float"]
    with pytest.raises(ValueError, match="tensor parallelism over mixture-of-experts"):
        MoEForCausalLM(executor.model_config, executor.model.backend, tp=SimpleNamespace(size=2))
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts models"):
        executor.model.enable_lora(2, 8)
