"""Bad input, limits, disconnects, auth and shutdown against the real `vt serve`.

Every rejection must be a clear OpenAI-style error, never a crash or a hang, and every aborted
request must give back its KV blocks (checked through /metrics).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.e2e.conftest import ServerHandle, start_server

IO_TIMEOUT_S = 15.0
HEADER_TIMEOUT_S = 1.0
KEEPALIVE_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 12
MAX_BODY_BYTES = 64 * 1024
MAX_MODEL_LEN = 2048
API_KEY = "sk-test-4f9a"
_METRIC = re.compile(r"^(vt:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+|NaN)$")


# ---- helpers shared with the fuzz and soak tests ----------------------------------------------

@contextmanager
def env_vars(**values: str) -> Iterator[None]:
    """Set environment variables for a server started inside the block."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in values.items():
            mp.setenv(k, v)
        yield


def host_port(server: ServerHandle) -> tuple[str, int]:
    m = re.match(r"http://([^:/]+):(\d+)", server.url)
    assert m, server.url
    return m.group(1), int(m.group(2))


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def read_response(sock: socket.socket) -> RawResponse | None:
    """Read one HTTP response with a Content-Length body; None when the server closed first."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        data = sock.recv(65536)
        if not data:
            break
        rest += data
    return RawResponse(status, headers, rest[:length])


def raw_request(server: ServerHandle, data: bytes) -> RawResponse | None:
    """Send raw bytes on a fresh connection and read one response."""
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before taking all of an oversized request
        try:
            return read_response(sock)
        except ConnectionResetError:
            return None


def post_bytes(path: str, body: bytes, content_type: str = "application/json",
               extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode() + body


def metrics(server: ServerHandle) -> dict[str, float]:
    r = httpx.get(f"{server.url}/metrics", timeout=IO_TIMEOUT_S)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        m = _METRIC.match(line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def wait_idle(server: ServerHandle, timeout: float = 20.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is in use; fail otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = (m["vt:kv_cache_usage_perc"] == 0 and m["vt:num_requests_running"] == 0
                and m["vt:num_requests_waiting"] == 0)
        if idle:
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {m}")
        time.sleep(0.02)  # polling interval only; the deadline decides


def wait_metric(server: ServerHandle, name: str, at_least: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while metrics(server)[name] < at_least:
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never reached {at_least}")
        time.sleep(0.01)


def assert_error(resp: RawResponse | httpx.Response | None, status: int,
                 contains: str = "", param: str | None = None) -> dict[str, Any]:
    assert resp is not None, "the server closed the connection without answering"
    body = resp.body if isinstance(resp, RawResponse) else resp.content
    code = resp.status if isinstance(resp, RawResponse) else resp.status_code
    assert code == status, (code, body[:300])
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert contains.lower() in err["message"].lower(), err
    if param is not None:
        assert err["param"] == param, err
    return err


def completion(server: ServerHandle, **body: Any) -> httpx.Response:
    body.setdefault("prompt", "hello")
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=IO_TIMEOUT_S)


def assert_serving(server: ServerHandle) -> None:
    r = completion(server, max_tokens=3, temperature=0.0, ignore_eos=True)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


class Stream:
    """A streaming completion over a raw socket: read events, then drop the connection at will."""

    def __init__(self, server: ServerHandle, max_tokens: int, prompt: str = "stream me") -> None:
        body = orjson.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                             "ignore_eos": True, "temperature": 0.0})
        self.sock = socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S)
        self.sock.sendall(post_bytes("/v1/completions", body))
        self.buf = b""

    def read_events(self, n: int) -> None:
        """Block until n SSE events have arrived."""
        while self.buf.count(b"data: ") < n:
            data = self.sock.recv(65536)
            assert data, "stream ended early"
            self.buf += data

    def read_to_end(self) -> bytes:
        while True:
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            self.buf += data
        return self.buf

    def close(self) -> None:
        self.sock.close()


# ---- servers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    with env_vars(VT_HTTP_HEADER_TIMEOUT=str(HEADER_TIMEOUT_S),
                  VT_HTTP_KEEPALIVE_TIMEOUT=str(KEEPALIVE_TIMEOUT_S),
                  VT_MAX_CONNECTIONS=str(MAX_CONNECTIONS), VT_MAX_BODY_BYTES=str(MAX_BODY_BYTES)):
        handle = start_server(tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN))
    yield handle
    assert handle.stop() == 0, handle.output()


@pytest.fixture(scope="module")
def single_seat(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    """One running sequence at a time and two waiting seats: queue states are easy to reach."""
    handle = start_server(tiny_model_dir, "--max-num-seqs", "1", "--max-waiting", "2")
    yield handle
    assert handle.stop() == 0, handle.output()


# ---- malformed requests ----------------------------------------------------------------------

@pytest.mark.parametrize("data", [
    b"GARBAGE\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"\x00\xff\x13\x37\r\n\r\n",
], ids=["garbage", "version", "no-colon", "bad-length", "two-lengths", "gzip-te", "bad-chunk", "binary"])
def test_malformed_http_gets_4xx_and_server_survives(server: ServerHandle, data: bytes) -> None:
    resp = raw_request(server, data)
    assert resp is not None and 400 <= resp.status < 600 and resp.status != 500, resp
    assert "error" in resp.json()
    assert httpx.get(f"{server.url}/health", timeout=IO_TIMEOUT_S).status_code == 200


@pytest.mark.parametrize("body,contains", [
    (b"", "empty"),
    (b"{", "json"),
    (b"{'prompt': 'x'}", "json"),
    (b"[1, 2]", "object"),
    (b'"prompt"', "object"),
    (b"null", "object"),
    (b"42", "object"),
    (b'{"prompt": "\xff\xfe"}', "json"),
    (b'{"prompt": "ok"} trailing', "json"),
    (b'{"prompt": NaN}', "json"),
])
def test_bad_json_is_400(server: ServerHandle, body: bytes, contains: str) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        assert_error(raw_request(server, post_bytes(path, body)), 400, contains)


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -1}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": -3}, "n"),
    ({"n": 10**6}, "n"),
    ({"n": 10**30}, "n"),
    ({"top_k": "all"}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": -1}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [1, 2]}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": 99}, "logprobs"),
    ({"stop_token_ids": "x"}, "stop_token_ids"),
    ({"priority": 1.5}, "priority"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
    ({"prompt": [-1, 2]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"model": 5}, "model"),
])
def test_wrong_types_and_ranges_are_400(server: ServerHandle, fields: dict[str, Any], param: str) -> None:
    body = {"prompt": "hello", "max_tokens": 2, **fields}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=IO_TIMEOUT_S)
    assert_error(r, 400, param=param)


@pytest.mark.parametrize("fields,param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"max_completion_tokens": -5}, "max_completion_tokens"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
])
def test_bad_chat_fields_are_400(server: ServerHandle, fields: dict[str, Any], param: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=IO_TIMEOUT_S)
    assert_error(r, 400, param=param)


def test_unknown_model_is_404(server: ServerHandle) -> None:
    r = completion(server, model="gpt-17", max_tokens=2)
    err = assert_error(r, 404, "gpt-17", param="model")
    assert err["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=IO_TIMEOUT_S,
                   json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 404, "nope", param="model")


def test_prompt_longer_than_max_model_len_is_400_naming_lengths(server: ServerHandle) -> None:
    ids = [5] * (MAX_MODEL_LEN + 10)
    err = assert_error(completion(server, prompt=ids, max_tokens=1), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and str(MAX_MODEL_LEN + 10) in err["message"]
    assert err["param"] == "prompt"
    # prompt fits, prompt + max_tokens does not
    err = assert_error(completion(server, prompt=[5] * 2000, max_tokens=100), 400)
    assert str(MAX_MODEL_LEN) in err["message"] and "2100" in err["message"]
    assert err["param"] == "max_tokens"
    err = assert_error(completion(server, prompt=[5] * 2000, max_tokens=2**31), 400)
    assert err["param"] == "max_tokens"
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=IO_TIMEOUT_S, json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": MAX_MODEL_LEN})
    assert assert_error(r, 400)["param"] == "max_completion_tokens"
    assert wait_idle(server)["vt:kv_cache_usage_perc"] == 0


def test_unsupported_content_type_is_415(server: ServerHandle) -> None:
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        data = post_bytes("/v1/completions", b'{"prompt": "x"}', content_type=ctype)
        err = assert_error(raw_request(server, data), 415, "content-type")
        assert err["code"] == "unsupported_media_type"


@pytest.mark.parametrize("path", ["/health", "/v1/models", "/metrics", "/version", "/load"])
def test_head_answers_like_get_without_a_body(server: ServerHandle, path: str) -> None:
    get = httpx.get(f"{server.url}{path}", timeout=IO_TIMEOUT_S)
    head = httpx.head(f"{server.url}{path}", timeout=IO_TIMEOUT_S)
    assert head.status_code == get.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    if path in ("/health", "/version", "/load"):  # bodies that do not change between the two
        assert int(head.headers["content-length"]) == len(get.content)


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/completions"), ("DELETE", "/v1/chat/completions"), ("POST", "/v1/models"),
    ("PUT", "/health"), ("POST", "/metrics"), ("GET", "/tokenize"),
])
def test_wrong_method_is_405(server: ServerHandle, method: str, path: str) -> None:
    r = httpx.request(method, f"{server.url}{path}", timeout=IO_TIMEOUT_S)
    assert_error(r, 405, method)
    assert r.headers.get("allow")


@pytest.mark.parametrize("path", ["/", "/v1", "/v2/completions", "/v1/completions/x", "/%00", "/..%2f.."])
def test_unknown_path_is_404(server: ServerHandle, path: str) -> None:
    r = httpx.get(f"{server.url}{path}", timeout=IO_TIMEOUT_S)
    assert_error(r, 404)


# ---- limits ----------------------------------------------------------------------------------

def test_oversized_headers_are_431(server: ServerHandle) -> None:
    big = "a" * (100 * 1024)
    resp = raw_request(server, f"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: {big}\r\n\r\n".encode())
    assert_error(resp, 431)
    many = "".join(f"X-H{i}: {'v' * 100}\r\n" for i in range(1000))
    assert_error(raw_request(server, f"GET /health HTTP/1.1\r\n{many}\r\n".encode()), 431)
    assert_error(raw_request(server, f"GET /{'p' * 100_000} HTTP/1.1\r\n\r\n".encode()), 431)
    assert_serving(server)


def test_oversized_body_is_413(server: ServerHandle) -> None:
    body = orjson.dumps({"prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert_error(raw_request(server, post_bytes("/v1/completions", body)), 413)
    # declared size alone is enough: no body needs to be sent
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {10**12}\r\n\r\n".encode()
    assert_error(raw_request(server, head), 413)
    # chunked bodies are counted as they arrive
    chunk = b"x" * 16384
    data = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    data += (b"%x\r\n%b\r\n" % (len(chunk), chunk)) * 8 + b"0\r\n\r\n"
    assert_error(raw_request(server, data), 413)
    assert_serving(server)


def _closed_within(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes `sock` (reading and dropping anything it sends)."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"connection still open after {limit} s") from None
    return time.monotonic() - start


def test_slow_headers_are_cut_off(server: ServerHandle) -> None:
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        # slowloris: one header byte at a time, well within any per-read timeout
        closed = False
        for _ in range(40):
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            sock.settimeout(0.1)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
        if not closed:
            _closed_within(sock, 5.0)
        assert time.monotonic() - start < HEADER_TIMEOUT_S + 3.0
    assert_serving(server)


def test_idle_keepalive_connection_is_closed(server: ServerHandle) -> None:
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        resp = read_response(sock)
        assert resp is not None and resp.status == 200
        waited = _closed_within(sock, KEEPALIVE_TIMEOUT_S + 5.0)
        assert waited >= KEEPALIVE_TIMEOUT_S - 0.5
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        _closed_within(sock, KEEPALIVE_TIMEOUT_S + 5.0)  # a connection that never sends anything


def test_open_connections_are_bounded(server: ServerHandle) -> None:
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS):
            s = socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S)
            socks.append(s)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered: the server holds it
            assert read_response(s).status == 200
        extra = socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S)
        socks.append(extra)
        assert_error(read_response(extra), 503, "connections")
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while True:  # the server notices the closes asynchronously
        r = httpx.get(f"{server.url}/health", timeout=IO_TIMEOUT_S)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
    assert r.status_code == 200


def test_full_waiting_queue_is_503_with_retry_after(single_seat: ServerHandle) -> None:
    running = Stream(single_seat, max_tokens=2000, prompt="runner")
    running.read_events(2)
    waiters = [Stream(single_seat, max_tokens=4, prompt=f"waiter {i}") for i in range(2)]
    try:
        wait_metric(single_seat, "vt:num_requests_waiting", 2)
        r = completion(single_seat, max_tokens=2)
        err = assert_error(r, 503)
        assert err["type"] == "server_busy"
        assert int(r.headers["retry-after"]) >= 1
        r = httpx.post(f"{single_seat.url}/v1/chat/completions", timeout=IO_TIMEOUT_S,
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        assert_error(r, 503)
    finally:
        running.close()  # aborting the runner lets the waiters through
    for w in waiters:
        assert b"data: [DONE]" in w.read_to_end()
        w.close()
    wait_idle(single_seat)
    assert_serving(single_seat)


# ---- disconnects and aborts ------------------------------------------------------------------

def test_disconnect_while_queued_frees_everything(single_seat: ServerHandle) -> None:
    running = Stream(single_seat, max_tokens=2000, prompt="holder")
    running.read_events(2)
    queued_stream = Stream(single_seat, max_tokens=50, prompt="queued stream")
    body = orjson.dumps({"prompt": "queued plain", "max_tokens": 50})
    plain = socket.create_connection(host_port(single_seat), timeout=IO_TIMEOUT_S)
    plain.sendall(post_bytes("/v1/completions", body))
    wait_metric(single_seat, "vt:num_requests_waiting", 2)
    queued_stream.close()
    plain.close()
    deadline = time.monotonic() + 10
    while metrics(single_seat)["vt:num_requests_waiting"] > 0:
        assert time.monotonic() < deadline, "queued requests were not aborted"
        time.sleep(0.01)
    running.close()
    wait_idle(single_seat)
    assert_serving(single_seat)


def test_disconnect_mid_stream_and_while_waiting_frees_everything(server: ServerHandle) -> None:
    before = metrics(server)
    streams = [Stream(server, max_tokens=1500, prompt=f"mid {i}") for i in range(4)]
    for s in streams:
        s.read_events(3)  # decoding
    body = orjson.dumps({"prompt": "plain wait", "max_tokens": 1500, "ignore_eos": True})
    plain = socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S)
    plain.sendall(post_bytes("/v1/completions", body))
    wait_metric(server, "vt:num_requests_running", 5)
    assert metrics(server)["vt:kv_cache_usage_perc"] > 0
    for s in streams:
        s.close()
    plain.close()
    wait_idle(server)
    after = metrics(server)
    assert after["vt:num_requests_running"] == 0
    assert after["vt:generation_tokens_total"] < before["vt:generation_tokens_total"] + 5 * 1500
    assert_serving(server)


def test_disconnect_right_after_sending_long_prompt(server: ServerHandle) -> None:
    # closes while the prompt is parsed, queued or being prefilled
    for i in range(10):
        ids = [(7 * i + j) % 1000 + 3 for j in range(1500)]
        body = orjson.dumps({"prompt": ids, "max_tokens": 100, "stream": i % 2 == 0})
        with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
            sock.sendall(post_bytes("/v1/completions", body))
    wait_idle(server)
    assert_serving(server)


def test_half_sent_body_then_disconnect(server: ServerHandle) -> None:
    body = orjson.dumps({"prompt": "x", "max_tokens": 4})
    data = post_bytes("/v1/completions", body)
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(data[:-5])
    wait_idle(server)
    assert_serving(server)


# ---- API key ---------------------------------------------------------------------------------

V1_ROUTES = [("GET", "/v1/models", None),
             ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
             ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                               "max_tokens": 1}),
             ("POST", "/tokenize", {"prompt": "x"}),
             ("POST", "/detokenize", {"tokens": [5]})]


def _check_auth(handle: ServerHandle, key: str) -> None:
    bad = [None, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"},
           {"Authorization": key}, {"Authorization": "Bearer"}, {"Authorization": f"Bearer {key}x"}]
    for method, path, body in V1_ROUTES:
        for headers in bad:
            r = httpx.request(method, f"{handle.url}{path}", json=body, headers=headers,
                              timeout=IO_TIMEOUT_S)
            err = assert_error(r, 401)
            assert err["type"] == "authentication_error", (path, headers)
        r = httpx.request(method, f"{handle.url}{path}", json=body, timeout=IO_TIMEOUT_S,
                          headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, (path, r.text)
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{handle.url}{path}", timeout=IO_TIMEOUT_S).status_code == 200


def test_api_key_flag(tiny_model_dir: Path) -> None:
    handle = start_server(tiny_model_dir, "--api-key", API_KEY)
    try:
        _check_auth(handle, API_KEY)
        import openai

        good = openai.OpenAI(base_url=f"{handle.url}/v1", api_key=API_KEY, max_retries=0)
        assert good.models.list().data
        bad = openai.OpenAI(base_url=f"{handle.url}/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    finally:
        assert handle.stop() == 0


def test_api_key_environment_variable(tiny_model_dir: Path) -> None:
    with env_vars(VT_API_KEY="env-key-123"):
        handle = start_server(tiny_model_dir)
    try:
        _check_auth(handle, "env-key-123")
    finally:
        assert handle.stop() == 0


# ---- shutdown --------------------------------------------------------------------------------

@pytest.mark.parametrize("shutdown_timeout", [0.5, 30.0])
def test_sigterm_with_a_stream_in_flight(tiny_model_dir: Path, shutdown_timeout: float) -> None:
    handle = start_server(tiny_model_dir, "--shutdown-timeout", str(shutdown_timeout))
    try:
        # long enough to outlive the short timeout, short enough to finish within the long one
        max_tokens = 1800 if shutdown_timeout < 1 else 150
        stream = Stream(handle, max_tokens=max_tokens)
        stream.read_events(2)
        result: dict[str, bytes] = {}
        reader = threading.Thread(target=lambda: result.setdefault("body", stream.read_to_end()))
        reader.start()
        start = time.monotonic()
        handle.proc.send_signal(signal.SIGTERM)
        rc = handle.proc.wait(shutdown_timeout + 10)
        elapsed = time.monotonic() - start
        reader.join(IO_TIMEOUT_S)
        assert not reader.is_alive(), "the stream did not end"
        stream.close()
        assert rc == 0, handle.output()
        assert elapsed < shutdown_timeout + 8
        body = result["body"]
        if shutdown_timeout >= 1:
            # time enough: the stream finished normally
            assert b'"finish_reason":"length"' in body and body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        events = [e for e in body.split(b"data: ")[1:]]
        assert events, body[-500:]
        with pytest.raises(OSError):
            socket.create_connection(host_port(handle), timeout=2).close()
    finally:
        if handle.proc.poll() is None:
            handle.proc.kill()
            handle.proc.wait(10)


def test_sigterm_idle_server_exits_zero(tiny_model_dir: Path) -> None:
    handle = start_server(tiny_model_dir)
    idle = socket.create_connection(host_port(handle), timeout=IO_TIMEOUT_S)  # an idle keep-alive
    try:
        handle.proc.send_signal(signal.SIGTERM)
        assert handle.proc.wait(15) == 0
        _closed_within(idle, 5.0)
    finally:
        idle.close()
        if handle.proc.poll() is None:
            handle.proc.kill()
            handle.proc.wait(10)
    assert "shutting down" in handle.output()


def test_invalid_limit_environment_fails_fast(tiny_model_dir: Path) -> None:
    with env_vars(VT_MAX_CONNECTIONS="lots"):
        with pytest.raises(RuntimeError, match="VT_MAX_CONNECTIONS"):
            start_server(tiny_model_dir)
    assert os.environ.get("VT_MAX_CONNECTIONS") is None
