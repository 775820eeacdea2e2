"""Priority vs fcfs on the real `vt serve`, seen by streaming HTTP clients.

Orderings come from token arrival order on the client: every streamed chunk gets the next number
of one global counter, so each request's first and last chunk (and every chunk in between) can be
placed relative to all others. Chunk counts stand in for time: they do not stretch when a loaded
machine runs slowly. `logprobs: 0` makes the server send one chunk per token, even for tokens that
decode to no text.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from tests.e2e.conftest import ServerHandle, start_server

POLL_S = 0.01
POLL_LIMIT = 3000           # polls of POLL_S: a 30 s bound on every wait for a server state
LOW, HIGH = 10, 0           # priorities: lower runs first
BACKLOG = 12
LOW_TOKENS = 512            # long enough that the backlog lasts thousands of steps
HIGH_TOKENS = 48


@dataclass
class Trace:
    """What one streaming client saw."""

    name: str
    sent: int                                   # global chunk count when the request was sent
    seqs: list[int] = field(default_factory=list)   # global number of each chunk of this request
    tokens: list[str] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def first(self) -> int:
        return self.seqs[0]

    @property
    def last(self) -> int:
        return self.seqs[-1]

    def chunks_between(self, lo: int, hi: int) -> int:
        return sum(1 for s in self.seqs if lo < s < hi)


class Recorder:
    """Streams completions and numbers every chunk of every request in arrival order."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, priorities: bool) -> None:
        self.client, self.url, self.model = client, url, model
        self.priorities = priorities
        self.count = 0

    @classmethod
    async def open(cls, client: httpx.AsyncClient, url: str, priorities: bool = True) -> Recorder:
        """`priorities` False: the server schedules fcfs, which refuses a priority other than 0,
        so none is sent and the same workload runs unprioritised."""
        r = await client.get(f"{url}/v1/models")
        return cls(client, url, r.json()["data"][0]["id"], priorities)

    def send(self, name: str, prompt: list[int], max_tokens: int, priority: int = 0,
             **sampling: object) -> tuple[Trace, asyncio.Task]:
        trace = Trace(name, self.count)
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True, "logprobs": 0, "temperature": 0.0, **sampling}
        if self.priorities:
            body["priority"] = priority
        return trace, asyncio.create_task(self._stream(trace, body))

    async def _stream(self, trace: Trace, body: dict) -> Trace:
        try:
            async with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                assert r.status_code == 200, (trace.name, await r.aread())
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = orjson.loads(line[6:])
                    assert "error" not in chunk, (trace.name, chunk)
                    for choice in chunk["choices"]:
                        self.count += 1
                        trace.seqs.append(self.count)
                        trace.text += choice["text"]
                        trace.tokens.extend(choice["logprobs"]["tokens"])
                        trace.finish_reason = choice["finish_reason"] or trace.finish_reason
                        trace.started.set()
        finally:
            trace.started.set()  # wake waiters on a failure too; they check for chunks
        return trace

    async def metrics(self) -> dict[str, float]:
        r = await self.client.get(f"{self.url}/metrics")
        assert r.status_code == 200
        out: dict[str, float] = {}
        for line in r.text.splitlines():
            if line.startswith("vt:") and "_bucket" not in line:
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0]
                # request_success_total has one line per reason: keep the sum
                out[key] = out.get(key, 0.0) + float(value)
        return out

    async def wait_metrics(self, pred: Callable[[dict[str, float]], bool], what: str) -> dict[str, float]:
        m: dict[str, float] = {}
        for _ in range(POLL_LIMIT):
            m = await self.metrics()
            if pred(m):
                return m
            await asyncio.sleep(POLL_S)
        raise AssertionError(f"the server never reached: {what}; last metrics {m}")


async def wait_started(*traces: Trace) -> None:
    await asyncio.wait_for(asyncio.gather(*(t.started.wait() for t in traces)), POLL_S * POLL_LIMIT)
    for t in traces:
        assert t.seqs, f"{t.name} ended without a token"


def prompt(i: int, n: int = 12) -> list[int]:
    return [(i * 37 + j * 11) % 900 + 3 for j in range(n)]


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path) -> Iterator[Callable[..., ServerHandle]]:
    """Start (once per argument list) and hand out servers; all are stopped at the end."""
    started: dict[tuple[str, ...], ServerHandle] = {}

    def get(*args: str) -> ServerHandle:
        if args not in started:
            started[args] = start_server(tiny_model_dir, *args)
        return started[args]

    yield get
    for h in started.values():
        h.stop()


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64))


async def assert_idle(rec: Recorder) -> dict[str, float]:
    # The last response ends right after its request is freed; the gauges follow at once.
    return await rec.wait_metrics(
        lambda m: m["vt:num_requests_running"] == 0 and m["vt:num_requests_waiting"] == 0
        and m["vt:kv_cache_usage_perc"] == 0.0, "no running, no waiting, KV usage 0")


# ---- priority vs fcfs under a backlog ----------------------------------------------------------

async def backlog_workload(rec: Recorder) -> tuple[list[Trace], list[Trace], float]:
    """Two long low-priority requests fill the batch (max-num-seqs 2), ten more queue behind them;
    then one high-priority request H0, and after it finishes two more, H1 and H2, together.
    Returns (lows, highs, preemptions during the run)."""
    m0 = await rec.metrics()
    lows: list[Trace] = []
    tasks: list[asyncio.Task] = []

    def low(i: int) -> None:
        t, task = rec.send(f"L{i}", prompt(i), LOW_TOKENS, LOW)
        lows.append(t)
        tasks.append(task)

    low(0)
    low(1)
    await wait_started(lows[0], lows[1])
    for i in range(2, BACKLOG):
        low(i)
    await rec.wait_metrics(lambda m: m["vt:num_requests_waiting"] >= BACKLOG - 2,
                           f"{BACKLOG - 2} requests waiting")
    h0, t0 = rec.send("H0", prompt(100), HIGH_TOKENS, HIGH)
    await t0
    h1, t1 = rec.send("H1", prompt(101), HIGH_TOKENS, HIGH)
    h2, t2 = rec.send("H2", prompt(102), HIGH_TOKENS, HIGH)
    await asyncio.gather(t1, t2, *tasks)
    m1 = await assert_idle(rec)
    highs = [h0, h1, h2]
    for t in lows + highs:
        want = LOW_TOKENS if t in lows else HIGH_TOKENS
        assert t.finish_reason == "length" and len(t.tokens) == want == len(t.seqs), t.name
    return lows, highs, m1["vt:num_preemptions_total"] - m0["vt:num_preemptions_total"]


def ttft_chunks(t: Trace) -> int:
    """Time to first token, counted in chunks streamed (to anyone) since the request was sent."""
    return t.first - t.sent


async def test_priority_serves_high_before_low_backlog(servers) -> None:
    h = servers("--scheduling-policy", "priority", "--max-num-seqs", "2")
    async with client() as c:
        rec = await Recorder.open(c, h.url)
        lows, highs, preemptions = await backlog_workload(rec)
    l0, l1 = lows[0], lows[1]
    h0 = highs[0]
    for hi in highs:
        started_before = [lo.name for lo in lows if lo.first < hi.first]
        assert len(started_before) <= 3, f"{hi.name} started after {started_before}"
        finished_before = [lo.name for lo in lows if lo.last < hi.last]
        assert len(finished_before) <= 1, f"{hi.name} finished after {finished_before}"
    # Time to first token: a fraction of the backlog's (expected: a few chunks vs ~1500).
    low_ttft = statistics.median(ttft_chunks(lo) for lo in lows)
    for hi in highs:
        assert ttft_chunks(hi) < 0.1 * low_ttft, (hi.name, ttft_chunks(hi), low_ttft)
    # H0 preempts the worst running request (L1: same priority, later arrival); L0 keeps decoding
    # beside H0, one token per step (a token already in flight may still arrive for L1).
    assert l1.chunks_between(h0.first, h0.last) <= 2
    assert l0.chunks_between(h0.first, h0.last) >= HIGH_TOKENS // 2
    # H1 and H2 together take both seats: no low-priority token while both run.
    both = (max(highs[1].first, highs[2].first), min(highs[1].last, highs[2].last))
    assert both[1] - both[0] > HIGH_TOKENS // 2
    for lo in lows:
        assert lo.chunks_between(*both) <= 2, lo.name
    # L1 by H0, then L1 (back first: it kept its place) and L0 by H1 and H2.
    assert preemptions >= 3
    # Preempted requests come back before later arrivals of the same priority.
    assert max(l0.last, l1.last) < min(lo.last for lo in lows[2:])


async def test_fcfs_serves_the_same_workload_in_arrival_order(servers) -> None:
    h = servers("--scheduling-policy", "fcfs", "--max-num-seqs", "2")
    async with client() as c:
        rec = await Recorder.open(c, h.url, priorities=False)
        lows, highs, preemptions = await backlog_workload(rec)
    h0 = highs[0]
    assert h0.first > max(lo.first for lo in lows), "fcfs: H0 arrived after every low request"
    assert sum(lo.last < h0.last for lo in lows) >= BACKLOG - 2
    assert ttft_chunks(h0) > statistics.median(ttft_chunks(lo) for lo in lows)
    assert preemptions == 0, "fcfs never preempts while KV blocks last"


# ---- starvation ------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["priority", "fcfs"])
async def test_equal_priority_requests_keep_arrival_order(servers, policy: str) -> None:
    h = servers("--scheduling-policy", policy, "--max-num-seqs", "1")
    n = 6
    async with client() as c:
        rec = await Recorder.open(c, h.url, priorities=policy == "priority")
        m0 = await rec.metrics()
        traces, tasks = [], []
        arrived = m0["vt:prompt_tokens_total"]
        for i in range(n):
            # one at a time: each is sent only once the server has counted the previous one's
            # prompt, so the server's arrival order is the send order
            t, task = rec.send(f"E{i}", prompt(i, 10 + i), 256 if i == 0 else 24, 5)
            traces.append(t)
            tasks.append(task)
            arrived += 10 + i
            await rec.wait_metrics(lambda m, a=arrived: m["vt:prompt_tokens_total"] >= a,
                                   f"request {i} arrived")
        await asyncio.gather(*tasks)
        m1 = await assert_idle(rec)
    firsts = [t.first for t in traces]
    assert firsts == sorted(firsts), f"first tokens out of arrival order: {firsts}"
    # One request runs at a time, so with no preemption each ran start to finish in the order it
    # started. That is checked on the server's counter: the client may read E0's long stream's
    # tail after the short streams that followed it (one busy connection against fresh ones), so
    # client-side completion order is compared among the equal short requests only.
    assert m1["vt:num_preemptions_total"] == m0["vt:num_preemptions_total"]
    lasts = [t.last for t in traces[1:]]
    assert lasts == sorted(lasts), f"last tokens out of arrival order: {lasts}"


async def test_low_priority_finishes_once_high_load_ends(servers) -> None:
    h = servers("--scheduling-policy", "priority", "--max-num-seqs", "1")
    async with client() as c:
        rec = await Recorder.open(c, h.url)
        m0 = await rec.metrics()
        low, low_task = rec.send("low", prompt(7, 20), 96, LOW)
        await wait_started(low)
        # a sustained high-priority load: each next one arrives when the previous one has started
        highs, tasks = [], []
        for i in range(6):
            t, task = rec.send(f"H{i}", prompt(50 + i), 16, HIGH)
            highs.append(t)
            tasks.append(task)
            await wait_started(t)
        await asyncio.gather(low_task, *tasks)
        m1 = await assert_idle(rec)
        alone, alone_task = rec.send("low-again", prompt(7, 20), 96, LOW)
        await alone_task
    assert m1["vt:num_preemptions_total"] > m0["vt:num_preemptions_total"]
    assert low.last > max(t.last for t in highs), "the high-priority load ran first"
    assert low.chunks_between(highs[0].first, highs[-1].last) <= 4
    assert low.finish_reason == "length" and len(low.tokens) == 96
    # resumed by recomputation: the same greedy output as a run that was never preempted
    assert low.tokens == alone.tokens and low.text == alone.text


# ---- preemption keeps outputs exact ----------------------------------------------------------

EXACT_N = 6
EXACT_TOKENS = 48


async def exact_workload(url: str,
                         priorities: bool) -> tuple[list[Trace], dict[str, float], dict[str, float]]:
    """Six concurrent requests (three greedy, three seeded with temperature) with mixed priorities
    (`priorities` False: none, for an fcfs server)."""
    async with client() as c:
        rec = await Recorder.open(c, url, priorities)
        m0 = await rec.metrics()
        traces, tasks = [], []
        for i in range(EXACT_N):
            sampling = {} if i % 2 == 0 else {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i}
            t, task = rec.send(f"X{i}", prompt(i, 20 + 8 * i), EXACT_TOKENS, i % 3, **sampling)
            traces.append(t)
            tasks.append(task)
        await asyncio.gather(*tasks)
        m1 = await assert_idle(rec)
    return traces, m0, m1


@pytest.fixture(scope="module")
def exact_reference(servers) -> list[Trace]:
    h = servers("--block-size", "16")   # the default pool: no preemption
    traces, m0, m1 = asyncio.run(exact_workload(h.url, priorities=False))
    assert m1["vt:num_preemptions_total"] == m0["vt:num_preemptions_total"]
    return traces


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("async_flag", ["--async-scheduling", "--no-async-scheduling"])
async def test_preemption_keeps_outputs_exact(servers, exact_reference: list[Trace], policy: str,
                                              async_flag: str) -> None:
    # 10 blocks of 16 tokens (a context of 160); one request needs up to 6 blocks, six together
    # about 30
    h = servers("--scheduling-policy", policy, "--num-gpu-blocks", "10", "--block-size", "16",
                "--max-model-len", "160", "--max-num-seqs", str(EXACT_N), async_flag)
    traces, m0, m1 = await exact_workload(h.url, priorities=policy == "priority")
    assert m1["vt:num_preemptions_total"] > m0["vt:num_preemptions_total"], "the pool forces preemption"
    for got, want in zip(traces, exact_reference):
        assert got.finish_reason == "length" and len(got.tokens) == EXACT_TOKENS
        assert got.tokens == want.tokens, f"{got.name}: output changed by preemption"
        assert got.text == want.text
