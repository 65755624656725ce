"""The web playground: the static page at ``/`` (chat + live scheduler pane) and the
``/v1/stats/stream`` server-sent-events endpoint that feeds its scheduler pane.

The stream reads the AsyncEngine's StatsPublisher (one snapshot per engine step) and never
touches the engine itself. Rates (tokens/s, batch size, tokens per step, prefix-cache hit rate)
are differences of the engine's cumulative counters between two consecutive events of one
stream, so an idle engine shows zeros instead of its last step.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from conveyor.engine.stats_stream import Snapshot, StatsPublisher
from conveyor.entrypoints.openai.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
DEFAULT_INTERVAL_S = 0.25
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.05, 10.0
HEARTBEAT_S = 1.0


class PlaygroundState(Protocol):
    """What the playground needs of the app's server state."""

    draining: bool

    def ready_engine(self) -> Any: ...


def register_playground(app: FastAPI, state: PlaygroundState) -> None:
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/stats/stream")
    async def stats_stream(request: Request) -> Response:
        interval = _interval(request.query_params.get("interval"))
        publisher = getattr(state.ready_engine(), "stats_publisher", None)
        if publisher is None:  # an engine that publishes no per-step statistics
            raise APIError(404, "This server has no statistics stream.", code="no_stats_stream")
        return StreamingResponse(
            _events(state, publisher, interval),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _interval(raw: str | None) -> float:
    if raw is None:
        return DEFAULT_INTERVAL_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not MIN_INTERVAL_S <= value <= MAX_INTERVAL_S:
        raise APIError(400, f"interval must be a number of seconds in [{MIN_INTERVAL_S}, "
                            f"{MAX_INTERVAL_S}], got {raw!r}", param="interval")
    return value


async def _events(state: PlaygroundState, publisher: StatsPublisher,
                  interval: float) -> AsyncIterator[str]:
    snapshots = publisher.watch(interval, max(interval, HEARTBEAT_S))
    previous: Snapshot | None = None
    try:
        async for snapshot in snapshots:
            if state.draining:
                return  # lets the server's graceful shutdown finish
            event = stats_event(previous, snapshot)
            event["watchers"] = publisher.num_watchers
            yield f"data: {json.dumps(event)}\n\n"
            previous = snapshot
    finally:
        await snapshots.aclose()


def stats_event(previous: Snapshot | None, snapshot: Snapshot) -> dict[str, Any]:
    """One event's JSON: the snapshot's gauges and totals, and rates since ``previous``."""
    s = snapshot.stats
    p = previous.stats if previous is not None else s
    q, pq = s.scheduler, p.scheduler
    elapsed = snapshot.time - previous.time if previous is not None else 0.0
    steps = s.num_steps - p.num_steps
    queries = q.prefix_cache_queries - pq.prefix_cache_queries

    def per_second(now: int, before: int) -> float:
        return (now - before) / elapsed if elapsed > 0 else 0.0

    return {
        "version": snapshot.version,
        "time": snapshot.wall_time,
        "waiting": q.num_waiting,
        "running": q.num_running,
        "swapped": q.num_swapped,
        "kv_usage": q.kv_usage,
        "free_blocks": q.num_free_blocks,
        "total_blocks": q.num_total_blocks,
        # None: no prompt was looked up since the previous event (no admission), so no rate.
        "prefix_cache_hit_rate": (q.prefix_cache_hits - pq.prefix_cache_hits) / queries
        if queries > 0 else None,
        "prefix_cache_hit_rate_total": q.prefix_cache_hits / q.prefix_cache_queries
        if q.prefix_cache_queries > 0 else 0.0,
        "steps_per_s": per_second(s.num_steps, p.num_steps),
        "batch_size": (s.scheduled_seqs_total - p.scheduled_seqs_total) / steps if steps else 0.0,
        "tokens_per_step": (s.scheduled_tokens_total - p.scheduled_tokens_total) / steps
        if steps else 0.0,
        "output_tokens_per_s": per_second(s.generation_tokens_total, p.generation_tokens_total),
        "prompt_tokens_per_s": per_second(s.prompt_tokens_total, p.prompt_tokens_total),
        "preemptions": q.num_preemptions,
        "num_steps": s.num_steps,
        "generation_tokens_total": s.generation_tokens_total,
        "prompt_tokens_total": s.prompt_tokens_total,
        "finished": dict(s.finished_by_reason),
        "num_requests": snapshot.num_requests,
        "requests": [{"id": r.request_id, "state": r.state, "prompt_tokens": r.num_prompt_tokens,
                      "output_tokens": r.num_output_tokens, "queue_s": round(r.queue_s, 3),
                      "age_s": round(r.age_s, 3)} for r in snapshot.requests],
    }
