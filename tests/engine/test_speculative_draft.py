"""Speculative decoding with a draft model (a second Conveyor model whose KV cache shares the
target's block tables): greedy output is token for token plain greedy's, with the embedded
model drafting for itself (nearly every proposal accepted) and with a tiny random draft
(nearly every one rejected), under preemption and prefix hits; every block comes back."""

from __future__ import annotations

import pytest
import torch
from speculative_runs import run_greedy

from conveyor.engine.args import EngineArgs

TEXTS = [
    "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nRewrite the function above with type hints:\n",
    "Once upon a time, in a kingdom far away, there lived a princess who loved to read",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
MAX_TOKENS = 40
BASE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, block_size=16,
            dtype="bfloat16")


@pytest.fixture(scope="module")
def executor():
    from conveyor.executor.model_executor import ModelExecutor

    return ModelExecutor(dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny_draft(executor, tmp_path_factory) -> str:
    """A tiny random Llama with the target's vocabulary and tokenizer (HF directory)."""
    import transformers

    path = str(tmp_path_factory.mktemp("tiny_draft"))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=executor.model_config.vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=True))
    model.save_pretrained(path)
    executor.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts(executor):
    return [executor.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(executor, prompts):
    return run_greedy(executor, EngineArgs(**BASE, num_gpu_blocks=200), prompts, MAX_TOKENS)[0]


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["self", "tiny"])
def test_draft_model_greedy_equals_plain_greedy(executor, prompts, plain, tiny_draft, draft):
    model = None if draft == "self" else tiny_draft
    for policy, mode, blocks, warm_up in (("chunked", "recompute", 200, True),
                                          ("prefill_first", "swap", 12, False)):
        args = EngineArgs(**BASE, num_gpu_blocks=blocks, policy=policy, preemption_mode=mode,
                          speculative_method="draft_model", speculative_model=model,
                          num_speculative_tokens=3, speculative_disable_by_batch_size=0)
        tokens, stats = run_greedy(executor, args, prompts, MAX_TOKENS, warm_up=warm_up)
        assert tokens == plain, (draft, policy)
        rate = stats.scheduler.spec_accepted_tokens / stats.scheduler.spec_draft_tokens
        assert rate > 0.9 if draft == "self" else rate < 0.2, (draft, rate)
        if blocks < 100:
            assert stats.scheduler.num_preemptions > 0
