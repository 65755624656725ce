"""`conveyor simulate` end to end through the CLI function, and its errors."""

import json

import pytest

from conveyor.sim.cli import main


def test_simulate_end_to_end_writes_json_plots_and_report(tmp_path, capsys):
    rc = main(["--model", "qwen3-0.6b", "--gpu", "l4", "--rate", "5,20",
               "--policy", "prefill_first,chunked", "--requests", "150", "--slo", "ttft=2s,tpot=80ms",
               "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots"),
               "--report", str(tmp_path / "report.md"), "--save-trace", str(tmp_path / "w.jsonl")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "qwen3-0.6b on 1 x l4" in out and "TTFT p50/p90/p99 ms" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["slo"] == "ttft<=2000ms,tpot<=80ms"
    runs = data["runs"]
    assert [(r["label"], r["rate"]) for r in runs] == [
        ("prefill_first/fcfs", 5.0), ("chunked/fcfs", 5.0),
        ("prefill_first/fcfs", 20.0), ("chunked/fcfs", 20.0)]
    for r in runs:
        assert r["served"] == 150 and r["output_tok_s"] > 0
        assert r["ttft_p50_ms"] <= r["ttft_p99_ms"]
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["cdf_rate_20.png", "cdf_rate_5.png", "latency_vs_rate.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:4] == b"\x89PNG" for p in plots)
    report = (tmp_path / "report.md").read_text()
    assert "| chunked/fcfs | 20 |" in report and "latency_vs_rate.png" in report

    # the saved trace replays to the same first run
    rc = main(["--model", "qwen3-0.6b", "--gpu", "l4", "--trace", str(tmp_path / "w.jsonl"),
               "--json", str(tmp_path / "replay.json")])
    assert rc == 0
    replay = json.loads((tmp_path / "replay.json").read_text())["runs"][0]
    assert replay["ttft_p50_ms"] == pytest.approx(runs[0]["ttft_p50_ms"], rel=1e-6)


def test_priority_queue_and_tp_flags(capsys):
    rc = main(["--model", "llama-3-70b", "--gpu", "h100-sxm", "--tp", "4", "--rate", "2",
               "--queue", "fcfs,priority", "--priorities", "0,1", "--requests", "60"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "llama-3-70b on 4 x h100-sxm" in out and "prefill_first/priority" in out


def test_list_specs(capsys):
    assert main(["--list-specs"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "rtx-4070-laptop" in out


@pytest.mark.parametrize("argv, message", [
    (["--gpu", "h1000"], "unknown hardware spec 'h1000'"),
    (["--model", "llama-3-70b"], "does not fit on 1 x h100-sxm"),
    (["--tp", "3"], "tp=3 must divide"),
    (["--slo", "ttft=fast"], "bad --slo"),
    (["--policy", "fifo"], "policy must be one of"),
    (["--input-len", "uniform:9-1"], "bad input length distribution"),
    (["--arrival", "weibull"], "bad arrival process"),
    (["--trace", "t.jsonl", "--rate", "5"], "--rate and --trace are exclusive"),
    (["--requests", "0"], "--requests must be >= 1"),
])
def test_bad_flags_give_clear_errors(capsys, argv, message):
    assert main([*argv]) == 2
    assert message in capsys.readouterr().err


def test_bad_rate_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--rate", "0"])
    assert e.value.code == 2
    assert "rates must be > 0" in capsys.readouterr().err
