"""/metrics exports the KV offload tiers' hits, blocks and lost blocks (only with the tiers on)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from conveyor.core.kv_connector.offload import KVOffloadStats
from conveyor.engine.stats import EngineStats
from conveyor.entrypoints.openai.metrics import _EngineStatsCollector


def metrics_text(stats: EngineStats) -> str:
    registry = CollectorRegistry()
    registry.register(_EngineStatsCollector(SimpleNamespace(stats=stats), "m"))
    return generate_latest(registry).decode()


def test_kv_offload_metrics_are_exported_per_tier():
    text = metrics_text(EngineStats(kv_offload=KVOffloadStats(
        hits_cpu=48, hits_disk=32, blocks_cpu=3, blocks_disk=7, lost_blocks=2)))
    for line in ('conveyor:kv_offload_hits_total{model_name="m",tier="cpu"} 48.0',
                 'conveyor:kv_offload_hits_total{model_name="m",tier="disk"} 32.0',
                 'conveyor:kv_offload_blocks{model_name="m",tier="cpu"} 3.0',
                 'conveyor:kv_offload_blocks{model_name="m",tier="disk"} 7.0',
                 'conveyor:kv_offload_lost_blocks_total{model_name="m"} 2.0'):
        assert line in text
    assert "kv_offload" not in metrics_text(EngineStats())
