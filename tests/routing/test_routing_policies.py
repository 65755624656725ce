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


def test_prefix_affinity_keeps_an_adapter_on_its_home() -> None:
    """Short prompts (no prefix to match): an adapter's requests follow its home while the loads
    stay within the margin; base-model requests still spread by load."""
    r = make_router("prefix_affinity", block_size=4, balance_abs=2, balance_rel=1.5)
    loads = {x: 0 for x in REPLICAS}
    homes = {}
    for adapter in ("sql", "chat"):
        d = r.route(REPLICAS, [1, 2], loads, adapter=adapter)
        assert not d.affinity_hit
        homes[adapter] = d.replica
        loads[d.replica] += 1
    assert homes["sql"] != homes["chat"]  # a new adapter goes to the least loaded replica
    for i in range(4):
        for adapter in ("sql", "chat"):
            d = r.route(REPLICAS, [3, i], loads, adapter=adapter)
            assert d.replica == homes[adapter] and d.affinity_hit, (adapter, i, loads)
        loads = {x: 0 for x in REPLICAS}  # their requests finished
    base = [r.route(REPLICAS, [5, i], {}).replica for i in range(3)]
    assert set(base) == set(REPLICAS)  # the base model keeps least_loaded's rotation
    assert r.home("sql") == homes["sql"] and r.home("unseen") is None


def test_prefix_affinity_moves_an_adapter_off_a_much_busier_home() -> None:
    r = make_router("prefix_affinity", block_size=4, balance_abs=2, balance_rel=1.5)
    home = r.route(REPLICAS, [1], {}, adapter=7).replica
    loads = {x: 0 for x in REPLICAS}
    loads[home] = 2  # least loaded + balance_abs: still home
    assert r.route(REPLICAS, [1], loads, adapter=7).replica == home
    loads[home] = 3  # over the margin: the least loaded replica, which becomes its home
    d = r.route(REPLICAS, [1], loads, adapter=7)
    assert d.replica != home and not d.affinity_hit
    assert r.home(7) == d.replica
    loads[d.replica] = 2
    assert r.route(REPLICAS, [1], loads, adapter=7).replica == d.replica


def test_prefix_affinity_matches_a_prefix_only_under_its_adapter() -> None:
    """The same prompt under another adapter (or the base model) matches nothing: KV computed
    under one adapter is not another's. A prefix held under the adapter beats its home."""
    r = make_router("prefix_affinity", block_size=4)
    base_home = r.route(REPLICAS, _prompt(3, 0), {}).replica
    d = r.route(REPLICAS, _prompt(3, 1), {base_home: 1}, adapter="sql")
    assert d.replica != base_home and d.matched_blocks == 0 and not d.affinity_hit
    sql_prefix_home = d.replica
    other = next(x for x in REPLICAS if x not in (base_home, sql_prefix_home))
    loads = {base_home: 1, sql_prefix_home: 1, other: 0}
    assert r.route(REPLICAS, [9], loads, adapter="sql").replica == sql_prefix_home  # home
    d = r.route(REPLICAS, _prompt(3, 2), {}, adapter="sql")
    assert d.replica == sql_prefix_home and d.matched_blocks == 3 and d.affinity_hit
    d = r.route(REPLICAS, _prompt(3, 3), {}, adapter="chat")
    assert d.matched_blocks == 0 and not d.affinity_hit


def test_prefix_affinity_forgets_the_homes_on_a_removed_replica() -> None:
    r = make_router("prefix_affinity", block_size=4)
    home = r.route(REPLICAS, [1], {}, adapter="sql").replica
    r.remove(home)
    assert r.home("sql") is None
    rest = [x for x in REPLICAS if x != home]
    d = r.route(rest, [1], {}, adapter="sql")
    assert d.replica in rest and r.home("sql") == d.replica


@pytest.mark.parametrize("name", ["round_robin", "least_loaded"])
def test_load_only_routers_ignore_adapters(name: str) -> None:
    r = make_router(name)
    picks = [r.route(REPLICAS, [1], {}, adapter="sql").replica for _ in range(3)]
    assert sorted(picks) == sorted(REPLICAS)
