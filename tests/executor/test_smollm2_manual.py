"""SmolLM2 greedy decoding equals transformers, driven by hand-built SchedulerOutputs.

The hand-built steps give each sequence its own blocks and exercise what the executor must
handle whatever the scheduler does: swap out/in and block copies (one batch, chunked prefill,
prefix hits and preemption go through the real Scheduler in test_smollm2_scheduler.py).
"""

from __future__ import annotations

import pytest
import torch

from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler_output import SchedulerOutput
from conveyor.core.sequence import Sequence, SequenceGroup
from conveyor.model.kernels.block_matmul import block_matmul_available
from conveyor.model.layers.quantized import BlockPanels, Int8Blocks, NibbleInt4

pytestmark = pytest.mark.slow  # SmolLM2 in float32 against transformers

BLOCK = 16
NUM_TOKENS = 48  # as in conftest's reference_tokens


def _make_seqs(prompts: list[list[int]], params: SamplingParams):
    seqs, nxt = [], 0
    for i, ids in enumerate(prompts):
        group = SequenceGroup(f"r{i}", list(ids), params, 0, 0.0)
        seq = Sequence(i, group, 0, list(ids), len(ids))
        group.seqs.append(seq)
        need = (len(ids) + NUM_TOKENS + BLOCK - 1) // BLOCK
        seq.block_tables = [list(range(nxt, nxt + need))]
        nxt += need
        seqs.append(seq)
    return seqs


def _run(executor, seqs, max_tokens: int = NUM_TOKENS) -> list[list[int]]:
    """Step until each sequence has max_tokens outputs (whole prompts, then decodes)."""
    while True:
        active = [s for s in seqs if s.num_output_tokens < max_tokens]
        if not active:
            return [s.output_token_ids for s in seqs]
        counts = [len(s.token_ids) - s.num_computed_tokens for s in active]
        so = SchedulerOutput(seqs=active, num_new_tokens=counts)
        out = executor.execute(so)
        for s, n, toks in zip(active, counts, out.sampled_token_ids, strict=True):
            s.num_computed_tokens += n
            s.token_ids.extend(toks)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def test_gguf_weights_equal_transformers_loader(executor, hf_model) -> None:
    sd = hf_model.state_dict()
    ours = executor.model
    layer = ours.layers[3]
    p = "model.layers.3."
    qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(layer.qkv_proj.dense_weight(), qkv, rtol=0, atol=0)
    every_token = torch.arange(executor.model_config.vocab_size)
    torch.testing.assert_close(ours.embed(every_token), sd["model.embed_tokens.weight"],
                               rtol=0, atol=0)
    if block_matmul_available():  # float32: the file's Q8_0 embedding is the lookup table and the
        # lm_head's small-batch copy, the layers' Q4_1 blocks their small-batch copies (as
        # BlockPanels where they run: deterministic inference, the default)
        assert isinstance(ours.lm_head.method.small, (Int8Blocks, BlockPanels))
        assert ours.embed_tokens.weight is None
        assert isinstance(layer.qkv_proj.method.small, (NibbleInt4, BlockPanels))
    cfg = executor.model_config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert cfg.eos_token_ids == [2] and cfg.tie_word_embeddings
    assert executor.tokenizer.chat_template


def test_swap_out_in_and_block_copy(executor, prompt_ids, reference_tokens) -> None:
    executor.initialize_cache(BLOCK, 256, 64)
    seqs = _make_seqs(prompt_ids[:2], GREEDY)
    _run(executor, seqs, max_tokens=10)
    a = seqs[0]
    # Swap a's blocks out, scribble over them, swap them back into other device blocks.
    cpu = list(range(len(a.block_tables[0])))
    executor.execute(SchedulerOutput(blocks_to_swap_out=list(zip(a.block_tables[0], cpu, strict=True))))
    executor.kv_cache.cache[:, :, a.block_tables[0]] = 0
    moved = list(range(200, 200 + len(a.block_tables[0])))
    executor.execute(SchedulerOutput(blocks_to_swap_in=list(zip(cpu, moved, strict=True))))
    a.block_tables = [moved]
    # Copy b's blocks elsewhere (as copy-on-write would) and continue from the copies.
    b = seqs[1]
    copies = list(range(230, 230 + len(b.block_tables[0])))
    executor.execute(SchedulerOutput(blocks_to_copy=list(zip(b.block_tables[0], copies, strict=True))))
    executor.kv_cache.cache[:, :, b.block_tables[0]] = 0
    b.block_tables = [copies]
    assert _run(executor, seqs) == reference_tokens[:2]
