"""`vt bench`'s HTTP client: keep-alive connections to one server, one streamed completion or chat
completion read as server-sent events into a RequestRecord, and the small JSON and /metrics
requests around a run.

It speaks just enough HTTP/1.1 for vt's server (and vLLM's): no client library, so that what is
timed is the server and the socket, and a chunk's arrival is seen the moment its bytes are read.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from vt.bench.stats import RequestRecord

READ_LIMIT = 1 << 22         # stream reader line limit: large enough for any one SSE chunk


class BenchError(Exception):
    """A benchmark that cannot run: bad target, server failed to start, unusable responses."""


@dataclass(frozen=True)
class Endpoint:
    """One server: where to connect, and the path prefix of a base URL such as
    http://host:8000/serving (vLLM's benchmark appends every route to --base-url, so do we)."""

    host: str
    port: int
    api_key: str | None = None
    prefix: str = ""

    @classmethod
    def from_url(cls, url: str, api_key: str | None = None) -> Endpoint:
        parts = urlsplit(url)
        return cls(parts.hostname or "127.0.0.1", parts.port or 80, api_key, parts.path.rstrip("/"))


Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class ConnectionPool:
    """Idle keep-alive connections to one endpoint, as an HTTP client library keeps them: a
    request takes one (or opens one) and gives it back once its response has been read whole.
    Without it every request pays a TCP connect and an accept on the server's busy loop, which
    delays arrivals at high concurrency."""

    def __init__(self, ep: Endpoint) -> None:
        self.ep = ep
        self.idle: list[Conn] = []
        self.opened = 0

    async def take(self) -> tuple[Conn, bool]:
        """A connection and whether it was reused (a reused one may have been closed by the server)."""
        while self.idle:
            reader, writer = self.idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return (reader, writer), True
            await _close(writer)
        self.opened += 1
        return await asyncio.open_connection(self.ep.host, self.ep.port, limit=READ_LIMIT), False

    def give_back(self, conn: Conn) -> None:
        self.idle.append(conn)

    async def close(self) -> None:
        while self.idle:
            await _close(self.idle.pop()[1])


def _request_bytes(ep: Endpoint, method: str, path: str, body: Any, keep_alive: bool) -> bytes:
    data = b"" if body is None else orjson.dumps(body)
    host = f"[{ep.host}]" if ":" in ep.host else ep.host  # an IPv6 literal
    head = [f"{method} {ep.prefix}{path} HTTP/1.1", f"Host: {host}:{ep.port}",
            "Connection: keep-alive" if keep_alive else "Connection: close", f"Content-Length: {len(data)}"]
    if body is not None:
        head.append("Content-Type: application/json")
    if ep.api_key:
        head.append(f"Authorization: Bearer {ep.api_key}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


async def _send(ep: Endpoint, method: str, path: str, body: Any = None
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(ep.host, ep.port, limit=READ_LIMIT)
    writer.write(_request_bytes(ep, method, path, body, keep_alive=False))
    await writer.drain()
    return reader, writer


async def _exchange(pool: ConnectionPool, method: str, path: str, body: Any
                    ) -> tuple[Conn, int, dict[str, str]]:
    """Send on a pooled connection and read the response head. A reused connection that fails
    (the server closed it while idle) is dropped and the next one tried; a fresh one's failure
    is the request's."""
    while True:
        conn, reused = await pool.take()
        try:
            conn[1].write(_request_bytes(pool.ep, method, path, body, keep_alive=True))
            await conn[1].drain()
            status, headers = await _read_head(conn[0])
            return conn, status, headers
        except (OSError, BenchError, asyncio.IncompleteReadError):
            await _close(conn[1])
            if not reused:
                raise


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise BenchError(f"not an HTTP response: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def _body_parts(reader: asyncio.StreamReader, headers: dict[str, str]):
    """Yield the body as it arrives: chunked coding, Content-Length, or read to close."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                raise BenchError("connection closed in the middle of a chunked body")
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return
            yield (await reader.readexactly(size + 2))[:-2]
    elif "content-length" in headers:
        n = int(headers["content-length"])
        if n:
            yield await reader.readexactly(n)
    else:
        while chunk := await reader.read(1 << 16):
            yield chunk


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass


async def http_json(ep: Endpoint, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One non-streaming request; returns (status, parsed JSON or text)."""
    reader, writer = await _send(ep, method, path, body)
    try:
        status, headers = await _read_head(reader)
        data = b"".join([part async for part in _body_parts(reader, headers)])
    finally:
        await _close(writer)
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, data.decode("utf-8", "replace")


def error_text(status: int, body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"HTTP {status}: {body['error'].get('message', '')}"
    return f"HTTP {status}: {str(body)[:200]}"


def _chunk_token(choice: dict, chat: bool) -> str | None:
    """The text of a streamed choice that marks a token's arrival, or None for one that does not.

    Every completion choice chunk is a token's arrival, text or not (a special token, or an id the
    tokenizer renders as nothing), as vLLM's benchmark counts. A chat stream first announces the
    reply's role with empty content before any token exists (vt and vLLM send it at once), so
    that chunk is no arrival unless it also carries text."""
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    if "role" in delta and not content:
        return None
    return content


async def stream_completion(ep: Endpoint, payload: dict, rec: RequestRecord, t0: float,
                            pool: ConnectionPool | None = None, *, path: str = "/v1/completions",
                            chat: bool = False) -> None:
    """Send one streaming completion (a chat completion with `chat`) to `path` and fill `rec`
    (times relative to t0). Never raises for a failed request: the failure goes into rec.error.
    With a pool the request goes on a keep-alive connection, given back once the response has
    been read to its end."""
    rec.start = time.perf_counter() - t0
    texts: list[str] = []
    usage: dict | None = None
    writer = None
    reusable = False
    try:
        if pool is None:
            reader, writer = await _send(ep, "POST", path, payload)
            status, headers = await _read_head(reader)
        else:
            (reader, writer), status, headers = await _exchange(pool, "POST", path, payload)
        keep = pool is not None and headers.get("connection", "").lower() != "close"
        if status != 200:
            raw = b"".join([part async for part in _body_parts(reader, headers)])
            reusable = keep
            try:
                body: Any = orjson.loads(raw)
            except orjson.JSONDecodeError:
                body = raw.decode("utf-8", "replace")
            rec.error = error_text(status, body)
            return
        buf = b""
        done = False
        parts = _body_parts(reader, headers)
        async for part in parts:
            now = time.perf_counter() - t0
            buf += part.replace(b"\r\n", b"\n")
            while b"\n\n" in buf and not done:
                event, buf = buf.split(b"\n\n", 1)
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    msg = orjson.loads(data)
                    if "error" in msg:
                        err = msg["error"]
                        text = err.get("message", err) if isinstance(err, dict) else err
                        rec.error = f"stream error: {text}"
                        return
                    if msg.get("usage"):
                        usage = msg["usage"]
                    for choice in msg.get("choices") or ():
                        text = _chunk_token(choice, chat)
                        if text is None:
                            continue
                        if rec.first_token is None:
                            rec.first_token = now
                        rec.chunk_times.append(now)
                        texts.append(text)
            if done:
                break
        if done and keep:
            async for _ in parts:  # the end of the chunked body, so the connection is clean
                pass
            reusable = True
        if not done:
            rec.error = "the stream ended without [DONE]"
        elif usage is None:
            rec.error = "the stream carried no usage (stream_options.include_usage ignored?)"
        elif rec.first_token is None:
            rec.error = "the stream carried no output"
        else:
            rec.output_tokens = int(usage.get("completion_tokens", 0))
            rec.input_tokens = int(usage.get("prompt_tokens", rec.input_tokens))
            rec.success = True
    except (OSError, asyncio.IncompleteReadError, BenchError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        rec.end = time.perf_counter() - t0
        rec.text = "".join(texts)
        if writer is not None:
            if reusable:  # only ever set with a pool
                pool.give_back((reader, writer))
            else:
                await _close(writer)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


async def read_metrics(ep: Endpoint) -> dict[str, float]:
    try:
        status, body = await http_json(ep, "GET", "/metrics")
    except (OSError, BenchError):
        return {}
    return parse_metrics(body) if status == 200 and isinstance(body, str) else {}
