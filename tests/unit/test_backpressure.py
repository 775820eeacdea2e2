"""A reader that falls behind pauses its request in the engine instead of growing a buffer, gets
the same tokens once it reads on, and one that never reads is cut and its KV freed.

The engine, the OpenAI routes and the HTTP server run in-process on the CPU backend; the server
side of each client socket gets a small kernel send buffer, so a few hundred kilobytes of unread
output reach the server's own buffer, as megabytes would on a default socket.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.http.openai_api import OpenAIApp
from vt.http.server import HttpLimits, HttpServer
from vt.model.make_model import make_model

TIMEOUT_S = 60.0
HIGH = 256 * 1024  # the server's write-buffer high mark
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("bp-model") / "tiny", preset="tiny")


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[tuple[AsyncEngine, HttpServer]]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=8))
    await engine.start()
    app = OpenAIApp(engine, "tiny")
    server = HttpServer(app.handle, HttpLimits(write_timeout_s=1.0), precheck=app.precheck)
    app.server = server
    await server.start("127.0.0.1", 0)
    yield engine, server
    await server.close(1.0)
    await engine.stop(0.0)


def _request(max_tokens: int = MAX_TOKENS) -> bytes:
    body = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
                         "stream": True, "ignore_eos": True, "seed": 11, "logprobs": True,
                         "top_logprobs": 20})
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body))


async def _client(server: HttpServer) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)  # reads ahead 8 KiB
    for _ in range(200):  # shrink the server side's kernel buffer once it has accepted us
        if server._connections:
            break
        await asyncio.sleep(0.005)
    for conn in server._connections:
        conn._transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    writer.write(_request())
    return reader, writer


async def _read_stream(reader: asyncio.StreamReader) -> list[str]:
    """The token texts of a whole chunked SSE chat stream."""
    raw = await asyncio.wait_for(reader.read(), TIMEOUT_S)
    body = raw.partition(b"\r\n\r\n")[2]
    data = b""
    while body:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        data, body = data + body[:size], body[size + 2:]
        if size == 0:
            break
    texts = []
    for frame in data.split(b"\n\n"):
        if frame.startswith(b"data: {"):
            event = orjson.loads(frame[6:])
            for c in event["choices"]:
                texts.extend(e["token"] for e in (c.get("logprobs") or {}).get("content") or [])
    return texts


async def _settled(engine: AsyncEngine) -> int:
    """Generated-token count once it has stopped moving for a while (the request is paused)."""
    last = -1
    for _ in range(int(TIMEOUT_S / 0.3)):
        await asyncio.sleep(0.3)
        now = engine.stats().generation_tokens_total
        if now == last:
            return now
        last = now
    raise AssertionError("generation never paused")


async def test_unread_stream_pauses_its_request_and_resumes_with_the_same_tokens(served) -> None:
    engine, server = served
    server.limits = HttpLimits(write_timeout_s=60.0)  # reading resumes long before any cut
    reader, writer = await _client(server)
    paused_at = await _settled(engine)
    assert 0 < paused_at < MAX_TOKENS  # the request stopped, not the stream's end
    buffered = max(c._transport.get_write_buffer_size() for c in server._connections)
    assert buffered <= HIGH + 3 * 8192  # the high mark plus the few tokens already in flight
    assert engine.stats().num_requests_running == 1  # paused, not aborted: its KV is kept
    tokens = await _read_stream(reader)  # reading resumes it to the end
    writer.close()
    assert len(tokens) == MAX_TOKENS
    # the same request read at full speed gives the same tokens: pausing changed nothing
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port, limit=1 << 20)
    writer.write(_request())
    assert await _read_stream(reader) == tokens
    writer.close()


async def test_a_reader_that_never_reads_is_cut_and_its_request_freed(served) -> None:
    engine, server = served
    readers = [await _client(server) for _ in range(3)]
    # the server closes each connection once its writes stop draining for write_timeout_s
    for _ in range(int(TIMEOUT_S / 0.1)):
        stats = engine.stats()
        if server.num_connections == 0 and stats.num_requests_running == 0:
            break
        await asyncio.sleep(0.1)
    stats = engine.stats()
    assert server.num_connections == 0
    assert stats.num_requests_running == 0 and stats.kv_cache_usage_perc == 0.0
    assert stats.request_success_total["abort"] == 3
    for _, writer in readers:
        writer.close()
