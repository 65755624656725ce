"""Batch jobs (``/v1/batches``): OpenAI's batch objects, run in the background on the server's
own routes and persisted under the state folder, so that a restart resumes them.

A batch's files: ``<dir>/batches/<id>.json`` (its object, rewritten as it changes),
``<id>.output.jsonl`` and ``<id>.errors.jsonl`` (each result appended and flushed as its request
finishes). A restarted server reads them back, skips the custom ids already answered and runs
the rest. At the end the two result files become files (``purpose`` ``batch_output``) that
``output_file_id`` and ``error_file_id`` name. At most ``concurrency`` of a server's batch
requests are in the engine at once, at the batch priority (``lines.BATCH_PRIORITY``) under
``--queue priority``: interactive requests go first."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from conveyor.entrypoints.openai.batch.files import FileStore, write_atomic
from conveyor.entrypoints.openai.batch.lines import Line, LineError, read_lines, run_line
from conveyor.entrypoints.openai.errors import APIError, bad_request

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from conveyor.entrypoints.openai.state import ServerState

logger = logging.getLogger("conveyor.batch")

DEFAULT_CONCURRENCY = 8
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
WINDOW_S = {"24h": 86400}


class BatchManager:
    def __init__(self, root: Path, files: FileStore, app: Starlette, state: ServerState,
                 concurrency: int = DEFAULT_CONCURRENCY, invalid_unicode: str = "reject") -> None:
        self.root = root / "batches"  # made with the first batch
        self.files = files
        self.app = app
        self.state = state
        self.concurrency = concurrency
        self.invalid_unicode = invalid_unicode  # --invalid-unicode, for the input lines' text
        self.batches: dict[str, dict[str, Any]] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.stopping = asyncio.Event()
        for path in sorted(self.root.glob("batch_*.json")):
            obj = json.loads(path.read_text())
            self.batches[obj["id"]] = obj

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Resume the batches a previous run left unfinished (called once the app starts)."""
        for batch_id, obj in self.batches.items():
            if obj["status"] in ACTIVE:
                self._launch(batch_id)

    async def stop(self) -> None:
        """Stop running batches where they are: what finished is on disk, the rest runs after
        the next start."""
        self.stopping.set()
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    def _launch(self, batch_id: str) -> None:
        self.tasks[batch_id] = asyncio.create_task(self._run(batch_id))

    def _save(self, obj: dict[str, Any]) -> None:
        write_atomic(self.root / f"{obj['id']}.json", json.dumps(obj).encode())

    def _results(self, batch_id: str, kind: str) -> Path:
        return self.root / f"{batch_id}.{kind}.jsonl"

    # ------------------------------------------------------------ API
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """A batch of a checked ``routes.BatchRequest`` body, started at once."""
        input_file_id, endpoint = body["input_file_id"], body["endpoint"]
        window, metadata = body["completion_window"], body["metadata"]
        if window not in WINDOW_S:
            raise bad_request("'completion_window' must be 24h", param="completion_window")
        self.files.get(input_file_id)  # a 404 for an unknown file
        now = int(time.time())
        obj = {"id": f"batch_{uuid.uuid4().hex}", "object": "batch", "endpoint": endpoint,
               "errors": None, "input_file_id": input_file_id, "completion_window": window,
               "status": "validating", "output_file_id": None, "error_file_id": None,
               "created_at": now, "in_progress_at": None, "expires_at": now + WINDOW_S[window],
               "finalizing_at": None, "completed_at": None, "failed_at": None,
               "expired_at": None, "cancelling_at": None, "cancelled_at": None,
               "request_counts": {"total": 0, "completed": 0, "failed": 0},
               "metadata": metadata}
        self.batches[obj["id"]] = obj
        self._save(obj)
        self._launch(obj["id"])
        return obj

    def get(self, batch_id: str) -> dict[str, Any]:
        obj = self.batches.get(batch_id)
        if obj is None:
            raise APIError(404, f"No such batch: {batch_id!r}", param="batch_id",
                           code="batch_not_found")
        return obj

    def list(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise bad_request("'limit' must be between 1 and 100", param="limit")
        items = sorted(self.batches.values(), key=lambda b: (b["created_at"], b["id"]),
                       reverse=True)
        if after is not None:
            ids = [b["id"] for b in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        obj = self.get(batch_id)
        if obj["status"] not in ("validating", "in_progress"):
            raise APIError(409, f"Batch {batch_id} is {obj['status']}: only a validating or "
                           "in-progress batch can be cancelled", code="invalid_state")
        obj["status"], obj["cancelling_at"] = "cancelling", int(time.time())
        self._save(obj)
        task = self.tasks.get(batch_id)
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if obj["status"] == "cancelling":  # the task had ended: finish the cancel here
            self._finish(obj, "cancelled")
        return obj

    # ------------------------------------------------------------ running
    def _done_ids(self, batch_id: str) -> set[str]:
        done = set()
        for kind in ("output", "errors"):
            path = self._results(batch_id, kind)
            if not path.exists():
                continue
            with open(path, "rb") as f:
                for raw in f:
                    try:
                        done.add(json.loads(raw)["custom_id"])
                    except (json.JSONDecodeError, KeyError):
                        pass  # a line cut by a crash: that request runs again
        return done

    async def _run(self, batch_id: str) -> None:
        obj = self.batches[batch_id]
        try:
            if obj["status"] == "cancelling":
                self._finish(obj, "cancelled")
                return
            lines = self._validate(obj)
            if lines is None:
                return
            while self.state.engine is None:  # the model is still loading
                if self.state.load_error is not None:
                    return
                await asyncio.sleep(0.1)
            await self._run_lines(obj, lines)
            if not self.stopping.is_set():
                self._finish(obj, "completed")
        except asyncio.CancelledError:
            if obj["status"] == "cancelling" and not self.stopping.is_set():
                self._finish(obj, "cancelled")
            raise

    def _validate(self, obj: dict[str, Any]) -> list[Line] | None:
        try:
            data = self.files.content_path(obj["input_file_id"]).read_bytes()
            lines = read_lines(data, obj["endpoint"], self.invalid_unicode)
        except (LineError, APIError) as e:
            line = e.line if isinstance(e, LineError) else None
            code = e.code if isinstance(e, LineError) else "invalid_file"
            obj["errors"] = {"object": "list", "data": [
                {"code": code, "message": str(e), "param": None, "line": line}]}
            obj["status"], obj["failed_at"] = "failed", int(time.time())
            self._save(obj)
            return None
        if obj["status"] == "validating":
            obj["status"], obj["in_progress_at"] = "in_progress", int(time.time())
        obj["request_counts"]["total"] = len(lines)
        self._save(obj)
        return lines

    async def _run_lines(self, obj: dict[str, Any], lines: list[Line]) -> None:
        batch_id = obj["id"]
        done = self._done_ids(batch_id)
        counts = obj["request_counts"]
        counts["completed"] = counts["failed"] = 0
        for kind, key in (("output", "completed"), ("errors", "failed")):
            path = self._results(batch_id, kind)
            if path.exists():
                counts[key] = sum(1 for raw in path.read_bytes().splitlines() if raw.strip())
        todo = [line for line in lines if line.custom_id not in done]
        slots = asyncio.Semaphore(self.concurrency)
        queue = self.state.engine_args.queue
        self.root.mkdir(parents=True, exist_ok=True)
        outputs = open(self._results(batch_id, "output"), "ab")  # noqa: SIM115
        errors = open(self._results(batch_id, "errors"), "ab")  # noqa: SIM115

        async def one(line: Line) -> None:
            async with slots:
                result = await run_line(self.app, line, queue, self.stopping)
            if result is None:
                return
            ok, record = result
            target = outputs if ok else errors
            target.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
            target.flush()
            os.fsync(target.fileno())
            counts["completed" if ok else "failed"] += 1
            self._save(obj)

        try:
            await asyncio.gather(*(one(line) for line in todo))
        finally:
            outputs.close()
            errors.close()

    def _finish(self, obj: dict[str, Any], status: str) -> None:
        """Turn the result files into files and end the batch as ``status``."""
        now = int(time.time())
        obj["status"], obj["finalizing_at"] = "finalizing", obj["finalizing_at"] or now
        for kind, key, name in (("output", "output_file_id", "output"),
                                ("errors", "error_file_id", "errors")):
            path = self._results(obj["id"], kind)
            data = path.read_bytes() if path.exists() else b""
            if data and obj[key] is None:
                obj[key] = self.files.create(data, f"{obj['id']}_{name}.jsonl",
                                             "batch_output")["id"]
        obj["status"] = status
        obj[f"{status}_at"] = now
        self._save(obj)
