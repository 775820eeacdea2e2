"""`vt bench`'s stream reader against canned SSE responses (completions and chat): what counts as a
token's arrival."""

from __future__ import annotations

import asyncio

import orjson

from vt.bench.client import Endpoint, stream_completion
from vt.bench.stats import RequestRecord


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(body), body)


async def _serve_canned(events: list[bytes], gap: float) -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        for e in events:
            writer.write(_chunked(e))
            await writer.drain()
            await asyncio.sleep(gap)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _read_canned(events: list[bytes], gap: float, input_tokens: int, body: dict, **stream) -> RequestRecord:
    """stream_completion's record of `events`, served one every `gap` s."""
    async def run() -> RequestRecord:
        server, port = await _serve_canned(events, gap)
        rec = RequestRecord(index=0, input_tokens=input_tokens)
        async with server:
            await stream_completion(Endpoint("127.0.0.1", port), body, rec, 0.0, **stream)
        return rec

    return asyncio.run(run())


def test_chunks_without_text_count_as_token_arrivals() -> None:
    """A token whose text is empty (a special token, or an id the tokenizer renders as nothing)
    still arrived: TTFT is the first choice chunk, and every choice chunk is an inter-token gap.
    The usage chunk (no choices) is not a token."""
    choice = lambda text, fin=None: {"choices": [{"index": 0, "text": text, "finish_reason": fin}]}  # noqa: E731
    events = [_event(choice("")), _event(choice("")), _event(choice("a")), _event(choice("", "length")),
              _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}}),
              b"data: [DONE]\n\n"]

    rec = _read_canned(events, 0.02, 3, {"prompt": [1, 2, 3]})
    assert rec.success, rec.error
    assert rec.output_tokens == 4
    assert len(rec.chunk_times) == 4
    assert rec.first_token == rec.chunk_times[0]
    # the last token came three gaps after the first, not at the first text
    assert rec.chunk_times[-1] - rec.first_token > 0.04
    assert rec.text == "a"


def test_a_chat_streams_role_announcement_is_not_a_token() -> None:
    """A chat stream opens with the reply's role and empty content before any token exists (vt and
    vLLM send it at once): TTFT starts at the first content chunk; an empty-text token still counts."""
    delta = lambda d, fin=None: {"choices": [{"index": 0, "delta": d, "finish_reason": fin}]}  # noqa: E731
    events = [_event(delta({"role": "assistant", "content": ""})), _event(delta({"content": "Hi"})),
              _event(delta({"content": ""})), _event(delta({"content": "!"}, "length")),
              _event({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}),
              b"data: [DONE]\n\n"]

    rec = _read_canned(events, 0.05, 9, {"messages": []}, path="/v1/chat/completions", chat=True)
    assert rec.success, rec.error
    assert rec.output_tokens == 3 and len(rec.chunk_times) == 3
    assert rec.text == "Hi!"
    assert rec.ttft is not None and rec.ttft >= 0.04  # one gap after the role chunk, not at it
