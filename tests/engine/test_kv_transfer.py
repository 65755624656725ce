"""The prefill-to-decode handoff without Ray, on the real model (SmolLM2, float32): a producer
engine prefills with max_tokens=1, its prompt blocks are read out right after that step
(HandoffExporter), encoded and handed to a consumer engine, which loads them instead of
computing them and decodes the rest. Greedy and seeded tokens equal a plain run's; a corrupt
block is computed instead; blocks held for a request are dropped when it ends; bad set-ups are
refused."""

from __future__ import annotations

import copy
import random

import pytest

from conveyor.core.kv_connector.inbound import InboundKVScheduler
from conveyor.core.kv_connector.keys import BlockRecord
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.kv_transfer import HandoffExporter, StoredBlock, encode_blocks
from conveyor.engine.llm_engine import LLMEngine
from conveyor.entrypoints.ray_serve.pd_handoff import (
    decode_params,
    prefill_params,
    splittable,
)
from engine_runs import run_to_end

BLOCK = 16


def make_engine(llm, **kwargs) -> LLMEngine:
    args = EngineArgs(num_gpu_blocks=24, block_size=BLOCK, max_model_len=256, max_num_seqs=4,
                      max_num_batched_tokens=256, seed=0, dtype="float32", **kwargs)
    return LLMEngine(args, executor=copy.copy(llm.llm_engine.executor))


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(48)
    return [rng.randrange(100, 40000) for _ in range(3 * BLOCK + 5)]


@pytest.fixture(scope="module")
def engines(llm):
    producer = make_engine(llm, kv_transfer="producer")
    consumer = make_engine(llm, kv_transfer="consumer")
    yield producer, consumer
    producer.shutdown()
    consumer.shutdown()


def prefill(producer: LLMEngine, prompt: list[int], params: SamplingParams, rid: str):
    """Run the prefill half; (its output, the stored blocks read out after its last step)."""
    exporter = HandoffExporter(producer.kv_transfer)
    future = exporter.expect(rid)
    producer.add_request(rid, {"prompt_token_ids": prompt}, prefill_params(params))
    final = None
    while producer.has_unfinished_requests():
        outs = producer.step()
        exporter.observe(outs, 0.0)
        final = next((o for o in outs if o.finished), final)
    exported = future.result(timeout=0)
    return final, encode_blocks(exported)


def decode(consumer: LLMEngine, prompt: list[int], first: int, params: SamplingParams,
           blocks: list[StoredBlock], rid: str):
    consumer.kv_transfer.receive(rid, blocks)
    try:
        (out,) = run_to_end(consumer, [({"prompt_token_ids": prompt + [first]},
                                        decode_params(params))], rid)
    finally:
        consumer.kv_transfer.release(rid)
    return out


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_handoff_gives_the_tokens_of_a_plain_run(llm, engines, prompt, params):
    producer, consumer = engines
    plain = make_engine(llm)
    (expected,) = run_to_end(plain, [({"prompt_token_ids": prompt}, params)], "plain")
    first_out, blocks = prefill(producer, prompt, params, f"p-{params.seed}")
    assert first_out.outputs[0].finish_reason == "length"
    assert [b.record.token_ids for b in blocks] == [tuple(prompt[j * BLOCK:(j + 1) * BLOCK])
                                                    for j in range(3)]
    first = first_out.outputs[0].token_ids[0]
    assert consumer.reset_prefix_cache()  # the other case's blocks would be pool hits
    before = consumer.get_stats()
    out = decode(consumer, prompt, first, params, blocks, f"d-{params.seed}")
    assert [first] + out.outputs[0].token_ids == expected.outputs[0].token_ids
    after = consumer.get_stats()
    assert after.kv_transfer.loaded_blocks - before.kv_transfer.loaded_blocks == 3
    # the decode side computed only its tail: the prompt's last 5 tokens and the first token
    assert after.prompt_tokens_total - before.prompt_tokens_total == 6
    assert after.kv_transfer.held_blocks == 0
    assert len(consumer.kv_transfer._store) == 0


def test_a_corrupt_block_is_computed_instead(llm, engines, prompt):
    producer, consumer = engines
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    consumer.reset_prefix_cache()
    first_out, blocks = prefill(producer, prompt, params, "pc")
    bad = bytearray(bytes(blocks[1].payload))
    bad[100] ^= 0xFF
    blocks[1] = StoredBlock(blocks[1].record, blocks[1].header, bad)
    first = first_out.outputs[0].token_ids[0]
    before = consumer.get_stats()
    out = decode(consumer, prompt, first, params, blocks, "dc")
    (expected,) = run_to_end(make_engine(llm), [({"prompt_token_ids": prompt}, params)], "pl")
    assert [first] + out.outputs[0].token_ids == expected.outputs[0].token_ids
    after = consumer.get_stats()
    assert after.kv_transfer.loaded_blocks - before.kv_transfer.loaded_blocks == 1
    assert after.kv_transfer.lost_blocks - before.kv_transfer.lost_blocks == 1
    assert after.prompt_tokens_total - before.prompt_tokens_total == 2 * BLOCK + 6


def test_an_aborted_request_drops_its_blocks(engines, prompt):
    producer, consumer = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first_out, blocks = prefill(producer, prompt, params, "pa")
    consumer.kv_transfer.receive("da", blocks)
    consumer.add_request("da", {"prompt_token_ids": prompt + [5]}, decode_params(params))
    consumer.step()
    consumer.step()
    consumer.abort_request("da")
    consumer.kv_transfer.release("da")
    while consumer.has_unfinished_requests():
        consumer.step()
    stats = consumer.get_stats()
    assert stats.kv_transfer.held_blocks == 0 and len(consumer.kv_transfer._store) == 0
    assert stats.scheduler.num_free_blocks == stats.scheduler.num_total_blocks


def test_a_request_stopped_at_its_first_token_exports_nothing(engines, prompt):
    producer, _ = engines
    exporter = HandoffExporter(producer.kv_transfer)
    future = exporter.expect("s")
    producer.add_request("s", {"prompt_token_ids": prompt},
                         SamplingParams(temperature=0, max_tokens=1, stop_token_ids=list(
                             range(50000))))
    while producer.has_unfinished_requests():
        exporter.observe(producer.step(), 0.0)
    assert future.result(timeout=0) is None


def test_offers_are_shared_and_checked():
    inbound = InboundKVScheduler(BLOCK)
    a = BlockRecord(b"a" * 16, b"r" * 16, (1,) * BLOCK)
    b = BlockRecord(b"b" * 16, a.key, (2,) * BLOCK)
    inbound.offer("x", [a, b])
    inbound.offer("y", [a])
    assert inbound.lookup([a, b]) == [a, b]
    assert inbound.lookup([BlockRecord(a.key, a.parent, (3,) * BLOCK)]) == []
    with pytest.raises(ValueError, match="offered already"):
        inbound.offer("x", [a])
    assert inbound.withdraw("x") == [b.key]
    assert inbound.withdraw("y") == [a.key]
    assert inbound.stats.held_blocks == 0


def test_split_params():
    p = SamplingParams(max_tokens=10, min_tokens=3, seed=1, temperature=0.5)
    assert (prefill_params(p).max_tokens, prefill_params(p).min_tokens) == (1, 1)
    assert (decode_params(p).max_tokens, decode_params(p).min_tokens) == (9, 2)
    assert decode_params(SamplingParams(max_tokens=None)).max_tokens is None
    assert splittable(p)
    assert not splittable(SamplingParams(max_tokens=1))
    assert not splittable(SamplingParams(n=2))
    assert not splittable(SamplingParams(presence_penalty=0.5))


def test_bad_setups_are_refused(llm):
    with pytest.raises(ValueError, match="do not combine"):
        make_engine(llm, kv_transfer="consumer", kv_offload_cpu_bytes=10**7)
    with pytest.raises(ValueError, match="kv_transfer must be"):
        make_engine(llm, kv_transfer="both")
    with pytest.raises(ValueError, match="needs --enable-prefix-caching"):
        make_engine(llm, kv_transfer="producer", enable_prefix_caching=False)
    plain = make_engine(llm)
    assert plain.kv_transfer is None
