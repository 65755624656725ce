"""The compile cache's limits on the real SmolLM2 tokenizer: a compile past its time limit fails
naming the flag, one that nobody waits for is stopped (its process and memory gone) without
delaying the next, a grammar larger than its share of the cache is refused, and the cache
keeps its compiled grammars within its bytes."""

from __future__ import annotations

import os
import time

import pytest

from conveyor.core.structured_outputs_params import StructuredOutputsParams as S
from conveyor.model.loader import default_model_path
from conveyor.structured_outputs import GrammarCompileCache, tokenizer_info

VOCAB = 49152
EOS = 2
HUGE_ENUM = S(json={"type": "string", "enum": [f"value-{i}-x" for i in range(100_000)]})


@pytest.fixture(scope="module")
def info():
    from conveyor.model.tokenizer import load_tokenizer

    return tokenizer_info(load_tokenizer(default_model_path()), VOCAB, [EOS])


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def _busy_worker(cache: GrammarCompileCache, before: dict[int, float]) -> int:
    """The compile process whose memory grew by 100 MiB over ``before`` (the one compiling)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in cache._pool.pids():
            if pid in before and _rss_mib(pid) > before[pid] + 100:
                return pid
        time.sleep(0.1)
    raise AssertionError("no compile process grew")


def _idle_pids(cache: GrammarCompileCache) -> dict[int, float]:
    cache.compile(S(regex="[a-z]+"))  # the first process is up
    return {pid: _rss_mib(pid) for pid in cache._pool.pids()}


def test_a_compile_past_the_time_limit_fails_naming_the_flag(info) -> None:
    cache = GrammarCompileCache(info, timeout_s=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"within 1 s \(--structured-outputs-compile-timeout"):
            cache.compile(HUGE_ENUM)
        assert time.monotonic() - start < 30  # process start-up plus the second of compiling
        assert cache.compile(S(regex="[0-9]+")) is not None  # a fresh process takes the next
        assert len(cache) == 1  # the failure is not kept
    finally:
        cache.shutdown()


def test_a_compile_nobody_waits_for_is_stopped_and_frees_its_memory(info) -> None:
    cache = GrammarCompileCache(info, timeout_s=120.0)
    try:
        before = _idle_pids(cache)
        abandoned = cache.submit(HUGE_ENUM)
        pid = _busy_worker(cache, before)
        cache.release(abandoned)  # its only holder leaves
        assert abandoned.cancelled() or abandoned.exception() is not None
        deadline = time.monotonic() + 5
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), "the abandoned compile's process still runs"
        start = time.monotonic()
        assert cache.compile(S(regex="[a-f]{2,9}")) is not None
        assert time.monotonic() - start < 15  # a fresh process, not the enum's 30 s
        assert len(cache) == 2 and HUGE_ENUM.key() not in cache._entries
    finally:
        cache.shutdown()


def test_a_second_process_starts_only_when_compiles_overlap(info) -> None:
    cache = GrammarCompileCache(info, timeout_s=120.0)
    try:
        for i in range(3):
            cache.compile(S(regex=f"[a-z]{{{i + 1}}}"))
        assert len(cache._pool.pids()) == 1  # one after another: one process
        slow = cache.submit(S(json={"type": "string", "enum": [f"v{i}-x" for i in range(30_000)]}))
        assert cache.compile(S(regex="[0-9]{3}")) is not None  # beside the slow one
        assert len(cache._pool.pids()) == 2
        cache.release(slow)
    finally:
        cache.shutdown()


def test_requests_submitted_together_compile_side_by_side(info) -> None:
    """Two compiles queued before either starts: the first slot to take one leaves the other
    to the next slot, so the quick one does not wait behind the slow one. (The slow grammar
    compiles to about 70 MB, more than the default cache's per-grammar share: room is made.)"""
    cache = GrammarCompileCache(info, timeout_s=120.0, max_bytes=2**30)
    try:
        slow = cache.submit(S(json={"type": "string", "enum": [f"w{i}-x" for i in range(30_000)]}))
        quick = cache.submit(S(regex="[0-9]{4}"))
        assert quick.result(timeout=60) is not None
        # the quick one finished while the slow one compiled
        assert not slow.done(), f"the slow compile ended first: {slow.exception()!r}"
        cache.release(quick)
        cache.release(slow)
    finally:
        cache.shutdown()


def test_a_constraint_held_by_another_request_keeps_compiling(info) -> None:
    cache = GrammarCompileCache(info)
    try:
        params = S(json={"type": "string", "enum": [f"v{i}" for i in range(3000)]})
        first = cache.submit(params)
        second = cache.submit(params)
        assert first is second
        cache.release(first)  # one holder leaves, one still waits
        assert second.result(timeout=60) is not None
        cache.release(second)
    finally:
        cache.shutdown()


def test_the_cache_keeps_within_its_bytes_and_refuses_larger_grammars(info) -> None:
    # a 2-choice grammar compiles to about 50 KB: eight fit, a quarter of the cache is the cap
    small = [S(choice=[f"a{i}", f"b{i}"]) for i in range(12)]
    size = GrammarCompileCache(info, max_bytes=2**30)
    try:
        one = size.compile(small[0]).memory_size_bytes
    finally:
        size.shutdown()
    cache = GrammarCompileCache(info, max_bytes=one * 8 + one // 2)
    try:
        for params in small:
            cache.compile(params)
            assert cache.num_bytes <= cache.max_bytes
        assert 7 <= len(cache) <= 8
        assert small[-1].key() in cache._entries and small[0].key() not in cache._entries
        with pytest.raises(ValueError, match="a quarter of --structured-outputs-cache-bytes"):
            cache.compile(S(json={"type": "string", "enum": [f"w{i}" for i in range(3000)]}))
    finally:
        cache.shutdown()


def test_shutdown_ends_the_processes(info) -> None:
    cache = GrammarCompileCache(info)
    pids = list(_idle_pids(cache))
    cache.shutdown()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), [p for p in pids if _alive(p)]
    assert os.getpid() not in pids
