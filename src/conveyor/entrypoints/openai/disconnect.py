"""A client that leaves: waiting on work until it is done or the client has disconnected,
whichever comes first (the work is then cancelled)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from conveyor.entrypoints.openai.errors import APIError

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request its client abandoned


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result; if the client leaves first, ``work`` is cancelled and a 499 raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise APIError(CLIENT_CLOSED_REQUEST, "the client closed the request")
    return task.result()


async def cancel_on_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Run a non-streaming handler; if the client leaves first, cancel it (which aborts its
    engine requests). Streaming responses get this from Starlette itself."""
    try:
        return await until_disconnect(request, work)
    except APIError as e:
        if e.status != CLIENT_CLOSED_REQUEST:
            raise
        return Response(status_code=CLIENT_CLOSED_REQUEST)
