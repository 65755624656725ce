"""A seeded request samples the same tokens whatever else shares its batches."""

from __future__ import annotations

import pytest

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler

pytestmark = pytest.mark.slow  # SmolLM2 in float32

SEEDED = SamplingParams(n=2, temperature=0.9, top_p=0.95, top_k=50, seed=42, max_tokens=10,
                        ignore_eos=True, logprobs=2)


def _run(executor, requests, policy: str):
    executor.initialize_cache(16, 128, 0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                                      policy=policy, long_prefill_token_threshold=13),
                      CacheConfig(block_size=16, num_gpu_blocks=128),
                      eos_token_ids=executor.model_config.eos_token_ids)
    groups = [sched.add_request(f"r{i}", list(ids), p) for i, (ids, p) in enumerate(requests)]
    target = next(g for g in groups if g.sampling_params is SEEDED)
    while sched.has_unfinished_requests():
        so = sched.schedule()
        out = executor.execute(so)
        for i, seq in enumerate(so.seqs):
            if seq.group is target and out.sampled_token_ids[i]:
                assert out.logprobs is not None and len(out.logprobs[i]) == so.num_samples(i)
                for d, t in zip(out.logprobs[i], out.sampled_token_ids[i], strict=True):
                    assert t in d and len(d) <= 3 and all(v <= 0 for v in d.values())
        sched.update(so, out.sampled_token_ids)
    return sorted((s.index, s.output_token_ids) for s in target.seqs)


def test_seeded_request_is_independent_of_the_batch(executor, prompt_ids) -> None:
    alone = _run(executor, [(prompt_ids[0], SEEDED)], "prefill_first")
    crowd = [(prompt_ids[0], SEEDED),
             (prompt_ids[1], SamplingParams(temperature=1.0, max_tokens=20)),
             (prompt_ids[2], SamplingParams(temperature=0.7, seed=7, max_tokens=9)),
             (prompt_ids[3], SamplingParams(temperature=0.0, max_tokens=5))]
    assert _run(executor, crowd, "prefill_first") == alone
    assert _run(executor, crowd[::-1][:3] + crowd[:1], "chunked") == alone
    (i0, a), (i1, b) = alone
    assert (i0, i1) == (0, 1) and len(a) == len(b) == 10 and a != b  # two different streams
