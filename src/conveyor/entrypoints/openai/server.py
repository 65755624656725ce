"""Runs the app under uvicorn with Conveyor's shutdown: on SIGINT/SIGTERM keep accepting
connections but answer new requests 503, let running requests finish for up to
``shutdown_timeout`` seconds, abort the rest, then close the listener and exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import uvicorn

from conveyor.engine.args import EngineArgs
from conveyor.entrypoints.openai.access_log import AccessLogSettings
from conveyor.entrypoints.openai.app import build_app
from conveyor.entrypoints.openai.limits import ServerLimits
from conveyor.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from conveyor.entrypoints.openai.security import ServerSecurity
from conveyor.entrypoints.openai.server_paths import ClientPaths
from conveyor.entrypoints.openai.state import ServerState

logger = logging.getLogger("conveyor.serve")


# After the drain's abort, how long the aborted requests get to send their last answer.
ABORT_GRACE_S = 1.0
# How long an idle keep-alive connection gets to close once the server shuts down: over TLS a
# close waits for the client's close_notify, which an idle client never sends until it next
# uses the connection, so the stop would otherwise wait out the whole shutdown timeout.
IDLE_CLOSE_GRACE_S = 0.5


class _Server(uvicorn.Server):
    """The first signal starts a drain: the listener stays open and every new request gets 503
    (``state.draining``) while the running ones finish; when none is left, or when
    ``shutdown_timeout`` less a second has passed and the rest were aborted, uvicorn's own
    shutdown closes the listener. A second signal goes straight to that shutdown.

    uvicorn re-raises the caught signal after its shutdown, which would end the process with
    status -15; Conveyor treats a signal as a normal, successful stop instead."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state
        self._drain_deadline: float | None = None
        self._aborted_at: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # uvicorn cancels what still runs when timeout_graceful_shutdown expires, which would
        # cut streams mid-air; abort those requests a moment earlier instead, so that each
        # client gets its last chunk (finish_reason "abort") and [DONE].
        timeout = self.config.timeout_graceful_shutdown
        aborter = None
        if timeout is not None and self._state.engine is not None:
            aborter = asyncio.create_task(self._abort_after(max(0.0, timeout - 1.0)))
        closer = asyncio.create_task(self._drop_idle_connections_after(IDLE_CLOSE_GRACE_S))
        try:
            await super().shutdown(sockets)
        finally:
            closer.cancel()
            if aborter is not None:
                aborter.cancel()

    async def _drop_idle_connections_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        for connection in list(self.server_state.connections):
            cycle = getattr(connection, "cycle", None)
            transport = getattr(connection, "transport", None)
            if transport is not None and (cycle is None or cycle.response_complete):
                transport.abort()

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        return self._drain_deadline is not None and self._drained()

    def _drained(self) -> bool:
        """Whether the drain is over (called every tick while draining)."""
        if self._state.admission.in_flight == 0:
            return True
        now = time.monotonic()
        if self._aborted_at is None:
            assert self._drain_deadline is not None
            if now < self._drain_deadline:
                return False
            engine = self._state.engine
            n = engine.abort_all() if engine is not None else 0
            logger.warning("shutdown timeout: aborted %d running request(s)", n)
            self._aborted_at = now
            return False
        return now - self._aborted_at > ABORT_GRACE_S

    async def _abort_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        assert self._state.engine is not None
        n = self._state.engine.abort_all()
        if n:
            logger.warning("shutdown timeout: aborted %d running request(s)", n)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is None and self._state.engine is not None:
            logger.info("%s: answering new requests 503; finishing the running ones",
                        signal.Signals(sig).name)
            self._state.draining = True
            timeout = self.config.timeout_graceful_shutdown or 0.0
            self._drain_deadline = time.monotonic() + max(0.0, timeout - 1.0)
            return
        self._state.draining = True
        self.handle_exit(sig, frame)


def run_server(engine_args: EngineArgs, host: str = "127.0.0.1", port: int = 8000,
               served_model_name: str | None = None, max_queued_requests: int | None = None,
               shutdown_timeout: float = 30.0, log_level: str = "info",
               security: ServerSecurity | None = None, limits: ServerLimits | None = None,
               access_log: AccessLogSettings | None = None, ssl_keyfile: str | None = None,
               ssl_certfile: str | None = None, state: ServerState | None = None,
               reasoning_parser: str | None = None, tool_call_parser: str | None = None,
               lora_modules: dict[str, str] | None = None, allow_runtime_lora: bool = False,
               lora_paths: ClientPaths | None = None, batch_dir: str | None = None) -> int:
    """Serve until a signal; returns the process exit status. HTTPS when both ssl files are
    given. ``state``: serve over another engine (a fleet of replicas) instead of one built
    from ``engine_args``. ``reasoning_parser``: a name in ``REASONING_PARSERS``;
    ``tool_call_parser``: one in ``tool_parsers.PARSERS`` (None: the chat template's format).
    ``batch_dir``: where uploaded files and batch jobs are kept (None: the cache folder's).
    ``lora_modules``: LoRA adapters (name -> PEFT directory) served from the start;
    ``allow_runtime_lora``: clients may load and unload adapters, from under ``lora_paths``."""
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (security and security.api_keys) and host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach it may use it "
                       "(--api-key)", host)
    state = state or ServerState(engine_args, served_model_name, max_queued_requests)
    state.reasoning_parser = REASONING_PARSERS[reasoning_parser] if reasoning_parser else None
    state.tool_call_parser = tool_call_parser
    state.batch_dir = Path(batch_dir) if batch_dir else None
    state.lora_modules = dict(lora_modules or {})
    state.allow_runtime_lora = allow_runtime_lora
    state.lora_paths = lora_paths or ClientPaths()
    app = build_app(state, security, limits, access_log)
    # uvicorn's own access log is off: Conveyor's (access_log.py) has the token counts.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on",
                            ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)
    server = _Server(config, state)

    def fatal() -> None:  # called from the engine thread too: only sets a flag
        server.should_exit = True

    state.on_fatal = fatal
    server.run()
    if state.load_error is not None or (state.engine is not None and state.engine.error):
        return 1
    return 0
