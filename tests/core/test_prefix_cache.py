"""Prefix caching: hits for identical and partially shared prompts, same-step sharing, verified
hits under hash collisions, LRU eviction, and counters that count only skipped tokens."""

from __future__ import annotations

from core_fakes import FakeExecutor, make_scheduler, run_to_completion, step

from conveyor.core import prefix_hash
from conveyor.core.sampling_params import SamplingParams

SP = SamplingParams(max_tokens=3, ignore_eos=True)


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 31 + salt * 1009) % 5000 + 1 for i in range(n)]


def test_identical_prompt_later_reuses_all_blocks_but_the_last_token():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    prompt = _prompt(18)  # 4 full blocks + 2 tokens
    sched.add_request("a", prompt, SP)
    run_to_completion(sched, ex)
    assert sched.stats.prefix_cache_queries == 18 and sched.stats.prefix_cache_hits == 0
    sched.add_request("b", prompt, SP)
    out = sched.schedule()
    assert out.num_new_tokens == [2] and out.seqs[0].num_computed_tokens == 16
    assert out.seqs[0].group.metrics.num_cached_tokens == 16
    assert sched.stats.prefix_cache_queries == 36 and sched.stats.prefix_cache_hits == 16
    sched.update(out, ex.execute(out))


def test_block_aligned_prompt_still_computes_its_last_token():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    prompt = _prompt(16)
    sched.add_request("a", prompt, SP)
    run_to_completion(sched, ex)
    sched.add_request("b", prompt, SP)
    out = sched.schedule()
    # the last block holds the last token: it is recomputed (4 tokens), 3 blocks are hits
    assert out.num_new_tokens == [4] and sched.stats.prefix_cache_hits == 12
    sched.update(out, ex.execute(out))


def test_partially_shared_prompts_hit_the_common_full_blocks():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    base = _prompt(12)
    sched.add_request("a", base + [7, 7, 7, 7, 7], SP)
    run_to_completion(sched, ex)
    sched.add_request("b", base[:10] + [9, 9, 9, 9], SP)  # shares 2 full blocks (8 tokens)
    out = sched.schedule()
    assert out.seqs[0].num_computed_tokens == 8 and out.num_new_tokens == [6]
    assert sched.stats.prefix_cache_hits == 8
    sched.update(out, ex.execute(out))
    run_to_completion(sched, ex)


def test_identical_prompts_admitted_in_the_same_step_share_blocks():
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    prompt = _prompt(14)
    sched.add_request("a", prompt, SP)
    sched.add_request("b", prompt, SP)
    out = sched.schedule()
    a, b = out.seqs
    assert out.num_new_tokens == [14, 2]  # b reuses a's 3 full blocks being computed now
    assert a.block_tables[0][:3] == b.block_tables[0][:3] and a.block_tables[0][3] != b.block_tables[0][3]
    refs = sched.block_manager.gpu.ref_counts
    assert [refs[x] for x in a.block_tables[0]] == [2, 2, 2, 1]
    assert sched.block_manager.num_free_blocks == 64 - 5
    sched.update(out, ex.execute(out))  # the fake executor reads b's prefix back: correct
    run_to_completion(sched, ex)


def test_hash_collisions_never_reuse_wrong_kv(monkeypatch):
    monkeypatch.setattr(prefix_hash, "hash_block", lambda parent, tokens: 42)
    sched = make_scheduler(block_size=4)
    ex = FakeExecutor(sched)
    sched.add_request("a", _prompt(13, salt=1), SP)
    run_to_completion(sched, ex)
    sched.add_request("b", _prompt(13, salt=2), SP)  # every block hashes to 42
    out, _ = step(sched, ex)
    assert sched.stats.prefix_cache_hits == 0
    # same last-block tokens under a different first block: still no hit
    p1 = [1, 2, 3, 4, 9, 9, 9, 9, 5]
    p2 = [5, 6, 7, 8, 9, 9, 9, 9, 5]
    sched.add_request("c", p1, SP)
    run_to_completion(sched, ex)
    hits = sched.stats.prefix_cache_hits
    sched.add_request("d", p2, SP)
    run_to_completion(sched, ex)
    assert sched.stats.prefix_cache_hits == hits


def test_freed_cached_blocks_are_evicted_least_recently_freed_first():
    sched = make_scheduler(block_size=4, num_gpu_blocks=8)
    ex = FakeExecutor(sched)
    sched.add_request("old", _prompt(13, salt=1), SamplingParams(max_tokens=1))  # 4 blocks
    run_to_completion(sched, ex)
    sched.add_request("new", _prompt(13, salt=2), SamplingParams(max_tokens=1))  # 4 blocks
    run_to_completion(sched, ex)
    assert sched.block_manager.num_free_blocks == 8  # cached blocks still count as free
    assert sched.block_manager.gpu.num_cached == 6  # 3 full blocks each
    sched.add_request("other", _prompt(9, salt=3), SamplingParams(max_tokens=1))  # 3 blocks
    run_to_completion(sched, ex)
    before = sched.stats.prefix_cache_hits
    sched.add_request("new2", _prompt(13, salt=2), SamplingParams(max_tokens=1))
    run_to_completion(sched, ex)
    assert sched.stats.prefix_cache_hits - before == 12  # "new" survived
    before = sched.stats.prefix_cache_hits
    sched.add_request("old2", _prompt(13, salt=1), SamplingParams(max_tokens=1))
    run_to_completion(sched, ex)
    assert sched.stats.prefix_cache_hits - before < 12  # "old" was evicted first


def test_counters_ignore_lookups_of_requests_that_were_not_admitted():
    sched = make_scheduler(block_size=4, num_gpu_blocks=4, max_num_batched_tokens=16,
                           max_model_len=16)
    ex = FakeExecutor(sched)
    prompt = _prompt(13)
    sched.add_request("a", prompt, SamplingParams(max_tokens=3, ignore_eos=True))  # 4 blocks
    step(sched, ex)
    sched.add_request("b", prompt[:8] + [1, 2, 3], SP)  # would hit 2 blocks, needs 1 more
    out, _ = step(sched, ex)
    assert [s.group.request_id for s in out.seqs] == ["a"] and sched.stats.num_waiting == 1
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (13, 0)
    run_to_completion(sched, ex)
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (24, 8)


def test_disabled_prefix_caching_counts_nothing_and_shares_nothing():
    sched = make_scheduler(block_size=4, prefix_caching=False)
    ex = FakeExecutor(sched)
    prompt = _prompt(14)
    sched.add_request("a", prompt, SP)
    sched.add_request("b", prompt, SP)
    out = sched.schedule()
    assert out.num_new_tokens == [14, 14]
    assert not set(out.seqs[0].block_tables[0]) & set(out.seqs[1].block_tables[0])
    sched.update(out, ex.execute(out))
    assert (sched.stats.prefix_cache_queries, sched.stats.prefix_cache_hits) == (0, 0)


def test_recomputed_sequence_hits_its_own_freed_blocks():
    sched = make_scheduler(block_size=4, num_gpu_blocks=9, max_num_batched_tokens=64,
                           max_model_len=64)
    ex = FakeExecutor(sched)
    sched.add_request("a", _prompt(16, salt=1), SamplingParams(max_tokens=12, ignore_eos=True))
    sched.add_request("b", _prompt(15, salt=2), SamplingParams(max_tokens=12, ignore_eos=True))
    done = run_to_completion(sched, ex, check=True)
    assert sched.stats.num_preemptions >= 1
    assert sched.stats.prefix_cache_hits > 0  # the victim's full blocks were still cached
    assert len(done["a"].seqs[0].output_token_ids) == 12
