"""Seeded random runs over every policy x queue x preemption mode: a cheap, wide complement to
the hypothesis state machine (same fake model, same invariants, same reference streams).
Seeds that once exposed a bug are listed in REGRESSIONS."""

from __future__ import annotations

import itertools
import random

import pytest
from core_fakes import (
    EOS,
    VOCAB,
    FakeExecutor,
    OracleProposer,
    check_invariants,
    hybrid_groups,
    reference_outputs,
    seq_limit,
)

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.sequence import SequenceStatus
from conveyor.core.spec_decode.config import SpeculativeConfig

COMBOS = list(itertools.product(["prefill_first", "chunked"], ["fcfs", "priority"],
                                 ["recompute", "swap"]))
# Profiles: (max_num_seqs, max_model_len, num_gpu_blocks / num_cpu_blocks, prompt, max_tokens,
# n) upper bounds. Seeds that once exposed a bug are listed in REGRESSIONS.
PROFILES = {"small": (6, 80, 40, 40, 16, 3), "large": (12, 200, 90, 120, 60, 4)}
REGRESSIONS = {
    ("small", "chunked", "fcfs", "swap"): [2320],  # a resumed mid-prefill sequence stalled
    ("large", "chunked", "priority", "recompute"): [149],  # preempted for a slot it never took
}


def run_random(seed: int, policy: str, queue: str, mode: str, profile: str = "small",
               speculative: bool = False, hybrid: bool = False) -> Scheduler:
    """``speculative``: decodes verify proposals of an OracleProposer (lookahead slots);
    ``hybrid``: a random layout of full-attention and sliding-window KV-cache groups."""
    max_seqs, max_len, max_blocks, max_prompt, max_out, max_n = PROFILES[profile]
    rng = random.Random(seed)
    seqs = rng.randint(1, max_seqs)
    sc = SchedulerConfig(seqs, seqs + rng.randint(0, 60), rng.randint(4, max_len), policy=policy,
                         queue=queue, preemption_mode=mode,
                         long_prefill_token_threshold=rng.randint(0, 12),
                         max_num_partial_prefills=rng.randint(1, 3))
    cc = CacheConfig(rng.choice([1, 2, 4, 8]), rng.randint(3, max_blocks), rng.randint(1, max_blocks),
                     rng.random() < 0.7)
    if hybrid:
        windows = [rng.randint(1, 12) for _ in range(rng.randint(1, 3))]
        groups = hybrid_groups(rng.choice([0, 1, 1, 1, 2]), windows)
        cc = CacheConfig(cc.block_size, cc.num_gpu_blocks * len(groups),
                         cc.num_cpu_blocks * len(groups), cc.enable_prefix_caching, groups)
    ticks = itertools.count()
    spec = proposer = None
    if speculative:
        spec = SpeculativeConfig(method=rng.choice(["ngram", "draft_model"]),
                                 num_speculative_tokens=rng.randint(1, 6),
                                 disable_by_batch_size=rng.choice([0, 0, 1, 3]))
        proposer = OracleProposer(seed, rng.choice([0.3, 0.8, 1.0]))
    sched = Scheduler(sc, cc, eos_token_ids=(EOS,), clock=lambda: float(next(ticks)),
                      speculative=spec)
    ex = FakeExecutor(sched)
    requests: dict[str, tuple[list[int], SamplingParams]] = {}
    finished: dict[str, object] = {}
    aborted: set[str] = set()
    prompts: list[list[int]] = []

    def step() -> None:
        out = sched.schedule()
        assert len(out.seqs) <= sc.max_num_seqs
        assert sum(out.num_new_tokens) == out.num_batched_tokens <= sc.max_num_batched_tokens
        for g in sched.update(out, ex.execute(out)):
            assert g.request_id not in finished
            finished[g.request_id] = g
        if proposer is not None:
            k = spec.num_speculative_tokens
            sched.update_draft_token_ids(out, [proposer.propose(s.token_ids, k) for s in out.seqs])
        check_invariants(sched)

    for _ in range(rng.randint(1, 40)):
        r = rng.random()
        if r < 0.35:
            if prompts and rng.random() < 0.5:
                base = rng.choice(prompts)
                prompt = base[:rng.randint(0, len(base))]
                prompt += [rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))]
            else:
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
            prompt = prompt or [1]
            prompts.append(prompt)
            max_tokens = rng.randint(1, max_out)
            sp = SamplingParams(n=rng.randint(1, max_n), max_tokens=max_tokens,
                                min_tokens=rng.randint(0, max_tokens),
                                ignore_eos=rng.random() < 0.5,
                                stop_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(0, 2))])
            rid = f"r{len(requests)}"
            requests[rid] = (prompt, sp)
            sched.add_request(rid, prompt, sp, priority=rng.randint(0, 3))
        elif r < 0.45:
            live = [g.request_id for g in sched.unfinished_groups()]
            if live:
                rid = rng.choice(live)
                finished[rid] = sched.abort(rid)
                aborted.add(rid)
                check_invariants(sched)
        else:
            for _ in range(rng.randint(1, 6)):
                step()
    for _ in range(20_000):
        if not sched.has_unfinished_requests():
            break
        step()
    else:
        raise AssertionError(f"no progress: {sched.stats}")
    assert set(finished) == set(requests)
    limit = seq_limit(sc, cc)
    for rid, group in finished.items():
        prompt, sp = requests[rid]
        if group.seqs[0].status is SequenceStatus.FINISHED_IGNORED:
            continue
        expected = reference_outputs(prompt, sp, limit)
        for seq in group.seqs:
            got = seq.output_token_ids
            want = expected[seq.index][:len(got)] if rid in aborted else expected[seq.index]
            assert got == want, (rid, seq.index)
    return sched


@pytest.mark.parametrize(("policy", "queue", "mode"), COMBOS)
@pytest.mark.parametrize(("profile", "num_seeds"), [("small", 100), ("large", 12)])
def test_random_runs(policy, queue, mode, profile, num_seeds):
    for seed in list(range(num_seeds)) + REGRESSIONS.get((profile, policy, queue, mode), []):
        try:
            run_random(seed, policy, queue, mode, profile)
        except Exception as e:
            raise AssertionError(f"seed {seed}: {e}") from e


@pytest.mark.parametrize(("policy", "queue", "mode"), COMBOS)
def test_random_runs_hybrid(policy, queue, mode):
    """Full-attention and sliding-window groups over one pool: same tokens, every group's reads
    check out (FakeExecutor), no block leaked or double-owned, windows released."""
    preemptions = 0
    for seed in range(80):
        try:
            sched = run_random(seed, policy, queue, mode, "small", hybrid=True)
        except Exception as e:
            raise AssertionError(f"seed {seed}: {e}") from e
        preemptions += sched.stats.num_preemptions
    assert preemptions > 0


@pytest.mark.parametrize(("policy", "queue", "mode"), COMBOS)
def test_random_runs_hybrid_speculative(policy, queue, mode):
    for seed in range(30):
        try:
            run_random(seed, policy, queue, mode, "small", speculative=True, hybrid=True)
        except Exception as e:
            raise AssertionError(f"seed {seed}: {e}") from e


@pytest.mark.parametrize(("policy", "queue", "mode"), COMBOS)
def test_random_runs_speculative(policy, queue, mode):
    """Lookahead slots with proposals accepted in part: same tokens, no leaked blocks."""
    drafts = accepted = preemptions = 0
    for seed in range(60):
        try:
            stats = run_random(seed, policy, queue, mode, "small", speculative=True).stats
        except Exception as e:
            raise AssertionError(f"seed {seed}: {e}") from e
        drafts += stats.spec_draft_tokens
        accepted += stats.spec_accepted_tokens
        preemptions += stats.num_preemptions
    assert 0 < accepted < drafts and preemptions > 0, (drafts, accepted, preemptions)
