"""`conveyor bench report`: the README's and docs' tables are what the repository's result files
say, a changed figure fails ``--check`` until the tables are regenerated, and a missing file or
one without provenance is a clear error."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import pytest

from conveyor.bench.doc_tables import ReportError, regenerate
from conveyor.bench.report import _fmt
from conveyor.entrypoints.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
W1 = "benchmarks/results/zen4/throughput_W1.json"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The README, docs and result files (without plots) in a directory of their own."""
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("*.png"))
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results",
                    ignore=shutil.ignore_patterns("*.png"))
    return tmp_path


def report(root: Path, *flags: str) -> int:
    return cli_main(["bench", "report", "--root", str(root), *flags])


def test_the_committed_tables_are_what_the_result_files_say(capsys):
    assert report(ROOT, "--check") == 0, capsys.readouterr().out[-3000:]
    readme = (ROOT / "README.md").read_text()
    assert f"<!-- bench-report:summary {W1} " in readme
    assert f"<!-- bench-report:throughput {W1} -->" in (ROOT / "docs/benchmarks.md").read_text()


def _output_rates(conveyor: dict) -> str:
    """Conveyor's output tok/s as the tables print them: best / median of the repeats."""
    rates = [m["output_tokens"] / m["wall_s"] for m in conveyor["repeats"]]
    return f"{_fmt(max(rates))} / {_fmt(statistics.median(rates))}"


def test_a_changed_figure_fails_the_check_until_the_tables_are_regenerated(repo, capsys):
    path = repo / W1
    payload = json.loads(path.read_text())
    conveyor = payload["results"][0]
    before = _output_rates(conveyor)
    for m in conveyor["repeats"]:
        m["wall_s"] /= 2  # every output tok/s figure of Conveyor's row doubles
    after = _output_rates(conveyor)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    capsys.readouterr()

    assert report(repo, "--check") == 1
    out, err = capsys.readouterr()
    summary_row = "| W1 | output tok/s, best / median | **{}** / {} |"
    assert "-" + summary_row.format(*before.split(" / ")) in out  # the README's row
    assert "+" + summary_row.format(*after.split(" / ")) in out
    assert f"-| conveyor | {conveyor['config']} | {before} |" in out  # docs/benchmarks.md's
    assert "2 table(s) differ from their result files" in err
    assert (repo / "README.md").read_text() == (ROOT / "README.md").read_text()  # untouched

    assert report(repo) == 0
    assert summary_row.format(*after.split(" / ")) in (repo / "README.md").read_text()
    assert report(repo, "--check") == 0


def test_a_missing_result_file_is_a_clear_error(repo, capsys):
    (repo / W1).unlink()
    assert report(repo, "--check") == 1
    assert (f"README.md: bench-report:summary: {W1}: no such result file"
            in capsys.readouterr().err)


def test_a_result_file_without_provenance_is_a_clear_error(repo, capsys):
    path = repo / W1
    payload = json.loads(path.read_text())
    del payload["provenance"]
    path.write_text(json.dumps(payload))
    assert report(repo) == 1
    err = capsys.readouterr().err
    assert f"{W1}: its provenance block lacks date, commit, dirty" in err
    assert (repo / "README.md").read_text() == (ROOT / "README.md").read_text()  # untouched


def test_regions_need_an_end_marker_and_a_known_kind(repo):
    with pytest.raises(ReportError, match="bench-report:throughput has no "
                                          "<!-- /bench-report:throughput -->"):
        regenerate(f"<!-- bench-report:throughput {W1} -->\ntext\n", repo, "doc.md")
    with pytest.raises(ReportError, match="unknown kind 'pie'"):
        regenerate(f"<!-- bench-report:pie {W1} -->\n<!-- /bench-report:pie -->\n", repo,
                   "doc.md")


def test_a_region_is_filled_from_its_file_and_the_rest_is_kept(repo):
    text = (f"# Title\n\n<!-- bench-report:summary {W1} -->\nstale\n"
            f"<!-- /bench-report:summary -->\n\nAfter.\n")
    new, changed = regenerate(text, repo, "doc.md")
    assert changed == [f"summary {W1}"]
    assert new.startswith(f"# Title\n\n<!-- bench-report:summary {W1} -->\n\n| workload |")
    assert new.endswith("._\n\n<!-- /bench-report:summary -->\n\nAfter.\n")
    p = json.loads((repo / W1).read_text())["provenance"]
    assert f"`{W1}` ({p['date'][:10]}, commit {p['commit'][:7]}" in new
    assert f"{p['cpu']['model']}, {p['cpu']['cores']} cores; torch {p['torch']}" in new
    assert regenerate(new, repo, "doc.md") == (new, [])


def test_a_gpu_run_names_the_card_then_its_host(repo):
    gpu = "benchmarks/results/h100/throughput_S1.json"
    text = f"<!-- bench-report:throughput {gpu} -->\n<!-- /bench-report:throughput -->\n"
    new, _ = regenerate(text, repo, "doc.md")
    assert "commit 50d5fd2): NVIDIA H100 80GB HBM3; host Intel(R) Xeon(R) Processor, 16 cores" in new
