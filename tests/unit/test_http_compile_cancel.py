"""A client that goes away while its grammar compiles cancels the compile: the HTTP layer stops
waiting, cancels the engine's compile (the compiler then stops its child unless another request
waits for the same grammar) and answers 499; a compile that ends first is used as before."""

from __future__ import annotations

import asyncio

import pytest

from vt.http.errors import HttpError
from vt.http.protocol import ProtocolError
from vt.http.structured_fields import StructuredField, constrain
from vt.sampling_params import SamplingParams
from vt.structured.compiler import GrammarError
from vt.structured.spec import GrammarSpec


class SlowCompiler:
    """compile_grammar that takes `seconds` (or forever), recording how it ended."""

    def __init__(self, seconds: float | None = None, error: str | None = None) -> None:
        self.seconds, self.error = seconds, error
        self.cancelled = self.finished = False

    async def compile_grammar(self, spec: GrammarSpec) -> object:
        try:
            if self.seconds is None:
                await asyncio.Event().wait()
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        if self.error:
            raise GrammarError(self.error)
        self.finished = True
        return object()


FIELD = StructuredField(GrammarSpec("regex", "a+"), "guided_regex")


async def test_a_disconnect_during_the_compile_cancels_it_and_answers_499() -> None:
    engine, gone = SlowCompiler(None), asyncio.Event()
    task = asyncio.ensure_future(constrain(engine, SamplingParams(), FIELD, disconnected=gone))
    await asyncio.sleep(0.05)
    assert not task.done()
    gone.set()
    with pytest.raises(HttpError) as e:
        await asyncio.wait_for(task, 2)
    assert e.value.status == 499 and engine.cancelled


async def test_a_compile_that_ends_first_is_used_and_its_errors_are_400s() -> None:
    engine = SlowCompiler(0.01)
    params = await constrain(engine, SamplingParams(), FIELD, disconnected=asyncio.Event())
    assert engine.finished and params.structured is not None
    with pytest.raises(ProtocolError) as e:
        await constrain(SlowCompiler(0.01, "bad regex"), SamplingParams(), FIELD,
                        disconnected=asyncio.Event())
    assert e.value.param == "guided_regex"


async def test_a_cancelled_handler_cancels_its_compile() -> None:
    """The server cancels a handler past its shutdown timeout: the compile goes with it."""
    engine = SlowCompiler(None)
    task = asyncio.ensure_future(constrain(engine, SamplingParams(), FIELD, disconnected=asyncio.Event()))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert engine.cancelled
