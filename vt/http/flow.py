"""Flow control of one connection: write marks, pausing reading and the body being produced,
drain, the write-progress watchdog and the lingering close.

The connection protocol (vt.http.server) feeds it the transport's pause/resume callbacks; the
worker answering requests (vt.http.exchange) writes through it and waits on `drain()`, so a
client that stops reading stops its producer and costs at most the high mark in buffers.
"""

from __future__ import annotations

import asyncio
import struct
import sys
from collections.abc import Callable

try:  # the kernel's send-queue size (Linux: SIOCOUTQ == TIOCOUTQ)
    import fcntl
    import termios

    _TIOCOUTQ: int | None = termios.TIOCOUTQ if sys.platform == "linux" else None
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]
    _TIOCOUTQ = None

# Write-buffer marks: a streaming writer waits above HIGH, so a slow reader costs at most this much.
WRITE_HIGH = 256 * 1024
WRITE_LOW = 64 * 1024
WRITE_SLICE = 64 * 1024  # a full body goes out in slices, each written once the buffer drains
LINGER_S = 2.0  # how long a rejected client may keep sending before we close for good


def kernel_unsent(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in the socket's kernel send queue (sent but unacknowledged, or unsent); 0 where the
    OS does not say."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or _TIOCOUTQ is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0"))[0]
    except (OSError, ValueError):
        return 0


class FlowControl:
    """The write side of one connection and the pausing of its reads.

    `on_stall` is called when the peer has taken none of the waiting output for write_timeout_s;
    the connection then cuts itself off."""

    def __init__(self, write_timeout_s: float, on_stall: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self._write_timeout_s = write_timeout_s
        self._on_stall = on_stall
        self.transport: asyncio.Transport | None = None
        self.closed = False  # the connection is lost
        self.lingering = False  # FIN sent, reading on to drop what the client still sends
        self.reading_paused = False
        self.write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._producer: object | None = None  # the stream body being written, for pause hooks
        self._write_timer: asyncio.TimerHandle | None = None  # the write-progress watchdog
        self._written = 0  # bytes handed to the transport
        self._delivered_mark = 0  # bytes the peer had taken at the watchdog's last look
        self._progress_at = 0.0  # when the peer last took any

    def attach(self, transport: asyncio.Transport, limit_buffer: bool) -> None:
        """The connection's transport; `limit_buffer` sets the write marks (an accepted client)."""
        self.transport = transport
        if limit_buffer:
            transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)

    @property
    def streaming(self) -> bool:
        """A stream body is being written."""
        return self._producer is not None

    # -- writing ----------------------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            self._written += len(data)
            if self._write_timer is None:
                self._delivered_mark = self._delivered()
                self._progress_at = self._loop.time()
                self._watch_writes()

    async def write_all(self, data: bytes) -> None:
        """Write a full body in slices, each once the buffer is below its high mark, so a client
        that reads slowly holds at most one high mark of copies beyond the body itself."""
        if len(data) <= WRITE_HIGH:
            self.write(data)
            return
        view = memoryview(data)
        for start in range(0, len(data), WRITE_SLICE):
            await self.drain()
            if self.closed:
                return
            self.write(view[start:start + WRITE_SLICE])

    async def drain(self) -> None:
        while self.write_paused and not self.closed:
            waiter = self._loop.create_future()
            self._drain_waiter = waiter
            await waiter

    def _wake_writer(self) -> None:
        waiter = self._drain_waiter
        self._drain_waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the body being produced ------------------------------------------------------------------

    def start_producing(self, producer: object) -> None:
        """A stream body starts: it is paused and resumed with the writes from now on."""
        self._producer = producer
        pause = getattr(producer, "pause_producing", None)
        if self.write_paused and pause is not None:
            pause()  # the reader is behind already: hold the source from the start

    def stop_producing(self) -> None:
        self._producer = None

    # -- asyncio.Protocol's flow callbacks ----------------------------------------------------------

    def pause_writing(self) -> None:
        self.write_paused = True
        pause = getattr(self._producer, "pause_producing", None)
        if pause is not None:
            pause()

    def resume_writing(self) -> None:
        self.write_paused = False
        resume = getattr(self._producer, "resume_producing", None)
        if resume is not None:
            resume()
        self._wake_writer()

    def pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True

    def resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def connection_lost(self) -> None:
        self.closed = True
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        self._wake_writer()

    # -- the write-progress watchdog ----------------------------------------------------------------

    def _delivered(self) -> int:
        """Bytes the peer's TCP has taken: written, less what waits in our buffer and, where the
        OS tells (Linux SIOCOUTQ), in the kernel's send queue. Its rise is the reader's progress."""
        transport = self.transport
        pending = transport.get_write_buffer_size() if transport is not None else 0
        return self._written - pending - kernel_unsent(transport)

    def _watch_writes(self) -> None:
        """Armed by a write: while output waits, the peer must take some of it at least every
        write_timeout_s, or the connection is cut (abort: close() would wait for the buffer to
        drain). It looks four times a timeout, so a cut comes within 1.25 timeouts of the last
        progress."""
        self._write_timer = self._loop.call_later(self._write_timeout_s / 4, self._on_write_timeout)

    def _on_write_timeout(self) -> None:
        self._write_timer = None
        if self.closed or self.transport is None:
            return
        delivered = self._delivered()
        if delivered >= self._written:
            return  # all out: the next write re-arms
        if delivered > self._delivered_mark:
            self._delivered_mark = delivered  # slow, but reading
            self._progress_at = self._loop.time()
        if self._loop.time() - self._progress_at < self._write_timeout_s:
            self._watch_writes()
            return
        self._on_stall()

    # -- closing ------------------------------------------------------------------------------------

    def linger(self) -> bool:
        """Send FIN but keep reading (the connection drops what arrives) for a while; False where
        the transport cannot half-close, and the caller closes outright.

        Closing with unread request bytes makes the kernel send RST, which can destroy the error
        response before the client reads it.
        """
        transport = self.transport
        if transport is None or transport.is_closing() or not transport.can_write_eof():
            return False
        self.lingering = True
        self.resume_reading()
        transport.write_eof()
        return True

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
