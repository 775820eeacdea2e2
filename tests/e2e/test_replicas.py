"""Three vt replicas behind the vLLM router (pip's vllm-router), all on loopback.

One replica set serves the file, in order: cache-aware routing against round robin on the same
kind of load, a rolling restart under load, then a SIGKILL under load (which leaves the set one
replica short, so it comes last). Every request has a timeout and every wait a bound.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT, start_server
from vt.launch.replicas import ReplicaSet, ReplicaSetConfig, free_port

REQUEST_TIMEOUT_S = 30.0   # no request may take longer, failed or not
LOAD_TIMEOUT_S = 120.0     # one whole load
CONCURRENCY = 12
GROUPS, PER_GROUP, PREFIX_WORDS = 20, 15, 150   # 300 requests in groups sharing long prefixes
# Each replica's KV cache holds about a third of the groups' prefixes: a router that keeps a group
# on one replica keeps its prefix cached, one that spreads every group over every replica evicts.
NUM_BLOCKS = 80
WORDS = ("the quick brown fox jumps over lazy dog hello world model token stream server request "
         "response batch cache block attention layer weight value key query prompt output input").split()


@dataclass
class Result:
    ok: bool
    status: int | None
    error: str | None
    seconds: float


def grouped_prompts(seed: int, groups: int = GROUPS, per_group: int = PER_GROUP) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))
        prompts += [prefix + " " + " ".join(rng.choice(WORDS) for _ in range(6)) for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


async def _one(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> Result:
    start = time.monotonic()
    status: list[int] = []

    async def stream() -> bytes:
        async with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}) as r:
            status.append(r.status_code)
            return b"".join([chunk async for chunk in r.aiter_bytes()])

    code = None
    try:
        body = await asyncio.wait_for(stream(), REQUEST_TIMEOUT_S)
        code = status[0]
        ok = code == 200 and body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in body
        return Result(ok, code, None if ok else body[-300:].decode("utf-8", "replace"),
                      time.monotonic() - start)
    except asyncio.TimeoutError:
        return Result(False, code, "timeout", time.monotonic() - start)
    except httpx.HTTPError as e:
        return Result(False, code, f"{type(e).__name__}: {e}", time.monotonic() - start)


def run_load(url: str, prompts: list[str], max_tokens: int = 4) -> list[Result]:
    """Stream every prompt's completion through url, CONCURRENCY at a time."""

    async def main() -> list[Result]:
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY)
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            async def bounded(p: str) -> Result:
                async with sem:
                    return await _one(client, url, p, max_tokens)
            return list(await asyncio.wait_for(asyncio.gather(*(bounded(p) for p in prompts)),
                                               LOAD_TIMEOUT_S))

    return asyncio.run(main())


def metric(url: str, name: str) -> float:
    """The sum of every sample of `name` (all label sets) on one replica's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"{name} not in {url}/metrics"
    return sum(float(v) for v in values)


def load_of(url: str) -> int:
    try:
        return httpx.get(f"{url}/load", timeout=2).json()["server_load"]
    except httpx.HTTPError:
        return -1


def failures(results: list[Result]) -> list[Result]:
    return [r for r in results if not r.ok]


def during(results_fn: Callable[[], list[Result]], action: Callable[[], None]) -> list[Result]:
    """Run a load and, in a thread, an action against the replicas while it runs."""
    errors: list[BaseException] = []

    def act() -> None:
        try:
            action()
        except BaseException as e:  # surfaced below: a failed action must fail the test
            errors.append(e)

    t = threading.Thread(target=act, daemon=True)
    t.start()
    results = results_fn()
    t.join(LOAD_TIMEOUT_S)
    assert not t.is_alive(), "the action did not finish"
    if errors:
        raise errors[0]
    return results


def busiest(cluster: Cluster, at_least: int = 1, timeout: float = 20.0) -> int:
    """The index of the replica with the most requests in flight, once one has `at_least`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = [load_of(u) for u in cluster.replica_urls]
        if max(loads) >= at_least:
            return loads.index(max(loads))
        time.sleep(0.05)
    raise AssertionError("no replica had requests in flight")


@dataclass
class Cluster:
    set: ReplicaSet
    cache_aware_url: str   # the router the launcher started
    round_robin_url: str   # a second router over the same replicas

    @property
    def replica_urls(self) -> list[str]:
        return self.set.replica_urls


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path):
    cfg = ReplicaSetConfig(model=str(tiny_model_dir), num_replicas=3, port=0, serve_args=(
        "--num-gpu-blocks", str(NUM_BLOCKS), "--max-model-len", "1024", "--shutdown-timeout", "20"),
        start_timeout_s=120.0)
    with ReplicaSet(cfg) as rs:
        yield Cluster(rs, rs.router_urls[0], rs.start_router(0, "round_robin"))


def test_cache_aware_routing_at_least_doubles_prefix_cache_hits(cluster: Cluster) -> None:
    hits: dict[str, float] = {}
    for name, url, seed in [("round_robin", cluster.round_robin_url, 1),
                            ("cache_aware", cluster.cache_aware_url, 2)]:
        before = sum(metric(u, "vllm:prefix_cache_hits_total") for u in cluster.replica_urls)
        results = run_load(url, grouped_prompts(seed))
        assert len(results) == GROUPS * PER_GROUP
        assert failures(results) == [], name
        hits[name] = sum(metric(u, "vllm:prefix_cache_hits_total") for u in cluster.replica_urls) - before
    assert hits["round_robin"] > 0
    assert hits["cache_aware"] >= 2 * hits["round_robin"], hits


def test_rolling_restart_under_load_fails_no_request(cluster: Cluster) -> None:
    restarted: list[int] = []

    def restart_busiest() -> None:
        i = busiest(cluster)   # a replica with streams in flight: they must finish while it drains
        restarted.append(i)
        cluster.set.restart(i)

    results = during(lambda: run_load(cluster.cache_aware_url, grouped_prompts(3), max_tokens=24),
                     restart_busiest)
    assert failures(results) == []
    assert all(r.seconds < REQUEST_TIMEOUT_S for r in results)
    # The restarted replica is back in the rotation: round robin reaches it again.
    url = cluster.replica_urls[restarted[0]]
    deadline = time.monotonic() + 30
    while metric(url, "vllm:request_success_total") == 0:
        assert time.monotonic() < deadline, "the restarted replica got no traffic"
        assert failures(run_load(cluster.round_robin_url, grouped_prompts(4, groups=3, per_group=3))) == []


def test_sigkill_under_load_fails_cleanly_and_later_requests_succeed(cluster: Cluster) -> None:
    killed: list[int] = []

    def kill_busiest() -> None:
        i = busiest(cluster, at_least=2)
        killed.append(i)
        cluster.set.replicas[i].signal(signal.SIGKILL)

    start = time.monotonic()
    results = during(lambda: run_load(cluster.cache_aware_url, grouped_prompts(5), max_tokens=32),
                     kill_busiest)
    assert time.monotonic() - start < LOAD_TIMEOUT_S
    assert len(results) == GROUPS * PER_GROUP
    for r in failures(results):
        # a clean end: an error status, or the connection closed mid-stream; never a hang
        assert r.error != "timeout", r
        assert r.seconds < REQUEST_TIMEOUT_S, r
    assert cluster.set.replicas[killed[0]].proc.wait(10) == -signal.SIGKILL
    after = run_load(cluster.cache_aware_url, grouped_prompts(6, groups=10, per_group=6))
    assert failures(after) == []


def test_draining_replica_is_unready_at_once_and_finishes_its_streams(tiny_model_dir: Path) -> None:
    server = start_server(tiny_model_dir, "--shutdown-timeout", "30")
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            assert client.get(f"{server.url}/health").status_code == 200
            with client.stream("POST", f"{server.url}/v1/completions", json={
                    "prompt": "hello world", "max_tokens": 400, "stream": True, "ignore_eos": True}) as r:
                chunks = r.iter_bytes()
                next(chunks)
                server.proc.send_signal(signal.SIGTERM)
                deadline = time.monotonic() + 10
                while client.get(f"{server.url}/health").status_code != 503:
                    assert time.monotonic() < deadline, "/health stayed 200 while draining"
                    time.sleep(0.01)
                refused = client.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert refused.status_code == 503
                assert refused.headers.get("retry-after") == "1"
                assert refused.json()["error"]["type"] == "service_unavailable"
                body = b"".join(chunks)
            assert body.endswith(b"data: [DONE]\n\n") and b'"finish_reason":"length"' in body
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_vt_replicas_command_serves_through_the_router_and_stops_everything(tiny_model_dir: Path) -> None:
    port = free_port()
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "vt", "replicas", "--model", str(tiny_model_dir),
                             "--num-replicas", "2", "--port", str(port), "--", "--max-model-len", "512"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=str(REPO_ROOT))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any("vt: router (cache_aware) on" in line for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, "".join(lines)
            time.sleep(0.1)
        results = run_load(f"http://127.0.0.1:{port}", grouped_prompts(7, groups=2, per_group=4))
        assert failures(results) == []
        replica_ports = re.findall(r"serving on http://127\.0\.0\.1:(\d+)", "".join(lines))
        assert len(replica_ports) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    reader.join(10)
    assert "stopping the router and the replicas" in "".join(lines)
    for p in [port, *replica_ports]:  # the router and both replicas are gone
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)
