"""One request/response cycle, and the worker that runs them in order for one connection.

The connection (vt.http.server) parses ahead and queues each request it has read whole; one
worker task answers the queue strictly in order, so the handler for request k+1 starts only after
response k is written. A response goes out whole (Content-Length), chunked from an async
iterator, or chunked from a PushBody its producer fills from callbacks.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

from vt.http.errors import HttpError, error_body
from vt.http.flow import FlowControl
from vt.http.messages import Handler, HttpRequest, PushBody, Response, StreamResponse

logger = logging.getLogger("vt.http")
# One line per answered request, as uvicorn's access log writes it for vLLM
# (--disable-uvicorn-access-log turns it off, --uvicorn-log-level sets its level).
access_logger = logging.getLogger("vt.access")

# Framing is ours: a handler may not override how the body is delimited.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
_LAST_CHUNK = b"0\r\n\r\n"


@dataclass
class QueuedRequest:
    """A fully received request waiting for its turn."""

    request: HttpRequest
    keep_alive: bool
    http10: bool
    is_head: bool


@dataclass
class Rejection:
    """A protocol-level error to answer, in order, before closing the connection."""

    status: int
    message: str
    response: Response | None = None  # the precheck's own answer, sent as it is


class ServerSide(Protocol):
    """What the worker asks of the server (vt.http.server.HttpServer): the handler, whether it
    is closing, its counters, the Date header and whether requests are logged."""

    @property
    def handler(self) -> Handler: ...

    @property
    def access_log(self) -> bool: ...

    @property
    def closing(self) -> bool: ...

    def request_started(self) -> None: ...

    def request_finished(self) -> None: ...

    def count_response(self, status: int) -> None: ...

    def date(self) -> str: ...


class ConnectionSide(Protocol):
    """What the worker asks of the connection it answers for."""

    @property
    def half_closed(self) -> bool:
        """The client sent EOF: the last request queued gets the close."""
        ...

    def resume_reading(self) -> None:
        """The queue has room again."""
        ...

    def close(self) -> None: ...

    def close_lingering(self) -> None: ...

    def queue_answered(self) -> None:
        """Every queued request is answered (a 100 Continue held back may go out now)."""
        ...

    def answering_stopped(self) -> None:
        """The worker ended: close, or wait for the next request."""
        ...


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def render_head(status: int, content_type: str | None, headers: Iterable[tuple[str, str]], *,
                keep_alive: bool, http10: bool, date: str, length: int | None,
                chunked: bool = False) -> bytes:
    """Status line and headers; Content-Length when `length` is not None."""
    if not isinstance(status, int) or not 100 <= status <= 999:
        raise ValueError(f"invalid HTTP status {status!r}")
    lines = [f"HTTP/1.1 {status} {_reason(status)}", "Server: vt", f"Date: {date}"]
    if content_type:
        lines.append(f"Content-Type: {content_type}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    if not keep_alive:
        lines.append("Connection: close")
    elif http10:
        lines.append("Connection: keep-alive")
    for name, value in headers:
        name, value = str(name), str(value)
        if any(c in name or c in value for c in "\r\n") or not name:
            raise ValueError(f"invalid response header {name!r}")
        if name.lower() not in _FRAMING_HEADERS:
            lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def render_closing(response: Response, date: str) -> bytes:
    """A whole response after which the connection closes (a rejection, a refused connection)."""
    return render_head(response.status, response.content_type, response.headers, keep_alive=False,
                       http10=False, date=date, length=len(response.body)) + response.body


def render_full(response: Response, item: QueuedRequest, keep_alive: bool, date: str) -> bytes:
    """A handler's whole response: no body for 1xx, 204, 304 and HEAD."""
    no_body = response.status < 200 or response.status in (204, 304)
    body = response.body
    if not isinstance(body, (bytes, bytearray, memoryview)):
        raise TypeError(f"Response.body must be bytes, got {type(body).__name__}")
    head = render_head(response.status, None if no_body else response.content_type, response.headers,
                       keep_alive=keep_alive, http10=item.http10, date=date,
                       length=None if no_body else len(body))
    return head if no_body or item.is_head else head + bytes(body)


def log_access(item: QueuedRequest, status: int) -> None:
    """The access-log line of one answered request: `client - "METHOD /path?query HTTP/1.1" 200 OK`."""
    if not access_logger.isEnabledFor(logging.INFO):
        return
    request = item.request
    client = f"{request.client[0]}:{request.client[1]}" if request.client else "-"
    target = f"{request.path}?{request.query}" if request.query else request.path
    access_logger.info('%s - "%s %s HTTP/%s" %d %s', client, request.method, target,
                       "1.0" if item.http10 else "1.1", status, _reason(status))


def internal_error() -> Response:
    return Response(500, error_body("Internal server error", type="server_error"))


def stopped_error() -> Response:
    """The answer to a request the server stopped before it was done (the shutdown timeout ran out)."""
    message = "the server stopped before this request was done; retry on another replica"
    return Response(503, error_body(message, type="service_unavailable"), headers=[("retry-after", "1")])


async def close_chunks(chunks: object) -> None:
    """Close a response iterator so the handler's `finally` runs; errors there are only logged."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("closing a response stream failed")


class Responder:
    """The worker of one connection: answers its queued requests strictly in order."""

    def __init__(self, server: ServerSide, flow: FlowControl, connection: ConnectionSide,
                 max_pipelined: int) -> None:
        self._server = server
        self._max_pipelined = max_pipelined  # below this many queued, a paused connection reads again
        self._flow = flow
        self._connection = connection
        self._queue: deque[QueuedRequest | Rejection] = deque()
        self._task: asyncio.Task[None] | None = None
        self._current: QueuedRequest | None = None  # the request being answered
        self.in_handler = False
        self._handler: asyncio.Future[Response | StreamResponse] | None = None  # the running handler
        self._handler_stopped = False  # stop_handler() cancelled it: its request gets stopped_error()

    @property
    def idle(self) -> bool:
        """No worker runs: nothing is queued or being answered."""
        return self._task is None

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def enqueue(self, item: QueuedRequest | Rejection) -> None:
        self._queue.append(item)
        if self._task is None and not self._flow.closed:
            self._task = asyncio.get_running_loop().create_task(self._work())

    def can_answer_half_closed(self) -> bool:
        """Whether a client that half-closed can still be answered (RFC 9112 9.6): a request waits
        or is being answered, no stream is under way (a client does not half-close in the middle
        of one) and none is HTTP/1.0 (no interim answers to probe with)."""
        waiting = [item for item in self._queue if isinstance(item, QueuedRequest)]
        if (not waiting and self._task is None) or self._flow.streaming:
            return False
        current = self._current
        return not ((current is not None and current.http10) or any(item.http10 for item in waiting))

    def connection_lost(self) -> None:
        if self._current is not None:
            self._current.request.disconnected.set()
        for item in self._queue:
            if isinstance(item, QueuedRequest):
                item.request.disconnected.set()
        self._queue.clear()
        # A running handler is left to notice `disconnected`; a stream is stopped at once.
        if self._task is not None and not self.in_handler:
            self._task.cancel()

    def stop_handler(self) -> None:
        """The server stops: a handler still at work on its request (reading its prompt, a
        template, a grammar, the engine's answer) is cancelled and its request answered 503."""
        handler = self._handler
        if handler is not None and not handler.done():
            self._handler_stopped = True
            handler.cancel()

    def cancel(self) -> asyncio.Task[None] | None:
        """Stop answering; returns the worker (cancelled) so the caller can wait for its cleanup."""
        task = self._task
        if task is not None:
            task.cancel()
        return task

    # -- the queue --------------------------------------------------------------------------------

    async def _work(self) -> None:
        flow, connection = self._flow, self._connection
        try:
            while self._queue and not flow.closed:
                item = self._queue.popleft()
                if flow.reading_paused and len(self._queue) < self._max_pipelined:
                    connection.resume_reading()
                if isinstance(item, Rejection):
                    self._reject(item)
                    return
                keep_alive = await self._serve(item)
                if not keep_alive or flow.closed:
                    connection.close()
                    return
                await flow.drain()  # a reader that stops reading stops the queue too
                if self._server.closing and not self._queue:  # the requests queued get their answers
                    connection.close()
                    return
            connection.queue_answered()
        except asyncio.CancelledError:
            pass  # the connection went away or the server is shutting down
        finally:
            self._task = None
            connection.answering_stopped()

    def _reject(self, item: Rejection) -> None:
        response = item.response or Response(item.status, error_body(item.message))
        try:
            payload = render_closing(response, self._server.date())
        except (ValueError, TypeError):
            logger.exception("the precheck returned an invalid response")
            response = internal_error()
            payload = render_closing(response, self._server.date())
        self._flow.write(payload)
        self._server.count_response(response.status)
        self._connection.close_lingering()

    # -- one request ------------------------------------------------------------------------------

    async def _serve(self, item: QueuedRequest) -> bool:
        """Run the handler for one request and write its response; return whether to keep alive."""
        server = self._server
        self._current = item
        server.request_started()
        try:
            response = await self._run_handler(item.request)
            if self._flow.closed:
                if isinstance(response, StreamResponse):
                    await close_chunks(response.chunks)
                return False
            # After a half-close or when the server closes, the last request queued gets the close.
            keep_alive = item.keep_alive and not ((server.closing or self._connection.half_closed)
                                                  and not self._queue)
            if isinstance(response, StreamResponse):
                return await self._send_stream(response, item, keep_alive)
            try:
                payload = render_full(response, item, keep_alive, server.date())
            except (ValueError, TypeError):
                request = item.request
                logger.exception("handler returned an invalid response for %s %s", request.method,
                                 request.path)
                response = internal_error()
                payload = render_full(response, item, keep_alive, server.date())
            server.count_response(response.status)
            if server.access_log:
                log_access(item, response.status)
            await self._flow.write_all(payload)
            return keep_alive
        finally:
            self._current = None
            server.request_finished()

    async def _run_handler(self, request: HttpRequest) -> Response | StreamResponse:
        self.in_handler = True
        # A task of its own, so that a stopping server can cancel the handler and still have this
        # worker write the 503 that answers its request.
        self._handler_stopped = False
        handler: asyncio.Future[Response | StreamResponse] | None = None
        try:
            handler = self._handler = asyncio.ensure_future(self._server.handler(request))
            response = await handler
            if not isinstance(response, (Response, StreamResponse)):
                raise TypeError(f"handler returned {type(response).__name__}, not Response/StreamResponse")
            return response
        except asyncio.CancelledError:
            if not (self._handler_stopped and handler is not None and handler.cancelled()):
                raise  # the worker itself is cancelled (the connection is gone)
            return stopped_error()
        except HttpError as exc:
            return Response(exc.status, exc.body(), headers=exc.headers)
        except Exception:
            logger.exception("handler failed for %s %s", request.method, request.path)
            return internal_error()
        finally:
            self.in_handler = False
            self._handler = None

    async def _send_stream(self, response: StreamResponse, item: QueuedRequest, keep_alive: bool) -> bool:
        chunked = not item.http10  # HTTP/1.0 has no chunked coding: the close ends the body
        keep_alive = keep_alive and chunked
        chunks = response.chunks
        headers = list(response.headers)
        if not any(str(name).lower() == "cache-control" for name, _ in headers):
            headers.append(("Cache-Control", "no-cache"))
        server, flow = self._server, self._flow
        try:
            head = render_head(response.status, response.content_type, headers, keep_alive=keep_alive,
                               http10=item.http10, date=server.date(), length=None, chunked=chunked)
        except (ValueError, TypeError):
            logger.exception("handler returned an invalid stream response")
            await close_chunks(chunks)
            error = internal_error()
            server.count_response(error.status)
            if server.access_log:
                log_access(item, error.status)
            flow.write(render_full(error, item, keep_alive, server.date()))
            return keep_alive
        server.count_response(response.status)
        if server.access_log:
            log_access(item, response.status)
        flow.write(head)
        completed = False
        flow.start_producing(chunks)
        try:
            if item.is_head:
                completed = True
            elif isinstance(chunks, PushBody):
                completed = await self._write_pushed(chunks, chunked)
            else:
                completed = await self._write_iterated(chunks, chunked)
        except Exception:
            logger.exception("response stream failed")
        finally:
            flow.stop_producing()
            await close_chunks(chunks)
        if not completed:
            # Headers are out: the only way left to signal failure is an unterminated body.
            self._connection.close()
            return False
        return keep_alive

    async def _write_pushed(self, body: PushBody, chunked: bool) -> bool:
        """Write what the producer sends until it ends the body; whether the body is complete."""
        flow = self._flow

        def emit(chunk: bytes) -> None:
            if chunk and not flow.closed:
                flow.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else bytes(chunk))

        if await body.run(emit) and not flow.closed:
            if chunked:
                flow.write(_LAST_CHUNK)
            return True
        return False

    async def _write_iterated(self, chunks: AsyncIterator[bytes], chunked: bool) -> bool:
        """Write each chunk the iterator yields, waiting for a slow reader; whether the body is
        complete."""
        flow = self._flow
        async for chunk in chunks:
            if flow.closed:
                return False
            if not chunk:
                continue  # an empty chunk would end the chunked body early
            flow.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else bytes(chunk))
            if flow.write_paused:
                await flow.drain()
            if flow.closed:
                return False
        if flow.closed:
            return False
        if chunked:
            flow.write(_LAST_CHUNK)
        return True
