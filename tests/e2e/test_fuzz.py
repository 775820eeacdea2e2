"""Random bytes and random JSON against a running `vt serve`: no crash, no hang, no 500, no leak."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.conftest import ServerHandle, start_server
from tests.e2e.test_reliability import (
    IO_TIMEOUT_S,
    assert_serving,
    env_vars,
    host_port,
    post_bytes,
    read_response,
    wait_idle,
)

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                derandomize=True)
# Statuses a client may get for a bad or odd request; 500 would mean an unhandled bug.
CLIENT_ERRORS = {400, 404, 405, 408, 411, 413, 415, 431, 501, 503, 505}
PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos",
          "stop_token_ids", "priority", "skip_special_tokens", "include_stop_str_in_output", "user",
          "echo", "tokens", "add_special_tokens", "logit_bias", "suffix", "best_of", "tools",
          "tool_choice", "response_format", "allowed_token_ids", "return_tokens_as_token_ids",
          "truncate_prompt_tokens"]

json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)
small_ints = st.integers(-3, 12)
field_value = st.one_of(json_value, small_ints, st.floats(-3, 3), st.text(max_size=30),
                        st.lists(st.integers(-5, 1100), max_size=8))
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""])},
    optional={"content": st.one_of(st.text(max_size=40), json_value)}), max_size=3)
request_body = st.fixed_dictionaries({}, optional={
    "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-2, 1100), max_size=10), json_value),
    "messages": messages,
    "max_tokens": st.one_of(small_ints, json_value),
}).flatmap(lambda base: st.dictionaries(st.sampled_from(FIELDS), field_value, max_size=6).map(
    lambda extra: {**extra, **base}))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    # a short context bounds how long any accepted random request can generate
    with env_vars(VT_HTTP_HEADER_TIMEOUT="2", VT_MAX_BODY_BYTES=str(256 * 1024)):
        handle = start_server(tiny_model_dir, "--max-model-len", "64", "--max-num-seqs", "16")
    yield handle
    assert handle.stop() == 0, handle.output()


def _exchange(server: ServerHandle, data: bytes) -> bytes:
    """Send `data`, end our side, and read whatever comes back until the server closes."""
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        out = b""
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
        return out


def _check_raw_answer(out: bytes) -> None:
    if not out:
        return  # nothing parsable came before our EOF: closing silently is fine
    assert out.startswith(b"HTTP/1.1 "), out[:200]
    status = int(out.split(b" ", 2)[1])
    assert status != 500 and status < 600, out[:500]


@FUZZ
@given(data=st.binary(max_size=3000))
def test_random_bytes(server: ServerHandle, data: bytes) -> None:
    _check_raw_answer(_exchange(server, data))


@FUZZ
@given(path=st.sampled_from(PATHS + ["/", "/health", "/v1/models"]),
       method=st.sampled_from(["GET", "POST", "PUT", "HEAD", "OPTIONS", "X"]),
       headers=st.lists(st.tuples(st.from_regex(r"[A-Za-z-]{1,12}", fullmatch=True),
                                  st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)),
                        max_size=4),
       body=st.binary(max_size=400))
def test_random_requests_with_valid_framing(server: ServerHandle, path: str, method: str,
                                            headers: list[tuple[str, str]], body: bytes) -> None:
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"))
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    _check_raw_answer(_exchange(server, head.encode() + body))


@FUZZ
@given(path=st.sampled_from(PATHS), body=request_body)
def test_random_json(server: ServerHandle, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(f"{server.url}{path}", content=json.dumps(body), timeout=IO_TIMEOUT_S,
                   headers={"content-type": "application/json"})
    if r.status_code == 200:
        return
    assert r.status_code in CLIENT_ERRORS, (body, r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"], r.text


@FUZZ
@given(body=st.one_of(json_value, st.binary(max_size=200).map(lambda b: b"\x00" + b)))
def test_random_top_level_documents(server: ServerHandle, body: Any) -> None:
    # stdlib json: it writes integers beyond 64 bits, which orjson refuses to
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(post_bytes("/v1/completions", raw))
        resp = read_response(sock)
    assert resp is not None
    if resp.status != 200:
        assert resp.status in CLIENT_ERRORS and resp.json()["error"]["message"], resp


def test_server_is_healthy_and_leak_free_after_fuzzing(server: ServerHandle) -> None:
    # runs last in this module: everything above must have left nothing behind
    assert httpx.get(f"{server.url}/health", timeout=IO_TIMEOUT_S).status_code == 200
    assert_serving(server)
    m = wait_idle(server)
    assert m["vt:kv_cache_usage_perc"] == 0
    assert server.proc.poll() is None
