"""`conveyor serve --data-parallel-size 2 --router kv_aware`: the router indexes the replicas' KV
events and keeps each conversation on the replica that holds it.

Three conversations of three turns, one request at a time, interleaved (an odd count: a router
that only rotated would move every conversation to the other replica on its next turn). Each
turn's prompt is the previous one plus new tokens, so a turn routed to the replica holding the
conversation finds its whole previous prompt cached there.
"""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import start_fleet

pytest.importorskip("ray.serve")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FLEET_FLAGS = ["--data-parallel-size", "2", "--ray-num-cpus", "2", "--threads-per-replica", "1",
               "--router", "kv_aware"]
CONVERSATIONS, TURNS, FIRST_BLOCKS, TURN_TOKENS = 3, 3, 8, 48


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    s = start_fleet(tmp_path_factory, FLEET_FLAGS)
    try:
        yield s
    finally:
        assert s.stop() == 0, s.log()


def _per_replica(m: dict[str, float], name: str) -> dict[str, float]:
    prefix = f"conveyor:{name}{{"
    return {k.split("replica=")[1].split(",")[0].rstrip("}"): v for k, v in m.items()
            if k.startswith(prefix) and "replica=" in k}


def _cache(m: dict[str, float]) -> tuple[float, float]:
    return (sum(_per_replica(m, "prefix_cache_hits_total").values()),
            sum(_per_replica(m, "prefix_cache_queries_total").values()))


def test_kv_aware_keeps_each_conversation_on_the_replica_holding_it(fleet) -> None:
    prompts = {c: [1000 + 997 * c + i for i in range(16 * FIRST_BLOCKS)]
               for c in range(CONVERSATIONS)}
    homes: dict[int, list[str]] = {c: [] for c in range(CONVERSATIONS)}
    with httpx.Client(base_url=fleet.base_url, timeout=120) as client:
        for turn in range(TURNS):
            if turn == 1:
                before = fleet.metrics()
            for c in range(CONVERSATIONS):
                sent0 = _per_replica(fleet.metrics(), "router_requests_total")
                resp = client.post("/v1/completions", json={"prompt": prompts[c],
                                                            "max_tokens": 2})
                assert resp.status_code == 200, resp.text
                sent1 = _per_replica(fleet.metrics(), "router_requests_total")
                (replica,) = [r for r in sent1 if sent1[r] > sent0.get(r, 0)]
                homes[c].append(replica)
                # the next turn: this prompt, an answer and a new message (new tokens)
                prompts[c] = prompts[c] + [20000 + 101 * c + 13 * turn + i
                                           for i in range(TURN_TOKENS)]
            time.sleep(0.5)  # the puller reads the replicas' events every 50 ms
    after = fleet.metrics()
    assert all(len(set(h)) == 1 for h in homes.values()), homes
    assert len({h[0] for h in homes.values()}) == 2, homes  # new conversations spread
    hits = _cache(after)[0] - _cache(before)[0]
    queries = _cache(after)[1] - _cache(before)[1]
    # turns 2 and 3 find their previous prompt's full blocks: 8 of 11 blocks, then 11 of 14
    assert hits / queries > 0.65, (hits, queries)
    affinity = _per_replica(after, "router_affinity_hits_total")
    assert sum(affinity.values()) >= CONVERSATIONS * (TURNS - 1)
