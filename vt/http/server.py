"""HTTP/1.1 server over httptools: the listening socket and the per-connection protocol.

A connection parses ahead (enforcing the header, URL and body limits httptools leaves to us, and
the head, body and keep-alive timers) and queues each request it has read whole; its Responder
(vt.http.exchange) answers the queue strictly in order, writing through its FlowControl
(vt.http.flow). The server knows nothing of the engine: it calls one `Handler` per request.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import formatdate
from typing import cast
from urllib.parse import unquote_to_bytes

import httptools

from vt.http.errors import error_body
from vt.http.exchange import QueuedRequest, Rejection, Responder, render_closing, stopped_error
from vt.http.flow import LINGER_S, FlowControl
from vt.http.messages import Handler, HttpRequest, Precheck, PushBody, Response, StreamResponse

__all__ = ["Handler", "HttpLimits", "HttpRequest", "HttpServer", "Precheck", "PushBody", "Response",
           "StreamResponse"]

logger = logging.getLogger("vt.http")

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# An interim answer to a client that half-closed while its request is being worked on: a client
# that left entirely answers it with a reset, which ends the request (1xx only exists in 1.1).
_PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"
_EOF_PROBE_S = 0.25
_READ_SLACK = 256 * 1024  # the most one socket read hands us (asyncio: 256 KiB, uvloop: 64 KiB)


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


class _Timer:
    """A connection's one timer, named for what it waits for: idle, head, body or linger."""

    def __init__(self, on_timeout: Callable[[str], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._on_timeout = on_timeout
        self._handle: asyncio.TimerHandle | None = None
        self.kind: str | None = None

    def set(self, kind: str, delay: float) -> None:
        self.cancel()
        self.kind = kind
        self._handle = self._loop.call_later(delay, self._fire, kind)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self.kind = None

    def _fire(self, kind: str) -> None:
        self._handle = None
        self.kind = None
        self._on_timeout(kind)


def _join_headers(raw_headers: list[tuple[bytes, bytes]]) -> tuple[dict[str, str], int]:
    """Headers by lower-case name, repeats joined with ", "; and how many Host headers came."""
    headers: dict[str, str] = {}
    num_hosts = 0
    for raw_name, raw_value in raw_headers:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1").strip(" \t")  # OWS only: 0xA0 may end a UTF-8 value
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
        num_hosts += name == "host"
    return headers, num_hosts


class _Reject(Exception):
    """Raised inside parser callbacks to stop parsing; the status is kept on the connection."""


class _Connection(asyncio.Protocol):
    """One client socket: parse ahead, enforce limits and timers, queue for the responder."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._limits = server.limits
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._client: tuple | None = None
        self._flow = FlowControl(self._limits.write_timeout_s, self._cut_stalled)
        self._responder = Responder(server, self._flow, self, self._limits.max_pipelined)
        # The message being parsed.
        self._url = bytearray()
        self._raw_headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._head_raw = 0
        self._body = bytearray()
        self._pending: QueuedRequest | None = None
        self._in_message = False
        self._in_head = False
        self._rejection: Rejection | None = None
        self._continue_pending = False  # a 100 Continue waits for earlier responses
        # Connection state.
        self._timer = _Timer(self._on_timeout)
        self._parse_stopped = False
        self._peer_eof = False  # the client half-closed: answer what arrived, then close
        self._eof_timer: asyncio.TimerHandle | None = None

    @property
    def _transport(self) -> asyncio.Transport | None:
        """The server side of the socket, where a test looks at the write buffer."""
        return self._flow.transport

    # -- asyncio.Protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._client = transport.get_extra_info("peername")
        server = self._server
        accepted = not server.closing and server.num_connections < self._limits.max_connections
        self._flow.attach(cast(asyncio.Transport, transport), limit_buffer=accepted)
        if not accepted:
            self._parse_stopped = True
            body = error_body("Too many connections", type="server_error")
            self._flow.write(render_closing(Response(503, body), server.date()))
            server.count_response(503)
            transport.close()
            return
        server._connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE chunks are small
            except (OSError, AttributeError):
                pass
        self._timer.set("idle", self._limits.keepalive_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._parse_stopped:
            return  # no further request will be answered on this connection
        if self._timer.kind == "idle":
            self._timer.cancel()
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
            rejection = self._rejection or Rejection(400, "Malformed HTTP request")
            logger.debug("rejecting request from %s: %s (%r)", self._client, rejection.message, exc)
            self._fail(rejection.status, rejection.message, rejection.response)
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
        # A cut-off request or one the responder cannot answer after a half-close: the client is gone.
        if self._in_message or not self._responder.can_answer_half_closed():
            return False
        self._peer_eof = True
        self._stop_parsing()
        self._eof_timer = self._loop.call_later(_EOF_PROBE_S, self._probe_peer)
        return True

    def _probe_peer(self) -> None:
        """While a handler works on a half-closed connection's request, send an interim 102: a
        client that closed entirely answers with a reset and the request is aborted."""
        self._eof_timer = None
        if self._flow.closed:
            return
        if self._responder.in_handler:
            self._flow.write(_PROCESSING)
        self._eof_timer = self._loop.call_later(_EOF_PROBE_S, self._probe_peer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._flow.connection_lost()
        self._parse_stopped = True
        self._timer.cancel()
        if self._eof_timer is not None:
            self._eof_timer.cancel()
            self._eof_timer = None
        self._server._connections.discard(self)
        self._responder.connection_lost()

    def pause_writing(self) -> None:
        self._flow.pause_writing()

    def resume_writing(self) -> None:
        self._flow.resume_writing()

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
        self._timer.set("head", self._limits.header_timeout_s)

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
        headers = self._check_headers(version)
        try:
            url = httptools.parse_url(bytes(self._url))
        except httptools.HttpParserInvalidURLError:
            self._reject(400, "Invalid request target")
        path = unquote_to_bytes(url.path).decode("utf-8", "replace") if url.path else "/"
        query = url.query.decode("latin-1") if url.query else ""
        method = self._parser.get_method().decode("ascii", "replace")
        http10 = version == "1.0"
        request = HttpRequest(method, path, query, headers, b"", self._client)
        self._pending = QueuedRequest(request, self._parser.should_keep_alive(), http10, method == "HEAD")
        self._timer.set("body", self._limits.body_timeout_s)
        if headers.get("expect", "").lower() == "100-continue" and not http10:
            # Only a request that would be served is invited to send its body.
            precheck = self._server.precheck
            refusal = precheck(request) if precheck is not None else None
            if refusal is not None:
                self._rejection = Rejection(refusal.status, "", refusal)
                raise _Reject("refused before 100 Continue")
            if self._responder.idle:
                self._flow.write(_CONTINUE)
            else:
                self._continue_pending = True  # sent once earlier responses are out

    def _check_headers(self, version: str) -> dict[str, str]:
        """The head's headers by lower-case name, repeats joined; framing and Host checked."""
        headers, num_hosts = _join_headers(self._raw_headers)
        transfer_encoding = headers.get("transfer-encoding")
        if transfer_encoding is not None and transfer_encoding.lower() != "chunked":
            self._reject(501, f"Unsupported Transfer-Encoding: {transfer_encoding}")
        content_length = headers.get("content-length")
        if content_length is not None:
            if not content_length.isdigit():
                self._reject(400, "Invalid Content-Length")
            if int(content_length) > self._limits.max_body_bytes:
                self._reject(413, f"Request body larger than {self._limits.max_body_bytes} bytes")
        # RFC 9112 3.2: exactly one Host in HTTP/1.1, at most one in 1.0.
        if num_hosts > 1 or (num_hosts == 0 and version == "1.1"):
            self._reject(400, "an HTTP/1.1 request needs exactly one Host header")
        return headers

    def on_body(self, body: bytes) -> None:
        self._body += body
        if len(self._body) > self._limits.max_body_bytes:
            self._reject(413, f"Request body larger than {self._limits.max_body_bytes} bytes")

    def on_message_complete(self) -> None:
        self._timer.cancel()
        self._in_message = False
        self._continue_pending = False
        pending = self._pending
        self._pending = None
        if pending is None:
            return
        pending.request.body = bytes(self._body)
        self._body = bytearray()
        self._responder.enqueue(pending)
        if not pending.keep_alive:
            self._stop_parsing()
        elif self._responder.num_queued >= self._limits.max_pipelined:
            self._flow.pause_reading()

    # -- parsing helpers --------------------------------------------------------------------------

    def _count_head(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > self._limits.max_header_bytes:
            self._reject(431, "Request header fields too large")

    def _reject(self, status: int, message: str) -> None:
        self._rejection = Rejection(status, message)
        raise _Reject(message)

    def _fail(self, status: int, message: str, response: Response | None = None) -> None:
        """Answer earlier requests, then this error (or `response`), then close."""
        self._stop_parsing()
        self._responder.enqueue(Rejection(status, message, response))

    def _stop_parsing(self) -> None:
        self._parse_stopped = True
        self._in_message = False
        if self._timer.kind in ("head", "body"):
            self._timer.cancel()

    # -- timers -----------------------------------------------------------------------------------

    def _rearm_message_timer(self) -> None:
        if self._in_head:
            self._timer.set("head", self._limits.header_timeout_s)
        else:
            self._timer.set("body", self._limits.body_timeout_s)

    def _on_timeout(self, kind: str) -> None:
        if kind in ("head", "body") and self._flow.reading_paused:
            return  # the delay is ours (too many queued requests); re-armed on resume
        if not self._flow.closed:
            logger.debug("closing connection from %s: %s timeout", self._client, kind)
            self.close()

    def _cut_stalled(self) -> None:
        """The peer took none of the waiting output for write_timeout_s."""
        logger.info("closing connection from %s: nothing read for %.0f s", self._client,
                    self._limits.write_timeout_s)
        self._parse_stopped = True
        self._timer.cancel()
        self._flow.abort()

    # -- what the responder asks (vt.http.exchange.ConnectionSide) --------------------------------

    @property
    def half_closed(self) -> bool:
        return self._peer_eof

    def resume_reading(self) -> None:
        """The queue has room again: read on, and restart the timer the pause held off."""
        self._flow.resume_reading()
        if self._in_message:
            self._rearm_message_timer()

    def close(self) -> None:
        self._parse_stopped = True
        self._timer.cancel()
        self._flow.close()

    def close_lingering(self) -> None:
        """Send FIN but keep reading (and dropping) for a while, or close where that cannot be."""
        self._parse_stopped = True
        if self._flow.linger():
            self._timer.set("linger", LINGER_S)
        else:
            self.close()

    def queue_answered(self) -> None:
        if self._continue_pending and self._in_message and not self._flow.closed:
            self._continue_pending = False
            self._flow.write(_CONTINUE)
            self._timer.set("body", self._limits.body_timeout_s)

    def answering_stopped(self) -> None:
        queued = self._responder.num_queued
        if self._parse_stopped and not queued and not self._flow.lingering:
            self.close()
        elif not self._flow.closed and not queued and not self._in_message:
            self._timer.set("idle", self._limits.keepalive_timeout_s)

    # -- shutdown ---------------------------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """A request is being received, waits to be answered or is being answered."""
        return self._in_message or not self._responder.idle

    def stop_requests(self) -> None:
        """The server stops before these requests are done: a handler still at work is stopped
        and its request answered 503, as is a request still arriving (then the connection closes)."""
        self._responder.stop_handler()
        if self._in_message and not self._flow.closed:
            self._fail(503, "", stopped_error())

    def close_if_idle(self) -> None:
        if self._responder.idle:
            self.close()

    def shutdown(self) -> asyncio.Task[None] | None:
        """Close now; returns the worker (cancelled) so the caller can wait for its cleanup."""
        self.close()
        return self._responder.cancel()


class HttpServer:
    """Serves `handler` over HTTP/1.1 on one listening socket."""

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits(),
                 precheck: Precheck | None = None, access_log: bool = True) -> None:
        if not callable(handler):
            raise TypeError("handler must be an async callable taking an HttpRequest")
        if not isinstance(limits, HttpLimits):
            raise TypeError("limits must be an HttpLimits")
        self.handler = handler
        self.limits = limits
        self.precheck = precheck
        self.access_log = access_log  # a log line per answered request (vt.access, at info)
        self.responses_total: dict[int, int] = {}
        self._in_flight = 0
        self._connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._closing = False
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

    @property
    def closing(self) -> bool:
        """close() has begun: no new connection, no keep-alive."""
        return self._closing

    @property
    def busy(self) -> bool:
        """Some connection is receiving a request, or has one waiting or being answered."""
        return any(connection.busy for connection in self._connections)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` s until no request is being received, waits or is being answered
        (polled: this runs once, at shutdown); whether that came."""
        deadline = time.monotonic() + timeout
        while self.busy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def stop_requests(self) -> None:
        """Shutting down past the time requests had to finish: every request still arriving or
        being worked on is answered 503 (streams already under way are their producers' to end)."""
        for connection in list(self._connections):
            connection.stop_requests()

    async def close(self, timeout: float) -> None:
        """Stop accepting, let in-flight requests finish for up to `timeout` s, then close everything."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections):
            connection.close_if_idle()
        if not await self.wait_idle(timeout):
            logger.warning("closing with %d requests still in flight", self._in_flight)
        workers = [w for w in (c.shutdown() for c in list(self._connections)) if w is not None]
        if workers:
            await asyncio.wait(workers, timeout=1.0)
        if self._server is not None:
            try:
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            except asyncio.TimeoutError:
                pass

    # -- kept by the connections' responders ----------------------------------------------------------

    def request_started(self) -> None:
        self._in_flight += 1

    def request_finished(self) -> None:
        self._in_flight -= 1

    def count_response(self, status: int) -> None:
        self.responses_total[status] = self.responses_total.get(status, 0) + 1

    def date(self) -> str:
        """The Date header's value."""
        now = int(time.time())
        if now != self._date_second:  # formatting once a second is plenty
            self._date_second = now
            self._date_value = formatdate(now, usegmt=True)
        return self._date_value
