"""Shutdown answers every accepted request: the pieces `vt serve` stops with, each on its own.

The server waits while any request is still arriving, queued or being answered (wait_idle); past
the shutdown timeout it stops what is left (stop_requests): a handler still at work is cancelled
and its request answered 503, a request still arriving gets a 503 and the close; pipelined
requests queued behind get their answers before the connection closes. The app refuses new
generation requests while draining, but one whose handler started before goes on to finish. The
engine's stop ends the requests it still holds with an error output its clients can read
(ERROR_STOPPED), and refuses new ones.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from tests.unit.test_http_server import (
    TIMEOUT,
    Served,
    connect,
    eventually,
    expect_closed,
    get,
    read_response,
)
from tests.unit.test_openai_api import COMPLETION, MODEL, FakeEngine, call, jbody
from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.engine.outputs import ERROR_STOPPED, EngineDeadError
from vt.http.openai_api import OpenAIApp
from vt.http.server import HttpRequest, HttpServer, PushBody, Response, StreamResponse
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams


@pytest.fixture
async def serve():
    served = Served()
    yield served
    for server in served.servers:
        await server.close(1.0)


def assert_stopped(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 503, body
    assert headers.get("retry-after") == "1"
    error = orjson.loads(body)["error"]
    assert error["type"] == "service_unavailable" and "stopped" in error["message"]


async def test_a_handler_still_at_work_is_stopped_and_its_request_answered_503(serve) -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def handler(req: HttpRequest) -> Response:
        started.set()
        try:
            await asyncio.Event().wait()  # a compile, a render, the engine's answer: never comes
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return Response(200)

    server: HttpServer = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get())
    await asyncio.wait_for(started.wait(), TIMEOUT)
    assert server.busy
    assert not await server.wait_idle(0.05)  # it would wait for the request as long as allowed
    server.stop_requests()
    assert_stopped(*await read_response(reader))
    assert cancelled.is_set()  # what it waited for is let go (a compile's child is killed)
    assert await server.wait_idle(TIMEOUT)
    writer.close()


async def test_a_request_still_arriving_gets_a_503_and_the_close(serve) -> None:
    server: HttpServer = await serve()
    reader, writer = await connect(server)
    writer.write(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
    assert await eventually(lambda: server.busy)  # a body on its way is an accepted request
    server.stop_requests()
    assert_stopped(*await read_response(reader))
    assert await expect_closed(reader) == b""
    writer.close()


async def test_a_stream_under_way_is_left_to_its_producer(serve) -> None:
    body = PushBody()

    async def handler(req: HttpRequest) -> StreamResponse:
        return StreamResponse(200, body)

    server: HttpServer = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get())
    body.send(b"one")
    assert await eventually(lambda: server.in_flight == 1)
    server.stop_requests()  # the engine ends a stream with its own error event
    body.send(b"two")
    body.end()
    status, _, data = await read_response(reader)
    assert (status, data) == (200, b"onetwo")
    writer.close()


async def test_pipelined_requests_queued_behind_get_their_answers_when_the_server_closes(serve) -> None:
    release = asyncio.Event()

    async def handler(req: HttpRequest) -> Response:
        if req.path == "/first":
            await release.wait()
        return Response(200, req.path.encode(), content_type="text/plain")

    server: HttpServer = await serve(handler)
    reader, writer = await connect(server)
    writer.write(get("/first") + get("/second") + get("/third"))
    assert await eventually(lambda: server.in_flight == 1)
    closing = asyncio.create_task(server.close(TIMEOUT))
    await asyncio.sleep(0.05)
    release.set()
    answers = [await read_response(reader) for _ in range(3)]
    assert [(status, body) for status, _, body in answers] == [(200, b"/first"), (200, b"/second"),
                                                               (200, b"/third")]
    assert "connection" not in answers[0][1] and answers[2][1]["connection"] == "close"
    await asyncio.wait_for(closing, TIMEOUT)
    writer.close()


class GatedCompiles(FakeEngine):
    """A fake engine whose grammar compiles wait for `compiled`."""

    def __init__(self) -> None:
        super().__init__()
        self.compiling, self.compiled = asyncio.Event(), asyncio.Event()

    async def compile_grammar(self, spec):
        self.compiling.set()
        await self.compiled.wait()
        await super().compile_grammar(spec)


async def test_draining_refuses_new_requests_but_lets_one_already_started_finish() -> None:
    engine = GatedCompiles()
    app = OpenAIApp(engine, MODEL)
    guided = {**COMPLETION, "guided_regex": "[a-z]+"}
    started = asyncio.create_task(call(app, "POST", "/v1/completions", guided))
    await asyncio.wait_for(engine.compiling.wait(), TIMEOUT)  # its handler waits in the compile
    app.begin_drain()
    late = await call(app, "POST", "/v1/completions", COMPLETION)
    assert late.status == 503 and jbody(late)["error"]["type"] == "service_unavailable"
    engine.compiled.set()
    done = await asyncio.wait_for(started, TIMEOUT)
    assert done.status == 200, done.body
    assert len(engine.calls) == 1  # the one accepted before the drain reached the engine


async def test_engine_stop_ends_its_requests_with_an_error_and_refuses_new_ones(tmp_path) -> None:
    engine = AsyncEngine(EngineConfig(model=str(make_model(tmp_path / "m")), device="cpu"))
    await engine.start()
    prompt = engine.tokenizer.encode("x")
    stream = engine.add_request("long", prompt, SamplingParams(max_tokens=1500, ignore_eos=True))
    first = await stream.__anext__()
    assert not first.finished
    await engine.stop(0.0)
    outs = [out async for out in stream]
    last = outs[-1]
    assert last.finished and last.finish_reason == "error" and last.error_kind == ERROR_STOPPED, last
    assert "stopped" in last.error
    with pytest.raises(EngineDeadError):
        engine.add_request("after", prompt, SamplingParams(max_tokens=2))
