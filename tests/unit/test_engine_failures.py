"""A failing engine step fails only its requests, with an error the client sees; the server keeps
serving. Repeated failures mark the engine dead: /health and new requests answer 503, nothing hangs.

The engine and the OpenAI routes run in-process; the device step is replaced to raise, as a CUDA
error would surface from the runner.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest

from vt.config import EngineConfig
from vt.engine import failures as failures_mod
from vt.engine.engine import AsyncEngine
from vt.engine.probe import ProbeUnavailable
from vt.http.openai_api import OpenAIApp
from vt.http.server import HttpRequest, PushBody, Response, StreamResponse
from vt.model.make_model import make_model

TIMEOUT_S = 30.0  # any single request taking longer than this is a hang
CUDA_ERROR = "CUDA error: an illegal memory access was encountered"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("fail-model") / "tiny", preset="tiny")


@pytest.fixture(params=[True, False], ids=["async", "sync"])
async def app(request: pytest.FixtureRequest, model_dir: Path) -> AsyncIterator[OpenAIApp]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", max_num_seqs=8,
                                      async_scheduling=request.param))
    await engine.start()
    yield OpenAIApp(engine, "tiny")
    await engine.stop(0.0)


class StepFault:
    """Wraps the runner's device step; raises on the next `count` calls (-1: forever)."""

    def __init__(self, runner: Any, count: int, attr: str = "_device_step") -> None:
        self.real: Callable[..., Any] = getattr(runner, attr)
        self.left = count
        self.raised = 0
        self.lock = threading.Lock()  # the numpy backend runs steps on a worker thread
        setattr(runner, attr, self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            fail = self.left != 0
            if fail:
                self.left -= 1
                self.raised += 1
        if fail:
            raise RuntimeError(CUDA_ERROR)
        return self.real(*args, **kwargs)


def _post(path: str, body: dict[str, Any]) -> HttpRequest:
    return HttpRequest("POST", path, "", {"content-type": "application/json"}, orjson.dumps(body), None)


def _get(path: str) -> HttpRequest:
    return HttpRequest("GET", path, "", {}, b"", None)


async def _call(app: OpenAIApp, req: HttpRequest) -> tuple[int, Any]:
    """(status, parsed JSON body) for a plain response, (status, [SSE payloads]) for a stream."""

    async def run() -> tuple[int, Any]:
        resp = await app.handle(req)
        if isinstance(resp, StreamResponse):
            events = []
            if isinstance(resp.chunks, PushBody):
                chunks: list[bytes] = []
                await resp.chunks.run(chunks.append)
            else:
                chunks = [chunk async for chunk in resp.chunks]
            for chunk in chunks:
                for line in chunk.decode().split("\n\n"):
                    if line.startswith("data: "):
                        data = line[len("data: "):]
                        events.append(data if data == "[DONE]" else orjson.loads(data))
            return resp.status, events
        assert isinstance(resp, Response)
        return resp.status, orjson.loads(resp.body) if resp.body else None

    return await asyncio.wait_for(run(), TIMEOUT_S)


def _completion(max_tokens: int = 4, stream: bool = False, prompt: str = "hello world") -> HttpRequest:
    return _post("/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                     "ignore_eos": True, "stream": stream})


async def _assert_idle(app: OpenAIApp) -> None:
    """No request left in the engine and every KV block free."""
    engine = app.engine

    async def settle() -> None:
        # after a failed step, the step still in flight and then a probe step may hold a block
        while not engine.idle or engine.scheduler.kv_usage > 0:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(settle(), TIMEOUT_S)
    stats = engine.stats()
    assert stats.num_requests_running == 0 and stats.num_requests_waiting == 0
    assert stats.kv_cache_usage_perc == 0.0
    engine.scheduler.pool.check_invariants()


async def test_failed_step_gives_500_and_server_keeps_serving(app: OpenAIApp) -> None:
    fault = StepFault(app.engine.runner, 1)
    status, body = await _call(app, _completion())
    assert fault.raised == 1
    assert status == 500
    assert body["error"]["type"] == "internal_server_error"
    assert CUDA_ERROR in body["error"]["message"]
    await _assert_idle(app)
    status, body = await _call(app, _completion())
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert (await _call(app, _get("/health")))[0] == 200
    await _assert_idle(app)


async def test_failed_step_ends_stream_with_error_event(app: OpenAIApp) -> None:
    StepFault(app.engine.runner, 1)
    status, events = await _call(app, _completion(stream=True))
    assert status == 200  # headers were sent before the step ran
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert len(errors) == 1 and CUDA_ERROR in errors[0]["error"]["message"]
    await _assert_idle(app)
    status, events = await _call(app, _completion(stream=True))
    assert status == 200 and events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_failure_mid_decode_fails_only_that_request(app: OpenAIApp) -> None:
    # a request decoding for a while; the fault hits one of its later steps
    long_req = asyncio.ensure_future(_call(app, _completion(max_tokens=40, stream=True)))
    engine = app.engine
    while engine._stats.generation_tokens_total < 3:
        await asyncio.wait_for(asyncio.sleep(0.005), TIMEOUT_S)
    StepFault(engine.runner, 1)
    status, events = await long_req
    assert status == 200 and events[-1] == "[DONE]"
    assert "error" in events[-2]
    await _assert_idle(app)
    status, body = await _call(app, _completion(max_tokens=3))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


async def test_concurrent_requests_after_a_failure_all_complete(app: OpenAIApp) -> None:
    StepFault(app.engine.runner, 1)
    first = await asyncio.gather(*(_call(app, _completion(prompt=f"p{i}")) for i in range(4)))
    assert {s for s, _ in first} <= {200, 500} and any(s == 500 for s, _ in first)
    await _assert_idle(app)
    again = await asyncio.gather(*(_call(app, _completion(prompt=f"q{i}")) for i in range(6)))
    assert [s for s, _ in again] == [200] * 6
    await _assert_idle(app)


@pytest.mark.parametrize("attr", ["_device_step", "execute"])
async def test_repeated_failures_mark_engine_unhealthy(app: OpenAIApp, attr: str) -> None:
    StepFault(app.engine.runner, -1, attr)
    statuses = []
    for i in range(5):  # bounded: the engine must give up within MAX_CONSECUTIVE_FAILURES requests
        status, body = await _call(app, _completion(prompt=f"try {i}"))
        statuses.append(status)
        if status == 503:
            break
        assert status == 500 and CUDA_ERROR in body["error"]["message"]
    assert statuses[-1] == 503, statuses
    status, body = await _call(app, _get("/health"))
    assert status == 503 and body["error"]["type"] == "service_unavailable"
    status, body = await _call(app, _completion(stream=True))
    assert status == 503 and "engine" in body["error"]["message"]
    assert app.engine.stats().kv_cache_usage_perc == 0.0


async def test_dead_engine_fails_inflight_streams(app: OpenAIApp) -> None:
    # several streams in flight when the device becomes unusable: each ends, none hangs
    StepFault(app.engine.runner, -1)
    results = await asyncio.gather(*(_call(app, _completion(max_tokens=20, stream=True, prompt=f"s{i}"))
                                     for i in range(5)))
    for status, events in results:
        if status == 200:
            assert events[-1] == "[DONE]" and "error" in events[-2]
        else:
            assert status == 503  # arrived after the engine was marked dead
    for i in range(5):  # one batch may hold them all: keep failing steps until the engine gives up
        status, _ = await _call(app, _completion(max_tokens=20, stream=True, prompt=f"t{i}"))
        if status == 503:
            break
    assert status == 503
    assert (await _call(app, _get("/health")))[0] == 503
    assert app.engine.stats().kv_cache_usage_perc == 0.0


async def test_crash_outside_the_step_does_not_hang_requests(app: OpenAIApp) -> None:
    engine = app.engine

    def broken(out: Any) -> None:
        raise KeyError("bug while processing a step")

    engine._process = broken  # type: ignore[method-assign]
    results = await asyncio.gather(_call(app, _completion()), _call(app, _completion(stream=True)))
    (s1, body), (s2, events) = results
    assert s1 == 500 and "KeyError" in body["error"]["message"]
    assert s2 == 200 and events[-1] == "[DONE]" and "error" in events[-2]
    assert (await _call(app, _get("/health")))[0] == 503
    assert (await _call(app, _completion()))[0] == 503


# ---- no request can make a step fail, and one that does anyway cannot kill the engine ----------

@pytest.mark.parametrize(("fields", "param"), [
    ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": [2**31], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": [5000], "min_tokens": 1}, "stop_token_ids"),
    ({"stop_token_ids": list(range(100, 140)), "min_tokens": 2}, "stop_token_ids"),
])
async def test_values_that_would_break_a_step_are_400_and_the_engine_lives(
        app: OpenAIApp, fields: dict[str, Any], param: str) -> None:
    # a normal request decoding beside them must not notice
    normal = asyncio.ensure_future(_call(app, _completion(max_tokens=30, stream=True)))
    for _ in range(4):  # past MAX_CONSECUTIVE_FAILURES
        body = {"prompt": "hello", "max_tokens": 4, **fields}
        status, err = await _call(app, _post("/v1/completions", body))
        assert status == 400 and err["error"]["param"] == param, err
    status, events = await normal
    assert status == 200 and events[-2]["choices"][0]["finish_reason"] == "length"
    assert (await _call(app, _get("/health")))[0] == 200
    await _assert_idle(app)


class PoisonFault:
    """A step fails whenever it holds a request with a marker seed: a fault one request brings,
    which admission checks did not foresee."""

    MARK = 424242

    def __init__(self, runner: Any) -> None:
        self.real = runner.execute
        self.raised = 0
        runner.execute = self

    def __call__(self, batch: Any, eos_for: Any, *rest: Any, **kw: Any) -> Any:
        if any(s.new is not None and s.new.params.seed == self.MARK for s in batch.seqs):
            self.raised += 1
            raise IndexError("index 5000 is out of bounds for axis 1 with size 1024")
        return self.real(batch, eos_for, *rest, **kw)


async def test_failures_one_request_causes_never_mark_the_engine_dead(app: OpenAIApp) -> None:
    fault = PoisonFault(app.engine.runner)
    for i in range(6):
        body = {"prompt": f"poison {i}", "max_tokens": 4, "seed": PoisonFault.MARK}
        status, err = await _call(app, _post("/v1/completions", body))
        assert status == 500 and "IndexError" in err["error"]["message"]
    assert fault.raised == 6
    # each time a probe step ran alone and passed: the device is fine
    assert (await _call(app, _get("/health")))[0] == 200
    status, body = await _call(app, _completion(max_tokens=3))
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    await _assert_idle(app)


async def test_health_says_why_the_engine_is_dead(app: OpenAIApp) -> None:
    StepFault(app.engine.runner, -1)
    for _ in range(5):
        if (await _call(app, _completion()))[0] == 503:
            break
    status, body = await _call(app, _get("/health"))
    assert status == 503
    assert "stopped after an error" in body["error"]["message"] and CUDA_ERROR in body["error"]["message"]


async def test_top_p_rounding_to_zero_keeps_the_most_likely_token(app: OpenAIApp) -> None:
    greedy = {"prompt": "hello world", "max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    status, want = await _call(app, _post("/v1/completions", greedy))
    assert status == 200
    for top_p in (1e-300, 1e-45, 1e-39):
        body = {**greedy, "temperature": 1.0, "top_p": top_p, "seed": 7}
        status, got = await _call(app, _post("/v1/completions", body))
        assert status == 200
        assert got["choices"][0]["text"] == want["choices"][0]["text"], top_p
        assert got["choices"][0]["finish_reason"] == "length"


async def test_unexplained_failures_count_until_a_step_runs(app: OpenAIApp, monkeypatch) -> None:
    # no block free for a probe: the failure stays unexplained and counts, but any step that
    # runs afterwards clears the count, and nothing waits on the probe meanwhile
    async def unavailable(runner: Any, pool: Any) -> BaseException:
        return ProbeUnavailable("no free KV block to run a probe step on")

    monkeypatch.setattr(failures_mod, "run_probe", unavailable)
    PoisonFault(app.engine.runner)
    poison = {"prompt": "poison", "max_tokens": 2, "seed": PoisonFault.MARK}
    for _ in range(4):
        assert (await _call(app, _post("/v1/completions", poison)))[0] == 500
        assert (await _call(app, _completion(max_tokens=2)))[0] == 200
    assert (await _call(app, _get("/health")))[0] == 200
    for _ in range(3):
        await _call(app, _post("/v1/completions", poison))
    assert (await _call(app, _get("/health")))[0] == 503
