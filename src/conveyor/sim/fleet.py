"""A fleet of N simulated replicas behind one router: N real Schedulers, each on its own virtual
clock and cost model, fed through the same routing code the Ray deployment runs
(conveyor.routing).

Discrete events: the busy replica whose clock is furthest behind takes its next step, after
every request that arrived by then has been routed (a replica's load is its routed minus its
finished requests, as the Ray router counts in-flight requests). An idle replica jumps to the
arrival it is given.

Prompts are distinct (token ids are the request's index) unless ``shared_prefix=(G, L)``: then
each prompt starts with one of G shared L-token prefixes (chosen with the workload's seed), the
case where prefix-aware routing pays off. Under ``kv_aware`` each replica's scheduler publishes
its KV events and the router's index reads them after every step of that replica, as the Ray
ingress pulls them from live replicas.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from conveyor.core.sampling_params import SamplingParams
from conveyor.routing import KVAware, make_router
from conveyor.sim.metrics import RunResult
from conveyor.sim.runner import (
    SIM_KEY_NAMESPACE,
    KvUsage,
    RequestLog,
    SimConfig,
    build,
    run_result,
)
from conveyor.sim.workload import Workload

PREFIX_TOKEN_BASE = 1 << 30  # prefix token ids, apart from the per-request ids (0..n-1)


@dataclass
class ReplicaLoad:
    """One replica's share of a fleet run."""

    replica: int
    requests: int = 0
    affinity_hits: int = 0
    output_tokens: int = 0
    busy_s: float = 0.0
    steps: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_usage_mean: float = 0.0

    def summary(self, makespan_s: float) -> dict:
        return {"replica": self.replica, "requests": self.requests,
                "affinity_hits": self.affinity_hits, "output_tokens": self.output_tokens,
                "busy": self.busy_s / makespan_s if makespan_s > 0 else math.nan,
                "steps": self.steps, "preemptions": self.preemptions,
                "prefix_hit_rate": self.prefix_cache_hits / self.prefix_cache_queries
                if self.prefix_cache_queries else 0.0,
                "kv_usage_mean": self.kv_usage_mean}


@dataclass
class FleetResult:
    result: RunResult  # every request, as one engine's run reports them
    router: str
    replicas: list[ReplicaLoad] = field(default_factory=list)

    def summary(self, slo) -> dict:
        out = self.result.summary(slo)
        span = self.result.makespan_s
        per = [r.summary(span) for r in self.replicas]
        queries = sum(r.prefix_cache_queries for r in self.replicas)
        out.update(router=self.router, num_replicas=len(self.replicas), per_replica=per,
                   prefix_hit_rate=sum(r.prefix_cache_hits for r in self.replicas) / queries
                   if queries else 0.0)
        return out


def prompt_builder(workload: Workload, shared_prefix: tuple[int, int] | None, seed: int = 0):
    """request index -> its prompt token ids."""
    lengths = workload.prompt_tokens.tolist()
    if shared_prefix is None:
        return lambda i: [i] * lengths[i]
    groups, prefix_len = shared_prefix
    if groups < 1 or prefix_len < 1:
        raise ValueError(f"shared prefix needs groups >= 1 and length >= 1, got {shared_prefix}")
    group_of = np.random.default_rng(seed).integers(0, groups, len(lengths)).tolist()
    prefixes = [[PREFIX_TOKEN_BASE + g * prefix_len + k for k in range(prefix_len)]
                for g in range(groups)]

    def prompt(i: int) -> list[int]:
        shared = min(prefix_len, lengths[i] - 1)  # at least one token of its own
        return prefixes[group_of[i]][:shared] + [i] * (lengths[i] - shared)

    return prompt


def simulate_fleet(config: SimConfig, workload: Workload, num_replicas: int, router: str,
                   rate: float = math.nan, shared_prefix: tuple[int, int] | None = None,
                   seed: int = 0) -> FleetResult:
    if num_replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {num_replicas}")
    wall0 = time.perf_counter()
    policy = make_router(router, block_size=config.block_size)
    kv_aware = isinstance(policy, KVAware)  # fed every replica's KV events after each step
    engines = [build(config, kv_events=kv_aware) for _ in range(num_replicas)]
    schedulers = [e[0] for e in engines]
    executors = [e[1] for e in engines]
    clocks = [e[2] for e in engines]
    loads_list = [ReplicaLoad(r) for r in range(num_replicas)]
    in_flight = dict.fromkeys(range(num_replicas), 0)
    replica_ids = list(range(num_replicas))
    if kv_aware:
        for r in replica_ids:
            policy.set_namespace(r, SIM_KEY_NAMESPACE)
    prompt_of = prompt_builder(workload, shared_prefix, seed)

    arrivals = workload.arrival_s.tolist()
    outputs = workload.output_tokens.tolist()
    priorities = workload.priority.tolist()
    n = len(arrivals)
    log = RequestLog(n)
    kv = [KvUsage() for _ in range(num_replicas)]
    busy = [False] * num_replicas

    def record(r: int, groups) -> None:
        for k in log.record(groups, clocks[r].now):
            in_flight[r] -= 1
            loads_list[r].output_tokens += int(log.generated[k])

    i = 0
    while True:
        r = -1
        t_next = math.inf
        for j in replica_ids:
            if busy[j] and clocks[j].now < t_next:
                r, t_next = j, clocks[j].now
        if i < n and arrivals[i] <= t_next:
            prompt = prompt_of(i)
            decision = policy.route(replica_ids, prompt, in_flight)
            j = decision.replica
            if not busy[j] and clocks[j].now < arrivals[i]:
                clocks[j].advance_to(arrivals[i])
            schedulers[j].add_request(
                str(i), prompt, SamplingParams(max_tokens=outputs[i], ignore_eos=True,
                                               temperature=0.0),
                priority=priorities[i], arrival_time=arrivals[i])
            busy[j] = True
            in_flight[j] += 1
            loads_list[j].requests += 1
            loads_list[j].affinity_hits += decision.affinity_hit
            i += 1
            continue
        if r < 0:
            break  # nothing busy, nothing left to arrive
        scheduler, executor = schedulers[r], executors[r]
        out = scheduler.schedule()
        sampled = executor.execute(out).sampled_token_ids if out.seqs else []
        done = scheduler.update(out, sampled)
        if kv_aware:
            scheduler.kv_events.flush(clocks[r].now)
            policy.apply(r, [e for b in scheduler.kv_events.drain() for e in b.events])
        if done:
            record(r, done)
        if out.seqs:
            kv[r].after_step(scheduler, executor)
        elif not done:
            if i >= n:
                raise RuntimeError(f"replica {r} made no progress at t={clocks[r].now:.3f}s")
            clocks[r].advance_to(max(arrivals[i], clocks[r].now))
        busy[r] = scheduler.has_unfinished_requests()

    for r, load in enumerate(loads_list):
        s = schedulers[r].stats
        load.busy_s = executors[r].busy_s
        load.steps = executors[r].num_steps
        load.preemptions = s.num_preemptions
        load.prefix_cache_queries = s.prefix_cache_queries
        load.prefix_cache_hits = s.prefix_cache_hits
        load.kv_usage_mean = kv[r].mean
    label = f"{config.label} x{num_replicas} {router}"
    result = run_result(
        config, workload, log, wall0, label=label, rate=rate,
        num_preemptions=sum(ld.preemptions for ld in loads_list),
        num_steps=sum(ld.steps for ld in loads_list), busy_s=sum(ld.busy_s for ld in loads_list),
        kv_usage_mean=float(np.mean([ld.kv_usage_mean for ld in loads_list])),
        kv_usage_peak=max(k.peak for k in kv), num_gpu_blocks=schedulers[0].stats.num_total_blocks,
        described={"replicas": num_replicas, "router": router, "shared_prefix": shared_prefix},
    )
    return FleetResult(result, router, loads_list)
