"""Hybrid KV-cache groups: full-attention and sliding-window groups over one block pool.

The layout rule (vLLM v1's), what each group holds during prefill and decode, admission counts,
prefix-cache hits across groups, preemption (recompute and swap), and n > 1 forks. Every run
goes through core_fakes.FakeExecutor, which checks each group's reads (tagged by group) and the
scheduler's invariants after every step.
"""

from __future__ import annotations

import pytest
from core_fakes import (
    FakeExecutor,
    check_invariants,
    hybrid_groups,
    make_scheduler,
    reference_outputs,
    run_to_completion,
    seq_limit,
    step,
)

from conveyor.core import prefix_hash
from conveyor.core.block_manager import NULL_BLOCK
from conveyor.core.config import CacheConfig
from conveyor.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    SlidingWindowSpec,
    kv_cache_groups,
    layer_slots,
    layers_per_group,
)
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.sequence import SequenceStatus as S

GEMMA3_270M_WINDOWS = [0 if (i + 1) % 6 == 0 else 512 for i in range(18)]


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n)


def live_blocks(table: list[int]) -> int:
    return sum(1 for b in table if b != NULL_BLOCK)


# ---------------------------------------------------------------------- layout


def test_gemma3_270m_layout_is_six_groups_of_three_layers():
    groups = kv_cache_groups(GEMMA3_270M_WINDOWS)
    assert len(groups) == 6 and layers_per_group(groups, 18) == 3
    assert groups[0] == KVCacheGroup(FullAttentionSpec(), (5, 11, 17))
    assert [g.spec for g in groups[1:]] == [SlidingWindowSpec(512)] * 5
    assert [g.layers for g in groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                              (14, 15, 16)]
    slots = layer_slots(groups, 18)
    assert slots[5] == (0, 0) and slots[17] == (0, 2) and slots[6] == (2, 2)
    assert sorted(groups[g].layers[s] for g, s in slots) == list(range(18))


def test_full_attention_model_is_one_group_of_every_layer():
    groups = kv_cache_groups([0] * 30)
    assert groups == (KVCacheGroup(FullAttentionSpec(), tuple(range(30))),)
    assert layers_per_group((), 30) == 30 and layer_slots((), 3) == [(0, 0), (0, 1), (0, 2)]
    assert CacheConfig(16, 10).specs == (FullAttentionSpec(),)


def test_group_size_is_the_gcd_of_the_layer_counts():
    groups = kv_cache_groups([0, 0, 0, 0, 8, 8, 8, 8, 8, 8])  # 4 full, 6 window -> 2 per group
    assert [len(g.layers) for g in groups] == [2] * 5
    assert [g.spec.sliding_window for g in groups] == [0, 0, 8, 8, 8]


@pytest.mark.parametrize(("groups", "message"), [
    ((KVCacheGroup(FullAttentionSpec(), (0,)), KVCacheGroup(SlidingWindowSpec(4), (1, 2))),
     "same number"),
    ((KVCacheGroup(FullAttentionSpec(), (0,)), KVCacheGroup(SlidingWindowSpec(4), (2,))),
     "exactly once"),
    ((KVCacheGroup(SlidingWindowSpec(4), (0,)), KVCacheGroup(FullAttentionSpec(), (1,))),
     "come first"),
])
def test_cache_config_rejects_bad_layouts(groups, message):
    with pytest.raises(ValueError, match=message):
        CacheConfig(4, 10, kv_cache_groups=groups)


def test_bad_window_is_rejected():
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowSpec(0)


# ---------------------------------------------------------------------- window release


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_window_groups_hold_constant_blocks_during_a_long_decode(policy):
    """bs 4, window 8: a window group holds at most 3 blocks once a step's blocks are computed,
    and, from the first decode boundary on, the pool's use grows only by the full-attention
    group's blocks."""
    groups = hybrid_groups(1, [8, 8])
    sched = make_scheduler(block_size=4, num_gpu_blocks=200, kv_cache_groups=groups,
                           policy=policy, long_prefill_token_threshold=8)
    bm = sched.block_manager
    assert bm.window_blocks(8) == 3
    sched.add_request("r", list(range(1, 41)), greedy(150))
    ex = FakeExecutor(sched)
    seq = sched.unfinished_groups()[0].seqs[0]
    window_use = []
    while sched.has_unfinished_requests():
        step(sched, ex)
        check_invariants(sched)
        if seq.status is not S.RUNNING or len(seq.token_ids) == seq.num_prompt_tokens:
            continue
        tables = seq.block_tables
        assert all(live_blocks(t) <= 3 for t in tables[1:]), tables
        used = bm.gpu.num_blocks - bm.gpu.num_free
        window_use.append(used - len(tables[0]))  # what the window groups hold
    # the 40-token prompt ends on a boundary: 2 blocks each until the first decode's block
    assert window_use[0] == 4 and set(window_use[1:]) == {6}  # 2 groups x 3 blocks
    assert seq.status is S.FINISHED_LENGTH_CAPPED and len(seq.output_token_ids) == 150


def test_chunked_prefill_holds_only_the_window_and_the_chunk():
    """An 8,000-token prompt (Gemma 3 270M layout, bs 16, window 512) in chunks of 512: each
    window group holds the previous window and the chunk, the full group every block."""
    groups = kv_cache_groups(GEMMA3_270M_WINDOWS)
    sched = make_scheduler(block_size=16, num_gpu_blocks=6 * 520, kv_cache_groups=groups,
                           policy="chunked", max_num_batched_tokens=512, max_model_len=8192,
                           prefix_caching=False)
    bm = sched.block_manager
    assert bm.num_new_blocks_to_admit(bm.no_hits(), 512) == 6 * 32
    assert bm.blocks_to_compute(8000, one_step=False) == 500 + 5 * 33
    assert bm.blocks_to_compute(8000, one_step=True) == 6 * 500
    sched.add_request("long", [7] * 8000, greedy(2))
    ex = FakeExecutor(sched)
    seq = sched.unfinished_groups()[0].seqs[0]
    peak = 0
    while seq.status is S.WAITING or seq.num_computed_tokens < 8000:
        step(sched, ex)
        held = max(live_blocks(t) for t in seq.block_tables[1:])
        peak = max(peak, held)
    assert peak <= 2 * 32 + 1  # the window before the chunk and the chunk's blocks
    assert len(seq.block_tables[0]) == 500
    assert all(live_blocks(t) <= 33 for t in seq.block_tables[1:])  # released after the chunk


def test_prefill_first_needs_every_group_in_one_step():
    """prefill_first computes a prompt at once, so each window group needs all its blocks: a
    prompt fits if 6 x its blocks fit; chunked needs only the full group's and the windows'."""
    groups = kv_cache_groups(GEMMA3_270M_WINDOWS)
    kw = {"block_size": 16, "num_gpu_blocks": 1000, "kv_cache_groups": groups,
          "max_num_batched_tokens": 8192, "max_model_len": 8192}
    one_step = make_scheduler(policy="prefill_first", **kw)
    chunked = make_scheduler(policy="chunked", **kw)
    assert one_step.max_seq_len == 1000 // 6 * 16
    assert chunked.block_manager.max_tokens(one_step=False) == (1000 - 5 * 33) * 16
    assert chunked.max_seq_len == 8192  # max_model_len
    for sched in (one_step, chunked):
        group = sched.add_request("p", [3] * 4000, greedy(1))
        ignored = group.seqs[0].status is S.FINISHED_IGNORED
        assert ignored == (sched is one_step)
        if ignored:
            assert "KV-cache blocks" in group.finish_message


# ---------------------------------------------------------------------- prefix cache


def _hybrid_sched(**kw):
    kw.setdefault("kv_cache_groups", hybrid_groups(1, [8, 4]))
    kw.setdefault("block_size", 4)
    kw.setdefault("num_gpu_blocks", 120)
    return make_scheduler(**kw)


def test_prefix_hit_spans_every_group_with_nulls_before_the_window():
    sched = _hybrid_sched()
    ex = FakeExecutor(sched)
    prompt = list(range(1, 42))  # 41 tokens: up to 10 full blocks may hit
    sched.add_request("a", prompt, greedy(3))
    run_to_completion(sched, ex, check=True)
    sched.add_request("b", prompt[:40] + [5, 6], greedy(3))
    out, _ = step(sched, ex)
    (b,) = out.seqs
    assert out.num_new_tokens == [2] and b.group.metrics.num_cached_tokens == 40
    tables = b.block_tables
    # window 8 reads positions 33..40 from position 40: blocks 8, 9 hit, 0..7 released
    assert tables[1][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in tables[1][8:]
    # window 4: positions 37..40: block 9 only
    assert tables[2][:9] == [NULL_BLOCK] * 9 and NULL_BLOCK not in tables[2][9:]
    refs = sched.block_manager.gpu.ref_counts
    assert all(refs[b] == 1 for t in tables for b in t if b != NULL_BLOCK)
    done = run_to_completion(sched, ex, check=True)
    assert done["b"].seqs[0].output_token_ids == reference_outputs(prompt[:40] + [5, 6],
                                                                  greedy(3), 256)[0]


def test_a_missing_window_block_shortens_the_hit():
    """Group 0 holds the whole prefix; a sliding-window group lost its block 9: the hit ends
    where that group still has every block its window needs (7 blocks: 5 and 6 are cached)."""
    sched = _hybrid_sched(kv_cache_groups=hybrid_groups(1, [8]))
    ex = FakeExecutor(sched)
    prompt = list(range(1, 42))
    sched.add_request("a", prompt, greedy(1))
    run_to_completion(sched, ex, check=True)
    bm = sched.block_manager
    b = sched.add_request("b", prompt, greedy(1)).seqs[0]
    hits = bm.find_cached_prefix(b)
    assert len(hits[0]) == 10
    bm.gpu._unregister(hits[1][9])  # evicted (its identity is gone)
    hits = bm.find_cached_prefix(b)
    assert [len(t) for t in hits] == [9, 9]  # blocks 7 and 8 still cover position 36's window
    bm.gpu._unregister(hits[1][7])
    hits = bm.find_cached_prefix(b)
    assert [len(t) for t in hits] == [7, 7] and hits[1][5:] != [NULL_BLOCK] * 2
    run_to_completion(sched, ex, check=True)


def test_window_blocks_are_verified_by_group_zeros_chain():
    """Same tokens after a different prefix: group 0 misses, so no window block is reused even
    though its own tokens match; and a block of one window group never serves another."""
    sched = _hybrid_sched()
    ex = FakeExecutor(sched)
    sched.add_request("a", [9] * 4 + list(range(1, 30)), greedy(1))
    run_to_completion(sched, ex, check=True)
    b = sched.add_request("b", [8] * 4 + list(range(1, 30)), greedy(1)).seqs[0]
    assert sched.block_manager.find_cached_prefix(b) == [[], [], []]
    run_to_completion(sched, ex, check=True)


def test_no_full_attention_group_means_no_prefix_cache():
    sched = _hybrid_sched(kv_cache_groups=hybrid_groups(0, [8, 8]))
    ex = FakeExecutor(sched)
    prompt = list(range(1, 30))
    sched.add_request("a", prompt, greedy(2))
    run_to_completion(sched, ex, check=True)
    b = sched.add_request("b", prompt, greedy(2)).seqs[0]
    assert not sched.block_manager.enable_prefix_caching
    assert sched.block_manager.find_cached_prefix(b) == [[], []]
    run_to_completion(sched, ex, check=True)


# ---------------------------------------------------------------------- preemption, n > 1


def test_swap_moves_only_the_live_window_blocks():
    sched = _hybrid_sched(num_gpu_blocks=40, num_cpu_blocks=60, preemption_mode="swap",
                          max_num_seqs=2)
    ex = FakeExecutor(sched)
    sched.add_request("a", list(range(1, 31)), greedy(40))
    step(sched, ex)
    step(sched, ex)
    (a,) = sched.running
    bm = sched.block_manager
    live = bm.num_live_blocks(a)
    # 31 computed: window 8 reads from 24 (blocks 6, 7), window 4 from 28 (block 7)
    assert live == 8 + 2 + 1
    sched.running.remove(a)
    sched.preempt(a)
    assert a.status is S.SWAPPED and len(sched.step_swap_out) == live
    assert a.cpu_block_tables[1].count(NULL_BLOCK) == 6
    run_to_completion(sched, ex, check=True)
    limit = seq_limit(sched.config, sched.cache_config)  # 52: prefill_first recomputes at once
    assert a.output_token_ids == reference_outputs(list(range(1, 31)), greedy(40), limit)[0]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_preemption_under_memory_pressure_gives_the_same_tokens(policy, mode):
    sched = _hybrid_sched(num_gpu_blocks=45, num_cpu_blocks=30, preemption_mode=mode,
                          policy=policy, max_num_seqs=4, long_prefill_token_threshold=6)
    prompts = {f"r{i}": [i + 1] * (10 + 3 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, greedy(30))
    done = run_to_completion(sched, check=True)
    assert sched.num_preemptions > 0
    limit = seq_limit(sched.config, sched.cache_config)
    for rid, prompt in prompts.items():
        assert done[rid].seqs[0].output_token_ids == reference_outputs(prompt, greedy(30), limit)[0]


def test_parallel_samples_share_every_group_and_copy_on_write_per_group():
    sched = _hybrid_sched()
    ex = FakeExecutor(sched)
    prompt = list(range(1, 8))  # 7 tokens: block 1 is partial and shared after the fork
    sched.add_request("n3", prompt, greedy(12, n=3))
    step(sched, ex)
    (group,) = sched.unfinished_groups()
    parent = group.seqs[0]
    refs = sched.block_manager.gpu.ref_counts
    assert all(s.block_tables == parent.block_tables for s in group.seqs)
    assert all(refs[b] == 3 for t in parent.block_tables for b in t if b != NULL_BLOCK)
    assert parent.block_tables[2][0] == NULL_BLOCK  # window 4 from position 7 reads block 1
    step(sched, ex)  # each sample writes position 7: block 1 is copied in every group
    for g in range(3):
        assert len({s.block_tables[g][1] for s in group.seqs}) == 3
        assert len({s.block_tables[g][0] for s in group.seqs}) == 1
    check_invariants(sched)
    done = run_to_completion(sched, ex, check=True)
    want = reference_outputs(prompt, greedy(12, n=3), 256)
    assert [s.output_token_ids for s in done["n3"].seqs] == want
    assert sched.block_manager.gpu.num_free == 120


def test_hash_collisions_never_reuse_wrong_kv_in_any_group(monkeypatch):
    """Every block of every group hashes alike: the verified keys (group 0's identity of the
    same index, the group, the tokens) still never hand out wrong K/V (FakeExecutor's reads)."""
    monkeypatch.setattr(prefix_hash, "hash_block", lambda parent, tokens: 42)
    sched = _hybrid_sched(num_gpu_blocks=90)
    ex = FakeExecutor(sched)
    base = list(range(1, 30))
    prompts = {"a": base, "b": base[:20] + [7] * 9, "c": [3] * 4 + base[4:], "d": base,
               "e": base[:13]}
    for rid, prompt in prompts.items():
        sched.add_request(rid, prompt, greedy(6))
        run_to_completion(sched, ex, check=True)
    for rid, prompt in prompts.items():  # all at once too: same-step sharing
        sched.add_request(rid, prompt, greedy(6))
    done = run_to_completion(sched, ex, check=True)
    for rid, prompt in prompts.items():
        assert done[rid].seqs[0].output_token_ids == reference_outputs(prompt, greedy(6), 256)[0]


def test_lora_roots_key_every_group():
    """A prefix computed under one LoRA adapter hits only under that adapter, in every group."""
    sched = _hybrid_sched()
    ex = FakeExecutor(sched)
    prompt = list(range(1, 30))
    sched.add_request("a", prompt, greedy(2), lora_id=1)
    run_to_completion(sched, ex, check=True)
    bm = sched.block_manager
    base = sched.add_request("base", prompt, greedy(2)).seqs[0]
    other = sched.add_request("other", prompt, greedy(2), lora_id=2).seqs[0]
    same = sched.add_request("same", prompt, greedy(2), lora_id=1).seqs[0]
    assert bm.find_cached_prefix(base) == bm.find_cached_prefix(other) == [[], [], []]
    hits = bm.find_cached_prefix(same)
    assert [len(t) for t in hits] == [7, 7, 7] and hits[1][4:] != [NULL_BLOCK] * 3
    run_to_completion(sched, ex, check=True)
