"""StatsPublisher without a model: one snapshot per publish shared by every watcher, the
in-flight table built only while watched and at most every table_interval_s, each watcher at its
own cadence, a heartbeat while idle; request_rows from a real (torch-free) Scheduler."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from conveyor.core.config import CacheConfig, SchedulerConfig
from conveyor.core.sampling_params import SamplingParams
from conveyor.core.scheduler import Scheduler
from conveyor.core.stats import SchedulerStats
from conveyor.engine.stats import EngineStats
from conveyor.engine.stats_stream import StatsPublisher, request_rows

pytestmark = pytest.mark.timeout(60)


def _busy(step: int) -> EngineStats:
    return EngineStats(SchedulerStats(num_running=3, num_waiting=1), num_steps=step)


class _Groups:
    """A ``groups`` callable that counts how often the publisher asks for the table."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> list:
        self.calls += 1
        return []


def test_publish_without_watchers_never_builds_the_table() -> None:
    publisher, groups = StatsPublisher(), _Groups()
    for step in range(1000):
        publisher.publish(_busy(step), groups)
    assert groups.calls == 0
    assert publisher.latest.version == 1000
    assert publisher.latest.stats.num_steps == 999


def test_watchers_share_each_snapshot_at_their_own_cadence() -> None:
    publisher, groups = StatsPublisher(table_interval_s=0.25), _Groups()
    intervals = [0.1, 0.1, 0.1, 0.2, 0.3]
    stop = threading.Event()

    def engine_thread() -> None:  # ~500 steps a second, as a fast engine would
        step = 0
        while not stop.is_set():
            step += 1
            publisher.publish(_busy(step), groups)
            time.sleep(0.002)

    async def watcher(interval: float, seconds: float) -> list:
        seen = []
        async for snapshot in publisher.watch(interval):
            seen.append((time.monotonic(), snapshot))
            if seen[-1][0] - seen[0][0] >= seconds:
                break
        return seen

    async def run() -> list:
        return await asyncio.gather(*(watcher(i, 1.5) for i in intervals))

    thread = threading.Thread(target=engine_thread)
    thread.start()
    try:
        started = time.monotonic()
        results = asyncio.run(run())
        elapsed = time.monotonic() - started
    finally:
        stop.set()
        thread.join()
    assert publisher.num_watchers == 0
    by_version = {}
    for interval, seen in zip(intervals, results, strict=True):
        versions = [s.version for _, s in seen]
        assert versions == sorted(set(versions)), "each event is newer than the one before"
        gaps = [b - a for (a, _), (b, _) in zip(seen, seen[1:], strict=False)]
        assert min(gaps) >= interval * 0.9, (interval, gaps)
        assert len(seen) <= 1.5 / interval + 2
        for _, snapshot in seen:
            assert by_version.setdefault(snapshot.version, snapshot) is snapshot  # built once
    # The table is rebuilt a few times a second while watched, not once per step.
    assert 1 <= groups.calls <= elapsed / 0.25 + 3 + len(intervals)


def test_an_idle_engine_still_gets_heartbeats() -> None:
    publisher = StatsPublisher()
    publisher.publish(EngineStats())

    async def run() -> list:
        seen = []
        async for snapshot in publisher.watch(0.05, heartbeat_s=0.2):
            seen.append((time.monotonic(), snapshot.version))
            if len(seen) == 4:
                return seen
        return seen

    seen = asyncio.run(run())
    assert [v for _, v in seen] == [1, 1, 1, 1]
    assert all(b - a >= 0.18 for (a, _), (b, _) in zip(seen, seen[1:], strict=False))


def test_request_rows_from_a_scheduler() -> None:
    clock = [100.0]
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64),
                      CacheConfig(block_size=4, num_gpu_blocks=32), clock=lambda: clock[0])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i in range(4):
        sched.add_request(f"req-{i}<b>", list(range(1, 6)), params)
    clock[0] = 101.0
    out = sched.schedule()  # prefill of the first two
    sched.update(out, [[7]] * len(out.seqs))
    clock[0] = 103.0
    rows, total = request_rows(sched.unfinished_groups(), clock[0], max_rows=3)
    assert total == 4
    assert [(r.request_id, r.state) for r in rows] == [
        ("req-0<b>", "running"), ("req-1<b>", "running"), ("req-2<b>", "waiting")]
    assert rows[0].num_prompt_tokens == 5 and rows[0].num_output_tokens == 1
    assert rows[0].queue_s == pytest.approx(1.0) and rows[0].age_s == pytest.approx(3.0)
    assert rows[2].queue_s == pytest.approx(3.0) and rows[2].num_output_tokens == 0
