"""The engine on a hybrid KV cache: a tiny random Gemma 3 (six layers, every third global, window
8, blocks of 4 tokens: KV-cache groups of two layers, one global and two sliding-window) runs on
three groups. Its greedy tokens equal transformers'; prefix-cache hits, chunked prefill,
preemption by recompute and by swap, and n > 1 leave every request's tokens as a plain run's;
a long decode keeps each window group at a window's blocks while the global group grows; the
engine sizes the cache in blocks of two layers."""

from __future__ import annotations

import pytest
import torch

from conveyor.core.block_manager import NULL_BLOCK
from conveyor.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.llm_engine import LLMEngine, _num_blocks
from conveyor.executor.model_executor import ModelExecutor
from engine_runs import run_to_end
from tiny_models import VOCAB, save_hybrid_gemma3

WINDOW, BLOCK = 8, 4
WINDOW_BLOCKS = -(-(WINDOW - 1) // BLOCK) + 1  # blocks a window group holds once computed
NEW_TOKENS = 10
GROUPS = (KVCacheGroup(FullAttentionSpec(), (2, 5)), KVCacheGroup(SlidingWindowSpec(WINDOW), (0, 1)),
          KVCacheGroup(SlidingWindowSpec(WINDOW), (3, 4)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_hybrid"))
    return path, save_hybrid_gemma3(path, WINDOW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Four prompts sharing a 20-token prefix (five blocks, past the window), and a short one."""
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(3, VOCAB, (20,), generator=gen).tolist()
    tails = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 9, 21)]
    return [shared + t for t in tails] + [torch.randint(3, VOCAB, (5,), generator=gen).tolist()]


def reference_tokens(ref, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False)
    return out[0, len(prompt):].tolist()


def executor(path: str, backend: str, monkeypatch: pytest.MonkeyPatch | None = None
             ) -> ModelExecutor:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_BACKEND", backend)
        return ModelExecutor(path, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def cpu_executor(model) -> ModelExecutor:
    return executor(model[0], "cpu")


def engine(ex: ModelExecutor, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_gpu_blocks", 256)
    kwargs.setdefault("max_num_seqs", 4)
    eng = LLMEngine(EngineArgs(dtype="float32", device="cpu", block_size=BLOCK,
                               max_model_len=256, **kwargs), executor=ex)
    assert eng.scheduler.cache_config.kv_cache_groups == GROUPS
    return eng


def requests(prompts: list[list[int]]) -> list[tuple[dict, SamplingParams]]:
    """Greedy requests, and one of two seeded samples."""
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=NEW_TOKENS,
                             ignore_eos=True)
    return ([({"prompt_token_ids": p}, greedy) for p in prompts]
            + [({"prompt_token_ids": prompts[1]}, sampled)])


def tokens(eng: LLMEngine, prompts: list[list[int]], prefix: str = "") -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in out.outputs]
            for out in run_to_end(eng, requests(prompts), prefix)]


def test_layout_cache_and_sizing(cpu_executor: ModelExecutor) -> None:
    """Three groups of two layers; a block holds two layers' K/V, so a byte budget holds three
    times the blocks of one group of all six layers; each layer reads its own slot."""
    ex = cpu_executor
    assert ex.kv_cache_groups == GROUPS
    per_block = ex.kv_cache_bytes_per_block(BLOCK)
    assert per_block == 2 * 2 * BLOCK * 2 * 16 * 4  # 2 layers, K and V, 2 KV heads of 16, fp32
    args = EngineArgs(dtype="float32", device="cpu", block_size=BLOCK, kv_cache_memory=2**20)
    assert _num_blocks(args, ex)[0] == 2**20 // per_block
    eng = engine(ex)
    cache = ex.kv_cache
    assert cache.cache.shape[:3] == (2, 2, 256)
    for layer, slot in enumerate([0, 1, 0, 0, 1, 1]):
        assert cache.layers[layer][0].data_ptr() == cache.cache[slot, 0].data_ptr()
    assert eng.num_gpu_blocks == 256


def test_greedy_tokens_equal_transformers(model, cpu_executor: ModelExecutor, prompts) -> None:
    """The default backend, whole prompts (prefill_first), then TorchBackend in chunks of 6."""
    path, ref = model
    want = [reference_tokens(ref, p, NEW_TOKENS) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [({"prompt_token_ids": p}, greedy) for p in prompts]
    got = run_to_end(engine(cpu_executor), reqs)
    assert [list(o.outputs[0].token_ids) for o in got] == want
    torch_ex = executor(path, "torch")
    assert torch_ex.model.backend.name == "torch"
    got = run_to_end(engine(torch_ex, policy="chunked", max_num_batched_tokens=6), reqs)
    assert [list(o.outputs[0].token_ids) for o in got] == want


def test_features_leave_tokens_unchanged(cpu_executor: ModelExecutor, prompts) -> None:
    """Against a plain run (whole prompts, nothing cached, room for everything): chunked prefill
    with the prefix cache (a second run hits past the window), and preemption by recompute and
    by swap in a cache too small for all at once; with n = 2 seeded samples among them."""
    plain = tokens(engine(cpu_executor, enable_prefix_caching=False), prompts)

    chunked = engine(cpu_executor, policy="chunked", max_num_batched_tokens=7)
    assert tokens(chunked, prompts) == plain
    outs = run_to_end(chunked, requests(prompts), "again")
    assert min(o.num_cached_tokens for o in outs[:3]) >= 2 * WINDOW  # the shared prefix's blocks
    assert [[list(c.token_ids) for c in o.outputs] for o in outs] == plain

    for mode in ("recompute", "swap"):
        # the longest request needs 13 blocks in each group for its one prefill step
        eng = engine(cpu_executor, num_gpu_blocks=40, preemption_mode=mode, swap_space=0.01)
        assert tokens(eng, prompts) == plain, mode
        assert eng.get_stats().scheduler.num_preemptions > 0, mode


def test_long_decode_keeps_window_groups_constant(model, cpu_executor: ModelExecutor) -> None:
    """A 6-token prompt decoding 90 tokens (eleven windows): after every step each window group
    holds at most a window's blocks + 1 while the global group holds every block; the tokens
    are transformers'."""
    _, ref = model
    prompt = [5, 9, 11, 40, 41, 7]
    new = 90
    eng = engine(cpu_executor, enable_prefix_caching=False)
    eng.add_request("long", {"prompt_token_ids": prompt},
                    SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    live: list[tuple[int, ...]] = []
    pool = eng.scheduler.block_manager.gpu
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final = out
        for seq in eng.scheduler.running:
            if seq.status.is_finished:
                continue
            tables = seq.block_tables
            assert len({len(t) for t in tables}) == 1
            assert NULL_BLOCK not in tables[0]
            window = [sum(b != NULL_BLOCK for b in t) for t in tables[1:]]
            assert max(window) <= WINDOW_BLOCKS + 1
            live.append((len(tables[0]), *window))
            assert pool.num_blocks - pool.num_free == len(tables[0]) + sum(window)
    assert live[-1][0] == -(-(len(prompt) + new - 1) // BLOCK)  # the last token is not stored
    assert {w for row in live[20:] for w in row[1:]} <= {WINDOW_BLOCKS, WINDOW_BLOCKS + 1}
    assert list(final.outputs[0].token_ids) == reference_tokens(ref, prompt, new)
