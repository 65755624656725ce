"""Prometheus metrics of a serving engine (``/metrics``), every name prefixed ``conveyor:``.

Gauges and counters are read from the AsyncEngine's latest EngineStats snapshot at scrape time
(the engine owns those totals); latency histograms are observed in the engine thread from each
step's output deltas (RequestMetrics timestamps and the step's end time, all time.monotonic()).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.engine.outputs import RequestOutput

PREFIX = "conveyor:"
FINISH_REASONS = ("stop", "length", "abort", "ignored")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                2.5, 5.0, 10.0)


class _EngineStatsCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self._engine = engine
        self._model = model_name

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats
        q = s.scheduler
        label = ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=label)
            g.add_metric([self._model], value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=label)
            c.add_metric([self._model], value)
            return c

        def tiered(kind: type, name: str, doc: str, cpu: float, disk: float) -> Metric:
            m = kind(PREFIX + name, doc, labels=["model_name", "tier"])
            m.add_metric([self._model, "cpu"], cpu)
            m.add_metric([self._model, "disk"], disk)
            return m

        yield gauge("num_requests_running", "Requests in the running batch.", q.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", q.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out to CPU memory.", q.num_swapped)
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                    q.kv_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      q.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      q.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions of running requests.", q.num_preemptions)
        yield counter("spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.",
                      q.spec_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                      q.spec_accepted_tokens)
        yield counter("spec_decode_num_verifications", "Decodes that verified a proposal.",
                      q.spec_verifications)
        yield gauge("spec_decode_acceptance_rate", "Accepted / proposed speculative tokens.",
                    q.spec_acceptance_rate)
        yield gauge("spec_decode_mean_accepted_length",
                    "Tokens per verifying decode (accepted proposal + 1).",
                    q.spec_mean_accepted_length)
        yield counter("prompt_tokens", "Prompt tokens of finished and running requests.",
                      s.prompt_tokens_total)
        yield counter("generation_tokens", "Generated tokens.", s.generation_tokens_total)
        yield gauge("lora_adapters_in_memory", "LoRA adapters read into host memory.",
                    s.lora_adapters_in_memory)
        yield counter("lora_slot_installs", "LoRA adapters copied into a model slot.",
                      s.lora_slot_installs)
        yield counter("lora_adapter_reads",
                      "LoRA adapters read again from their files (host memory was full).",
                      s.lora_adapter_reads)
        kv = s.kv_offload
        if kv is not None:  # KV offload tiers (docs/kv_cache.md)
            yield tiered(CounterMetricFamily, "kv_offload_hits",
                         "Prompt tokens loaded from a KV offload tier instead of computed.",
                         kv.hits_cpu, kv.hits_disk)
            yield tiered(GaugeMetricFamily, "kv_offload_blocks",
                         "KV blocks a KV offload tier holds.", kv.blocks_cpu, kv.blocks_disk)
            yield counter("kv_offload_lost_blocks", "Stored KV blocks found corrupt, truncated "
                          "or missing when read back (computed again).", kv.lost_blocks)
        kt = s.kv_transfer
        if kt is not None:  # a decode replica of prefill/decode disaggregation
            yield counter("kv_transfer_loaded_blocks", "KV blocks handed over by a prefill "
                          "replica and loaded instead of computed.", kt.loaded_blocks)
            yield counter("kv_transfer_offered_blocks", "KV blocks handed over with requests.",
                          kt.offered_blocks)
            yield counter("kv_transfer_lost_blocks", "KV blocks handed over that failed "
                          "verification or were gone (computed instead).", kt.lost_blocks)
            yield gauge("kv_transfer_held_blocks", "KV blocks handed over held for running "
                        "requests.", kt.held_blocks)
        if s.max_loras:  # vLLM's lora_requests_info: the labels carry the adapters' names
            info = GaugeMetricFamily(PREFIX + "lora_requests_info",
                                     "LoRA adapters with running and with only waiting "
                                     "requests (the value: when this was read).",
                                     labels=["max_lora", "running_lora_adapters",
                                             "waiting_lora_adapters"])
            info.add_metric([str(s.max_loras), ",".join(s.lora_running_adapters),
                             ",".join(s.lora_waiting_adapters)], time.time())
            yield info
        finished = CounterMetricFamily(PREFIX + "request_success",
                                       "Finished requests by finish reason.",
                                       labels=["model_name", "finished_reason"])
        by_reason = dict(s.finished_by_reason)
        for reason in sorted(set(FINISH_REASONS) | set(by_reason)):
            finished.add_metric([self._model, reason], by_reason.get(reason, 0))
        yield finished


class ServerMetrics:
    """The registry behind ``/metrics`` and the output observer that feeds its histograms."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._model = model_name
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.",
                         _LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive tokens.",
                        _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.",
                          _LATENCY_BUCKETS)
        self._last_token_time: dict[str, float] = {}  # engine thread only

    def attach(self, engine: AsyncEngine) -> None:
        self.registry.register(_EngineStatsCollector(engine, self._model))

    def observe(self, deltas: list[RequestOutput], now: float) -> None:
        """OutputObserver: called in the engine thread after every step."""
        for d in deltas:
            if d.metrics is None:
                continue
            got_tokens = any(c.token_ids for c in d.outputs)
            last = self._last_token_time.get(d.request_id)
            if got_tokens:
                if last is None:
                    m = d.metrics
                    self.ttft.observe(max(0.0, (m.first_token_time or now) - m.arrival_time))
                else:
                    self.itl.observe(now - last)
                self._last_token_time[d.request_id] = now
            if d.finished:
                self._last_token_time.pop(d.request_id, None)
                m = d.metrics
                self.e2e.observe(max(0.0, (m.finished_time or now) - m.arrival_time))
                if m.first_scheduled_time is not None:
                    self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
