"""Server-sent events of a streamed completion: the framing, a plain token's event built from
bytes cut once, and the response body that carries the events of one or several choices."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from vt.engine.outputs import RequestOutput, RequestStream
from vt.http.choices import close_streams, engine_failure, merge_outputs
from vt.http.engine_client import EngineClient
from vt.http.messages import PushBody, StreamResponse

log = logging.getLogger("vt.http")

DONE = b"data: [DONE]\n\n"
_HOLE = "\x00vt-text\x00"


def sse_event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class TextEvents:
    """The SSE event of a plain token (no logprobs, not the last), byte for byte what sse_event
    would make of `event(index, text)`: the bytes around the text are serialised once per choice
    and only the text is encoded per token, instead of a dict of dicts."""

    def __init__(self, event: Callable[[int, str], dict[str, Any]]) -> None:
        self._event = event
        self._parts: dict[int, list[bytes]] = {}

    def __call__(self, index: int, text: str) -> bytes:
        parts = self._parts.get(index)
        if parts is None:
            parts = self._parts[index] = sse_event(self._event(index, _HOLE)).split(orjson.dumps(_HOLE))
        if len(parts) != 2:  # the marker occurs elsewhere too (a model named so): no shortcut
            return sse_event(self._event(index, text))
        return parts[0] + orjson.dumps(text) + parts[1]


def error_event(out: RequestOutput) -> bytes:
    """The SSE event that ends a stream whose request the engine ended with an error (its type
    by the error's kind, as a whole answer's status would be)."""
    failure = engine_failure(out.error, out.error_kind)
    return sse_event({"error": {"message": failure.message, "type": failure.type, "param": None,
                                "code": None}})


def nothing_new(out: RequestOutput) -> bool:
    """True for an output with no token, no text and no finish. A token with empty or held-back
    text still gets its chunk (as vLLM does): clients count tokens and time them from the stream."""
    return not out.text and not out.token_ids and not out.finished


@dataclass
class StreamEvents:
    """The SSE events of one streamed response: `first` before any output, `output(i, out)` for
    each engine output of choice i (an error's events end with DONE: the stream stops there),
    `last()` once every choice has finished."""

    first: list[bytes]
    output: Callable[[int, RequestOutput], list[bytes]]
    last: Callable[[], list[bytes]]


async def _pull_events(streams: list[RequestStream], events: StreamEvents) -> AsyncGenerator[bytes, None]:
    for data in events.first:
        yield data
    async for i, out in merge_outputs(streams):
        datas = events.output(i, out)
        for data in datas:
            yield data
        if datas and datas[-1] is DONE:
            return
    for data in events.last():
        yield data


class _SseBody:
    """The chunk iterator handed to the server; closing it aborts the engine requests.

    A plain async generator closed before its first step never runs its `finally`, so the
    cleanup lives here, where it runs whether or not streaming ever started.
    """

    def __init__(self, events: AsyncGenerator[bytes, None], streams: list[RequestStream],
                 engine: EngineClient) -> None:
        self._events = events
        self._streams = streams
        self._engine = engine
        self._closed = False

    def __aiter__(self) -> _SseBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._events.__anext__()
        except BaseException:
            # finished, failed or cancelled: nothing more will be read, release the requests now
            await self.aclose()
            raise

    def pause_producing(self) -> None:
        self._set_paused(True)

    def resume_producing(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        """Pause (or resume) the engine requests behind a response whose reader fell behind."""
        for stream in self._streams:
            self._engine.set_paused(stream.request_id, paused)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._events.aclose()
        finally:
            await close_streams(self._streams)


def stream_response(engine: EngineClient, streams: list[RequestStream],
                    events: StreamEvents) -> StreamResponse:
    """One choice: the engine hands each output to a callback that writes its events into the
    response (no task wakes per token). Several choices are merged by a generator."""
    if len(streams) != 1:
        return StreamResponse(200, _SseBody(_pull_events(streams, events), streams, engine))
    stream = streams[0]
    body = PushBody(on_abort=lambda: engine.abort(stream.request_id),
                    on_pause=lambda paused: engine.set_paused(stream.request_id, paused))
    for data in events.first:
        body.send(data)

    def deliver(out: RequestOutput) -> None:
        try:
            datas = events.output(0, out)
            for data in datas:
                body.send(data)
            if datas and datas[-1] is DONE:  # the engine failed the request
                body.end()
            elif out.finished:
                for data in events.last():
                    body.send(data)
                body.end()
        except Exception:
            log.exception("writing a stream event failed")
            body.end(ok=False)
            engine.abort(stream.request_id)

    stream.deliver_to(deliver)
    return StreamResponse(200, body)
