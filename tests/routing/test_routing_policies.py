"""The routing policies on their own: round robin cycles, least_loaded follows the loads,
prefix_affinity keeps a shared prefix on one replica until that replica is much busier."""

from __future__ import annotations

import pytest

from conveyor.routing import make_router

REPLICAS = ["a", "b", "c"]


def _prompt(prefix: int, suffix: int, block_size: int = 4, blocks: int = 3) -> list[int]:
    return [prefix] * (block_size * blocks) + [1000 + suffix] * block_size


def test_round_robin_cycles() -> None:
    r = make_router("round_robin")
    picks = [r.route(REPLICAS, [1, 2, 3], {}).replica for _ in range(6)]
    assert picks == REPLICAS * 2


def test_least_loaded_follows_loads() -> None:
    r = make_router("least_loaded")
    assert r.route(REPLICAS, [1], {"a": 3, "b": 1, "c": 2}).replica == "b"
    ties = {r.route(REPLICAS, [1], {}).replica for _ in range(3)}
    assert ties == set(REPLICAS)  # ties rotate


def test_prefix_affinity_keeps_a_prefix_on_one_replica() -> None:
    r = make_router("prefix_affinity", block_size=4)
    loads = {x: 0 for x in REPLICAS}
    homes = {}
    for prefix in range(3):
        d = r.route(REPLICAS, _prompt(prefix, 0), loads)
        assert not d.affinity_hit and d.matched_blocks == 0
        homes[prefix] = d.replica
        loads[d.replica] += 1
    assert set(homes.values()) == set(REPLICAS)  # new prefixes spread by load
    for i in range(1, 10):
        for prefix in range(3):
            d = r.route(REPLICAS, _prompt(prefix, i), loads)
            assert d.replica == homes[prefix] and d.affinity_hit
            assert d.matched_blocks == 3  # the suffix block differs


def test_prefix_affinity_balances_when_the_home_is_much_busier() -> None:
    r = make_router("prefix_affinity", block_size=4, balance_abs=2, balance_rel=1.5)
    home = r.route(REPLICAS, _prompt(7, 0), {}).replica
    loads = {x: 0 for x in REPLICAS}
    loads[home] = 2
    assert r.route(REPLICAS, _prompt(7, 1), loads).replica == home
    loads[home] = 10
    d = r.route(REPLICAS, _prompt(7, 2), loads)
    assert d.replica != home and not d.affinity_hit
    loads[home] = 0  # both now hold the prefix: the less loaded one wins
    loads[d.replica] = 1
    assert r.route(REPLICAS, _prompt(7, 3), loads).replica == home


def test_prefix_affinity_forgets_removed_replicas_and_short_prompts_balance() -> None:
    r = make_router("prefix_affinity", block_size=4)
    home = r.route(REPLICAS, _prompt(1, 0), {}).replica
    r.remove(home)
    rest = [x for x in REPLICAS if x != home]
    assert r.route(rest, _prompt(1, 1), {}).replica in rest
    d = r.route(REPLICAS, [5, 6], {"a": 1, "b": 0, "c": 1})  # under one block: no prefix
    assert d.replica == "b" and not d.affinity_hit


def test_unknown_router() -> None:
    with pytest.raises(ValueError, match="prefix_affinity"):
        make_router("random")
