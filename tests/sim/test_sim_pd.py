"""Prefill/decode disaggregation in the simulator: accounting, the KV transfer, decode-pool
admission, the routing shared with the colocated fleet, and DistServe's goodput shape."""

import json
import math

import numpy as np
import pytest

import conveyor.routing
from conveyor.sim import fleet, pd_fleet
from conveyor.sim.cli import main
from conveyor.sim.kv_link import LinkSpec, parse_link
from conveyor.sim.metrics import SLO
from conveyor.sim.pd_fleet import parse_pd, simulate_pd
from conveyor.sim.pd_goodput import System, max_rate, sweep
from conveyor.sim.runner import SimConfig, simulate
from conveyor.sim.specs import load_hardware, load_model
from conveyor.sim.workload import generate

FAST = LinkSpec("test", 1000.0, 0.0)


def _config(**kw) -> SimConfig:
    return SimConfig(model=load_model("qwen3-0.6b"), hardware=load_hardware("l4"), **kw)


@pytest.mark.parametrize("policy", ["prefill_first", "chunked"])
def test_every_request_finishes_once_with_ttft_from_prefill_and_tpot_from_decode(policy):
    workload = generate(300, 30.0, input_len="uniform:1-400", output_len="uniform:1-40", seed=3)
    pd = simulate_pd(_config(policy=policy), workload, 2, 2, "least_loaded", FAST, rate=30.0)
    r, s = pd.result, pd.summary(SLO())
    assert s["served"] == 300 and np.all(~np.isnan(r.finished_s))
    assert np.array_equal(r.output_tokens, workload.output_tokens)  # 1 prefill-side + the rest
    per = {p["replica"]: p for p in s["per_replica"]}
    handed_off = workload.output_tokens > 1
    assert per["P0"]["requests"] + per["P1"]["requests"] == 300
    assert per["D0"]["requests"] + per["D1"]["requests"] == int(handed_off.sum())
    assert sum(p["output_tokens"] for p in per.values()) == int(workload.output_tokens.sum())
    # TTFT ends on the prefill side, at the handoff; decoding starts after the transfer
    assert np.array_equal(r.first_token_s[handed_off], pd.handoff_s[handed_off])
    assert np.all(np.isnan(pd.handoff_s[~handed_off]))
    full_blocks = workload.prompt_tokens >= 16
    loaded = handed_off & full_blocks
    assert np.all(pd.load_start_s[loaded] >= pd.handoff_s[loaded])
    assert np.all(r.finished_s[loaded] > pd.load_done_s[loaded])
    assert np.array_equal(pd.load_blocks[loaded], workload.prompt_tokens[loaded] // 16)
    assert s["kv_transfers"] == int(loaded.sum()) and s["decode_recomputed"] == 0
    assert per["P0"]["prefix_hit_rate"] == 0.0 and per["D0"]["prefix_hit_rate"] > 0.8


def test_single_request_matches_one_engine_plus_the_transfer():
    workload = generate(1, 1.0, input_len="fixed:1000", output_len="fixed:50", seed=0)
    config = _config()
    alone = simulate(config, workload)
    slow, fast = LinkSpec("slow", 1.0, 100.0), FAST
    runs = {link.name: simulate_pd(config, workload, 1, 1, "round_robin", link)
            for link in (slow, fast)}
    for pd in runs.values():
        assert pd.result.ttft_s[0] == pytest.approx(alone.ttft_s[0], rel=1e-12)
        blocks = int(pd.load_blocks[0])
        assert blocks == 1000 // 16
        expected = pd.link.transfer_s(blocks * pd.decode[0].connector.link.block_bytes)
        assert pd.load_done_s[0] - pd.load_start_s[0] == pytest.approx(expected, rel=1e-12)
    gap = runs["slow"].load_done_s[0] - runs["test"].load_done_s[0]
    assert gap > 0.05  # 7 MB at 1 GB/s
    e2e = {name: pd.result.e2e_s[0] for name, pd in runs.items()}
    assert e2e["slow"] - e2e["test"] == pytest.approx(gap, rel=1e-9)
    assert runs["slow"].result.tpot_s[0] > runs["test"].result.tpot_s[0]


def test_decode_pool_admission_waits_for_room():
    # 48 requests at once; each needs 6 decode blocks (80 prompt tokens, the first token and 7
    # more), so a pool of 24 holds 4 at a time: the others wait for room before their blocks move
    workload = generate(48, math.inf, input_len="fixed:80", output_len="fixed:8", seed=0)
    pd = simulate_pd(_config(num_gpu_blocks=24), workload, 2, 1, "round_robin", FAST)
    s = pd.summary(SLO())
    assert s["served"] == 48 and s["decode_recomputed"] == 0 and s["kv_transfers"] == 48
    assert pd.decode[0].scheduler.stats.num_preemptions == 0
    wait = pd.load_start_s - pd.handoff_s
    assert np.sort(wait)[-10:].min() > 0.05  # the last ones waited for many decode steps
    # never more requests holding decode blocks than fit: intervals [load start, finish]
    events = sorted([(t, 1) for t in pd.load_start_s] + [(t, -1) for t in pd.result.finished_s],
                    key=lambda e: (e[0], e[1]))
    assert np.cumsum([d for _, d in events]).max() == 24 // 6


def test_routing_is_the_colocated_fleets():
    assert pd_fleet.make_router is fleet.make_router is conveyor.routing.make_router
    workload = generate(40, 20.0, input_len="fixed:64", output_len="fixed:8", seed=0)
    pd = simulate_pd(_config(), workload, 2, 2, "round_robin", FAST)
    colocated = fleet.simulate_fleet(_config(), workload, 2, "round_robin")
    assert [i.load.requests for i in pd.prefill] == [r.requests for r in colocated.replicas]
    shared = simulate_pd(_config(), generate(60, 20.0, input_len="fixed:600", seed=1), 3, 1,
                         "prefix_affinity", FAST, shared_prefix=(3, 512))
    assert sum(i.load.affinity_hits for i in shared.prefill) > 40


def test_disaggregation_wins_under_tight_tpot_and_loses_under_loose_slo():
    # prefill-heavy (1000-2000 prompt tokens, 50-150 out) Llama-3-8B on A100s: 2 colocated
    # replicas against 1 prefill + 1 decode instance, same GPUs
    hardware, model = load_hardware("a100-80g"), load_model("llama-3-8b")
    config = SimConfig(model=model, hardware=hardware, policy="chunked")
    systems = [System(config, 2), System(config, 1, 1)]
    points = sweep(systems, [1, 2, 3, 4, 5, 6],
                   lambda rate: generate(150, rate, input_len="uniform:1000-2000",
                                         output_len="uniform:50-150", seed=0),
                   "least_loaded", parse_link("nvlink", hardware))
    colocated = [p for p in points if not p.system.disaggregated]
    disaggregated = [p for p in points if p.system.disaggregated]
    tight, loose = SLO(0.5, 0.0125), SLO(2.0, 0.075)
    assert max_rate(disaggregated, tight)[0] > 2 * max_rate(colocated, tight)[0]
    assert max_rate(colocated, loose)[0] > max_rate(disaggregated, loose)[0]


def test_max_rate_interpolates_and_marks_bounds():
    config = _config()
    workload = generate(30, 5.0, output_len="fixed:4", seed=0)
    point = sweep([System(config, 1, 1)], [1.0], lambda r: workload, "round_robin", FAST)[0]
    assert max_rate([point], SLO(10, 10)) == (1.0, ">=")
    assert max_rate([point], SLO(1e-9, 1e-9)) == (1.0, "<")


def test_simulate_cli_pd(tmp_path, capsys):
    rc = main(["--model", "qwen3-0.6b", "--gpu", "l4", "--pd", "1:1,2:1", "--requests", "60",
               "--rate-per-gpu", "2,4", "--input-len", "uniform:200-600", "--output-len",
               "uniform:10-30", "--slo-scale", "0.5,1", "--plot", str(tmp_path),
               "--report", str(tmp_path / "pd.md"), "--json", str(tmp_path / "pd.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "colocated x2 (prefill_first)" in out and "PD 2:1 (prefill_first)" in out
    assert "Per-GPU goodput" in out
    assert (tmp_path / "pd_goodput.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "pd.json").read_text())
    assert [(r["system"], r["rate_per_gpu"]) for r in data["runs"][:3]] == [
        ("colocated x2 (prefill_first)", 2.0), ("PD 1:1 (prefill_first)", 2.0),
        ("PD 2:1 (prefill_first)", 2.0)]
    assert data["runs"][2]["rate"] == 6.0 and data["runs"][2]["num_gpus"] == 3
    assert set(data["max_rate_per_gpu"]) == {"colocated x2 (prefill_first)",
                                             "PD 1:1 (prefill_first)", "PD 2:1 (prefill_first)"}
    assert "pd_goodput.png" in (tmp_path / "pd.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--pd", "1"], "bad --pd '1'"),
    (["--pd", "0:1"], "bad --pd '0:1'"),
    (["--pd", "1:1", "--kv-link", "fast"], "bad --kv-link 'fast'"),
    (["--pd", "1:1", "--gpu", "rtx-4070-laptop", "--model", "qwen3-0.6b"], "no GPU interconnect"),
    (["--pd", "1:1", "--no-enable-prefix-caching"], "needs prefix caching on"),
    (["--pd", "1:1", "--model", "gemma3-270m"], "one KV-cache group"),
    (["--pd", "1:1", "--router", "round_robin,least_loaded"], "one --router"),
    (["--pd", "1:1", "--rate", "2", "--rate-per-gpu", "1"], "exclusive"),
    (["--pd", "1:1", "--slo-scale", "0"], "bad --slo-scale"),
    (["--rate-per-gpu", "1"], "use it with --pd"),
])
def test_pd_bad_flags_give_clear_errors(capsys, argv, message):
    assert main([*argv, "--requests", "5"]) == 2
    assert message in capsys.readouterr().err


def test_parse_pd():
    assert parse_pd("3:1") == (3, 1)
    with pytest.raises(ValueError, match="PREFILL:DECODE"):
        parse_pd("a:b")
