"""The stats line `vt serve` logs every 10 s while busy, as vLLM's: prompt and generation
throughput over the interval, running and waiting requests, KV cache use, prefix-cache hit rate."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vt.stats")
STATS_INTERVAL_S = 10.0


@dataclass(frozen=True)
class StatsSnapshot:
    time: float
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_tokens: int
    running: int
    waiting: int
    kv_usage: float           # fraction of KV blocks in use


def snapshot(engine: Any, now: float | None = None) -> StatsSnapshot:
    s = engine.stats()
    return StatsSnapshot(time.monotonic() if now is None else now, s.prompt_tokens_total,
                         s.generation_tokens_total, s.prefix_cache_hit_tokens_total,
                         s.num_requests_running, s.num_requests_waiting, s.kv_cache_usage_perc)


def stats_line(prev: StatsSnapshot, cur: StatsSnapshot) -> str | None:
    """The line for the interval from prev to cur; None when the server was idle all along."""
    prompt = cur.prompt_tokens - prev.prompt_tokens
    generated = cur.generation_tokens - prev.generation_tokens
    if not (prompt or generated or cur.running or cur.waiting):
        return None
    seconds = max(cur.time - prev.time, 1e-9)
    hits = cur.prefix_hit_tokens - prev.prefix_hit_tokens
    hit_rate = 100.0 * min(hits / prompt, 1.0) if prompt > 0 else 0.0
    return (f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s, "
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s, "
            f"Running: {cur.running} reqs, Waiting: {cur.waiting} reqs, "
            f"KV cache usage: {100.0 * cur.kv_usage:.1f}%, Prefix cache hit rate: {hit_rate:.1f}%")


async def log_stats(engine: Any, interval: float = STATS_INTERVAL_S) -> None:
    """Log a stats line every `interval` seconds the server was busy; runs until cancelled."""
    prev = snapshot(engine)
    while True:
        await asyncio.sleep(interval)
        cur = snapshot(engine)
        line = stats_line(prev, cur)
        if line is not None:
            log.info("%s", line)
        prev = cur
