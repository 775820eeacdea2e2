"""Grammar compiles and request chat templates that harm no one, through the real `vt serve`.

A request's chat template (under --trust-request-chat-template) that folds a huge constant, loops
or runs one long C call is a 400 within its bound, while /health and other requests go on and
the server's memory stays put; a template's runtime error is a 400, not a 500. A grammar that
compiles slowly holds up no other grammar, and stopping the server does not wait for it. What
vLLM serves is served: a choice of thousands of options, tool_choice required over 3,000 tools.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import ServerHandle, start_server
from tests.e2e.test_reliability import assert_serving

IO_TIMEOUT_S = 120.0
TEMPLATE_BOUND_S = 6.0       # a bounded render's 400 (2 s of template, a child's start, the loop's share)
HEALTH_S = 1.0               # /health while a template renders or a grammar compiles
RSS_GROWTH = 256 << 20       # the server's resident growth over every bad template here
FAST_GRAMMAR_S = 15.0        # a small grammar's reply while a slow one compiles
SLOW_GRAMMAR = "start: " + " | ".join(f'"w{i}"' for i in range(66000))  # seconds, then too large
MESSAGES = [{"role": "user", "content": "Hello"}]

TEMPLATE_BOMBS = {
    "constant repeat": "{{ 'x' * 10**9 }}",
    "constant power": "{{ 7 ** 100000000 }}",
    "constant width": "{{ 'x'|center(999999999) }}",
    "big range": "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "one long C call": "{{ ([[0] * 1000] * 100000)|sum(start=[])|length }}",
    "memory": ("{% set s = 'x' * 16000000 %}{% set ns = namespace(l=[]) %}"
               "{% for i in range(64) %}{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l|length }}"),
}
TEMPLATE_ERRORS = {
    "division by zero": "{{ 1/0 }}",
    "undefined call": "{{ nope() }}",
    "type error": "{{ messages[0].content / 2 }}",
}


def _rss(server: ServerHandle) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _post(server: ServerHandle, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=IO_TIMEOUT_S)


def _one_line_error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert "\n" not in err["message"] and "backtrace" not in err["message"], err
    assert len(err["message"]) < 600, err
    return err


class _HealthWatch:
    """Polls /health from a thread; the slowest answer seen."""

    def __init__(self, server: ServerHandle) -> None:
        self.server, self.worst, self._stop = server, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            r = httpx.get(f"{self.server.url}/health", timeout=IO_TIMEOUT_S)
            assert r.status_code == 200
            self.worst = max(self.worst, time.monotonic() - start)
            time.sleep(0.05)

    def __enter__(self) -> _HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model_dir, "--trust-request-chat-template")
    yield handle
    assert handle.stop() == 0, handle.output()


def test_request_template_bombs_are_400_within_their_bound_and_harm_no_one(server: ServerHandle) -> None:
    _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                           "chat_template": "{{ messages[0].content }}"})  # renderer up
    before = _rss(server)
    with _HealthWatch(server) as health:
        for name, source in TEMPLATE_BOMBS.items():
            start = time.monotonic()
            r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1,
                                                       "chat_template": source})
            assert r.status_code == 400, (name, r.text)
            assert time.monotonic() - start < TEMPLATE_BOUND_S, name
            _one_line_error(r)
    assert health.worst < HEALTH_S
    assert _rss(server) - before < RSS_GROWTH
    assert_serving(server)


def test_request_template_runtime_errors_are_400(server: ServerHandle) -> None:
    for name, source in TEMPLATE_ERRORS.items():
        body = {"messages": MESSAGES, "max_tokens": 1, "chat_template": source}
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 400, (name, r.text)
        assert "chat template" in _one_line_error(r)["message"]
        assert r.json()["error"]["param"] == "chat_template", (name, r.text)  # the request's own field
    ok = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                "chat_template": "{{ messages[0].content }}"})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("count", [2001, 66000])
def test_a_choice_of_thousands_is_served(server: ServerHandle, count: int) -> None:
    options = [f"option {i}" for i in range(count)]
    r = _post(server, "/v1/completions", {"prompt": "Pick:", "max_tokens": 40, "guided_choice": options})
    assert r.status_code == 200, r.text[:500]
    assert r.json()["choices"][0]["text"] in options


def test_tool_choice_required_over_3000_tools_is_served(server: ServerHandle) -> None:
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"], "additionalProperties": False}}} for i in range(3000)]
    r = _post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 200, "seed": 1,
                                               "tools": tools, "tool_choice": "required"})
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        names = {t["function"]["name"] for t in tools}
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in names
            assert set(json.loads(call["function"]["arguments"])) == {"city"}


def test_a_fast_grammar_is_answered_while_a_slow_one_compiles(server: ServerHandle) -> None:
    slow: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: slow.setdefault("r", _post(
        server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "guided_grammar": SLOW_GRAMMAR})))
    thread.start()
    try:
        time.sleep(1.0)
        with _HealthWatch(server) as health:
            start = time.monotonic()
            body = {"prompt": "Year:", "max_tokens": 8, "guided_regex": "[0-9]{3}x"}
            r = _post(server, "/v1/completions", body)
            assert r.status_code == 200, r.text
            assert time.monotonic() - start < FAST_GRAMMAR_S
            assert thread.is_alive()  # answered beside the slow one, not after it
        assert health.worst < HEALTH_S
    finally:
        thread.join()
    assert slow["r"].status_code == 400
    assert "too large" in _one_line_error(slow["r"])["message"]


def test_stopping_during_a_slow_compile_keeps_to_the_shutdown_timeout(tiny_model_dir: Path) -> None:
    handle = start_server(tiny_model_dir, "--shutdown-timeout", "2")
    try:
        threading.Thread(target=lambda: _post(handle, "/v1/completions", {
            "prompt": "x", "max_tokens": 2, "guided_grammar": SLOW_GRAMMAR}), daemon=True).start()
        time.sleep(1.5)
        start = time.monotonic()
        handle.proc.send_signal(signal.SIGTERM)
        handle.proc.wait(30)
        assert time.monotonic() - start < 2 + 5.0, handle.output()
    finally:
        handle.stop()


def test_a_server_template_that_fails_is_reported_at_start_and_refused_naming_messages(
        tiny_model_dir: Path) -> None:
    """--chat-template that compiles but cannot render a plain conversation: a warning when the
    server starts (it then renders in the bounded child), and a 400 naming messages, never a 500."""
    handle = start_server(tiny_model_dir, "--chat-template", "{{ messages[0].content }}{{ 1 / 0 }}")
    try:
        assert "--chat-template: " in handle.output(), handle.output()
        r = _post(handle, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "messages"
    finally:
        assert handle.stop() == 0, handle.output()
