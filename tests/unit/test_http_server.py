"""The HTTP/1.1 layer against raw sockets and httpx, on the default asyncio loop and on uvloop."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import orjson
import pytest
import uvloop

from vt.http.errors import HttpError, error_body
from vt.http.server import HttpLimits, HttpRequest, HttpServer, PushBody, Response, StreamResponse

TIMEOUT = 5.0  # generous bound so a broken server fails the test instead of hanging it


pytestmark = pytest.mark.filterwarnings("ignore:Overriding the \"event_loop_policy\" fixture")


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def event_loop_policy(request):
    if request.param == "uvloop":
        return uvloop.EventLoopPolicy()
    return asyncio.DefaultEventLoopPolicy()


async def echo(req: HttpRequest) -> Response:
    body = orjson.dumps(
        {
            "method": req.method,
            "path": req.path,
            "query": req.query,
            "headers": req.headers,
            "body": req.body.decode("latin-1"),
        }
    )
    return Response(200, body)


class Served:
    """A server on 127.0.0.1:0 closed at the end of the test."""

    def __init__(self) -> None:
        self.servers: list[HttpServer] = []

    async def __call__(self, handler=echo, precheck=None, **limits) -> HttpServer:
        server = HttpServer(handler, HttpLimits(**limits), precheck=precheck)
        await server.start("127.0.0.1", 0)
        self.servers.append(server)
        return server


@pytest.fixture
async def serve():
    served = Served()
    yield served
    for server in served.servers:
        await server.close(1.0)


async def connect(server: HttpServer, limit: int = 2**16):
    return await asyncio.open_connection("127.0.0.1", server.port, limit=limit)


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    lines = head.decode("latin-1").split("\r\n")
    version, status, _ = lines[0].split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in lines[1:]:
        if line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return int(status), headers


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), TIMEOUT)
    size = int(size_line.strip(), 16)
    data = await asyncio.wait_for(reader.readexactly(size + 2), TIMEOUT)
    assert data.endswith(b"\r\n")
    return data[:-2]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status, headers = await read_head(reader)
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while chunk := await read_chunk(reader):
            body += chunk
    elif "content-length" in headers:
        body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), TIMEOUT)
    else:
        body = await asyncio.wait_for(reader.read(), TIMEOUT)
    return status, headers, body


async def expect_eof(reader: asyncio.StreamReader) -> bytes:
    """Everything until the server closes; fails if it never does."""
    return await asyncio.wait_for(reader.read(), TIMEOUT)


async def expect_closed(reader: asyncio.StreamReader) -> bytes:
    """Like expect_eof, for a client that may still be writing when the server closes: its
    kernel then answers the late bytes with a reset, which is a close as well."""
    try:
        return await expect_eof(reader)
    except ConnectionResetError:
        return b""


async def eventually(cond, timeout: float = TIMEOUT) -> bool:
    """Poll cond until it holds or the timeout passes; its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond() and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return cond()


async def hang_up_after_first_chunk(server: HttpServer, first: bytes) -> None:
    """GET a stream, read its head and first chunk (which must be `first`), then disconnect."""
    reader, writer = await connect(server)
    writer.write(get())
    await read_head(reader)
    assert await read_chunk(reader) == first
    writer.close()


def get(path: str = "/", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


# -- basics ---------------------------------------------------------------------------------------


async def test_keep_alive_serves_several_requests_on_one_connection(serve):
    server = await serve()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        for i in range(5):
            r = await client.post(f"/v1/x%20y?n={i}", content=b"payload-%d" % i, headers={"X-A": "1"})
            assert r.status_code == 200
            assert r.headers["server"] == "vt"
            assert "date" in r.headers
            got = r.json()
            assert got["method"] == "POST"
            assert got["path"] == "/v1/x y"
            assert got["query"] == f"n={i}"
            assert got["body"] == f"payload-{i}"
            assert got["headers"]["x-a"] == "1"
            assert server.num_connections == 1
    assert server.responses_total == {200: 5}


async def test_repeated_headers_are_joined(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(get("/", "X-Tag: a\r\nx-tag: b\r\n"))
    status, _, body = await read_response(reader)
    assert status == 200
    assert orjson.loads(body)["headers"]["x-tag"] == "a, b"
    writer.close()


async def test_url_arriving_in_pieces_is_accumulated(serve):
    server = await serve()
    reader, writer = await connect(server)
    for piece in (b"GET /abc", b"def/gh", b"i?q=", b"1 HTTP/1.1\r\nHost: t\r\n\r\n"):
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(0)
    status, _, body = await read_response(reader)
    assert status == 200
    got = orjson.loads(body)
    assert (got["path"], got["query"]) == ("/abcdef/ghi", "q=1")
    writer.close()


async def test_pipelined_requests_are_answered_in_order_one_after_the_other(serve):
    log: list[str] = []

    async def handler(req: HttpRequest) -> Response:
        log.append("start " + req.path)
        if req.path == "/a":  # the first one yields to the loop a lot: b must still wait
            for _ in range(20):
                await asyncio.sleep(0)
        log.append("end " + req.path)
        return Response(200, req.path.encode(), content_type="text/plain")

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get("/a") + get("/b") + get("/c"))
    bodies = [(await read_response(reader))[2] for _ in range(3)]
    assert bodies == [b"/a", b"/b", b"/c"]
    assert log == ["start /a", "end /a", "start /b", "end /b", "start /c", "end /c"]
    writer.close()


async def test_deep_pipeline_beyond_max_pipelined_is_answered_in_order(serve):
    server = await serve(max_pipelined=2)
    reader, writer = await connect(server)
    writer.write(b"".join(get(f"/{i}") for i in range(30)))
    paths = [orjson.loads((await read_response(reader))[2])["path"] for _ in range(30)]
    assert paths == [f"/{i}" for i in range(30)]
    writer.close()


async def test_head_request_gets_headers_only(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\n" + get("/next"))
    status, headers = await read_head(reader)
    assert status == 200 and int(headers["content-length"]) > 0
    status, _, body = await read_response(reader)  # no body bytes came between the two heads
    assert orjson.loads(body)["path"] == "/next"
    writer.close()


async def test_chunked_request_body(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    writer.write(b"5\r\nhello\r\n")
    await writer.drain()
    writer.write(b"6\r\n world\r\n0\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 200
    assert orjson.loads(body)["body"] == "hello world"
    writer.close()


async def test_expect_100_continue(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    line = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT)
    assert line == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["body"] == "body"
    writer.close()


async def test_connection_close_and_http10(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(get("/", "Connection: close\r\n"))
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await expect_eof(reader) == b""

    reader, writer = await connect(server)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "close"
    assert await expect_eof(reader) == b""

    reader, writer = await connect(server)
    writer.write(b"GET /1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    status, headers, _ = await read_response(reader)
    assert status == 200 and headers["connection"] == "keep-alive"
    writer.write(b"GET /2 HTTP/1.0\r\n\r\n")
    status, _, body = await read_response(reader)
    assert orjson.loads(body)["path"] == "/2"
    writer.close()


# -- limits and malformed input -------------------------------------------------------------------


async def test_oversized_header_gets_431(serve):
    server = await serve(max_header_bytes=1024)
    reader, writer = await connect(server)
    writer.write(get("/", "X-Big: " + "a" * 2000 + "\r\n"))
    status, _, body = await read_response(reader)
    assert status == 431
    assert orjson.loads(body)["error"]["type"] == "invalid_request_error"
    assert await expect_eof(reader) == b""

    reader, writer = await connect(server)
    writer.write(get("/" + "u" * 2000))
    assert (await read_response(reader))[0] == 431


async def test_header_value_that_never_ends_is_bounded(serve):
    server = await serve(max_header_bytes=1024)
    reader, writer = await connect(server)
    writer.write(b"GET / HTTP/1.1\r\nX-Big: ")
    for _ in range(40):  # no CRLF ever: the parser never reports the header itself
        writer.write(b"a" * 16384)
        await writer.drain()
    status, _, _ = await read_response(reader)
    assert status == 431


async def test_oversized_body_gets_413(serve):
    server = await serve(max_body_bytes=1000)
    reader, writer = await connect(server)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 1001\r\n\r\n")
    status, _, body = await read_response(reader)  # answered before any body byte is sent
    assert status == 413
    assert "error" in orjson.loads(body)
    writer.close()

    reader, writer = await connect(server)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    writer.write(b"258\r\n" + b"x" * 600 + b"\r\n")
    writer.write(b"258\r\n" + b"x" * 600 + b"\r\n")
    status, _, _ = await read_response(reader)
    assert status == 413
    assert await expect_eof(reader) == b""
    assert server.responses_total == {413: 2}


async def test_unsupported_transfer_encoding_is_refused(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: gzip\r\n\r\n")
    status, _, _ = await read_response(reader)
    assert status in (400, 501)
    assert await expect_eof(reader) == b""


@pytest.mark.parametrize(
    "garbage", [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"\x00\xff\x13\x37 lots of junk\r\n\r\n"]
)
async def test_malformed_request_gets_400_and_server_keeps_serving(serve, garbage):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(garbage)
    status, headers, body = await read_response(reader)
    assert status == 400
    assert headers["connection"] == "close"
    assert orjson.loads(body)["error"]["message"]
    assert await expect_eof(reader) == b""

    reader, writer = await connect(server)
    writer.write(get("/ok"))
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_garbage_after_good_request_answers_the_good_one_first(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(get("/good") + b"NOT HTTP AT ALL\r\n\r\n")
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["path"] == "/good"
    assert (await read_response(reader))[0] == 400
    assert await expect_eof(reader) == b""


async def test_slow_header_sender_is_closed(serve):
    server = await serve(header_timeout_s=0.2)
    reader, writer = await connect(server)
    writer.write(b"GET / HTTP/1.1\r\nHost: t\r\n")  # the head never ends
    assert await expect_eof(reader) == b""
    assert server.responses_total == {}


async def test_header_timeout_counts_from_the_first_byte(serve):
    server = await serve(header_timeout_s=0.3)
    reader, writer = await connect(server)
    writer.write(b"GET / HTTP/1.1\r\n")
    loop = asyncio.get_running_loop()
    started = loop.time()
    for _ in range(100):  # keep trickling bytes: that must not extend the deadline
        if reader.at_eof() or writer.is_closing() or loop.time() - started > 0.6:
            break  # closed (by FIN, or by the reset our late bytes drew)
        writer.write(b"X-A: b\r\n")
        await asyncio.sleep(0.01)
    assert await expect_closed(reader) == b""
    assert loop.time() - started < 2.0


async def test_slow_body_sender_is_closed(serve):
    server = await serve(body_timeout_s=0.2)
    reader, writer = await connect(server)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nabc")
    assert await expect_eof(reader) == b""


async def test_idle_keep_alive_connection_is_closed(serve):
    server = await serve(keepalive_timeout_s=0.2)
    reader, writer = await connect(server)
    writer.write(get())
    assert (await read_response(reader))[0] == 200
    assert await expect_eof(reader) == b""
    assert server.num_connections == 0


async def test_connections_beyond_the_limit_get_503(serve):
    server = await serve(max_connections=2)
    conns = []
    for _ in range(2):
        reader, writer = await connect(server)
        writer.write(get())
        assert (await read_response(reader))[0] == 200
        conns.append((reader, writer))
    reader, writer = await connect(server)
    status, headers, body = await read_response(reader)
    assert status == 503
    assert headers["connection"] == "close"
    assert orjson.loads(body)["error"]["message"] == "Too many connections"
    assert await expect_eof(reader) == b""
    # Freeing a slot lets a new client in.
    conns[0][1].close()
    await conns[0][1].wait_closed()
    for _ in range(100):
        if server.num_connections < 2:
            break
        await asyncio.sleep(0.01)
    reader, writer = await connect(server)
    writer.write(get())
    assert (await read_response(reader))[0] == 200


# -- handler outcomes -----------------------------------------------------------------------------


async def test_handler_exception_gives_500_and_the_next_request_works(serve, caplog):
    async def handler(req: HttpRequest) -> Response:
        if req.path == "/boom":
            raise RuntimeError("kaput")
        return Response(200, b"fine", content_type="text/plain")

    server = await serve(handler)
    reader, writer = await connect(server)
    with caplog.at_level(logging.ERROR, logger="vt.http"):
        writer.write(get("/boom"))
        status, _, body = await read_response(reader)
    assert status == 500
    assert orjson.loads(body)["error"]["type"] == "server_error"
    assert any("kaput" in (r.exc_text or "") for r in caplog.records if r.name == "vt.http")
    writer.write(get("/fine"))
    status, _, body = await read_response(reader)
    assert (status, body) == (200, b"fine")
    assert server.responses_total == {500: 1, 200: 1}


async def test_http_error_gives_its_status_and_body(serve):
    async def handler(req: HttpRequest) -> Response:
        raise HttpError(404, "no such model", param="model", code="model_not_found",
                        headers=[("X-Why", "missing")])

    server = await serve(handler)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        r = await client.get("/v1/nope")
    assert r.status_code == 404
    assert r.headers["x-why"] == "missing"
    assert r.content == error_body("no such model", param="model", code="model_not_found")
    assert r.json() == {
        "error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}
    }


# -- streaming ------------------------------------------------------------------------------------


async def test_stream_arrives_chunk_by_chunk(serve):
    second = asyncio.Event()

    async def handler(req: HttpRequest) -> StreamResponse:
        async def chunks():
            yield b"data: first\n\n"
            await second.wait()
            yield b"data: second\n\n"

        return StreamResponse(200, chunks())

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get("/s"))
    status, headers = await read_head(reader)
    assert status == 200
    assert headers["transfer-encoding"] == "chunked"
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    assert "content-length" not in headers
    assert await read_chunk(reader) == b"data: first\n\n"  # before the handler may yield more
    assert not second.is_set()
    second.set()
    assert await read_chunk(reader) == b"data: second\n\n"
    assert await read_chunk(reader) == b""
    writer.write(get("/after"))  # the connection is still good
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_stream_with_httpx(serve):
    async def handler(req: HttpRequest) -> StreamResponse:
        async def chunks():
            for i in range(10):
                yield b"%d," % i

        return StreamResponse(200, chunks(), content_type="text/plain")

    server = await serve(handler)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as client:
        async with client.stream("GET", "/") as r:
            got = b"".join([c async for c in r.aiter_raw()])
    assert got == b"".join(b"%d," % i for i in range(10))


async def test_client_disconnect_mid_stream_closes_the_iterator(serve):
    finalized = asyncio.Event()
    requests: list[HttpRequest] = []

    async def handler(req: HttpRequest) -> StreamResponse:
        requests.append(req)

        async def chunks():
            try:
                yield b"one"
                await asyncio.Event().wait()  # waits for work that never comes
                yield b"never"
            finally:
                finalized.set()

        return StreamResponse(200, chunks())

    server = await serve(handler)
    await hang_up_after_first_chunk(server, b"one")
    await asyncio.wait_for(finalized.wait(), TIMEOUT)
    await asyncio.wait_for(requests[0].disconnected.wait(), TIMEOUT)
    assert await eventually(lambda: server.in_flight == 0)


async def test_disconnect_sets_event_for_a_running_handler(serve):
    started = asyncio.Event()
    saw_disconnect = asyncio.Event()

    async def handler(req: HttpRequest) -> Response:
        started.set()
        await req.disconnected.wait()
        saw_disconnect.set()
        return Response(200)

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    writer.close()
    await asyncio.wait_for(saw_disconnect.wait(), TIMEOUT)


async def test_slow_reader_keeps_the_write_buffer_bounded(serve):
    chunk = b"z" * 65536
    total = 160  # 10 MiB: more than the socket buffers between us hold (client's pinned small below)
    produced = 0
    max_buffer = 0
    done = asyncio.Event()

    async def handler(req: HttpRequest) -> StreamResponse:
        async def chunks():
            nonlocal produced, max_buffer
            for _ in range(total):
                for conn in server._connections:  # peek at the server side of the socket
                    max_buffer = max(max_buffer, conn._transport.get_write_buffer_size())
                produced += 1
                yield chunk
            done.set()

        return StreamResponse(200, chunks(), content_type="application/octet-stream")

    server = await serve(handler)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)  # no receive-window autotuning
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=65536)
    writer.write(get())
    # The client reads nothing more: the producer must stall instead of finishing.
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(done.wait(), 1.0)
    assert produced < total
    assert max_buffer <= 256 * 1024 + len(chunk) + 64
    # Reading resumes the stream, and every byte arrives.
    status, _, body = await read_response(reader)
    assert status == 200
    assert len(body) == total * len(chunk)
    assert done.is_set()
    writer.close()


async def test_stream_error_mid_body_truncates_the_response(serve):
    async def handler(req: HttpRequest) -> StreamResponse:
        async def chunks():
            yield b"partial"
            raise RuntimeError("engine died")

        return StreamResponse(200, chunks())

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get())
    await read_head(reader)
    assert await read_chunk(reader) == b"partial"
    assert await expect_eof(reader) == b""  # no terminating zero chunk


async def test_push_body_chunks_arrive_in_order_and_end_the_body(serve):
    bodies: list[PushBody] = []

    aborted: list[str] = []

    async def handler(req: HttpRequest) -> StreamResponse | Response:
        if req.path != "/p":
            return Response(200)
        body = PushBody(on_abort=lambda: aborted.append(req.path))
        body.send(b"data: early\n\n")  # before the head is written: held, then sent first
        bodies.append(body)
        return StreamResponse(200, body)

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get("/p"))
    status, headers = await read_head(reader)
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert await read_chunk(reader) == b"data: early\n\n"
    bodies[0].send(b"data: later\n\n")  # from a plain callback, no task of its own
    bodies[0].send(b"")  # empty chunks would end a chunked body: skipped
    assert await read_chunk(reader) == b"data: later\n\n"
    bodies[0].end()
    bodies[0].send(b"after the end")  # dropped
    assert await read_chunk(reader) == b""
    writer.write(get("/after"))  # the connection is still good
    assert (await read_response(reader))[0] == 200
    assert aborted == []  # a body that ended is not aborted
    writer.close()


async def test_push_body_disconnect_runs_on_abort_once(serve):
    aborted: list[int] = []
    bodies: list[PushBody] = []

    async def handler(req: HttpRequest) -> StreamResponse:
        body = PushBody(on_abort=lambda: aborted.append(1))
        body.send(b"one")
        bodies.append(body)
        return StreamResponse(200, body)

    server = await serve(handler)
    await hang_up_after_first_chunk(server, b"one")
    assert await eventually(lambda: bool(aborted))
    assert aborted == [1]
    bodies[0].send(b"late")  # the producer may still send: nothing breaks
    bodies[0].end()
    await bodies[0].aclose()
    assert aborted == [1]
    assert await eventually(lambda: server.in_flight == 0)


async def test_push_body_failure_truncates_and_head_request_aborts(serve):
    aborted: list[str] = []

    async def handler(req: HttpRequest) -> StreamResponse:
        body = PushBody(on_abort=lambda: aborted.append(req.method))
        body.send(b"partial")
        if req.method == "GET":
            asyncio.get_running_loop().call_later(0.05, body.end, False)
        return StreamResponse(200, body)

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\n")
    status, headers = await read_head(reader)
    assert status == 200
    writer.write(get())  # the HEAD answer had no body: the next response follows at once
    await read_head(reader)
    assert await read_chunk(reader) == b"partial"
    assert await expect_eof(reader) == b""  # no terminating zero chunk
    assert aborted == ["HEAD"]


# -- shutdown -------------------------------------------------------------------------------------


async def test_close_waits_for_in_flight_request(serve):
    started, release = asyncio.Event(), asyncio.Event()

    async def handler(req: HttpRequest) -> Response:
        started.set()
        await release.wait()
        return Response(200, b"done", content_type="text/plain")

    server = await serve(handler)
    port = server.port
    idle_reader, _ = await connect(server)
    reader, writer = await connect(server)
    writer.write(get())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    closing = asyncio.create_task(server.close(TIMEOUT))
    assert await expect_eof(idle_reader) == b""  # idle connections go at once
    assert not closing.done()
    assert server.in_flight == 1
    release.set()
    status, headers, body = await read_response(reader)
    assert (status, body) == (200, b"done")
    assert headers["connection"] == "close"
    await asyncio.wait_for(closing, TIMEOUT)
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_close_gives_up_after_timeout(serve):
    started = asyncio.Event()

    async def handler(req: HttpRequest) -> Response:
        started.set()
        await asyncio.Event().wait()
        return Response(200)

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    await asyncio.wait_for(server.close(0.1), TIMEOUT)
    assert await expect_eof(reader) == b""


# -- hostile clients ------------------------------------------------------------------------------


async def small_window_client(server: HttpServer, request: bytes):
    """A client whose receive buffer is pinned small, so an unread response backs up quickly."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=65536)
    writer.write(request)
    return reader, writer


class Producer:
    """Pushes chunks into a PushBody from its own task, as the engine does, and honours the
    server's pause requests the way the engine does: a paused request computes nothing."""

    def __init__(self, total: int, chunk: bytes = b"p" * 32768) -> None:
        self.total, self.chunk = total, chunk
        self.sent = 0
        self.pauses: list[bool] = []
        self.running = asyncio.Event()
        self.running.set()
        self.aborted = False
        self.body = PushBody(on_abort=self.abort, on_pause=self.pause)
        self.task = asyncio.ensure_future(self.run())

    def pause(self, paused: bool) -> None:
        self.pauses.append(paused)
        (self.running.clear if paused else self.running.set)()

    def abort(self) -> None:
        self.aborted = True

    async def run(self) -> None:
        while self.sent < self.total and not self.aborted:
            await self.running.wait()
            await asyncio.sleep(0)
            self.body.send(self.chunk)
            self.sent += 1
        self.body.end()


async def test_push_body_producer_is_paused_while_the_reader_is_behind(serve):
    producers: list[Producer] = []
    max_buffer = 0

    async def handler(req: HttpRequest) -> StreamResponse:
        producers.append(Producer(total=400))  # 12.5 MiB, more than the socket buffers hold
        return StreamResponse(200, producers[0].body, content_type="application/octet-stream")

    server = await serve(handler)
    reader, writer = await small_window_client(server, get())
    await asyncio.sleep(0.05)
    for _ in range(100):  # the client reads nothing for a second
        for conn in server._connections:
            max_buffer = max(max_buffer, conn._transport.get_write_buffer_size())
        await asyncio.sleep(0.01)
    p = producers[0]
    assert p.pauses and p.pauses[0] is True and p.sent < p.total
    assert max_buffer <= 256 * 1024 + 2 * len(p.chunk)
    status, _, body = await read_response(reader)  # reading resumes it, and every byte arrives
    assert status == 200 and len(body) == p.total * len(p.chunk)
    assert p.pauses[-1] is False and not p.aborted
    writer.close()


@pytest.mark.parametrize("kind", ["push", "full"])
async def test_a_client_that_never_reads_is_cut_after_the_write_timeout(serve, kind):
    producers: list[Producer] = []
    done = asyncio.Event()

    async def handler(req: HttpRequest) -> Response | StreamResponse:
        if req.path == "/x":
            return Response(200)
        if kind == "full":
            try:
                return Response(200, b"f" * (16 << 20))  # more than every buffer on the way
            finally:
                done.set()
        producers.append(Producer(total=10**9))
        return StreamResponse(200, producers[0].body)

    server = await serve(handler, write_timeout_s=0.3)
    reader, writer = await small_window_client(server, get())
    assert await eventually(lambda: server.num_connections == 0, timeout=10)
    assert await eventually(lambda: server.in_flight == 0)
    if kind == "push":
        assert producers[0].aborted  # the request behind the stream is aborted
    writer.close()
    # the slot is free for others
    reader, writer = await connect(server)
    writer.write(get("/x"))
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_a_slow_but_steady_reader_is_not_cut(serve):
    async def handler(req: HttpRequest) -> Response:
        return Response(200, b"s" * (1 << 20))

    server = await serve(handler, write_timeout_s=0.4)
    reader, writer = await small_window_client(server, get())
    status, headers = await read_head(reader)
    got = 0
    while got < int(headers["content-length"]):
        data = await asyncio.wait_for(reader.read(16384), TIMEOUT)
        assert data, "cut off mid-body"
        got += len(data)
        await asyncio.sleep(0.02)  # well below the timeout between reads, far slower than the server
    assert status == 200 and got == 1 << 20
    writer.close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET / HTTP/1.1\r\n\r\n", 400),                                # no Host
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),          # two
    (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", 505),
    (b"GET /\r\n\r\n", 400),                                         # HTTP/0.9 style
    (b"GET / HTTP/0.9\r\n\r\n", 400),
])
async def test_request_lines_and_hosts_rfc9112_refuses(serve, request_bytes, status):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(request_bytes)
    got, headers, _ = await read_response(reader)
    assert got == status and headers["connection"] == "close"
    writer.close()


async def test_http10_needs_no_host(serve):
    server = await serve()
    reader, writer = await connect(server)
    writer.write(b"GET / HTTP/1.0\r\n\r\n")
    assert (await read_response(reader))[0] == 200
    writer.close()


async def test_100_continue_only_after_the_precheck_passes(serve):
    def precheck(req: HttpRequest) -> Response | None:
        if req.path == "/locked":
            return Response(401, b'{"error": "key"}', headers=[("www-authenticate", "Bearer")])
        return None

    server = await serve(precheck=precheck)
    reader, writer = await connect(server)
    writer.write(b"POST /locked HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    status, headers, body = await read_response(reader)  # the final answer, no 100 before it
    assert status == 401 and headers["www-authenticate"] == "Bearer" and body == b'{"error": "key"}'
    assert await expect_closed(reader) == b""
    reader, writer = await connect(server)
    writer.write(b"POST /open HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), TIMEOUT) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    status, _, body = await read_response(reader)
    assert status == 200 and orjson.loads(body)["body"] == "body"
    writer.close()


async def test_a_request_followed_by_a_half_close_is_answered(serve):
    async def handler(req: HttpRequest) -> Response:
        await asyncio.sleep(0.6)  # long enough for interim answers to go out meanwhile
        return Response(200, b"answer")

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get() + get("/second"))
    writer.write_eof()
    data = await expect_eof(reader)
    # interim 102s, then both answers in order, then the close
    finals = [line for line in data.split(b"\r\n") if line.startswith(b"HTTP/1.1 ") and b" 102 " not in line]
    assert finals == [b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK"]
    assert data.endswith(b"answer") and data.count(b"answer") == 2
    writer.close()


async def test_a_client_that_left_entirely_is_noticed_while_its_request_runs(serve):
    started = asyncio.Event()
    requests: list[HttpRequest] = []

    async def handler(req: HttpRequest) -> Response:
        requests.append(req)
        started.set()
        await req.disconnected.wait()  # a long generation that only a disconnect ends
        return Response(499)

    server = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    writer.close()  # FIN, exactly as a half-close looks: only a write tells them apart
    await asyncio.wait_for(requests[0].disconnected.wait(), TIMEOUT)
    assert await eventually(lambda: server.in_flight == 0)


def test_limits_are_validated():
    with pytest.raises(ValueError, match="max_body_bytes"):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="header_timeout_s"):
        HttpLimits(header_timeout_s=-1)
    with pytest.raises(ValueError, match="write_timeout_s"):
        HttpLimits(write_timeout_s=0)
