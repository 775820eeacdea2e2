"""Work a handler waits on that a client's going away ends: the work is cancelled, the answer 499."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from vt.http.errors import HttpError

T = TypeVar("T")


async def unless_disconnected(disconnected: asyncio.Event, work: Awaitable[T]) -> T:
    """The result of `work`, unless `disconnected` is set first: then `work` is cancelled (and
    awaited) and the answer is a 499. A handler cancelled while it waits cancels `work` too."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected.wait())
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise HttpError(499, "client closed the request", code="client_closed_request")
    return task.result()
