"""Prefill/decode disaggregation: P prefill and D decode instances, each a real Scheduler on its
own virtual clock and cost model, behind the routing code the colocated fleet runs
(``conveyor.routing``, ``sim/fleet.py``).

A request is routed to a prefill instance, which runs it with ``max_tokens=1``: its prefill
produces the first token (TTFT: arrival, prefill-side queueing and prefill). The request is then
routed (same policy, its own router) to a decode instance, waits there until its pool can hold
the request (``sim/decode_inbound.py``), and joins its scheduler with the prompt plus that token
and ``max_tokens`` = the rest of its output; the decode instance loads the prompt's KV blocks
over its inbound link through its KV connector (``sim/remote_prefill.py``) and decodes to the
end. TPOT = (finish − first token) /
(output − 1) spans the transfer and the decode side's queueing and steps.

Discrete events, as in the colocated fleet: the instance furthest behind in time steps next,
after every arrival and handoff up to then has been routed; a decode instance whose requests
all wait on transfers sleeps until the first one ends. A prefill instance frees a request's
blocks when it finishes (they stay in its prefix cache); the transfer is not charged to it.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field

import numpy as np

from conveyor.core.sampling_params import SamplingParams
from conveyor.routing import make_router
from conveyor.routing.pd_split import parse_pd  # noqa: F401 - the simulator's CLI imports it here
from conveyor.sim.clock import VirtualClock
from conveyor.sim.cost_model import CostModel
from conveyor.sim.decode_inbound import Inbound
from conveyor.sim.fleet import ReplicaLoad, prompt_builder
from conveyor.sim.kv_link import KVLink, LinkSpec
from conveyor.sim.metrics import RunResult
from conveyor.sim.remote_prefill import RemotePrefill
from conveyor.sim.runner import KvUsage, RequestLog, SimConfig, build, run_result
from conveyor.sim.workload import Workload

HANDOFF_TOKEN = 0  # the first token, as the SimulatedExecutor samples it


@dataclass
class Instance:
    """One engine of the fleet (a prefill or a decode instance) and its counters."""

    name: str  # P0, P1, ..., D0, ...
    scheduler: object
    executor: object
    clock: VirtualClock
    connector: RemotePrefill | None = None  # decode instances
    load: ReplicaLoad = field(default_factory=lambda: ReplicaLoad(0))
    kv: KvUsage = field(default_factory=KvUsage)
    busy: bool = False
    wake_s: float = math.nan  # sleeping until its first transfer ends (NaN: awake)
    inbound: Inbound = field(default_factory=Inbound)  # decode instances: handoffs waiting

    @property
    def next_s(self) -> float:
        return self.clock.now if math.isnan(self.wake_s) else self.wake_s

    def per_replica(self, makespan_s: float) -> dict:
        return {**self.load.summary(makespan_s), "replica": self.name}


@dataclass
class PDResult:
    result: RunResult  # every request, as one engine's run reports them
    router: str
    link: LinkSpec
    prefill: list[Instance]
    decode: list[Instance]
    handoff_s: np.ndarray  # when the first token was ready to move (NaN: not handed off)
    load_start_s: np.ndarray  # when the decode instance queued the transfer (NaN: no load)
    load_done_s: np.ndarray
    load_blocks: np.ndarray
    decode_recomputed: int  # handed off with full blocks, yet never loaded (computed locally)

    @property
    def num_gpus(self) -> int:
        return (len(self.prefill) + len(self.decode)) * self.result.tp

    def summary(self, slo) -> dict:
        return {**self.result.summary(slo), **self.pd_summary()}

    def pd_summary(self) -> dict:
        """What disaggregation adds to a run's summary: instances, KV transfers, how long
        handed-off requests waited for a decode instance to start their load."""
        span = self.result.makespan_s
        loaded = ~np.isnan(self.load_done_s)
        wait = self.load_start_s[loaded] - self.handoff_s[loaded]
        transfer = self.load_done_s[loaded] - self.load_start_s[loaded]
        return dict(
            router=self.router, pd=f"{len(self.prefill)}:{len(self.decode)}",
            num_replicas=len(self.prefill) + len(self.decode), num_gpus=self.num_gpus,
            kv_link=str(self.link),
            per_replica=[i.per_replica(span) for i in (*self.prefill, *self.decode)],
            kv_transfers=int(loaded.sum()),
            kv_transfer_gb=float(sum(i.connector.link.num_blocks * i.connector.link.block_bytes
                                     for i in self.decode)) * self.result.tp / 1e9,
            kv_transfer_p50_ms=float(np.median(transfer)) * 1e3 if len(transfer) else math.nan,
            decode_admit_wait_p50_ms=float(np.median(wait)) * 1e3 if len(wait) else math.nan,
            decode_admit_wait_p99_ms=float(np.percentile(wait, 99)) * 1e3 if len(wait)
            else math.nan,
            decode_recomputed=self.decode_recomputed)


def simulate_pd(config: SimConfig, workload: Workload, num_prefill: int, num_decode: int,
                router: str, link: LinkSpec, rate: float = math.nan,
                shared_prefix: tuple[int, int] | None = None, seed: int = 0) -> PDResult:
    """Run every request of ``workload`` through ``num_prefill`` prefill and ``num_decode``
    decode instances of ``config`` (see the module docstring)."""
    if num_prefill < 1 or num_decode < 1:
        raise ValueError(f"--pd needs at least one prefill and one decode instance, got "
                         f"{num_prefill}:{num_decode}")
    if not config.enable_prefix_caching:
        raise ValueError("--pd needs prefix caching on: a decode instance admits the "
                         "transferred blocks as prefix-cache hits")
    wall0 = time.perf_counter()
    bs = config.block_size
    cost = CostModel(config.model, config.hardware, config.tp, bs)
    if len(cost.kv_cache_groups) > 1:
        raise ValueError(f"--pd supports models with one KV-cache group; {config.model.name} "
                         f"has {len(cost.kv_cache_groups)} (sliding-window layers)")
    prefill = []
    for k in range(num_prefill):
        scheduler, executor, clock, _ = build(config)
        prefill.append(Instance(f"P{k}", scheduler, executor, clock, load=ReplicaLoad(k)))
    decode = []
    for k in range(num_decode):
        clock = VirtualClock()
        connector = RemotePrefill(KVLink(link, cost.block_bytes), clock)
        scheduler, executor, _, _ = build(config, kv_connector=connector, clock=clock)
        decode.append(Instance(f"D{k}", scheduler, executor, clock, connector,
                               load=ReplicaLoad(num_prefill + k)))
    instances = prefill + decode
    prefill_router = make_router(router, block_size=bs)
    decode_router = make_router(router, block_size=bs)
    prefill_ids, decode_ids = list(range(num_prefill)), list(range(num_decode))
    prefill_loads = dict.fromkeys(prefill_ids, 0)
    decode_loads = dict.fromkeys(decode_ids, 0)
    prompt_of = prompt_builder(workload, shared_prefix, seed)

    arrivals = workload.arrival_s.tolist()
    outputs = workload.output_tokens.tolist()
    priorities = workload.priority.tolist()
    n = len(arrivals)
    log = RequestLog(n)
    handoff_s = np.full(n, np.nan)
    load_start, load_done = np.full(n, np.nan), np.full(n, np.nan)
    load_blocks = np.zeros(n, dtype=np.int64)
    handoffs: list[tuple[float, int]] = []  # heap of (time, request index)
    recomputed = 0

    def wake(inst: Instance, t: float) -> None:
        if not inst.busy or not math.isnan(inst.wake_s):  # idle, or only waiting on transfers
            inst.clock.advance_to(t)
        inst.wake_s = math.nan
        inst.busy = True

    def arrive(k: int) -> None:
        prompt = prompt_of(k)
        decision = prefill_router.route(prefill_ids, prompt, prefill_loads)
        inst = prefill[decision.replica]
        wake(inst, arrivals[k])
        inst.scheduler.add_request(
            str(k), prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0),
            priority=priorities[k], arrival_time=arrivals[k])
        prefill_loads[decision.replica] += 1
        inst.load.requests += 1
        inst.load.affinity_hits += decision.affinity_hit

    def hand_off(t: float, k: int) -> None:
        decision = decode_router.route(decode_ids, prompt_of(k), decode_loads)
        d = decision.replica
        inst = decode[d]
        wake(inst, t)
        inst.inbound.push(t, k, int(workload.prompt_tokens[k]) + 1)
        decode_loads[d] += 1
        inst.load.requests += 1
        inst.load.affinity_hits += decision.affinity_hit

    def join(d: int, inst: Instance, t: float, k: int) -> None:
        """The handoff joins the decode scheduler, its prompt blocks offered to the connector."""
        prompt = prompt_of(k)
        group = inst.scheduler.add_request(
            str(k), prompt + [HANDOFF_TOKEN],
            SamplingParams(max_tokens=outputs[k] - 1, ignore_eos=True, temperature=0.0),
            priority=priorities[k], arrival_time=t)
        seq = group.seqs[0]
        if not seq.status.is_finished:
            bm = inst.scheduler.block_manager
            keys = bm.block_keys(seq, len(prompt) // bs)  # every full block of the prompt
            inst.connector.offer(seq.seq_id, list(keys))

    def finish(k: int, group, now: float, generated: int) -> None:
        m = group.metrics
        log.finished[k] = m.finished_time if m.finished_time is not None else now
        log.generated[k] = generated
        log.reasons[k] = group.seqs[0].status.finish_reason or ""

    def prefill_done(p: int, inst: Instance, groups) -> None:
        for g in groups:
            k = int(g.request_id)
            prefill_loads[p] -= 1
            first = g.metrics.first_token_time
            if first is None or outputs[k] <= 1:  # ignored, or done with its only token
                finish(k, g, inst.clock.now, sum(s.num_output_tokens for s in g.seqs))
                if first is not None:
                    log.first_token[k] = first
                    inst.load.output_tokens += 1
                continue
            log.first_token[k] = first
            inst.load.output_tokens += 1
            handoff_s[k] = inst.clock.now
            heapq.heappush(handoffs, (inst.clock.now, k))

    def decode_done(d: int, inst: Instance, groups) -> None:
        nonlocal recomputed
        for g in groups:
            k = int(g.request_id)
            decode_loads[d] -= 1
            seq = g.seqs[0]
            inst.connector.withdraw(seq.seq_id)
            loaded = inst.connector.loads.pop(seq.seq_id, None)
            if loaded is not None:
                load_start[k], load_done[k] = loaded.start_s, loaded.done_s
                load_blocks[k] = loaded.num_blocks
            elif len(g.prompt_token_ids) > bs and g.metrics.num_cached_tokens == 0:
                recomputed += 1
            generated = sum(s.num_output_tokens for s in g.seqs)
            inst.load.output_tokens += generated
            finish(k, g, inst.clock.now, 1 + generated)

    i = 0
    while True:
        inst, r, t_next = None, -1, math.inf
        for j, candidate in enumerate(instances):
            if candidate.busy and candidate.next_s < t_next:
                inst, r, t_next = candidate, j, candidate.next_s
        t_arrival = arrivals[i] if i < n else math.inf
        t_handoff = handoffs[0][0] if handoffs else math.inf
        if min(t_arrival, t_handoff) <= t_next and min(t_arrival, t_handoff) < math.inf:
            if t_handoff < t_arrival:  # a handoff first: it was produced before this arrival
                t, k = heapq.heappop(handoffs)
                hand_off(t, k)
            else:
                arrive(i)
                i += 1
            continue
        if inst is None:
            break  # nothing busy, nothing left to arrive
        if not math.isnan(inst.wake_s):
            inst.clock.advance_to(inst.wake_s)
            inst.wake_s = math.nan
        scheduler, executor, connector = inst.scheduler, inst.executor, inst.connector
        if connector is not None:
            report = connector.finished(inst.clock.now)
            if report is not None:
                scheduler.update_kv_connector(report)
            for t, k in inst.inbound.admit(scheduler):
                join(r - num_prefill, inst, t, k)
        out = scheduler.schedule()
        sampled = executor.execute(out).sampled_token_ids if out.seqs else []
        done = scheduler.update(out, sampled)
        if done:
            if r < num_prefill:
                prefill_done(r, inst, done)
            else:
                decode_done(r - num_prefill, inst, done)
        if out.seqs:
            inst.kv.after_step(scheduler, executor)
        elif not done:
            if connector is None or math.isinf(connector.next_done_s):
                raise RuntimeError(f"instance {inst.name} made no progress at "
                                   f"t={inst.clock.now:.3f}s")
            inst.wake_s = max(connector.next_done_s, inst.clock.now)
        inst.busy = scheduler.has_unfinished_requests() or len(inst.inbound) > 0
        if not inst.busy:
            inst.wake_s = math.nan

    for inst in instances:
        s = inst.scheduler.stats
        inst.load.busy_s = inst.executor.busy_s
        inst.load.steps = inst.executor.num_steps
        inst.load.preemptions = s.num_preemptions
        inst.load.prefix_cache_queries = s.prefix_cache_queries
        inst.load.prefix_cache_hits = s.prefix_cache_hits
        inst.load.kv_usage_mean = inst.kv.mean
    loads = [inst.load for inst in instances]
    label = f"{config.label} pd{num_prefill}:{num_decode} {router}"
    result = run_result(
        config, workload, log, wall0, label=label, rate=rate,
        num_preemptions=sum(ld.preemptions for ld in loads),
        num_steps=sum(ld.steps for ld in loads), busy_s=sum(ld.busy_s for ld in loads),
        kv_usage_mean=float(np.mean([ld.kv_usage_mean for ld in loads])),
        kv_usage_peak=max(inst.kv.peak for inst in instances),
        num_gpu_blocks=decode[0].scheduler.stats.num_total_blocks,
        described={"pd": f"{num_prefill}:{num_decode}", "router": router,
                   "kv_link": str(link), "shared_prefix": shared_prefix},
    )
    return PDResult(result, router, link, prefill, decode, handoff_s, load_start, load_done,
                    load_blocks, recomputed)
