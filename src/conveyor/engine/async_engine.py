"""AsyncEngine: an LLMEngine driven by a background thread, with one async stream per request.

The engine thread owns the LLMEngine: it alone calls ``add_request``, ``step``, ``abort_request``
and ``get_stats``. The event loop talks to it through a locked inbox (new requests, aborts) and a
wake-up event; results travel back with ``loop.call_soon_threadsafe``. So a model step never
blocks the event loop, and the engine never sees two threads at once.

``generate()`` yields *deltas*: each RequestOutput carries, per sample, only the text, token ids
and logprobs that are new since the previous one (samples that did not change are left out).
Leaving the iterator early (client gone, task cancelled) aborts the request, which frees its
KV blocks at the engine thread's next turn, i.e. within one step.

Requests are admitted at most ``ADMIT_PER_TURN`` between two steps (the rest wait their turn in
the thread's own queue): a request of thousands of prompts costs the running streams one step
of admissions at a time, not one long pause.

After every step the thread replaces ``stats`` (read by /metrics) and hands the same snapshot to
``stats_publisher``, which streams it to any number of watchers (the playground's stats stream).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import RequestOutputKind, SamplingParams
from conveyor.engine.stats_stream import StatsPublisher
from conveyor.lora.request import LoRARequest

if TYPE_CHECKING:
    from conveyor.engine.llm_engine import LLMEngine
    from conveyor.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

ADMIT_PER_TURN = 256  # requests added to the engine between two steps (``add_request`` each)

# Called in the engine thread after each step with that step's deltas and its end time
# (time.monotonic()); the server's Prometheus metrics hang off this.
OutputObserver = Callable[[list["RequestOutput"], float], None]


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


class EngineStoppedError(RuntimeError):
    """The engine is shutting down (or died) and admits no new request."""


@dataclass
class _NewRequest:
    request_id: str
    prompt: str | list[int] | dict[str, Any]
    sampling_params: SamplingParams | PoolingParams
    priority: int
    arrival_time: float
    fairness_key: str | None = None
    lora_request: LoRARequest | None = None


@dataclass
class _Sent:
    """How much of each sample a request's stream has already been given."""

    num_tokens: int = 0
    num_chars: int = 0
    num_logprobs: int = 0
    finished: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observers: list[OutputObserver] | None = None,
                 idle_wait_s: float = 0.5,
                 on_dead: Callable[[BaseException], None] | None = None) -> None:
        """``on_dead``: called (from the engine thread) when the engine cannot go on."""
        self.engine = engine
        self._on_dead = on_dead
        self._observers = list(observers or [])
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[_NewRequest] = []
        self._pending: deque[_NewRequest] = deque()  # engine thread: taken from the inbox, not yet admitted
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[..., Any], tuple[Any, ...], asyncio.Future[Any]]] = []
        self._stopping = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side only: request id -> queue of deltas / exceptions.
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        # Engine-thread side only: request id -> {sample index -> what was sent}.
        self._sent: dict[str, dict[int, _Sent]] = {}
        self.stats = engine.get_stats()  # latest snapshot, replaced (never mutated) by the thread
        self.stats_publisher = StatsPublisher()  # the same snapshots, for streaming watchers
        self.stats_publisher.publish(self.stats)

    # ---------------------------------------------------------------- properties
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def error(self) -> BaseException | None:
        """Why the engine thread died (None while it lives)."""
        return self._error

    def num_queued_requests(self) -> int:
        """Requests accepted but not yet scheduled (in the inbox or the engine's waiting queue)."""
        with self._lock:
            return len(self._inbox) + len(self._pending) + self.stats.scheduler.num_waiting

    # ---------------------------------------------------------------- lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="conveyor-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop admitting, abort whatever is still unfinished, and join the engine thread."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # ---------------------------------------------------------------- requests
    async def generate(self, prompt: str | list[int] | dict[str, Any],
                       sampling_params: SamplingParams | PoolingParams, request_id: str,
                       priority: int = 0,
                       fairness_key: str | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its RequestOutput deltas until it finishes.
        ``fairness_key``, ``lora_request``: see ``LLMEngine.add_request``.

        ``prompt`` is anything ``LLMEngine.add_request`` takes. Raises ValueError when the engine
        rejects the request (bad prompt or parameters) and EngineStoppedError when the engine no
        longer admits requests.
        """
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        if isinstance(sampling_params, SamplingParams):  # anything else: add_request refuses it
            # The streams' deltas are diffs of cumulative outputs (_delta).
            sampling_params = sampling_params.with_output_kind(RequestOutputKind.CUMULATIVE)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        with self._lock:
            if self._stopping or self._error is not None:
                raise EngineStoppedError("the engine is shutting down") from self._error
            self._streams[request_id] = queue
            self._inbox.append(_NewRequest(request_id, prompt, sampling_params, priority,
                                           time.monotonic(), fairness_key, lora_request))
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine never took it, or already dropped it
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def encode(self, prompt: str | list[int] | dict[str, Any],
                     pooling_params: PoolingParams, request_id: str, priority: int = 0,
                     fairness_key: str | None = None) -> RequestOutput:
        """Run one pooling request; its final output (``embedding`` set unless it was ignored
        or aborted: see ``finish_reason``). Raises as ``generate`` does."""
        final = None
        async for out in self.generate(prompt, pooling_params, request_id, priority, fairness_key):
            final = out
        assert final is not None and final.finished
        return final

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Serve an adapter: its files are read on a worker thread, then the engine thread
        installs it between steps, so the running batch never waits for the disk. ValueError
        for a bad adapter."""
        adapter = await asyncio.to_thread(self.engine.read_lora, lora_request)
        await self.run_in_engine_thread(self.engine.add_lora, lora_request, adapter)

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Stop serving an adapter (its running requests finish under it); False if unknown."""
        return await self.run_in_engine_thread(self.engine.remove_lora, lora_int_id)

    async def run_in_engine_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread between two steps; its result or exception."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.start() was not called")
        future: asyncio.Future[Any] = self._loop.create_future()
        with self._lock:
            if self._stopping or self._error is not None:
                raise EngineStoppedError("the engine is shutting down") from self._error
            self._calls.append((fn, args, future))
        self._wake.set()
        return await future

    def structured_outputs_compile_cache(self) -> Any:
        """The engine's grammar compile cache (thread-safe; building it the first time reads
        the vocabulary, so call it off the event loop)."""
        return self.engine.structured_outputs.compile_cache

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread). Its blocks are freed at the engine thread's next turn."""
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        """Abort every request that has a live stream (event-loop thread); how many there were."""
        request_ids = list(self._streams)
        for rid in request_ids:
            self.abort(rid)
        return len(request_ids)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    stopping = self._stopping
                self._run_calls(calls)
                self._pending.extend(inbox)
                self._drop_pending(aborts)
                self._admit(len(self._pending) if stopping else ADMIT_PER_TURN)
                if stopping:
                    aborts.extend(self._sent)
                outputs = self._abort_in_engine(aborts)
                if self._pending:
                    self._wake.set()  # more to admit after this step
                if self.engine.has_unfinished_requests():
                    self._publish_stats()  # queue counts include what was just admitted
                    started = time.monotonic()
                    outputs += self._step()
                    self._deliver(outputs)
                    if not outputs and time.monotonic() - started < 1e-3:
                        self._wake.wait(5e-3)  # nothing could run: don't spin hot
                    continue
                self._deliver(outputs)
                if outputs:  # the last requests were aborted: /metrics shows an idle engine
                    self._publish_stats()
                if stopping:
                    return
                self._wake.wait(self._idle_wait_s)
        except BaseException as e:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine thread died")
            with self._lock:
                self._error = e
            self._fail_all(e)
            if self._on_dead is not None:
                self._on_dead(e)

    def _run_calls(self, calls: list[tuple[Callable[..., Any], tuple[Any, ...],
                                           asyncio.Future[Any]]]) -> None:
        for fn, args, future in calls:
            try:
                result, error = fn(*args), None
            except Exception as e:  # handed to the caller
                result, error = None, e
            self._call_in_loop(_settle, future, result, error)

    def _drop_pending(self, aborts: list[str]) -> None:
        """Take aborted requests out of the not-yet-admitted ones (their streams end now)."""
        if not aborts or not self._pending:
            return
        gone = set(aborts)
        kept = [r for r in self._pending if r.request_id not in gone]
        for req in self._pending:
            if req.request_id in gone:
                self._post(req.request_id, EngineStoppedError("aborted before it was admitted"))
        self._pending = deque(kept)

    def _admit(self, limit: int) -> None:
        for _ in range(min(limit, len(self._pending))):
            req = self._pending.popleft()
            try:
                self.engine.add_request(req.request_id, req.prompt, req.sampling_params,
                                        priority=req.priority, arrival_time=req.arrival_time,
                                        fairness_key=req.fairness_key,
                                        lora_request=req.lora_request)
            except ValueError as e:
                self._post(req.request_id, e)
                continue
            self._sent[req.request_id] = {}

    def _abort_in_engine(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for rid in dict.fromkeys(request_ids):
            out = self.engine.abort_request(rid)
            if out is not None:
                outputs.append(out)
        return outputs

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception as e:
            if getattr(e, "engine_fatal", False):  # e.g. a lost tensor-parallel rank
                raise
            # A failing step poisons every request in it; fail them all, keep serving new ones.
            logger.exception("engine step failed; aborting all running requests")
            for rid in list(self._sent):
                self.engine.abort_request(rid)
                self._post(rid, RuntimeError(f"engine step failed: {e}"))
            self._sent.clear()
            return []

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        deltas = [d for d in (self._delta(o) for o in outputs) if d is not None]
        self._publish_stats()
        for observer in self._observers:
            try:
                observer(deltas, now)
            except Exception:  # observers are metrics; never let them stop the engine
                logger.exception("output observer failed")
        if deltas:
            self._call_in_loop(self._dispatch, deltas)

    def _delta(self, out: RequestOutput) -> RequestOutput | None:
        from conveyor.engine.outputs import CompletionOutput, RequestOutput

        sent_by_index = self._sent.get(out.request_id)
        if sent_by_index is None:
            return None  # already finished and delivered (e.g. aborted after finishing)
        changed = []
        for c in out.outputs:
            sent = sent_by_index.setdefault(c.index, _Sent())
            finished = c.finish_reason is not None
            new_tokens = list(c.token_ids[sent.num_tokens:])
            if not new_tokens and finished == sent.finished and len(c.text) <= sent.num_chars:
                continue
            logprobs = None
            if c.logprobs is not None:
                logprobs = list(c.logprobs[sent.num_logprobs:])
                sent.num_logprobs = len(c.logprobs)
            changed.append(CompletionOutput(
                index=c.index, text=c.text[sent.num_chars:], token_ids=new_tokens,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason, logprobs=logprobs))
            sent.num_tokens = len(c.token_ids)
            sent.num_chars = max(sent.num_chars, len(c.text))
            sent.finished = finished
        if out.finished:
            del self._sent[out.request_id]
        elif not changed:
            return None
        return RequestOutput(request_id=out.request_id, prompt=out.prompt,
                             prompt_token_ids=out.prompt_token_ids, outputs=changed,
                             finished=out.finished, metrics=out.metrics,
                             finish_message=out.finish_message,
                             prompt_logprobs=out.prompt_logprobs, embedding=out.embedding)

    def _publish_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._lock:
            self.stats = stats
        self.stats_publisher.publish(stats, self.engine.scheduler.unfinished_groups)

    def _post(self, request_id: str, item: Any) -> None:
        self._call_in_loop(self._dispatch_one, request_id, item)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            calls, self._calls = self._calls, []

        def fail() -> None:
            for queue in self._streams.values():
                queue.put_nowait(EngineStoppedError(f"the engine stopped: {error}"))
            for _fn, _args, future in calls:
                _settle(future, None, EngineStoppedError(f"the engine stopped: {error}"))

        self._call_in_loop(fail)

    def _call_in_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    # ---------------------------------------------------------------- event-loop side
    def _dispatch(self, deltas: list[RequestOutput]) -> None:
        for d in deltas:
            self._dispatch_one(d.request_id, d)

    def _dispatch_one(self, request_id: str, item: Any) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:  # None: the client left; its abort is already queued
            queue.put_nowait(item)
