"""/metrics exports speculative decoding's counters, acceptance rate and mean accepted length."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from conveyor.core.stats import SchedulerStats
from conveyor.engine.stats import EngineStats
from conveyor.entrypoints.openai.metrics import _EngineStatsCollector


def test_speculative_metrics_are_exported():
    stats = EngineStats(SchedulerStats(spec_draft_tokens=40, spec_accepted_tokens=30,
                                       spec_verifications=10))
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(SimpleNamespace(stats=stats), "m"))
    text = generate_latest(registry).decode()
    for line in ('conveyor:spec_decode_num_draft_tokens_total{model_name="m"} 40.0',
                 'conveyor:spec_decode_num_accepted_tokens_total{model_name="m"} 30.0',
                 'conveyor:spec_decode_num_verifications_total{model_name="m"} 10.0',
                 'conveyor:spec_decode_acceptance_rate{model_name="m"} 0.75',
                 'conveyor:spec_decode_mean_accepted_length{model_name="m"} 4.0'):
        assert line in text
