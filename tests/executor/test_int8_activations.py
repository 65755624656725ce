"""SmolLM2 with ``int8_activations`` (bf16, GGUF blocks multiplied as integers where the CPU has
AVX512-VNNI): used where asked, and how far its logits move from the float32 model's, teacher
forced over the chat prompts and transformers' greedy continuations, against plain bf16's."""

from __future__ import annotations

import pytest
import torch

from conveyor.executor.model_executor import ModelExecutor
from conveyor.model.device import select_kernels
from conveyor.model.layers.block_method import Int8PanelMethod
from conveyor.model.layers.linear import PanelMethod

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not select_kernels(torch.device("cpu"), torch.bfloat16, 64, int8_activations=True).int8_panels,
    reason="int8 panels need bf16 panels and a compiler targeting AVX512-VNNI")]


def all_logits(ex: ModelExecutor, seqs: list[list[int]]) -> torch.Tensor:
    """Logits at every position of ``seqs``, computed as one prefill step, in float32."""
    block_size = 16
    ex.initialize_cache(block_size, sum(-(-len(s) // block_size) for s in seqs))
    tables, first = [], 0
    for s in seqs:
        n = -(-len(s) // block_size)
        tables.append(list(range(first, first + n)))
        first += n
    meta = ex.model.backend.build_metadata(tables, [0] * len(seqs), [len(s) for s in seqs],
                                           block_size, ex.model_config.num_queries_per_kv,
                                           ex.dtype)
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.inference_mode():
        return ex.model(ids, meta.positions, ex.kv_cache.layers, meta,
                        torch.arange(len(ids))).float()


def test_int8_activations_stay_close_to_float32(executor, prompt_ids, reference_tokens):
    seqs = [p + r for p, r in zip(prompt_ids, reference_tokens, strict=True)]
    reference = all_logits(executor, seqs).log_softmax(-1)
    measured = {}
    for int8 in (False, True):
        ex = ModelExecutor(dtype="bfloat16", device="cpu", int8_activations=int8)
        layer = ex.model.layers[0]
        assert isinstance(layer.gate_up_proj.method.large, Int8PanelMethod) == int8
        assert isinstance(ex.model.lm_head.method.large, PanelMethod)  # logits stay bf16 products
        qkv = layer.qkv_proj.method.large
        assert (isinstance(qkv, Int8PanelMethod) and qkv.int8.exact is not None) == int8
        assert ex.model.fused_decode.serves(64)  # any decode batch runs in one call either way
        got = all_logits(ex, seqs).log_softmax(-1)
        kl = (reference.exp() * (reference - got)).sum(-1).mean().item()
        top1 = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
        measured[int8] = kl, top1
        print(f"int8_activations={int8}: KL {kl:.5f}, top-1 agreement {top1:.4f}")
        del ex
    # Measured on a Zen 4: bf16 KL 0.0013, top-1 agreement 97.9%; int8 0.0042, 96.3% (with an
    # int8 lm_head 0.0037, 95.9%; without calibration.py's exact channels too 0.0053, 96.4%;
    # llama.cpp 0.0034, 98.1%). Over 4,096 positions of docs/ text, the int8 lm_head's rounding
    # was most of the difference from bf16 (docs/performance.md).
    assert measured[False][0] < 0.004 and measured[False][1] > 0.97
    assert measured[True][0] < 0.006 and measured[True][1] > 0.94
    assert measured[True][0] > measured[False][0]  # the rounding is not free
