"""Through the real `vt serve`: SIGTERM leaves no accepted request unanswered, and constraints
that leave a request no token to sample give that request a clear error of its own.

Shutdown: a request accepted before the signal finishes within --shutdown-timeout (a grammar
still compiling included); past the timeout, every request still open is answered at every stage
it can be in (its body arriving, its template rendering, its grammar compiling, its tokens
generating): a 503 with OpenAI's error body, or for a stream under way an error event and
[DONE]. The server exits on time, whatever the compiles and renders still take.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import ServerHandle, start_server
from tests.e2e.test_reliability import assert_error, host_port, read_response

IO_TIMEOUT_S = 60.0
EXIT_SLACK_S = 6.0  # past the shutdown timeout: the engine's stop, the last writes, the process exit
# ~2-4 s to compile (the 9,000 required properties, a little more for slower machines)
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12000)},
              "required": [f"p{i}" for i in range(12000)]}
SLOW_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(66000))  # ~7 s, then a 400
LOOPING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


class Call:
    """One request from its own thread; `result` is (status, body) or the exception it met."""

    def __init__(self, server: ServerHandle, path: str, body: dict[str, Any]) -> None:
        self.first_event = threading.Event()
        self.result: tuple[int, bytes] | BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(server, path, body), daemon=True)
        self._thread.start()

    def _run(self, server: ServerHandle, path: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=IO_TIMEOUT_S) as r:
                data = b""
                for chunk in r.iter_bytes():
                    data += chunk
                    if b"data: " in data:
                        self.first_event.set()
                self.result = (r.status_code, data)
        except BaseException as e:  # noqa: BLE001 - a dropped connection is what the test looks for
            self.result = e

    def join(self) -> tuple[int, bytes]:
        self._thread.join(IO_TIMEOUT_S)
        assert not self._thread.is_alive(), "no answer came"
        assert isinstance(self.result, tuple), f"the request got no answer: {self.result!r}"
        return self.result


def sigterm(server: ServerHandle, timeout: float) -> float:
    """SIGTERM, wait for a clean exit; the seconds it took."""
    start = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(timeout + 30)
    elapsed = time.monotonic() - start
    assert rc == 0, server.output()
    return elapsed


def assert_stopped(status: int, body: bytes) -> None:
    assert status == 503, body[-400:]
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "service_unavailable", error


def sse_events(body: bytes) -> list[Any]:
    return [e if e == "[DONE]" else json.loads(e)
            for e in (part.strip() for part in body.decode().split("data: ")[1:])]


def test_a_request_compiling_its_grammar_at_sigterm_finishes_within_the_timeout(tiny_model_dir: Path) -> None:
    server = start_server(tiny_model_dir, "--shutdown-timeout", "30")
    try:
        schema = {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}
        calls = [Call(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": stream,
                                                  "response_format": schema}) for stream in (False, True)]
        time.sleep(0.5)  # received: the handlers wait for the compile
        assert all(c.result is None for c in calls), "compiled before the signal: nothing to test"
        sigterm(server, 30)
        (status, body), (stream_status, stream_body) = (c.join() for c in calls)
        assert status == 200, body[-400:]
        assert orjson.loads(body)["choices"][0]["finish_reason"] == "length"
        assert stream_status == 200
        events = sse_events(stream_body)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
    finally:
        server.stop()


def test_past_the_timeout_every_stage_gets_an_answer(tiny_model_dir: Path) -> None:
    timeout = 0.3
    server = start_server(tiny_model_dir, "--shutdown-timeout", str(timeout), "--trust-request-chat-template")
    partial = socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S)
    try:
        long = {"prompt": "x", "max_tokens": 1900, "ignore_eos": True}
        slow = {"prompt": "x", "max_tokens": 2, "guided_grammar": SLOW_GRAMMAR}
        calls = {
            "compiling": Call(server, "/v1/completions", slow),
            "compiling, streamed": Call(server, "/v1/completions", {**slow, "stream": True}),
            "rendering": Call(server, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "chat_template": LOOPING_TEMPLATE}),
            "generating": Call(server, "/v1/completions", long),
            "generating, streamed": Call(server, "/v1/completions", {**long, "stream": True}),
        }
        body = orjson.dumps({"prompt": "x", "max_tokens": 2})
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        assert calls["generating, streamed"].first_event.wait(IO_TIMEOUT_S)
        time.sleep(0.3)
        assert all(c.result is None for c in calls.values())
        elapsed = sigterm(server, timeout)
        assert elapsed < timeout + EXIT_SLACK_S, server.output()
        for name, call in calls.items():
            status, data = call.join()
            if name == "generating, streamed":
                assert status == 200
                events = sse_events(data)
                assert events[-1] == "[DONE]", events[-3:]
                assert events[-2]["error"]["type"] == "service_unavailable", events[-2]
                assert all("error" not in e for e in events[:-2])
            else:
                assert_stopped(status, data)
        arriving = read_response(partial)
        assert arriving is not None, "the request still arriving got no answer"
        assert_stopped(arriving.status, arriving.body)
    finally:
        partial.close()
        server.stop()


# ---- no token to sample ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model_dir)
    yield handle
    assert handle.stop() == 0, handle.output()


def token_id(server: ServerHandle, text: str) -> int:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                   timeout=IO_TIMEOUT_S)
    [token] = r.json()["tokens"]
    return token


def post(server: ServerHandle, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", **body}, timeout=IO_TIMEOUT_S)


@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_leave_no_first_token_are_a_400(server: ServerHandle, stream: bool) -> None:
    bracket = token_id(server, "[")
    # the request: "[" is the grammar's only first token and min_tokens holds it back
    body = {"max_tokens": 3, "structured_outputs": {"choice": ["["]}, "stop_token_ids": [bracket],
            "min_tokens": 1, "stream": stream}
    assert_error(post(server, body), 400, "no token could be sampled", param="min_tokens")
    # the same conflict through allowed_token_ids
    body = {"max_tokens": 3, "allowed_token_ids": [bracket], "stop_token_ids": [bracket], "min_tokens": 1,
            "stream": stream}
    assert_error(post(server, body), 400, "no token could be sampled", param="allowed_token_ids")
    assert post(server, {"max_tokens": 3, "structured_outputs": {"choice": ["["]},
                         "stop_token_ids": [bracket]}).status_code == 200


def test_a_grammar_state_left_with_no_token_fails_that_request_alone(server: ServerHandle) -> None:
    bracket = token_id(server, "[")
    body = {"max_tokens": 6, "structured_outputs": {"choice": ["a["]}, "stop_token_ids": [bracket],
            "min_tokens": 3}
    beside = Call(server, "/v1/completions", {"prompt": "x", "max_tokens": 200, "ignore_eos": True})
    err = assert_error(post(server, body), 400, "no token could be sampled for output token 2")
    assert "min_tokens (3)" in err["message"] and err["type"] == "invalid_request_error"
    r = post(server, {**body, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.content)
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "invalid_request_error", events
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "a"  # never a token outside the grammar
    status, data = beside.join()
    assert status == 200 and orjson.loads(data)["usage"]["completion_tokens"] == 200
