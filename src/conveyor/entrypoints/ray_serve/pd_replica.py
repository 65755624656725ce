"""A replica's two halves of prefill/decode disaggregation (``pd_fleet.py``, docs/kv_cache.md).

``prefill_stream`` (a producer replica): runs the request (the ingress capped it at its first
token) and, when it ends at that cap, yields the first token as a delta that is not finished,
then a ``KVHandoff``: the prompt blocks the engine read out right after the step
(``HandoffExporter``), encoded off the engine thread and put into Ray's object store one object
per block. A request that ended otherwise (stopped, ignored, aborted) ends here as usual.

``decode_stream`` (a consumer replica): fetches the blocks (those that arrive in a row from the
first; a block whose object is lost, e.g. its prefill replica died, and all after it are
computed instead), offers them to its engine for the request, runs the request and, however it
ends, drops what is left of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.kv_transfer import ExportedBlocks, HandoffExporter, StoredBlock, encode_blocks
from conveyor.entrypoints.ray_serve.pd_handoff import BlockRef, KVHandoff

logger = logging.getLogger("conveyor.serve")


async def prefill_stream(engine: Any, exporter: HandoffExporter, request_id: str,
                         prompt: dict[str, Any], params: SamplingParams, priority: int,
                         fairness_key: str | None) -> AsyncIterator[Any]:
    """``engine``: the replica's AsyncEngine."""
    future = exporter.expect(request_id)
    tokens: list[int] = []
    try:
        async with aclosing(engine.generate(prompt, params, request_id, priority,
                                            fairness_key)) as deltas:
            async for delta in deltas:
                tokens += delta.outputs[0].token_ids if delta.outputs else []
                if not (delta.finished and delta.outputs
                        and delta.outputs[0].finish_reason == "length"):
                    yield delta
                    continue
                yield _unfinished(delta)  # the client's first token, before the copy
                exported = await asyncio.wrap_future(future)
                blocks = await asyncio.to_thread(_put_blocks, exported)
                yield KVHandoff(delta.prompt_token_ids, tokens[0], exported.namespace, blocks,
                                delta.num_cached_tokens)
    finally:
        exporter.forget(request_id)


async def decode_stream(engine: Any, transfer: Any, request_id: str, handoff: KVHandoff,
                        prompt: dict[str, Any], params: SamplingParams, priority: int,
                        fairness_key: str | None) -> AsyncIterator[Any]:
    """``engine``: the replica's AsyncEngine; ``transfer``: its LLMEngine's KVTransfer."""
    blocks = await _fetch(handoff, transfer.namespace)
    await engine.run_in_engine_thread(transfer.receive, request_id, blocks)
    try:
        async with aclosing(engine.generate(prompt, params, request_id, priority,
                                            fairness_key)) as deltas:
            async for delta in deltas:
                yield delta
    finally:
        # not awaited: the stream may be closing because its task was cancelled
        _background(engine.run_in_engine_thread(transfer.release, request_id))


_TASKS: set[asyncio.Future] = set()


def _background(coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    _TASKS.add(task)
    task.add_done_callback(_TASKS.discard)


def _unfinished(delta: Any) -> Any:
    outputs = [dataclasses.replace(c, finish_reason=None, stop_reason=None)
               for c in delta.outputs]
    return dataclasses.replace(delta, finished=False, outputs=outputs)


def _put_blocks(exported: ExportedBlocks) -> list[BlockRef]:
    import ray

    return [BlockRef(b.record, ray.put((b.header, b.payload))) for b in encode_blocks(exported)]


async def _fetch(handoff: KVHandoff, namespace: bytes) -> list[StoredBlock]:
    if handoff.namespace != namespace:
        logger.warning("KV blocks of another model or layout handed over; computing them")
        return []
    got = await asyncio.gather(*(b.ref for b in handoff.blocks), return_exceptions=True)
    blocks = []
    for block, value in zip(handoff.blocks, got, strict=True):
        if isinstance(value, BaseException):
            logger.warning("%d of %d KV blocks handed over could not be fetched (%r); "
                           "computing them", len(got) - len(blocks), len(got), value)
            break
        header, payload = value
        blocks.append(StoredBlock(block.record, header, payload))
    return blocks
