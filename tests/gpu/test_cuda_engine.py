"""The CUDA path end to end on a real GPU: greedy tokens equal transformers' (SmolLM2 and a tiny
random Qwen3, float32 on both sides), CUDA-graph decode equals eager decode (bf16), the engine's
scheduling variants give the same tokens, the KV cache is sized from the card's memory, and
swapped blocks come back intact."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.llm import LLM
from conveyor.model.backends.triton_kernels import TritonBackend

NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _llm(model: str | None = None, **kwargs) -> LLM:
    """An engine on the GPU with a fixed cache (the default takes 90% of the card, which would
    leave the next engine of the module nothing)."""
    return LLM(model, **{"device": "cuda", "dtype": "float32", "max_num_seqs": 8,
                         "num_gpu_blocks": 256, **kwargs})


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def smollm2_reference():
    """transformers' SmolLM2 (its own GGUF reading) in float32 on the GPU, and greedy tokens of
    a few chat prompts from it, one prompt at a time."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from conveyor.model.loader import default_model_path
    from conveyor.model.tokenizer import load_tokenizer

    path = default_model_path()
    cfg = load_gguf_checkpoint(path)["config"]
    cfg.pop("_model_name_or_path", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model.cuda()
    tok = load_tokenizer(path)
    prompts = []
    for text in ("What is the capital of France?", "Write a haiku about the sea.",
                 "Explain photosynthesis in one paragraph.", "Why is the sky blue?"):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok.encode(chat, add_special_tokens=False))
    return prompts, [greedy_tokens(model, p, NUM_TOKENS) for p in prompts]


def greedy_tokens(model, prompt: list[int], n: int) -> list[int]:
    """``n`` argmax tokens, EOS not special (as ``ignore_eos``), with transformers' KV cache."""
    device = next(model.parameters()).device
    tokens = []
    with torch.no_grad():
        res = model(torch.tensor([prompt], device=device), use_cache=True)
        for _ in range(n):
            tokens.append(int(res.logits[0, -1].argmax()))
            res = model(torch.tensor([[tokens[-1]]], device=device),
                        past_key_values=res.past_key_values, use_cache=True)
    return tokens


@pytest.fixture(scope="module")
def smollm2_fp32():
    return _llm()


def test_device_auto_picks_cuda_and_triton_attention(smollm2_fp32):
    ex = smollm2_fp32.llm_engine.executor
    assert ex.device.type == "cuda" and isinstance(ex.runner.backend, TritonBackend)
    auto = LLM(dtype="bfloat16", num_gpu_blocks=64).llm_engine.executor
    assert auto.device.type == "cuda" and auto.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", [
    {},
    {"policy": "chunked", "max_num_batched_tokens": 32, "long_prefill_token_threshold": 7,
     "max_num_partial_prefills": 2},
    {"num_gpu_blocks": 12, "preemption_mode": "recompute"},
    {"num_gpu_blocks": 12, "preemption_mode": "swap"},
    {"enforce_eager": True},
], ids=["graphs", "chunked", "preempt-recompute", "preempt-swap", "eager"])
def test_smollm2_greedy_equals_transformers(variant, smollm2_reference, smollm2_fp32):
    prompts, reference = smollm2_reference
    llm = smollm2_fp32 if not variant else _llm(**variant)
    assert _tokens(llm, prompts) == reference
    assert _tokens(llm, prompts) == reference  # again: whole prompts from the prefix cache


def test_cuda_graph_decode_equals_eager_bf16(smollm2_reference):
    prompts, _ = smollm2_reference
    graphs = _llm(dtype="bfloat16", max_num_seqs=16)
    eager = _llm(dtype="bfloat16", max_num_seqs=16, enforce_eager=True)
    batch = prompts * 3  # 12 sequences: padded to the ladder's 16
    assert _tokens(graphs, batch) == _tokens(eager, batch)
    assert graphs.llm_engine.executor.runner.graphs.graphs  # they were captured and used


def test_seeded_sampling_equals_eager(smollm2_reference):
    prompts, _ = smollm2_reference
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NUM_TOKENS, seed=7,
                            ignore_eos=True)
    graphs = _llm()
    eager = _llm(enforce_eager=True)
    assert _tokens(graphs, prompts, params) == _tokens(eager, prompts, params)


def test_kv_cache_sized_from_gpu_memory():
    free, total = torch.cuda.mem_get_info()
    used = total - free
    llm = LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5)
    engine = llm.llm_engine
    cache_bytes = engine.num_gpu_blocks * engine.executor.kv_cache_bytes_per_block(16)
    assert 0 < cache_bytes < 0.5 * total - used
    with pytest.raises(ValueError, match="no KV-cache block fits"):
        LLM(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.01)


def test_tiny_qwen3_greedy_equals_transformers(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=256, intermediate_size=384,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, tie_word_embeddings=False,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 128)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(tmp_path)
    ref.cuda()
    prompts = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 40, 17)]
    llm = _llm(str(tmp_path), max_num_seqs=4, num_gpu_blocks=64)
    assert _tokens(llm, prompts) == [greedy_tokens(ref, p, NUM_TOKENS) for p in prompts]


def test_swap_through_pinned_memory_round_trips():
    from conveyor.model.kv_cache import KVCache

    cache = KVCache(2, 2, 64, 16, num_blocks=8, num_cpu_blocks=6, dtype=torch.bfloat16,
                    device=torch.device("cuda"))
    assert cache.cpu_pool.is_pinned()
    cache.cache.copy_(torch.randn(cache.cache.shape, device="cuda"))
    original = cache.cache.clone()
    cache.swap_out([(1, 0), (2, 1), (3, 2), (6, 5)])
    cache.cache.zero_()
    cache.swap_in([(0, 4), (1, 5), (2, 6), (5, 7)])
    for src, dst in [(1, 4), (2, 5), (3, 6), (6, 7)]:
        assert torch.equal(cache.cache[:, :, dst], original[:, :, src])
