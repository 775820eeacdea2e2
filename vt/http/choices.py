"""The n engine requests behind one response: each choice's accumulated output, their outputs
merged in arrival order, and a whole (non-streamed) answer collected."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from vt.engine.outputs import ERROR_REQUEST, ERROR_STOPPED, RequestOutput, RequestStream, TokenLogprob
from vt.http.disconnects import unless_disconnected
from vt.http.errors import HttpError
from vt.http.messages import HttpRequest

log = logging.getLogger("vt.http")


@dataclass
class Choice:
    """Accumulated state of one of the n engine requests behind a response."""

    index: int
    request_id: str
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_output_tokens: int = 0
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_kind: str | None = None  # with error: RequestOutput.error_kind
    text_offset: int = 0   # characters streamed so far, for completions text_offset

    def update(self, out: RequestOutput) -> None:
        self.text.append(out.text)
        self.token_ids.extend(out.token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        self.num_output_tokens = out.num_output_tokens
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason
            self.error = out.error
            self.error_kind = out.error_kind


def engine_failure(message: str | None, kind: str | None) -> HttpError:
    """The answer to a request the engine ended with an error, by the error's kind: the request's
    own constraints (400), a stopping server (503) or the engine (500)."""
    if kind == ERROR_REQUEST:
        return HttpError(400, message or "the request cannot go on")
    if kind == ERROR_STOPPED:
        return HttpError(503, message or "the server stopped before the request was done",
                         type="service_unavailable", headers=[("retry-after", "1")])
    return HttpError(500, message or "the request failed in the engine", type="internal_server_error")


def usage(num_prompt_tokens: int, choices: list[Choice], more_tokens: int = 0) -> dict[str, int]:
    """OpenAI's usage object: the prompt tokens and the choices' output tokens (plus more_tokens)."""
    completion = sum(c.num_output_tokens for c in choices) + more_tokens
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


async def _next(stream: RequestStream) -> RequestOutput:
    return await stream.__anext__()


async def merge_outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (choice index, output) from several engine streams in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending: dict[asyncio.Future[RequestOutput], int] = {
        asyncio.ensure_future(_next(stream)): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                if not out.finished:
                    pending[asyncio.ensure_future(_next(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # retrieved so asyncio does not warn about it


async def close_streams(streams: list[RequestStream]) -> None:
    """Close every engine stream; closing an unfinished one aborts its request."""
    for stream in streams:
        try:
            await stream.aclose()
        except Exception:
            log.exception("closing a request stream failed")


async def collect(request: HttpRequest, streams: list[RequestStream], choices: list[Choice]) -> None:
    """Drain all streams into `choices`; a client disconnect aborts them (a 499), a request the
    engine failed fails the answer (engine_failure)."""

    async def drain() -> None:
        async for i, out in merge_outputs(streams):
            choices[i].update(out)

    try:
        await unless_disconnected(request.disconnected, drain())
    finally:
        await close_streams(streams)
    failed = [c for c in choices if c.finish_reason == "error"]
    if failed:
        raise engine_failure(failed[0].error, failed[0].error_kind)
