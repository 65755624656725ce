"""The simulator's fleet mode: N schedulers behind the routing code the Ray deployment runs."""

import json

import pytest

from conveyor.sim.cli import main
from conveyor.sim.fleet import prompt_builder, simulate_fleet
from conveyor.sim.metrics import SLO
from conveyor.sim.runner import SimConfig
from conveyor.sim.specs import load_hardware, load_model
from conveyor.sim.workload import generate


def _config(**kw) -> SimConfig:
    return SimConfig(model=load_model("qwen3-0.6b"), hardware=load_hardware("l4"), **kw)


def test_every_request_is_served_once_and_loads_add_up() -> None:
    workload = generate(400, 40.0, seed=1)
    fleet = simulate_fleet(_config(), workload, 4, "least_loaded", rate=40.0)
    s = fleet.summary(SLO())
    assert s["served"] == 400 and s["num_replicas"] == 4
    assert sum(r["requests"] for r in s["per_replica"]) == 400
    assert sum(r["output_tokens"] for r in s["per_replica"]) == int(workload.output_tokens.sum())
    assert all(r["requests"] > 50 for r in s["per_replica"])  # spread, not piled on one


def test_shared_prefix_prompts() -> None:
    workload = generate(20, 10.0, input_len="fixed:40", seed=0)
    prompt = prompt_builder(workload, (3, 32), seed=0)
    prompts = [prompt(i) for i in range(20)]
    assert all(len(p) == 40 for p in prompts)
    assert len({tuple(p[:32]) for p in prompts}) == 3
    assert all(p[32:] == [i] * 8 for i, p in enumerate(prompts))


def test_prefix_affinity_beats_round_robin_on_shared_prefixes() -> None:
    # Small KV caches: a replica cannot hold every group's prefix, so where a group goes matters.
    workload = generate(600, 30.0, input_len="fixed:600", output_len="fixed:20", seed=2)
    rates = {}
    for router in ("prefix_affinity", "round_robin"):
        fleet = simulate_fleet(_config(num_gpu_blocks=400), workload, 4, router, rate=30.0,
                               shared_prefix=(12, 512))
        rates[router] = fleet.summary(SLO())["prefix_hit_rate"]
    # 512 of 600 tokens shared: 85% is the most any router can reach
    assert rates["prefix_affinity"] > 0.8 and rates["round_robin"] < 0.7, rates


def test_kv_aware_reads_the_simulated_replicas_kv_events() -> None:
    """The same small caches: kv_aware finds each group's prefix where the replicas' KV events
    say it is, as well as prefix_affinity remembers where it sent it."""
    workload = generate(600, 30.0, input_len="fixed:600", output_len="fixed:20", seed=2)
    fleet = simulate_fleet(_config(num_gpu_blocks=400), workload, 4, "kv_aware", rate=30.0,
                           shared_prefix=(12, 512))
    s = fleet.summary(SLO())
    assert s["served"] == 600 and s["prefix_hit_rate"] > 0.8, s["prefix_hit_rate"]
    assert sum(r["affinity_hits"] for r in s["per_replica"]) > 400


def test_simulate_cli_fleet(tmp_path, capsys) -> None:
    rc = main(["--model", "qwen3-0.6b", "--gpu", "l4", "--rate", "20", "--requests", "200",
               "--replicas", "3", "--router", "prefix_affinity,round_robin",
               "--shared-prefix", "4:128", "--json", str(tmp_path / "fleet.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "3 replicas of qwen3-0.6b" in out and "affinity hits" in out
    runs = json.loads((tmp_path / "fleet.json").read_text())["runs"]
    assert [r["router"] for r in runs] == ["prefix_affinity", "round_robin"]
    assert all(len(r["per_replica"]) == 3 and r["served"] == 200 for r in runs)


def test_simulate_cli_fleet_errors(capsys) -> None:
    assert main(["--replicas", "2", "--router", "random", "--requests", "10"]) == 2
    assert "unknown router" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--replicas", "2", "--shared-prefix"])
