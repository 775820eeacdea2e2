"""HTTP/1.1 server over httptools: keep-alive, ordered pipelining, limits, chunked streaming.

One `_Connection` protocol per socket parses ahead into a queue and a single worker task answers
the queue strictly in order, so the handler for request k+1 starts only after response k is written.
The server knows nothing of the engine: it calls one `Handler` per request.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from urllib.parse import unquote_to_bytes

import httptools

from vt.http.errors import HttpError, error_body

try:  # the kernel's send-queue size (Linux: SIOCOUTQ == TIOCOUTQ)
    import fcntl
    import termios

    _TIOCOUTQ: int | None = termios.TIOCOUTQ if sys.platform == "linux" else None
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]
    _TIOCOUTQ = None

logger = logging.getLogger("vt.http")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# An interim answer to a client that half-closed while its request is being worked on: a client
# that left entirely answers it with a reset, which ends the request (1xx only exists in 1.1).
_PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"
_EOF_PROBE_S = 0.25
# Framing is ours: a handler may not override how the body is delimited.
_FRAMING_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})
# Write-buffer marks: a streaming writer waits above HIGH, so a slow reader costs at most this much.
_WRITE_HIGH = 256 * 1024
_WRITE_LOW = 64 * 1024
_LINGER_S = 2.0  # how long a rejected client may keep sending before we close for good
_READ_SLACK = 256 * 1024  # the most one socket read hands us (asyncio: 256 KiB, uvloop: 64 KiB)
_WRITE_SLICE = 64 * 1024  # a full body goes out in slices, each written once the buffer drains


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits; every value must be positive."""

    max_header_bytes: int = 65536  # URL + header names + values; 431 beyond
    max_body_bytes: int = 16 * 1024 * 1024  # 413 beyond (Content-Length up front, chunked as it arrives)
    header_timeout_s: float = 10.0  # the whole head must arrive within this, from its first byte
    body_timeout_s: float = 30.0  # the whole body must arrive within this, from the end of the head
    keepalive_timeout_s: float = 30.0  # idle connections are closed after this
    max_connections: int = 1024  # beyond: 503 and close
    max_pipelined: int = 64  # parsed-but-unanswered requests before reading pauses
    write_timeout_s: float = 30.0  # output waiting this long with none of it taken by the peer: cut

    def __post_init__(self) -> None:
        for name in (
            "max_header_bytes",
            "max_body_bytes",
            "header_timeout_s",
            "body_timeout_s",
            "keepalive_timeout_s",
            "max_connections",
            "max_pipelined",
            "write_timeout_s",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"HttpLimits.{name} must be a positive number, got {value!r}")


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
    headers: list = field(default_factory=list)


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
        self._done: asyncio.Future | None = None

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


@dataclass
class _Pending:
    """A fully received request waiting for its turn."""

    request: HttpRequest
    keep_alive: bool
    http10: bool
    is_head: bool


@dataclass
class _Rejection:
    """A protocol-level error to answer, in order, before closing the connection."""

    status: int
    message: str
    response: Response | None = None  # the precheck's own answer, sent as it is


class _Reject(Exception):
    """Raised inside parser callbacks to stop parsing; the status is kept on the connection."""


def _kernel_unsent(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in the socket's kernel send queue (sent but unacknowledged, or unsent); 0 where the
    OS does not say."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or _TIOCOUTQ is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


async def _aclose(chunks: object) -> None:
    """Close a response iterator so the handler's `finally` runs; errors there are only logged."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is None:
        return
    try:
        await aclose()
    except Exception:
        logger.exception("closing a response stream failed")


class _Connection(asyncio.Protocol):
    """One client socket: parse ahead, queue, answer in order."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._limits = server.limits
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._client: tuple | None = None
        # The message being parsed.
        self._url = bytearray()
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_raw = 0
        self._body = bytearray()
        self._pending: _Pending | None = None
        self._in_message = False
        self._in_head = False
        self._rejection: _Rejection | None = None
        # Answering.
        self._queue: deque[_Pending | _Rejection] = deque()
        self._worker: asyncio.Task | None = None
        self._in_handler = False
        self._current: HttpRequest | None = None
        self._continue_pending = False
        # Connection state.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: str | None = None
        self._reading_paused = False
        self._parse_stopped = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future | None = None
        self._write_timer: asyncio.TimerHandle | None = None  # the write-progress watchdog
        self._written = 0  # bytes handed to the transport
        self._delivered_mark = 0  # bytes the peer had taken at the watchdog's last look
        self._progress_at = 0.0  # when the peer last took any
        self._producer: object | None = None  # the stream body being written, for pause hooks
        self._peer_eof = False  # the client half-closed: answer what arrived, then close
        self._eof_timer: asyncio.TimerHandle | None = None
        self._current_http10 = False
        self._closed = False
        self._lingering = False

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._client = transport.get_extra_info("peername")
        srv = self._server
        if srv._closing or srv.num_connections >= self._limits.max_connections:
            self._parse_stopped = True
            body = error_body("Too many connections", type="server_error")
            self._write(self._render(503, body, "application/json", [], keep=False, http10=False))
            srv._count(503)
            transport.close()
            return
        srv._connections.add(self)
        transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)  # type: ignore[attr-defined]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE chunks are small
            except (OSError, AttributeError):
                pass
        self._set_timer("idle", self._limits.keepalive_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._parse_stopped:
            return  # no further request will be answered on this connection
        if self._timer_kind == "idle":
            self._cancel_timer()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # We speak no other protocol: answer what was parsed, then close.
            if self._in_message:
                self._fail(400, "Protocol upgrade is not supported")
            else:
                self._stop_parsing()
            return
        except Exception as exc:
            if self._parse_stopped:
                return  # bytes after a `Connection: close` request: ignored
            rej = self._rejection or _Rejection(400, "Malformed HTTP request")
            logger.debug("rejecting request from %s: %s (%r)", self._client, rej.message, exc)
            self._fail(rej.status, rej.message, rej.response)
            return
        # httptools buffers a header line until it ends, out of our callbacks' sight: bound the raw
        # bytes a head may take. A chunk in which the head began may also hold the previous
        # request's tail, hence the slack of one read.
        if self._in_head:
            self._head_raw += len(data)
            if self._head_raw > 2 * self._limits.max_header_bytes + _READ_SLACK:
                self._fail(431, "Request header fields too large")

    def eof_received(self) -> bool:
        # RFC 9112 9.6: a client may half-close once its request is sent and still read the answer.
        # A cut-off request, nothing to answer, a stream already under way (a client does not
        # half-close in the middle of one) or HTTP/1.0 (no interim answers to probe with): the
        # client is gone.
        waiting = [item for item in self._queue if isinstance(item, _Pending)]
        if (self._in_message or (not waiting and self._worker is None) or self._producer is not None
                or self._current_http10 or any(item.http10 for item in waiting)):
            return False
        self._peer_eof = True
        self._stop_parsing()
        self._eof_timer = self._loop.call_later(_EOF_PROBE_S, self._probe_peer)
        return True

    def _probe_peer(self) -> None:
        """While a handler works on a half-closed connection's request, send an interim 102: a
        client that closed entirely answers with a reset and the request is aborted."""
        self._eof_timer = None
        if self._closed:
            return
        if self._in_handler:
            self._write(_PROCESSING)
        self._eof_timer = self._loop.call_later(_EOF_PROBE_S, self._probe_peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._parse_stopped = True
        self._cancel_timer()
        for timer in (self._write_timer, self._eof_timer):
            if timer is not None:
                timer.cancel()
        self._write_timer = self._eof_timer = None
        self._server._connections.discard(self)
        if self._current is not None:
            self._current.disconnected.set()
        for item in self._queue:
            if isinstance(item, _Pending):
                item.request.disconnected.set()
        self._queue.clear()
        self._wake_writer()
        # A running handler is left to notice `disconnected`; a stream is stopped at once.
        if self._worker is not None and not self._in_handler:
            self._worker.cancel()

    def pause_writing(self) -> None:
        self._write_paused = True
        pause = getattr(self._producer, "pause_producing", None)
        if pause is not None:
            pause()

    def resume_writing(self) -> None:
        self._write_paused = False
        resume = getattr(self._producer, "resume_producing", None)
        if resume is not None:
            resume()
        self._wake_writer()

    def _delivered(self) -> int:
        """Bytes the peer's TCP has taken: written, less what waits in our buffer and, where the
        OS tells (Linux SIOCOUTQ), in the kernel's send queue. Its rise is the reader's progress."""
        transport = self._transport
        pending = transport.get_write_buffer_size() if transport is not None else 0
        return self._written - pending - _kernel_unsent(transport)

    def _watch_writes(self) -> None:
        """Armed by a write: while output waits, the peer must take some of it at least every
        write_timeout_s, or the connection is cut (abort: close() would wait for the buffer to
        drain). It looks four times a timeout, so a cut comes within 1.25 timeouts of the last
        progress."""
        self._write_timer = self._loop.call_later(self._limits.write_timeout_s / 4, self._on_write_timeout)

    def _on_write_timeout(self) -> None:
        self._write_timer = None
        transport = self._transport
        if self._closed or transport is None:
            return
        delivered = self._delivered()
        if delivered >= self._written:
            return  # all out: the next write re-arms
        if delivered > self._delivered_mark:
            self._delivered_mark = delivered  # slow, but reading
            self._progress_at = self._loop.time()
        if self._loop.time() - self._progress_at < self._limits.write_timeout_s:
            self._watch_writes()
            return
        logger.info("closing connection from %s: nothing read for %.0f s", self._client,
                    self._limits.write_timeout_s)
        self._parse_stopped = True
        self._cancel_timer()
        transport.abort()

    # -- httptools callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = bytearray()
        self._raw_headers = []
        self._head_bytes = 0
        self._head_raw = 0
        self._body = bytearray()
        self._pending = None
        self._in_message = True
        self._in_head = True
        self._set_timer("head", self._limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._url += url  # may arrive in several pieces
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        self._raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self._in_head = False
        version = self._parser.get_http_version()
        if version == "0.9":
            self._reject(400, "HTTP/0.9 requests are not supported")
        if version not in ("1.0", "1.1"):
            self._reject(505, f"HTTP version {version} is not supported; use HTTP/1.1")
        headers: dict[str, str] = {}
        num_hosts = 0
        for raw_name, raw_value in self._raw_headers:
            name = raw_name.decode("latin-1").lower()
            value = raw_value.decode("latin-1").strip(" \t")  # OWS only: 0xA0 may end a UTF-8 value
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
            num_hosts += name == "host"
        te = headers.get("transfer-encoding")
        if te is not None and te.lower() != "chunked":
            self._reject(501, f"Unsupported Transfer-Encoding: {te}")
        cl = headers.get("content-length")
        if cl is not None:
            if not cl.isdigit():
                self._reject(400, "Invalid Content-Length")
            if int(cl) > self._limits.max_body_bytes:
                self._reject(413, f"Request body larger than {self._limits.max_body_bytes} bytes")
        # RFC 9112 3.2: exactly one Host in HTTP/1.1, at most one in 1.0.
        if num_hosts > 1 or (num_hosts == 0 and version == "1.1"):
            self._reject(400, "an HTTP/1.1 request needs exactly one Host header")
        try:
            url = httptools.parse_url(bytes(self._url))
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "Invalid request target")
        path = unquote_to_bytes(url.path).decode("utf-8", "replace") if url.path else "/"
        query = url.query.decode("latin-1") if url.query else ""
        method = self._parser.get_method().decode("ascii", "replace")
        http10 = version == "1.0"
        request = HttpRequest(method, path, query, headers, b"", self._client)
        self._pending = _Pending(request, self._parser.should_keep_alive(), http10, method == "HEAD")
        self._set_timer("body", self._limits.body_timeout_s)
        if headers.get("expect", "").lower() == "100-continue" and not http10:
            # Only a request that would be served is invited to send its body.
            precheck = self._server.precheck
            refusal = precheck(request) if precheck is not None else None
            if refusal is not None:
                self._rejection = _Rejection(refusal.status, "", refusal)
                raise _Reject("refused before 100 Continue")
            if self._worker is None:
                self._write(_CONTINUE)
            else:
                self._continue_pending = True  # sent once earlier responses are out

    def on_body(self, body: bytes) -> None:
        self._body += body
        if len(self._body) > self._limits.max_body_bytes:
            self._reject(413, f"Request body larger than {self._limits.max_body_bytes} bytes")

    def on_message_complete(self) -> None:
        self._cancel_timer()
        self._in_message = False
        self._continue_pending = False
        pending = self._pending
        self._pending = None
        if pending is None:
            return
        pending.request.body = bytes(self._body)
        self._body = bytearray()
        self._queue.append(pending)
        if not pending.keep_alive:
            self._stop_parsing()
        elif len(self._queue) >= self._limits.max_pipelined and not self._reading_paused:
            self._transport.pause_reading()
            self._reading_paused = True
        self._ensure_worker()

    # -- parsing helpers --------------------------------------------------------------------------

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self._limits.max_header_bytes:
            self._reject(431, "Request header fields too large")

    def _reject(self, status: int, message: str) -> None:
        self._rejection = _Rejection(status, message)
        raise _Reject(message)

    def _fail(self, status: int, message: str, response: Response | None = None) -> None:
        """Answer earlier requests, then this error (or `response`), then close."""
        self._stop_parsing()
        self._queue.append(_Rejection(status, message, response))
        self._ensure_worker()

    def _stop_parsing(self) -> None:
        self._parse_stopped = True
        self._in_message = False
        if self._timer_kind in ("head", "body"):
            self._cancel_timer()

    # -- timers -----------------------------------------------------------------------------------

    def _set_timer(self, kind: str, delay: float) -> None:
        self._cancel_timer()
        self._timer_kind = kind
        self._timer = self._loop.call_later(delay, self._on_timeout, kind)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = None
        self._timer_kind = None

    def _rearm_message_timer(self) -> None:
        if self._in_head:
            self._set_timer("head", self._limits.header_timeout_s)
        else:
            self._set_timer("body", self._limits.body_timeout_s)

    def _on_timeout(self, kind: str) -> None:
        self._timer = None
        self._timer_kind = None
        if kind in ("head", "body") and self._reading_paused:
            return  # the delay is ours (too many queued requests); re-armed on resume
        if not self._closed:
            logger.debug("closing connection from %s: %s timeout", self._client, kind)
            self._close_transport()

    # -- answering --------------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        if self._worker is None and not self._closed:
            self._worker = self._loop.create_task(self._work())

    async def _work(self) -> None:
        try:
            while self._queue and not self._closed:
                item = self._queue.popleft()
                if self._reading_paused and len(self._queue) < self._limits.max_pipelined:
                    self._reading_paused = False
                    self._transport.resume_reading()
                    if self._in_message:
                        self._rearm_message_timer()
                if isinstance(item, _Rejection):
                    resp = item.response or Response(item.status, error_body(item.message))
                    try:
                        payload = self._render(resp.status, resp.body, resp.content_type, resp.headers,
                                               False, False)
                    except (ValueError, TypeError):
                        logger.exception("the precheck returned an invalid response")
                        resp = self._internal_error()
                        payload = self._render(resp.status, resp.body, resp.content_type, [], False, False)
                    self._write(payload)
                    self._server._count(resp.status)
                    self._close_lingering()
                    return
                keep = await self._serve(item)
                if not keep or self._closed:
                    self._close_transport()
                    return
                await self._drain()  # a reader that stops reading stops the queue too
                if self._server._closing:
                    self._close_transport()
                    return
            if self._continue_pending and self._in_message and not self._closed:
                self._continue_pending = False
                self._write(_CONTINUE)
                self._set_timer("body", self._limits.body_timeout_s)
        except asyncio.CancelledError:
            pass  # the connection went away or the server is shutting down
        finally:
            self._worker = None
            if self._parse_stopped and not self._queue and not self._lingering:
                self._close_transport()
            elif not self._closed and not self._queue and not self._in_message:
                self._set_timer("idle", self._limits.keepalive_timeout_s)

    async def _serve(self, item: _Pending) -> bool:
        """Run the handler for one request and write its response; return whether to keep alive."""
        req = item.request
        srv = self._server
        self._current = req
        self._current_http10 = item.http10
        srv._in_flight += 1
        try:
            self._in_handler = True
            try:
                resp = await srv.handler(req)
                if not isinstance(resp, (Response, StreamResponse)):
                    raise TypeError(f"handler returned {type(resp).__name__}, not Response/StreamResponse")
            except HttpError as exc:
                resp = Response(exc.status, exc.body(), headers=exc.headers)
            except Exception:
                logger.exception("handler failed for %s %s", req.method, req.path)
                resp = self._internal_error()
            finally:
                self._in_handler = False
            if self._closed:
                if isinstance(resp, StreamResponse):
                    await _aclose(resp.chunks)
                return False
            # After a half-close, the last request queued gets the close.
            keep = item.keep_alive and not srv._closing and not (self._peer_eof and not self._queue)
            if isinstance(resp, StreamResponse):
                return await self._send_stream(resp, item, keep)
            try:
                payload = self._render_full(resp, item, keep)
            except (ValueError, TypeError):
                logger.exception("handler returned an invalid response for %s %s", req.method, req.path)
                resp = self._internal_error()
                payload = self._render_full(resp, item, keep)
            srv._count(resp.status)
            await self._write_all(payload)
            return keep
        finally:
            self._current = None
            self._current_http10 = False
            srv._in_flight_done()

    async def _send_stream(self, resp: StreamResponse, item: _Pending, keep: bool) -> bool:
        chunked = not item.http10  # HTTP/1.0 has no chunked coding: the close ends the body
        keep = keep and chunked
        chunks = resp.chunks
        extra = list(resp.headers)
        if not any(str(k).lower() == "cache-control" for k, _ in extra):
            extra.append(("Cache-Control", "no-cache"))
        try:
            head = self._render(resp.status, b"", resp.content_type, extra, keep, item.http10,
                                length=None, chunked=chunked)
        except (ValueError, TypeError):
            logger.exception("handler returned an invalid stream response")
            await _aclose(chunks)
            err = self._internal_error()
            self._server._count(err.status)
            self._write(self._render_full(err, item, keep))
            return keep
        self._server._count(resp.status)
        self._write(head)
        completed = False
        self._producer = chunks
        pause = getattr(chunks, "pause_producing", None)
        if self._write_paused and pause is not None:
            pause()  # the reader is behind already: hold the source from the start
        try:
            if item.is_head:
                completed = True
            elif isinstance(chunks, PushBody):
                def emit(chunk: bytes) -> None:
                    if chunk and not self._closed:
                        self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else bytes(chunk))

                if await chunks.run(emit) and not self._closed:
                    if chunked:
                        self._write(b"0\r\n\r\n")
                    completed = True
            else:
                async for chunk in chunks:
                    if self._closed:
                        break
                    if not chunk:
                        continue  # an empty chunk would end the chunked body early
                    self._write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else bytes(chunk))
                    if self._write_paused:
                        await self._drain()
                    if self._closed:
                        break
                else:
                    if not self._closed:
                        if chunked:
                            self._write(b"0\r\n\r\n")
                        completed = True
        except Exception:
            logger.exception("response stream failed")
        finally:
            self._producer = None
            await _aclose(chunks)
        if not completed:
            # Headers are out: the only way left to signal failure is an unterminated body.
            self._close_transport()
            return False
        return keep

    async def _write_all(self, data: bytes) -> None:
        """Write a full body in slices, each once the buffer is below its high mark, so a client
        that reads slowly holds at most one high mark of copies beyond the body itself."""
        if len(data) <= _WRITE_HIGH:
            self._write(data)
            return
        view = memoryview(data)
        for start in range(0, len(data), _WRITE_SLICE):
            await self._drain()
            if self._closed:
                return
            self._write(view[start:start + _WRITE_SLICE])

    async def _drain(self) -> None:
        while self._write_paused and not self._closed:
            waiter = self._loop.create_future()
            self._drain_waiter = waiter
            await waiter

    def _wake_writer(self) -> None:
        waiter = self._drain_waiter
        self._drain_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _internal_error(self) -> Response:
        return Response(500, error_body("Internal server error", type="server_error"))

    # -- output -----------------------------------------------------------------------------------

    def _render_full(self, resp: Response, item: _Pending, keep: bool) -> bytes:
        no_body = resp.status < 200 or resp.status in (204, 304)
        body = resp.body
        if not isinstance(body, (bytes, bytearray, memoryview)):
            raise TypeError(f"Response.body must be bytes, got {type(body).__name__}")
        head = self._render(
            resp.status,
            b"",
            None if no_body else resp.content_type,
            resp.headers,
            keep,
            item.http10,
            length=None if no_body else len(body),
        )
        return head if no_body or item.is_head else head + bytes(body)

    def _render(
        self,
        status: int,
        body: bytes,
        content_type: str | None,
        headers: list,
        keep: bool,
        http10: bool,
        length: int | None = -1,
        chunked: bool = False,
    ) -> bytes:
        """Status line + headers (+ `body` when `length` is -1, meaning "use len(body)")."""
        if not isinstance(status, int) or not 100 <= status <= 999:
            raise ValueError(f"invalid HTTP status {status!r}")
        lines = [f"HTTP/1.1 {status} {_reason(status)}", "Server: vt", f"Date: {self._server._date()}"]
        if content_type:
            lines.append(f"Content-Type: {content_type}")
        if length == -1:
            lines.append(f"Content-Length: {len(body)}")
        elif length is not None:
            lines.append(f"Content-Length: {length}")
        if chunked:
            lines.append("Transfer-Encoding: chunked")
        if not keep:
            lines.append("Connection: close")
        elif http10:
            lines.append("Connection: keep-alive")
        for name, value in headers:
            name, value = str(name), str(value)
            if any(c in name or c in value for c in "\r\n") or not name:
                raise ValueError(f"invalid response header {name!r}")
            if name.lower() not in _FRAMING_HEADERS:
                lines.append(f"{name}: {value}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head + body if length == -1 else head

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            self._written += len(data)
            if self._write_timer is None:
                self._delivered_mark = self._delivered()
                self._progress_at = self._loop.time()
                self._watch_writes()

    def _close_lingering(self) -> None:
        """Send FIN but keep reading (and dropping) for a while.

        Closing with unread request bytes makes the kernel send RST, which can destroy the error
        response before the client reads it.
        """
        transport = self._transport
        self._parse_stopped = True
        if transport is None or transport.is_closing() or not transport.can_write_eof():
            self._close_transport()
            return
        self._lingering = True
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        transport.write_eof()
        self._set_timer("linger", _LINGER_S)

    def _close_transport(self) -> None:
        self._parse_stopped = True
        self._cancel_timer()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    # -- shutdown ---------------------------------------------------------------------------------

    def close_if_idle(self) -> None:
        if self._worker is None:
            self._close_transport()

    def shutdown(self) -> asyncio.Task | None:
        """Close now; returns the worker (cancelled) so the caller can wait for its cleanup."""
        worker = self._worker
        self._close_transport()
        if worker is not None:
            worker.cancel()
        return worker


class HttpServer:
    """Serves `handler` over HTTP/1.1 on one listening socket."""

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits(),
                 precheck: Precheck | None = None) -> None:
        if not callable(handler):
            raise TypeError("handler must be an async callable taking an HttpRequest")
        if not isinstance(limits, HttpLimits):
            raise TypeError("limits must be an HttpLimits")
        self.handler = handler
        self.limits = limits
        self.precheck = precheck
        self.responses_total: dict[int, int] = {}
        self._in_flight = 0
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._closing = False
        self._drained: asyncio.Event | None = None
        self._date_second = -1
        self._date_value = ""

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port (port 0 picks a free one, see `.port`)."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=2048
        )

    @property
    def port(self) -> int:
        if self._server is None or not self._server.sockets:
            raise RuntimeError("HttpServer is not listening")
        return self._server.sockets[0].getsockname()[1]

    @property
    def num_connections(self) -> int:
        return len(self._connections)

    @property
    def in_flight(self) -> int:
        """Requests whose handler has started and whose response is not fully written."""
        return self._in_flight

    async def close(self, timeout: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` s, then close everything."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self._connections):
            conn.close_if_idle()
        if self._in_flight > 0:
            self._drained = asyncio.Event()
            try:
                await asyncio.wait_for(self._drained.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning("closing with %d requests still in flight", self._in_flight)
        workers = [w for w in (conn.shutdown() for conn in list(self._connections)) if w is not None]
        if workers:
            await asyncio.wait(workers, timeout=1.0)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass

    def _in_flight_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and self._drained is not None:
            self._drained.set()

    def _count(self, status: int) -> None:
        self.responses_total[status] = self.responses_total.get(status, 0) + 1

    def _date(self) -> str:
        now = int(time.time())
        if now != self._date_second:  # formatting once a second is plenty
            self._date_second = now
            self._date_value = formatdate(now, usegmt=True)
        return self._date_value
