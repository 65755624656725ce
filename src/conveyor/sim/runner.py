"""Run a workload through the real Scheduler with a SimulatedExecutor on a virtual clock.

The loop is the engine's loop with the model replaced: requests are added when the virtual
clock reaches their arrival time, then ``schedule() -> execute() -> update()`` repeats; an
idle engine jumps to the next arrival. Each request's prompt is distinct (its token ids are
its index), so the prefix cache only hits when a preempted sequence is recomputed and finds its
own blocks still cached.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from hashlib import blake2b

import numpy as np

from conveyor.core.config import PreemptionMode, QueueOrder, SchedulingPolicy, parse_choices
from conveyor.core.kv_connector.keys import KEY_BYTES
from conveyor.core.sampling_params import SamplingParams
from conveyor.sim.clock import VirtualClock
from conveyor.sim.cost_model import CostModel
from conveyor.sim.executor import SimulatedExecutor
from conveyor.sim.metrics import RunResult
from conveyor.sim.specs import HardwareSpec, ModelSpec
from conveyor.sim.workload import Workload

DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
KV_SAMPLE_EVERY = 4  # steps between KV-usage samples (mean is weighted by busy time)


@dataclass
class SimConfig:
    """What is simulated: model on hardware, plus the engine's scheduling knobs (EngineArgs' names)."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    policy: SchedulingPolicy = SchedulingPolicy.PREFILL_FIRST  # a member or its string
    queue: QueueOrder = QueueOrder.FCFS
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192, raised to max_model_len where the
    # policy caps a sequence at it (prefill_first)
    max_model_len: int | None = None  # None: the model's context length, capped at 8192
    block_size: int = 16
    num_gpu_blocks: int | None = None  # None: derived from memory minus weights
    swap_space_gb: float = 4.0  # CPU pool for preemption_mode="swap"
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1

    def __post_init__(self) -> None:
        parse_choices(self)
        for name in ("max_num_seqs", "block_size", "max_num_partial_prefills"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("max_num_batched_tokens", "max_model_len", "num_gpu_blocks"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if not self.swap_space_gb >= 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb!r}")

    @property
    def label(self) -> str:
        label = f"{self.policy}/{self.queue}"
        return label + "/swap" if self.preemption_mode is PreemptionMode.SWAP else label

    def resolved_max_model_len(self) -> int:
        if self.max_model_len is not None:
            return self.max_model_len
        return min(self.model.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)

    def resolved_max_num_batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        budget = DEFAULT_MAX_NUM_BATCHED_TOKENS
        if self.policy.seq_len_cap(budget) is not None:
            budget = max(budget, self.resolved_max_model_len())  # the cap must not cut the context
        return budget

    def describe(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"], out["hardware"] = self.model.name, self.hardware.name
        out["max_model_len"] = self.resolved_max_model_len()
        out["max_num_batched_tokens"] = self.resolved_max_num_batched_tokens()
        return out


# the content-key namespace of every simulated replica (they all run the same model)
SIM_KEY_NAMESPACE = blake2b(b"conveyor-sim", digest_size=KEY_BYTES).digest()


def build(config: SimConfig, kv_events: bool = False, kv_connector=None,
          clock: VirtualClock | None = None):
    """(scheduler, executor, clock, cost model) wired together for one run; ``kv_events``: the
    scheduler publishes its KV events (``scheduler.kv_events``, flushed by the caller after each
    step) with content keys in ``SIM_KEY_NAMESPACE``; ``kv_connector``: the scheduler half of a
    KV connector (``core/kv_connector``) the scheduler loads through; ``clock``: the engine's
    clock (default: a new one at 0)."""
    from conveyor.core.config import CacheConfig, SchedulerConfig
    from conveyor.core.kv_connector.events import KVEventLog
    from conveyor.core.scheduler import Scheduler

    cost = CostModel(config.model, config.hardware, config.tp, config.block_size)
    num_gpu_blocks = config.num_gpu_blocks or cost.num_gpu_blocks()
    num_cpu_blocks = cost.num_cpu_blocks(config.swap_space_gb) \
        if config.preemption_mode is PreemptionMode.SWAP else 0
    clock = clock or VirtualClock()
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.resolved_max_num_batched_tokens(),
            max_model_len=config.resolved_max_model_len(),
            policy=config.policy,
            queue=config.queue,
            preemption_mode=config.preemption_mode,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            max_num_partial_prefills=config.max_num_partial_prefills,
        ),
        CacheConfig(block_size=config.block_size, num_gpu_blocks=num_gpu_blocks,
                    num_cpu_blocks=num_cpu_blocks,
                    enable_prefix_caching=config.enable_prefix_caching,
                    kv_cache_groups=cost.kv_cache_groups),
        eos_token_ids=(),
        clock=clock,
        kv_events=KVEventLog(config.block_size) if kv_events else None,
        kv_connector=kv_connector,
        kv_key_namespace=SIM_KEY_NAMESPACE if kv_events or kv_connector is not None else None,
    )
    return scheduler, SimulatedExecutor(cost, clock), clock, cost


class RequestLog:
    """Each request's outcome as its group finishes: first-token and finish times on the virtual
    clock, tokens generated, finish reason."""

    def __init__(self, n: int) -> None:
        self.first_token = np.full(n, np.nan)
        self.finished = np.full(n, np.nan)
        self.generated = np.zeros(n, dtype=np.int64)
        self.reasons = [""] * n

    def record(self, groups, now: float) -> list[int]:
        """Records finished ``groups`` (request ids are workload indices); returns the indices."""
        indices = []
        for g in groups:
            k = int(g.request_id)
            m = g.metrics
            if m.first_token_time is not None:
                self.first_token[k] = m.first_token_time
            self.finished[k] = m.finished_time if m.finished_time is not None else now
            self.generated[k] = sum(s.num_output_tokens for s in g.seqs)
            self.reasons[k] = g.seqs[0].status.finish_reason or ""
            indices.append(k)
        return indices


class KvUsage:
    """One engine's KV-cache usage, sampled every ``KV_SAMPLE_EVERY`` steps: its mean weighted
    by busy time, and its peak."""

    def __init__(self) -> None:
        self.weighted = self.sampled_s = self.peak = 0.0

    def after_step(self, scheduler, executor: SimulatedExecutor) -> None:
        if executor.num_steps % KV_SAMPLE_EVERY == 0:  # a stats snapshot is not free
            usage = scheduler.stats.kv_usage
            self.weighted += usage * (executor.busy_s - self.sampled_s)
            self.sampled_s = executor.busy_s
            self.peak = max(self.peak, usage)

    @property
    def mean(self) -> float:
        return self.weighted / self.sampled_s if self.sampled_s else 0.0


def run_result(config: SimConfig, workload: Workload, log: RequestLog, wall0: float,
               described: dict | None = None, **fields) -> RunResult:
    """A RunResult of ``workload``'s requests as ``log`` recorded them; ``described``: what the
    run adds to ``config.describe()``; ``fields``: the run's label, rate and totals."""
    return RunResult(
        model=config.model.name, hardware=config.hardware.name, tp=config.tp,
        arrival_s=workload.arrival_s.copy(), first_token_s=log.first_token,
        finished_s=log.finished, prompt_tokens=workload.prompt_tokens.copy(),
        output_tokens=log.generated, priority=workload.priority.copy(),
        finish_reason=log.reasons, block_size=config.block_size,
        wall_s=time.perf_counter() - wall0, config={**config.describe(), **(described or {})},
        **fields)


def simulate(config: SimConfig, workload: Workload, rate: float = math.nan) -> RunResult:
    """Run every request of ``workload`` to completion; returns per-request timings."""
    wall0 = time.perf_counter()
    scheduler, executor, clock, _ = build(config)
    arrivals = workload.arrival_s.tolist()
    prompts = workload.prompt_tokens.tolist()
    outputs = workload.output_tokens.tolist()
    priorities = workload.priority.tolist()
    n = len(arrivals)
    log = RequestLog(n)
    kv = KvUsage()

    i = 0
    while True:
        now = clock.now
        while i < n and arrivals[i] <= now:
            params = SamplingParams(max_tokens=outputs[i], ignore_eos=True, temperature=0.0)
            scheduler.add_request(str(i), [i] * prompts[i], params, priority=priorities[i],
                                  arrival_time=arrivals[i])
            i += 1
        if not scheduler.has_unfinished_requests():
            if i >= n:
                break
            clock.advance_to(arrivals[i])
            continue
        out = scheduler.schedule()
        sampled = executor.execute(out).sampled_token_ids if out.seqs else []
        done = scheduler.update(out, sampled)
        if done:
            log.record(done, clock.now)
        if out.seqs:
            kv.after_step(scheduler, executor)
        elif not done:  # nothing could run and nothing finished
            if i >= n:
                raise RuntimeError(f"scheduler made no progress with {n - i} requests left "
                                   f"unfinished at t={clock.now:.3f}s")
            clock.advance_to(arrivals[i])

    stats = scheduler.stats
    return run_result(
        config, workload, log, wall0, label=config.label, rate=rate,
        num_preemptions=stats.num_preemptions, num_steps=executor.num_steps,
        busy_s=executor.busy_s, kv_usage_mean=kv.mean, kv_usage_peak=kv.peak,
        num_gpu_blocks=stats.num_total_blocks)
