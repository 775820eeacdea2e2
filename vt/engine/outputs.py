"""What the engine hands the HTTP layer: outputs, their streams, and the errors a request can meet.

A light module: `vt.http` imports it (to tell errors apart by type and to read outputs) without
importing the engine or the model runtime behind it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class PromptTooLongError(ValueError):
    """The prompt (with max_tokens) does not fit the context: a 400."""


class QueueFullError(RuntimeError):
    """The waiting queue is full: a 503 with retry-after."""


class EngineDeadError(RuntimeError):
    """The engine can no longer run steps (or is stopping): a 503."""


# Why a request ended with finish_reason "error" (RequestOutput.error_kind); the HTTP layer answers
# each with its own status.
ERROR_ENGINE = "engine"    # a step failed, or the engine died: 500
ERROR_STOPPED = "stopped"  # the server stopped before the request was done: 503
ERROR_REQUEST = "request"  # the request's own constraints left no token to sample: 400


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


# One per token of every request: slotted and unfrozen, as a frozen dataclass costs ~1.5 us
# more to build. Readers treat it as immutable.
@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str                                   # delta since the last output
    token_ids: tuple[int, ...]                  # delta
    logprobs: tuple[TokenLogprob, ...] | None   # delta, aligned with token_ids
    finished: bool
    finish_reason: str | None                   # stop | length | abort | error
    stop_reason: str | int | None               # matched stop string or stop token id
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    error_kind: str = ERROR_ENGINE              # with error: ERROR_ENGINE | ERROR_STOPPED | ERROR_REQUEST
    embedding: Any = None                       # an embedding request's vector (numpy float32[d]), finished


class StreamOwner(Protocol):
    """What a RequestStream needs from the engine that feeds it."""

    def abort(self, request_id: str) -> None: ...

    def _post(self, fn: Callable[[RequestOutput], None], out: RequestOutput) -> None: ...


class RequestStream:
    """Async iterator of one request's RequestOutputs; closing it early aborts the request.

    The engine puts one output per request per step, so this is a plain deque with a single
    waiter rather than an asyncio.Queue, whose getter and putter bookkeeping cost ~2 us a token.
    """

    __slots__ = ("engine", "request_id", "_items", "_waiter", "_done", "_deliver")

    def __init__(self, engine: StreamOwner, request_id: str) -> None:
        self.engine, self.request_id = engine, request_id
        self._items: deque[RequestOutput] = deque()
        self._waiter: asyncio.Future | None = None
        self._done = False
        self._deliver: Callable[[RequestOutput], None] | None = None

    def deliver_to(self, fn: Callable[[RequestOutput], None]) -> None:
        """Hand every output to fn instead of queueing it for iteration. fn runs on the event
        loop once the scheduler yields (after the next step is launched), in output order; it
        must not raise (what it raises is logged)."""
        self._deliver = fn
        items, self._items = self._items, deque()
        for out in items:
            self.engine._post(fn, out)

    def put(self, out: RequestOutput) -> None:
        """Engine side: never blocks; wakes the reader if it waits."""
        if self._deliver is not None:
            self.engine._post(self._deliver, out)
            return
        self._items.append(out)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                if self._waiter is waiter:
                    self._waiter = None
        out = self._items.popleft()
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)
