"""What a handler takes and returns: the parsed request, a whole response, a streamed one.

The HTTP server (vt.http.server) builds an HttpRequest per request and writes what its handler
returns; nothing here touches a socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class HttpRequest:
    """One parsed request as the handler sees it."""

    method: str
    path: str  # percent-decoded, without the query
    query: str  # raw query string, without '?'
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    client: tuple | None
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)  # set when the peer goes away


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class StreamResponse:
    """A chunked response: each bytes object the iterator yields (or the PushBody is sent) is
    written as one chunk.

    A body whose source produces on its own (a PushBody, or an iterator over queued outputs) may
    have `pause_producing()` / `resume_producing()`: the server calls them when the client falls
    more than the write buffer's high mark behind and when it catches up, so a slow reader costs
    that much memory and no more."""

    status: int
    chunks: AsyncIterator[bytes] | PushBody
    content_type: str = "text/event-stream"
    headers: list[tuple[str, str]] = field(default_factory=list)


class PushBody:
    """A chunked body that its producer writes into from plain callbacks, so no task wakes per
    chunk (a StreamResponse's iterator costs a task step and a few frames a chunk).

    The producer calls send() per chunk and end() once (ok=False: it broke, and the body is left
    unterminated, as for a failing iterator). Chunks sent before the server has written the head
    wait in a list. If the connection goes first the server calls aclose(), which runs on_abort.
    """

    def __init__(self, on_abort: Callable[[], None] | None = None,
                 on_pause: Callable[[bool], None] | None = None) -> None:
        self._on_abort = on_abort
        self._on_pause = on_pause  # called with True when the reader falls behind, False when caught up
        self._emit: Callable[[bytes], None] | None = None
        self._waiting: list[bytes] = []
        self._ended = False
        self._ok = True
        self._closed = False
        self._done: asyncio.Future[None] | None = None

    def send(self, chunk: bytes) -> None:
        if self._ended or self._closed:
            return
        if self._emit is None:
            self._waiting.append(chunk)
        else:
            self._emit(chunk)

    def end(self, ok: bool = True) -> None:
        if self._ended:
            return
        self._ended, self._ok = True, ok
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def run(self, emit: Callable[[bytes], None]) -> bool:
        """Server side: write what waited, then everything sent until end(); its ok flag."""
        self._emit = emit
        waiting, self._waiting = self._waiting, []
        for chunk in waiting:
            emit(chunk)
        if not self._ended:
            self._done = asyncio.get_running_loop().create_future()
            await self._done
        return self._ok

    def pause_producing(self) -> None:
        if self._on_pause is not None and not self._ended:
            self._on_pause(True)

    def resume_producing(self) -> None:
        if self._on_pause is not None and not self._ended:
            self._on_pause(False)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._emit = None
        if not self._ended and self._on_abort is not None:
            self._on_abort()


Handler = Callable[[HttpRequest], Awaitable["Response | StreamResponse"]]
# Called with a request's head (empty body) before `100 Continue` is sent: a Response refuses it.
Precheck = Callable[[HttpRequest], "Response | None"]
