"""Soak: a couple of thousand small mixed requests with random disconnects, then no leak.

At the end no KV block is in use, nothing runs or waits, and the server's RSS is within a bound
of its value after warm-up.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from tests.e2e.conftest import ServerHandle, start_server
from tests.e2e.test_reliability import assert_serving, host_port, metrics, post_bytes, wait_idle

NUM_REQUESTS = 2000
WARMUP = 200
CONCURRENCY = 32
REQUEST_TIMEOUT_S = 30.0
RSS_GROWTH_LIMIT_KIB = 100 * 1024
DISCONNECT_P = 0.2


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ServerHandle]:
    handle = start_server(tiny_model_dir, "--max-num-seqs", "16", "--max-model-len", "256")
    yield handle
    assert handle.stop() == 0, handle.output()


def rss_kib(server: ServerHandle) -> int:
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS line")


async def _one(server: ServerHandle, rng: random.Random, i: int, outcomes: Counter) -> None:
    stream = rng.random() < 0.5
    chat = rng.random() < 0.3
    max_tokens = rng.randint(1, 8)
    vocab = ["alpha", "beta", "gamma", "delta", "x", "yz"]
    words = " ".join(rng.choice(vocab) for _ in range(rng.randint(1, 12)))
    body: dict = {"max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                  "temperature": rng.choice([0.0, 0.7, 1.0]), "seed": i}
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": words}]
    else:
        path = "/v1/completions"
        body["prompt"] = words
    # where to drop the connection: None = never, else after this many bytes of the answer
    drop_at = rng.choice([0, 1, 100, 300, 600]) if rng.random() < DISCONNECT_P else None
    host, port = host_port(server)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(post_bytes(path, orjson.dumps(body)))
        await writer.drain()
        data = b""
        while drop_at is None or len(data) < drop_at:
            chunk = await reader.read(65536)
            if not chunk:
                break
            data += chunk
    finally:
        writer.close()
    if drop_at is not None:
        outcomes["dropped"] += 1
        return
    head, _, payload = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), data[:300]
    if stream:
        assert b"data: [DONE]" in payload, payload[-300:]
        assert payload.endswith(b"0\r\n\r\n")
        outcomes["stream"] += 1
    else:
        assert orjson.loads(payload)["usage"]["completion_tokens"] == max_tokens
        outcomes["plain"] += 1


async def _run(server: ServerHandle, start: int, count: int, outcomes: Counter) -> None:
    rng = random.Random(start)
    next_i = start
    end = start + count

    async def worker() -> None:
        nonlocal next_i
        while next_i < end:
            i = next_i
            next_i += 1
            await asyncio.wait_for(_one(server, rng, i, outcomes), REQUEST_TIMEOUT_S)

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def test_soak_mixed_requests_leave_no_leak(server: ServerHandle) -> None:
    outcomes: Counter = Counter()
    asyncio.run(_run(server, 0, WARMUP, outcomes))
    wait_idle(server)
    rss_after_warmup = rss_kib(server)
    asyncio.run(_run(server, WARMUP, NUM_REQUESTS - WARMUP, outcomes))
    m = wait_idle(server, timeout=30)
    assert m["vt:kv_cache_usage_perc"] == 0
    assert m["vt:num_requests_running"] == 0 and m["vt:num_requests_waiting"] == 0
    assert sum(outcomes.values()) == NUM_REQUESTS, outcomes
    assert outcomes["dropped"] > NUM_REQUESTS * DISCONNECT_P / 2, outcomes
    assert outcomes["stream"] > 0 and outcomes["plain"] > 0
    growth = rss_kib(server) - rss_after_warmup
    assert growth < RSS_GROWTH_LIMIT_KIB, f"RSS grew by {growth} KiB over {NUM_REQUESTS - WARMUP} requests"
    # every request ended one way or another: finished ones are counted by reason
    assert metrics(server)["vt:num_requests_running"] == 0
    assert_serving(server)
    assert server.proc.poll() is None
