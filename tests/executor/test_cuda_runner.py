"""The CUDA path's Python without a GPU: the graph ladder and padding, decode input
preparation, GPU memory sizing from given numbers, swap-run planning, and the runner's eager
forward (Triton attention, in the interpreter) against transformers on a tiny random Llama."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first imported

from conveyor.core.step_input import StepInput  # noqa: E402
from conveyor.executor.cuda_graphs import (  # noqa: E402
    graph_batch_sizes,
    padded_batch_size,
    prepare_decode_inputs,
)
from conveyor.executor.gpu_memory import (  # noqa: E402
    activation_bytes,
    gpu_kv_cache_blocks,
)
from conveyor.model.backends.triton_kernels import TritonBackend  # noqa: E402
from conveyor.model.kv_cache import KVCache, contiguous_runs  # noqa: E402

GiB = 2**30


def test_graph_ladder_and_padding():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(2000)[-1] == 512
    sizes = graph_batch_sizes(64)
    assert [padded_batch_size(n, sizes) for n in (1, 3, 8, 9, 17, 64)] == [1, 4, 8, 16, 32, 64]
    assert padded_batch_size(65, sizes) is None


def test_prepare_decode_inputs_pads_rows_that_neither_write_nor_attend():
    inputs = prepare_decode_inputs([5, 6, 7], [16, 3, 40], [[2, 1], [0], [9, 4, 5]],
                                   block_size=16, batch_size=4, width=6)
    assert inputs.input_ids.tolist() == [5, 6, 7, 0]
    assert inputs.positions.tolist() == [16, 3, 40, 0]
    assert inputs.slot_mapping.tolist() == [16, 3, 88, -1]
    assert inputs.seq_lens.tolist() == [17, 4, 41, 0]
    assert inputs.block_tables.tolist() == [[2, 1, 0, 0, 0, 0], [0] * 6, [9, 4, 5, 0, 0, 0],
                                            [0] * 6]
    with pytest.raises(ValueError, match="do not fit"):
        prepare_decode_inputs([1, 2], [0, 0], [[0], [1]], 16, batch_size=1, width=2)
    with pytest.raises(ValueError, match="longer than"):
        prepare_decode_inputs([1], [0], [[0, 1, 2]], 16, batch_size=1, width=2)


def test_triton_metadata_decodes_then_chunks():
    backend = TritonBackend(torch.device("cpu"))
    backend.plan_decode(128, 1, graph_batch_sizes(4))
    meta = backend.build_metadata([[3, 4], [1, 2], [7, 8, 9]], [5, 2, 9], [1, 4, 3], 4, 1,
                                  torch.float32)
    assert meta.num_decodes == 1 and meta.max_query_len == 4
    assert meta.positions.tolist() == [5, 2, 3, 4, 5, 9, 10, 11]
    assert meta.slot_mapping.tolist() == [17, 6, 7, 8, 9, 37, 38, 39]
    assert meta.seq_lens.tolist() == [6, 6, 12]
    assert meta.prefill_query_start.tolist() == [0, 4, 7]
    assert meta.block_tables.tolist() == [[3, 4, 0], [1, 2, 0], [7, 8, 9]]
    with pytest.raises(ValueError, match="single-token entries first"):
        backend.build_metadata([[0], [1]], [0, 0], [3, 1], 4, 1, torch.float32)


def test_gpu_memory_sizing():
    # 80 GiB card, 10 GiB in use (weights), 0.9 allowed, 2 GiB kept: 60 GiB of 2 MiB blocks
    blocks = gpu_kv_cache_blocks(free=70 * GiB, total=80 * GiB, utilization=0.9,
                                 bytes_per_block=2 * 2**20, reserved=2 * GiB)
    assert blocks == 60 * 512
    # what another process holds counts against the budget too
    assert gpu_kv_cache_blocks(50 * GiB, 80 * GiB, 0.9, 2 * 2**20, 2 * GiB) == 40 * 512
    with pytest.raises(ValueError, match="no KV-cache block fits"):
        gpu_kv_cache_blocks(10 * GiB, 80 * GiB, 0.9, 2 * 2**20, 2 * GiB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        gpu_kv_cache_blocks(70 * GiB, 80 * GiB, 1.5, 2 * 2**20, 0)
    small = activation_bytes(256, 8, 576, 1536, 49152, 2)
    assert activation_bytes(4096, 8, 576, 1536, 49152, 2) > small > 8 * 49152 * 4


def test_swap_runs_coalesce_consecutive_blocks():
    assert contiguous_runs([(4, 0), (5, 1), (6, 2), (9, 3), (2, 7), (3, 8)]) == [
        (2, 7, 2), (4, 0, 3), (9, 3, 1)]
    assert contiguous_runs([]) == []
    # the runs, copied per layer and K/V, move exactly the listed blocks
    src = torch.randn(2, 2, 10, 4, 1, 8)
    dst = torch.zeros(2, 2, 9, 4, 1, 8)
    pairs = [(4, 0), (5, 1), (6, 2), (9, 3), (2, 7), (3, 8)]
    KVCache._copy_runs(pairs, src, dst)
    for s, d in pairs:
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert not dst[:, :, 4:7].any()


def _tiny_llama(path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=160,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, 96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(path)
    return model


@pytest.mark.slow
def test_eager_runner_matches_transformers(tmp_path, monkeypatch):
    """Chunked prefill, a mixed decode + chunk step and a decode-only step through the
    runner on the Triton backend (head_dim 64, GQA 2): each sampled row's logits equal
    transformers' at that position."""
    from conveyor.executor.model_executor import ModelExecutor

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # else interpreted
    monkeypatch.setenv("CONVEYOR_BACKEND", "triton")
    ref = _tiny_llama(tmp_path)
    ex = ModelExecutor(str(tmp_path), dtype="float32", device=device.type, max_num_seqs=4,
                       enforce_eager=True)
    ex.initialize_cache(block_size=8, num_gpu_blocks=12)
    runner, cache = ex.runner, ex.kv_cache
    assert isinstance(runner.backend, TritonBackend) and runner.graphs is None
    gen = torch.Generator().manual_seed(1)
    seq_a = torch.randint(3, 96, (22,), generator=gen).tolist()
    seq_b = torch.randint(3, 96, (16,), generator=gen).tolist()
    with torch.no_grad():
        want_a = ref(torch.tensor([seq_a])).logits[0]
        want_b = ref(torch.tensor([seq_b])).logits[0]
    table_a, table_b = [5, 2, 9], [0, 7]

    def step(entries):
        """entries: (seq, table, start, count), decodes first; logits of each entry's last row."""
        ids, last = [], []
        for seq, _, start, count in entries:
            ids += seq[start:start + count]
            last.append(len(ids) - 1)
        return runner.forward(StepInput(input_ids=ids, starts=[e[2] for e in entries],
                                          counts=[e[3] for e in entries],
                                          block_tables=[e[1] for e in entries],
                                          logits_indices=last))

    def check(got, wants):
        torch.testing.assert_close(got.cpu(), torch.stack(wants), atol=2e-4, rtol=2e-4)

    check(step([(seq_a, table_a, 0, 12), (seq_b, table_b, 0, 13)]), [want_a[11], want_b[12]])
    check(step([(seq_b, table_b, 13, 1), (seq_a, table_a, 12, 8)]), [want_b[13], want_a[19]])
    check(step([(seq_a, table_a, 20, 1), (seq_b, table_b, 14, 1)]), [want_a[20], want_b[14]])

    # What a CUDA graph replays: the decode forward over inputs padded to a ladder size with
    # the graphs' fixed split count. Padded rows write no K/V and leave real rows alone.
    inputs = prepare_decode_inputs([seq_a[21], seq_b[15]], [21, 15], [table_a, table_b],
                                   block_size=8, batch_size=4, width=16)
    slots = [table_a[21 // 8] * 8 + 21 % 8, table_b[15 // 8] * 8 + 15 % 8]
    before = cache.cache.clone()
    logits = runner._decode_forward(*(t.to(device) for t in (
        inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.block_tables,
        inputs.seq_lens)))
    assert logits.shape[0] == 4
    check(logits[:2], [want_a[21], want_b[15]])
    changed = (cache.cache != before).flatten(4).any(-1).any(0).any(0).flatten()
    assert sorted(changed.nonzero().flatten().cpu().tolist()) == sorted(slots)


def test_engine_sizes_a_cuda_cache_from_mem_get_info(monkeypatch):
    """The engine's block count on CUDA: gpu_memory_utilization of what mem_get_info reports,
    less what is in use and the activation reserve; a kv_cache_memory in bytes still wins."""
    from types import SimpleNamespace

    from conveyor.distributed.group import ParallelConfig
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm_engine import _num_blocks
    from conveyor.executor.gpu_memory import GRAPH_AND_WORKSPACE_BYTES
    from conveyor.model.config import ModelConfig

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GiB, 80 * GiB))
    config = SimpleNamespace(hidden_size=576, intermediate_size=1536, vocab_size=49152)
    executor = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16,
                               model_config=config, parallel=ParallelConfig(),
                               kv_cache_groups=(),
                               kv_cache_bytes_per_block=lambda block_size: 2**20)
    args = EngineArgs(gpu_memory_utilization=0.5, max_num_batched_tokens=2048, max_num_seqs=8)
    reserved = GRAPH_AND_WORKSPACE_BYTES + activation_bytes(2048, 8, 576, 1536, 49152, 2)
    assert _num_blocks(args, executor) == (((40 - 10) * GiB - reserved) // 2**20, 0)
    assert _num_blocks(args.replace(kv_cache_memory=5 * 2**20), executor) == (5, 0)
    assert _num_blocks(args.replace(preemption_mode="swap", swap_space=1.0), executor)[1] == 1024
    assert {"hidden_size", "intermediate_size", "vocab_size"} <= set(
        ModelConfig.__dataclass_fields__)


def test_cpu_executor_keeps_the_cpu_path():
    from conveyor.model.device import use_triton_attention

    assert not use_triton_attention(torch.device("cpu"), 64)
    assert use_triton_attention(torch.device("cuda"), 64)
    assert not use_triton_attention(torch.device("cuda"), 96)  # not a power of two


def test_decode_splits_follow_the_padded_batch_with_or_without_graphs():
    """Eager decode uses the split count of the graph its batch would pad to, so graph replays
    and eager steps reduce alike (bit-equal tokens)."""
    backend = TritonBackend(torch.device("cpu"))
    backend.plan_decode(8192, 3, graph_batch_sizes(64))
    assert backend.decode_splits(12) == backend.decode_splits(16) != backend.decode_splits(4)
    assert backend.decode_splits(1) == 16  # one long sequence alone: the most splits
