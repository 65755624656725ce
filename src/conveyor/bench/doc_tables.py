"""`conveyor bench report`: the figure tables of README.md and docs/*.md, regenerated from the
result files they quote, so that no figure can drift from its file.

A generated region lies between two comments naming its kind and its result files (paths from
the repository's root):

    <!-- bench-report:throughput benchmarks/results/zen4/throughput_W1.json -->
    ...
    <!-- /bench-report:throughput -->

Kinds: ``throughput`` (one `bench throughput` file: the table and the notes the bench prints),
``summary`` (several `bench throughput` files of one machine: a row per workload, a column per
system), ``serve`` and ``embeddings`` (`bench serve` files, merged as ``--from-json`` merges
them), ``soak``. Every region ends with its files' provenance. ``--check`` changes nothing and
fails, with a diff, when a region is not what its files give.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conveyor.bench.embeddings import format_embedding_table
from conveyor.bench.provenance import missing_keys
from conveyor.bench.report import (
    SystemResult,
    format_serving_table,
    format_summary_table,
    format_table,
)
from conveyor.bench.soak import format_soak
from conveyor.bench.throughput import report_notes
from conveyor.bench.workloads import is_single_stream

START = re.compile(r"<!-- bench-report:(?P<kind>[\w-]+)(?P<files>(?: [^\s>]+\.json)+) -->\n")
Result = tuple[str, dict[str, Any]]  # (path from the root, the file's JSON)


class ReportError(Exception):
    """A region that cannot be generated: unknown kind, missing or unreadable file, no
    provenance, no end marker."""


def load_result(root: Path, path: str) -> dict[str, Any]:
    file = root / path
    if not file.is_file():
        raise ReportError(f"{path}: no such result file")
    try:
        payload = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None
    missing = missing_keys(payload.get("provenance"))
    if missing:
        raise ReportError(f"{path}: its provenance block lacks {', '.join(missing)}; `conveyor "
                          f"bench ... --json` records where a result came from, and the tables "
                          f"show only results that say so")
    return payload


def _throughput(results: list[Result]) -> str:
    if len(results) != 1:
        raise ReportError("a throughput region takes one file")
    payload = results[0][1]
    workload = payload["workload"]["name"]
    rows = [SystemResult.from_dict(d) for d in payload["results"]]
    table = format_table(rows, single_stream=is_single_stream(workload))
    notes = report_notes(payload, workload)
    return table + ("\n\n```text\n" + "\n".join(notes) + "\n```" if notes else "")


def _summary(results: list[Result]) -> str:
    return format_summary_table([(p["workload"]["name"],
                                  [SystemResult.from_dict(d) for d in p["results"]])
                                 for _, p in results])


def _serve(results: list[Result]) -> str:
    return format_serving_table([run for _, p in results for run in p["runs"]])


def _embeddings(results: list[Result]) -> str:
    return format_embedding_table([run for _, p in results for run in p["runs"]])


def _soak(results: list[Result]) -> str:
    if len(results) != 1:
        raise ReportError("a soak region takes one file")
    return "```text\n" + format_soak(results[0][1]) + "\n```"


KINDS: dict[str, Callable[[list[Result]], str]] = {
    "throughput": _throughput, "summary": _summary, "serve": _serve, "embeddings": _embeddings,
    "soak": _soak,
}


def render(kind: str, results: list[Result]) -> str:
    """A region's body: the kind's table, then a line per file saying where it came from."""
    if kind not in KINDS:
        raise ReportError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    return KINDS[kind](results) + "\n\n" + format_sources(results)


def format_sources(results: list[Result]) -> str:
    """One line: each file with the date and commit of its run, then the machine and versions
    they ran with (each fact once)."""
    runs, machine = [], []
    for path, payload in results:
        p = payload["provenance"]
        commit = (f", commit {p['commit'][:7]}" + (" with local changes" if p["dirty"] else "")
                  if p["commit"] else "")
        runs.append(f"`{path}` ({p['date'][:10]}{commit})")
        cpu = p["cpu"]
        facts = [(cpu["model"] or "unknown CPU") + (f", {cpu['cores']} cores" if cpu["cores"]
                                                    else "")]
        device = (payload.get("roofline") or {}).get("machine", {}).get("device", "cpu")
        if device != "cpu":  # a GPU run: the card first, the CPU as its host
            facts = [device, "host " + facts[0]]
        facts += [f"{name} {version}" for name, version in
                  [("torch", p["torch"]), *p["peers"].items()] if version]
        if p.get("backfilled"):
            facts.append("provenance backfilled from git history")
        machine += [fact for fact in facts if fact not in machine]
    return f"_From {', '.join(runs)}: {'; '.join(machine)}._"


def regenerate(text: str, root: Path, doc: str) -> tuple[str, list[str]]:
    """``text`` with every region rendered anew from its files, and the names of the regions
    that changed. ``doc`` names the file in errors."""
    out, changed, pos = [], [], 0
    for start in START.finditer(text):
        if start.start() < pos:
            continue  # a start marker quoted inside a region that is being replaced
        kind = start["kind"]
        end_marker = f"<!-- /bench-report:{kind} -->"
        end = text.find(end_marker, start.end())
        if end < 0:
            raise ReportError(f"{doc}: bench-report:{kind} has no {end_marker}")
        files = start["files"].split()
        try:
            body = "\n" + render(kind, [(f, load_result(root, f)) for f in files]) + "\n\n"
        except ReportError as e:
            raise ReportError(f"{doc}: bench-report:{kind}: {e}") from None
        if text[start.end():end] != body:
            changed.append(f"{kind} {' '.join(files)}")
        out += [text[pos:start.end()], body]
        pos = end
    out.append(text[pos:])
    return "".join(out), changed


def default_docs(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def main(args: argparse.Namespace) -> int:
    root = Path(args.root)
    docs = [Path(d) for d in args.docs] if args.docs else default_docs(root)
    try:
        updates = []
        for doc in docs:
            if not doc.is_file():
                raise ReportError(f"{doc}: no such file (run from the repository's root, or give "
                                  f"--root)")
            text = doc.read_text()
            new, changed = regenerate(text, root, str(doc))
            if changed:
                updates.append((doc, text, new, changed))
    except ReportError as e:
        print(f"conveyor bench report: {e}", file=sys.stderr)
        return 1
    for doc, text, new, changed in updates:
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(keepends=True), new.splitlines(keepends=True),
                f"{doc} (as it is)", f"{doc} (from the result files)"))
        else:
            doc.write_text(new)
            for region in changed:
                print(f"{doc}: regenerated {region}")
    if args.check and updates:
        count = sum(len(changed) for *_, changed in updates)
        print(f"conveyor bench report --check: {count} table(s) differ from their result files; "
              f"`conveyor bench report` regenerates them", file=sys.stderr)
        return 1
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="regenerate the README's and docs' figure tables "
                              "from the result files", description=__doc__.split("\n\n")[0])
    p.add_argument("docs", nargs="*", metavar="DOC",
                   help="Markdown files to regenerate (default: README.md and docs/*.md)")
    p.add_argument("--root", default=".",
                   help="the repository's root: result paths in the markers start here")
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 with a diff when a table differs from its files")
    p.set_defaults(func=main)
