"""RequestStream: the per-request channel between the scheduler coroutine and its reader."""

from __future__ import annotations

import asyncio

from vt.engine.outputs import RequestOutput, RequestStream


class _Engine:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _post(self, fn, out) -> None:  # as AsyncEngine: delivered from a loop callback
        asyncio.get_running_loop().call_soon(fn, out)


def _out(k: int, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", f"t{k}", (k,), None, finished, "length" if finished else None, None, 3, k,
                         0)


async def test_reader_gets_outputs_in_order_and_stops_after_the_last():
    s = RequestStream(_Engine(), "r")
    s.put(_out(1))
    s.put(_out(2))
    got = [await s.__anext__(), await s.__anext__()]
    reader = asyncio.ensure_future(s.__anext__())
    await asyncio.sleep(0)
    assert not reader.done()  # waits for the engine
    s.put(_out(3, finished=True))
    got.append(await reader)
    assert [o.token_ids for o in got] == [(1,), (2,), (3,)]
    assert [o async for o in s] == []  # finished: iteration ends


async def test_a_cancelled_reader_leaves_the_stream_usable():
    s = RequestStream(_Engine(), "r")
    reader = asyncio.ensure_future(s.__anext__())
    await asyncio.sleep(0)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    s.put(_out(1))  # nobody waits now: no error, the output is kept
    assert (await asyncio.wait_for(s.__anext__(), 1)).token_ids == (1,)


async def test_closing_early_aborts_once_and_closing_after_the_end_does_not():
    engine = _Engine()
    s = RequestStream(engine, "r")
    await s.aclose()
    await s.aclose()
    assert engine.aborted == ["r"]
    done = RequestStream(engine, "d")
    done.put(_out(1, finished=True))
    await done.__anext__()
    await done.aclose()
    assert engine.aborted == ["r"]


async def test_deliver_to_hands_over_queued_and_later_outputs_in_order():
    s = RequestStream(_Engine(), "r")
    s.put(_out(1))
    seen: list[int] = []
    s.deliver_to(lambda out: seen.append(out.token_ids[0]))
    s.put(_out(2))
    s.put(_out(3, finished=True))
    assert seen == []  # not from inside the engine's step processing
    await asyncio.sleep(0)
    assert seen == [1, 2, 3]
