"""Hostile clients against the real `vt serve`: none can kill the engine, stall the loop or starve
the others, alone or mixed with normal traffic in a bounded soak.

The soak runs normal clients beside clients that send values the sampler cannot hold, deep JSON,
huge prompts and stop lists, never read their answers, half-close, or speak broken HTTP. After
it: every normal request succeeded, /health is 200, nothing runs or waits, no KV block is used,
and the server's RSS grew by less than SOAK_RSS_GROWTH_LIMIT_KIB over its value after warm-up.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import ServerHandle, start_server
from tests.e2e.test_reliability import assert_serving, host_port, post_bytes, raw_request, wait_idle
from tests.e2e.test_soak import rss_kib

MAX_MODEL_LEN = 512
WRITE_TIMEOUT_S = 1.0
SOAK_SECONDS = 30.0
SOAK_RSS_GROWTH_LIMIT_KIB = 64 * 1024  # measured: ~19 MiB over ~6,900 requests
IO_TIMEOUT_S = 30.0
API_KEY = "clé-секрет-🔑"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model_dir, "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16",
                          "--max-connections", "64", "--http-write-timeout", str(WRITE_TIMEOUT_S))
    yield handle
    assert handle.stop() == 0, handle.output()


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _body(path: str, body: dict) -> bytes:
    return post_bytes(path, orjson.dumps(body))


def final_response(data: bytes) -> bytes:
    """The response after any interim 102s (sent while a half-closed client's request runs)."""
    while data.startswith(b"HTTP/1.1 102 "):
        data = data.partition(b"\r\n\r\n")[2]
    return data


def _status(data: bytes) -> int:
    data = final_response(data)
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else 0


# ---- each class alone ---------------------------------------------------------------------------

def test_clients_that_never_read_cannot_hold_every_connection(tiny_model_dir: Path) -> None:
    handle = start_server(tiny_model_dir, "--max-connections", "6", "--http-write-timeout", "1")
    socks = []
    try:
        body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1800,
                             "ignore_eos": True, "stream": True, "logprobs": True, "top_logprobs": 20})
        for _ in range(6):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(host_port(handle))
            sock.sendall(post_bytes("/v1/chat/completions", body))
            socks.append(sock)
        # the six hold every slot until the server gives up on their unread writes
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{handle.url}/health", timeout=IO_TIMEOUT_S).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the non-readers kept every slot"
            time.sleep(0.2)
        wait_idle(handle)  # their requests were aborted, their KV freed: they still hold sockets
        assert_serving(handle)
    finally:
        for sock in socks:
            sock.close()
        assert handle.stop() == 0, handle.output()


def test_prompt_that_cannot_fit_is_refused_untokenized(server: ServerHandle) -> None:
    text = "abcdefgh " * (1_500_000)  # 13.5 MB
    r = raw_request(server, _body("/v1/completions", {"prompt": text, "max_tokens": 1}))
    err = r.json()["error"]
    assert r.status == 400 and err["param"] == "prompt"
    assert "characters" in err["message"]  # counted, not tokenized
    assert len(err["message"]) < 400
    assert_serving(server)


@pytest.mark.parametrize(("data", "status"), [
    (b"GET /health HTTP/1.1\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET /health HTTP/2.0\r\nHost: a\r\n\r\n", 505),
    (b"GET /health\r\n\r\n", 400),
])
def test_rfc9112_request_lines_and_hosts(server: ServerHandle, data: bytes, status: int) -> None:
    r = raw_request(server, data)
    assert r is not None and r.status == status


def test_complete_request_then_half_close_is_answered(server: ServerHandle) -> None:
    body = orjson.dumps({"prompt": "hello", "max_tokens": 5, "ignore_eos": True})
    with socket.create_connection(host_port(server), timeout=IO_TIMEOUT_S) as sock:
        sock.sendall(post_bytes("/v1/completions", body))
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = final_response(data).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:200]
    assert orjson.loads(payload)["usage"]["completion_tokens"] == 5


def test_api_key_and_100_continue(tiny_model_dir: Path) -> None:
    handle = start_server(tiny_model_dir, "--api-key", API_KEY)
    try:
        body = orjson.dumps({"prompt": "hi", "max_tokens": 2})
        key = API_KEY.encode()
        # the key as the bytes a client sends (UTF-8), compared as such
        auth = f"Authorization: Bearer {API_KEY}\r\n"
        ok = raw_request(handle, post_bytes("/v1/completions", body, extra=auth))
        assert ok is not None and ok.status == 200, ok
        # no 100 Continue for a request the key check refuses: its final answer at once
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % len(body))
        refused = raw_request(handle, head)
        assert refused is not None and refused.status == 401
        head = head.replace(b"Host: a\r\n", b"Host: a\r\nAuthorization: Bearer " + key + b"\r\n")
        with socket.create_connection(host_port(handle), timeout=IO_TIMEOUT_S) as sock:
            sock.sendall(head)
            assert sock.recv(1024) == b"HTTP/1.1 100 Continue\r\n\r\n"
    finally:
        assert handle.stop() == 0, handle.output()


# ---- the soak -----------------------------------------------------------------------------------

async def _exchange(server: ServerHandle, data: bytes, read: bool = True, half_close: bool = False,
                    rcvbuf: int | None = None, hold_s: float = 0.0) -> bytes:
    host, port = host_port(server)
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    try:
        writer.write(data)
        await writer.drain()
        if half_close:
            writer.write_eof()
        if not read:
            await asyncio.sleep(hold_s)
            return b""
        return await asyncio.wait_for(reader.read(), IO_TIMEOUT_S)
    except (ConnectionResetError, BrokenPipeError):
        return b""
    finally:
        writer.close()


class Soak:
    def __init__(self, server: ServerHandle) -> None:
        self.server = server
        self.normal: Counter = Counter()
        self.hostile: Counter = Counter()
        self.failures: list[str] = []

    async def normal_request(self, rng: random.Random, i: int) -> None:
        stream = rng.random() < 0.5
        max_tokens = rng.randint(1, 12)
        body: dict = {"max_tokens": max_tokens, "stream": stream, "ignore_eos": True, "seed": i,
                      "temperature": rng.choice([0.0, 0.8])}
        if rng.random() < 0.4:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": f"hello {i}"}]
        else:
            path = "/v1/completions"
            body["prompt"] = f"the quick brown fox {i}"
        data = await _exchange(self.server, _body(path, body))
        head, _, payload = data.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            self.failures.append(f"normal {path} -> {data[:200]!r}")
        elif stream and not (b"data: [DONE]" in payload and payload.endswith(b"0\r\n\r\n")):
            self.failures.append(f"normal stream cut short: {payload[-200:]!r}")
        elif not stream and orjson.loads(payload)["usage"]["completion_tokens"] != max_tokens:
            self.failures.append(f"normal plain wrong usage: {payload[:200]!r}")
        self.normal["stream" if stream else "plain"] += 1

    async def hostile_request(self, rng: random.Random) -> None:
        kind = rng.choice(["sampler", "nesting", "top_p", "non_reader", "half_close", "http",
                           "stops", "big_prompt", "wide", "drop"])
        srv = self.server
        want: tuple[int, ...] = (400,)
        if kind == "sampler":
            bad = rng.choice([{"top_k": 2**31}, {"stop_token_ids": [2**31], "min_tokens": 1},
                              {"stop_token_ids": [10**6], "min_tokens": 2}])
            data = await _exchange(srv, _body("/v1/completions", {"prompt": "x", "max_tokens": 4, **bad}))
        elif kind == "nesting":
            field = rng.choice([b"prompt", b"max_tokens", b"temperature", b"seed", b"user"])
            raw = b'{"prompt": "x", "%s": %s}' % (field, nested(1000))
            data = await _exchange(srv, post_bytes("/v1/completions", raw))
        elif kind == "top_p":
            want = (200,)
            data = await _exchange(srv, _body("/v1/completions", {"prompt": "x", "max_tokens": 3,
                                                                   "top_p": 1e-300, "seed": 3}))
        elif kind == "non_reader":
            body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 400, "stream": True,
                    "ignore_eos": True, "logprobs": True, "top_logprobs": 20}
            await _exchange(srv, _body("/v1/chat/completions", body), read=False, rcvbuf=4096,
                            hold_s=rng.uniform(0.5, 3.0))
            data, want = b"", ()
        elif kind == "half_close":
            want = (200,)
            data = await _exchange(srv, _body("/v1/completions", {"prompt": "x", "max_tokens": 2}),
                                   half_close=True)
        elif kind == "http":
            want = (400, 505)
            data = await _exchange(srv, rng.choice([b"GET /health HTTP/1.1\r\n\r\n",
                                                    b"GET /health HTTP/2.0\r\nHost: a\r\n\r\n"]))
        elif kind == "stops":
            data = await _exchange(srv, _body("/v1/completions", {"prompt": "x", "stop": ["zz"] * 400_000}))
        elif kind == "big_prompt":
            data = await _exchange(srv, _body("/v1/completions", {"prompt": "word " * 400_000}))
        elif kind == "wide":
            want = (200,)
            body = {"messages": [{"role": "user", "content": "x"}], "n": 32, "max_tokens": 8,
                    "logprobs": True, "top_logprobs": 20, "ignore_eos": True}
            data = await _exchange(srv, _body("/v1/chat/completions", body))
        else:  # drop mid-stream
            body = {"prompt": "x", "max_tokens": 300, "stream": True, "ignore_eos": True}
            await _exchange(srv, _body("/v1/completions", body), read=False, hold_s=rng.uniform(0, 0.5))
            data, want = b"", ()
        if want and _status(data) not in want:
            self.failures.append(f"hostile {kind} -> {data[:200]!r}")
        self.hostile[kind] += 1

    async def run(self, seconds: float, seed: int) -> None:
        deadline = time.monotonic() + seconds
        counter = iter(range(10**9))

        async def worker(k: int, hostile: bool) -> None:
            rng = random.Random(seed * 100 + k)
            while time.monotonic() < deadline:
                if hostile:
                    await self.hostile_request(rng)
                else:
                    await self.normal_request(rng, next(counter))

        await asyncio.gather(*(worker(k, False) for k in range(8)),
                             *(worker(100 + k, True) for k in range(6)))


def test_soak_hostile_clients_beside_normal_traffic(server: ServerHandle) -> None:
    warm = Soak(server)
    asyncio.run(warm.run(3.0, seed=1))
    wait_idle(server, timeout=30)
    rss_before = rss_kib(server)
    soak = Soak(server)
    asyncio.run(soak.run(SOAK_SECONDS, seed=2))
    assert not soak.failures, soak.failures[:5]
    assert sum(soak.normal.values()) > 50 and len(soak.hostile) >= 8, (soak.normal, soak.hostile)
    m = wait_idle(server, timeout=30)
    assert m["vt:num_requests_running"] == 0 and m["vt:num_requests_waiting"] == 0
    assert m["vt:kv_cache_usage_perc"] == 0
    assert httpx.get(f"{server.url}/health", timeout=IO_TIMEOUT_S).status_code == 200
    growth = rss_kib(server) - rss_before
    assert growth < SOAK_RSS_GROWTH_LIMIT_KIB, f"RSS grew by {growth} KiB"
    assert_serving(server)
    assert server.proc.poll() is None
