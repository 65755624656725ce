"""Gemma 3 270M (the embedded Q4_K_M GGUF) against transformers' float32 model on the same file,
on its hybrid KV cache (six groups of three layers: one global, five sliding-window): the same
greedy tokens (short prompts, and one that crosses the 512-token sliding window), close
log-probabilities after a prompt of over 2,000 tokens (four windows), and the same tokens
through the torch and C++ backends with chunked prefill and prefix caching; on the C++ backend
every decode step's layers run in one call (``kernels/decode_layer.cpp``). The Triton
backend's run (interpreter) is ``model/triton/test_triton_gemma3.py``.

One load per backend (module-scoped executors; an engine per schedule reuses one) and one of
transformers' model: the file's GGUF metadata (262,144 tokens) takes seconds to parse each time.
"""

from __future__ import annotations

import os

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.chat import chat_prompt
from conveyor.engine.llm_engine import LLMEngine, _num_blocks
from conveyor.executor.model_executor import ModelExecutor
from conveyor.model.config import FULL, SLIDING, window_pattern
from conveyor.model.loader import GEMMA3_ALIAS
from conveyor.model.tokenizer import load_tokenizer
from engine_runs import run_to_end
from gemma3_data import SHORT_PROMPT, SHORT_PROMPT_TOKENS, gemma3_path, numbered_text

NEW_TOKENS = 24
WINDOW_PROMPT = numbered_text(30)  # about 650 tokens: decodes and late chunks past the window
PROMPTS = [SHORT_PROMPT, "def fibonacci(n):", "Once upon a time, in a small village,",
           WINDOW_PROMPT]
LONG_PROMPT = numbered_text(100)  # about 2,150 tokens
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path() -> str:
    return gemma3_path()


@pytest.fixture(scope="module")
def tokenizer(path: str):
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def reference(path: str, tokenizer) -> dict:
    """transformers' float32 model on the same GGUF file: its greedy tokens for PROMPTS, and
    the log-softmax after LONG_PROMPT (float64 from its float32 logits)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    model.eval()
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt).input_ids])
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)
            tokens.append(out[0, ids.shape[1]:].tolist())
        long_ids = tokenizer(LONG_PROMPT).input_ids
        logits = model(torch.tensor([long_ids])).logits[0, -1]
    return {"tokens": tokens, "long_ids": long_ids,
            "long_logprobs": torch.log_softmax(logits.double(), -1)}


def executor(backend: str) -> ModelExecutor:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_BACKEND", backend)
        # float compute: the checks here are against transformers' float32 forward
        return ModelExecutor(GEMMA3_ALIAS, dtype="float32", device="cpu", weight_compute="float")


@pytest.fixture(scope="module")
def cpu_executor(path: str) -> ModelExecutor:
    ex = executor("cpu")
    if not getattr(ex.model.backend, "attention_kernel", False):
        pytest.skip("the C++ kernels are not available here")
    return ex


@pytest.fixture(scope="module")
def torch_executor(path: str) -> ModelExecutor:
    return executor("torch")


def engine(ex: ModelExecutor, **kwargs) -> LLMEngine:
    eng = LLMEngine(EngineArgs(model=GEMMA3_ALIAS, dtype="float32", device="cpu",
                               weight_compute=ex.weight_compute, **kwargs),
                    executor=ex)
    groups = eng.scheduler.cache_config.kv_cache_groups
    assert len(groups) == 6 and groups == ex.kv_cache_groups  # the hybrid layout, not ()
    assert ex.kv_cache.cache.shape[0] == 3  # a block holds one group's three layers
    return eng


def greedy(eng: LLMEngine, prompts: list, prefix: str = "") -> list[list[int]]:
    return [list(out.outputs[0].token_ids)
            for out in run_to_end(eng, [(p, GREEDY) for p in prompts], prefix)]


def test_config_from_the_gguf_file(cpu_executor: ModelExecutor) -> None:
    cfg = cpu_executor.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == (
        "gemma3", 18, 256, 4, 1)
    assert (cfg.sliding_window, cfg.sliding_window_pattern) == (512, 6)
    assert cfg.attention_windows == ([512] * 5 + [0]) * 3
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (cfg.rope_local_theta, cfg.rope_theta, cfg.rope_scaling) == (10_000.0, 1e6, None)
    assert cfg.attention_scale is None  # query_pre_attn_scalar 256 = head_dim
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    assert {1, 106} <= set(cfg.eos_token_ids)  # <eos> and <end_of_turn>
    # the file stores Gemma's norm scales as 1 + w: they are near 1, not near 0
    assert cpu_executor.model.layers[0].input_norm.weight.mean() > 0.5


def test_engine_sizes_the_hybrid_cache(cpu_executor: ModelExecutor) -> None:
    """A block holds one group's 3 layers (not 18): 1 GiB of float32 KV holds 10,922 blocks
    of 16 tokens, 6 x one group of 18 layers' 1,820 (docs/kv_cache.md)."""
    assert len(cpu_executor.kv_cache_groups) == 6
    assert cpu_executor.kv_cache_bytes_per_block(16) == 2 * 3 * 256 * 16 * 4
    args = EngineArgs(model=GEMMA3_ALIAS, dtype="float32", device="cpu", kv_cache_memory=2**30)
    assert _num_blocks(args, cpu_executor)[0] == 10_922


def test_layer_types_as_a_window_pattern() -> None:
    assert window_pattern(([SLIDING] * 5 + [FULL]) * 3, 18, "x") == 6
    assert window_pattern([SLIDING] * 4, 4, "x") == 0
    assert window_pattern([FULL] * 4, 4, "x") == 1
    with pytest.raises(ValueError, match="every N-th layer global"):
        window_pattern([FULL, SLIDING, SLIDING, FULL], 4, "x")
    with pytest.raises(ValueError, match="must give 3 layers"):
        window_pattern([SLIDING, FULL], 3, "x")


def test_tokenizer_and_chat_turns(tokenizer) -> None:
    assert tokenizer("Hello world").input_ids == [2, 9259, 1902]  # <bos> first, once
    prompt = chat_prompt(tokenizer, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi!"},
                                     {"role": "assistant", "content": "Hello."},
                                     {"role": "user", "content": "Name a colour."}])
    assert prompt["prompt"] == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
    ids = prompt["prompt_token_ids"]
    assert ids[:2] == [2, 105] and ids.count(2) == 1 and ids.count(106) == 3
    assert ids[-3] == 105 and tokenizer.decode(ids[-2:]) == "model\n"


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(cpu_executor: ModelExecutor, reference: dict,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The C++ backend, whole prompts then decodes, every decode step's 18 layers in one C++ call
    (``kernels/decode_layer.cpp``: the file's Q5_0/Q4_K/Q6_K/Q8_0 projections as ``QuantPanels``,
    on the hybrid cache's six groups); a second engine with chunked prefill (the long prompt in
    chunks of up to 96 tokens) on the same weights, run twice: the second run's prompts come
    from the prefix cache."""
    import conveyor.model.llama as llama

    assert reference["tokens"][0][:len(SHORT_PROMPT_TOKENS)] == SHORT_PROMPT_TOKENS
    model = cpu_executor.model
    assert model.fused_decode is not None and model.fused_decode.num_layers == 18
    calls = []  # rows of each step in one call
    real = llama.decode_layers
    monkeypatch.setattr(llama, "decode_layers",
                        lambda *a: calls.append(a[1].shape[0]) or real(*a))
    assert greedy(engine(cpu_executor), PROMPTS) == reference["tokens"]
    # every decode step: each prompt's tokens after its first (which its prefill gives)
    assert sum(calls) == len(PROMPTS) * (NEW_TOKENS - 1)
    chunked = engine(cpu_executor, policy="chunked", max_num_batched_tokens=96)
    assert greedy(chunked, PROMPTS) == reference["tokens"]
    outs = run_to_end(chunked, [(p, GREEDY) for p in PROMPTS], "again")
    assert outs[-1].num_cached_tokens >= 512  # past the window: its blocks came from the cache
    assert [list(o.outputs[0].token_ids) for o in outs] == reference["tokens"]


@pytest.mark.slow
def test_torch_backend_gives_the_same_tokens(torch_executor: ModelExecutor,
                                             reference: dict) -> None:
    """TorchBackend with chunked prefill, then the same prompts from the prefix cache."""
    chunked = engine(torch_executor, policy="chunked", max_num_batched_tokens=96)
    assert greedy(chunked, PROMPTS) == reference["tokens"]
    outs = run_to_end(chunked, [(p, GREEDY) for p in PROMPTS], "again")
    assert outs[-1].num_cached_tokens >= 512
    assert [list(o.outputs[0].token_ids) for o in outs] == reference["tokens"]


@pytest.mark.slow
def test_long_prompt_logprobs_close_to_transformers(cpu_executor: ModelExecutor,
                                                    reference: dict) -> None:
    """After over 2,000 tokens (every sliding layer's window moved four times), the top-20
    log-probabilities of the next token equal transformers' to float32 rounding: the same
    dequantized weights, summed in other orders over 18 layers and 2,000-key softmaxes. The
    difference measured 3e-5 (AVX-512); the bound leaves room for another CPU's order of
    sums."""
    ids = reference["long_ids"]
    assert len(ids) > 4 * 512
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)
    out = run_to_end(engine(cpu_executor, max_num_batched_tokens=4096), [(
        {"prompt_token_ids": ids}, params)])[0]
    top = out.outputs[0].logprobs[0]
    expected = reference["long_logprobs"]
    assert out.outputs[0].token_ids[0] == int(expected.argmax())
    got = torch.tensor([lp.logprob for lp in top.values()], dtype=torch.float64)
    want = expected[list(top)]
    torch.testing.assert_close(got, want, rtol=0, atol=5e-4)
