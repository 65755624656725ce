"""Table, ratio, JSON and plot writers of the benchmarks."""

import json
import math

import pytest

from conveyor.bench.report import (
    Measurement,
    SystemResult,
    format_serving_table,
    format_table,
    percentiles,
    plot_serving,
    plot_throughput,
    ratio,
    write_json,
)


def _result(system, walls, config="cfg", tokens=1000, prompt=500):
    return SystemResult(system, config, [Measurement(w, prompt, tokens) for w in walls],
                        peak_rss_mb=1234.0)


def test_best_and_median_pick_the_right_repeat():
    r = _result("conveyor", [4.0, 2.0, 5.0])
    assert r.best_and_median("output_tokens_per_s") == (500.0, 250.0)
    assert r.best_and_median("wall_s", lower_is_better=True) == (2.0, 4.0)
    assert r.best_and_median("total_tokens_per_s")[0] == 750.0


def test_ratio_is_peer_over_conveyor_and_nan_without_reference():
    assert ratio(50.0, 200.0) == 0.25
    assert math.isnan(ratio(50.0, math.nan)) and math.isnan(ratio(50.0, 0.0))


def test_table_shows_ratios_to_conveyor_and_skipped_peers():
    rows = [_result("conveyor", [2.0, 2.5]), _result("transformers", [8.0, 9.0], "static 64"),
            SystemResult("llamacpp", "", skipped="skipped (not installed)")]
    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "output tok/s vs conveyor" in lines[0]
    conveyor, peer, skipped = lines[2:]
    assert "1.00x" in conveyor
    assert "0.25x" in peer  # 1000/8 vs 1000/2
    assert "500 / 450" in conveyor  # best / median output tok/s (1000/2, 1000/2.5)
    assert "skipped (not installed)" in skipped and "llamacpp" in skipped


def test_single_stream_table_reports_ttft_in_ms_and_decode_rate():
    m = Measurement(3.0, 128, 256, ttft_s=0.05, decode_tokens_per_s=90.0)
    peer = Measurement(6.0, 128, 256, ttft_s=0.10, decode_tokens_per_s=45.0)
    table = format_table([SystemResult("conveyor", "c", [m]), SystemResult("llamacpp", "l", [peer])],
                         single_stream=True)
    assert "TTFT ms" in table and "decode tok/s" in table
    peer_line = table.splitlines()[3]
    assert "100 / 100" in peer_line  # TTFT ms
    assert "2.00x" in peer_line and "0.50x" in peer_line  # TTFT ratio, decode ratio


def test_json_round_trip(tmp_path):
    r = _result("conveyor", [2.0])
    r.extra["profile"] = {"overhead_pct": 5.0}
    path = tmp_path / "sub" / "out.json"
    write_json(path, {"results": [r.to_dict()]})
    raw = json.loads(path.read_text())
    assert raw["results"][0]["repeats"][0]["output_tokens_per_s"] == 500.0
    back = SystemResult.from_dict(raw["results"][0])
    assert back.repeats == r.repeats and back.extra == r.extra and back.label == "conveyor (cfg)"


def test_throughput_plot_is_a_png(tmp_path):
    path = tmp_path / "bars.png"
    plot_throughput([_result("conveyor", [2.0]), _result("transformers", [6.0]),
                     SystemResult("llamacpp", "", skipped="skipped (not installed)")],
                    path, "W1")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentiles():
    p = percentiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert p["mean"] == 3.0 and p["p50"] == 3.0
    assert p["p90"] == pytest.approx(4.6) and p["p99"] == pytest.approx(4.96)
    assert all(math.isnan(v) for v in percentiles([]).values())


def _serving_run(label, rate, ttft):
    lat = {"mean": ttft, "p50": ttft, "p90": ttft * 2, "p99": ttft * 3}
    return {"label": label, "request_rate": rate, "sent": 4, "completed": 4,
            "request_throughput": 1.0, "output_throughput": 100.0, "goodput": 0.5,
            "preemptions": 2, "ttft": lat, "tpot": lat, "itl": lat, "e2e": lat}


def test_serving_table_and_merged_plot(tmp_path):
    runs = [_serving_run("prefill_first", 1.0, 0.1), _serving_run("prefill_first", math.inf, 0.4),
            _serving_run("chunked", 1.0, 0.05), _serving_run("chunked", math.inf, 0.2)]
    table = format_serving_table(runs)
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert "| prefill_first | inf | 4/4 |" in lines[3]
    assert "100 / 100 / 200 / 300" in lines[2]  # TTFT ms mean / p50 / p90 / p99
    path = tmp_path / "lat.png"
    plot_serving(runs, path, "test")
    assert path.read_bytes()[:4] == b"\x89PNG"
