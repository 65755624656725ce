"""--profile: time outside the model forward, measured by wrapping an engine's parts."""

import time
from types import SimpleNamespace

import pytest
import torch

from conveyor.bench.throughput import format_profile, profile_engine


class FakeEngine:
    """The engine's shape as profile_engine sees it: scheduler, executor (+ model), outputs."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.scheduler = SimpleNamespace(schedule=self._schedule, update=lambda out, s: [])
        self.executor = SimpleNamespace(device="cpu", model=torch.nn.Linear(4, 4),
                                        execute=self._execute)
        self._outputs = SimpleNamespace(process=lambda groups: time.sleep(0.001) or [])

    def _schedule(self):
        n, decode = self.batches.pop(0)
        return SimpleNamespace(seqs=[object()] * n, num_new_tokens=[1 if decode else 8] * n)

    def _execute(self, out):
        time.sleep(0.001)  # input preparation
        self.executor.model(torch.zeros(1, 4))
        return [[0]] * len(out.seqs)

    def step(self):
        out = self.scheduler.schedule()
        self.scheduler.update(out, self.executor.execute(out))
        return self._outputs.process([])


def test_profile_splits_step_time_and_restores_the_engine():
    engine = FakeEngine([(4, False)] + [(4, True)] * 3 + [(2, True)] * 2)
    original_step = engine.step
    model = engine.executor.model
    forward_delay = 0.004

    def slow_forward(module, args, output):
        time.sleep(forward_delay)

    handle = model.register_forward_hook(slow_forward)  # runs inside the timed forward
    try:
        p = profile_engine(engine, lambda: [engine.step() for _ in range(6)])
    finally:
        handle.remove()
    everything = p["all_steps"]
    assert everything["steps"] == 6 and everything["batch"] == "2-4"
    top = p["decode_at_max_batch"]
    assert top["steps"] == 3 and top["batch"] == 4
    parts = everything["breakdown_pct"]
    assert everything["forward_pct"] + everything["overhead_pct"] == pytest.approx(100.0)
    assert sum(parts.values()) == pytest.approx(everything["overhead_pct"], abs=1e-6)
    assert parts["input prep+sampling"] > 0 and parts["outputs+detokenize"] > 0
    assert everything["forward_pct"] > 30  # 4 ms forward vs ~2 ms of the rest
    assert "decode_at_max_batch (3 steps, batch 4)" in format_profile(p)
    # nothing left behind: methods and hooks restored
    assert engine.step == original_step
    assert "step" not in vars(engine) and not model._forward_pre_hooks
