"""`conveyor bench soak` against a running server, briefly: its hostile mix gets only the 4xx it
deserves, no 5xx, and no KV block is left behind."""

from __future__ import annotations

import argparse
import asyncio

from conveyor.bench.soak import add_parser, soak
from long_runs import sized


def test_short_soak_passes(server) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["soak", "--base-url", server.base_url, "--duration", str(sized(8, 600)),
                              "--rate", "4", "--hostile", "0.5", "--max-tokens", "4",
                              "--sample-every", "2", "--rss-tolerance", "1.0"])
    summary = asyncio.run(soak(server.base_url, args))
    assert summary["server_errors_5xx"] == 0 and summary["dropped_connections"] == 0
    assert not summary["wrong_status"] and not summary["failed_ordinary"]
    assert summary["kv_usage_at_end"] == 0.0
    assert {"ok", "not_json"} <= set(summary["by_kind"]), summary["by_kind"]
    assert summary["passed"]
