"""Engine counters and latency histograms, read by /metrics and `vt bench`."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass
class Histogram:
    """Cumulative-on-read Prometheus histogram: per-bucket counts, sum and count."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, cumulative count) pairs, the last bound being +inf."""
        out, run = [], 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts):
            run += c
            out.append((bound, run))
        return out


@dataclass
class EngineStats:
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_hit_tokens_total: int = 0
    prefix_cache_queries_total: int = 0       # tokens of admitted requests looked up in the cache
    request_success_total: Counter = field(default_factory=Counter)  # by finish reason
    steps_total: int = 0
    step_time_seconds_total: float = 0.0      # launch-to-completion time of steps
    gpu_idle_seconds_total: float = 0.0       # gaps with no step in flight while work existed
    time_to_first_token_seconds: Histogram = field(default_factory=Histogram)
    inter_token_latency_seconds: Histogram = field(default_factory=Histogram)
    e2e_request_latency_seconds: Histogram = field(default_factory=Histogram)
    # KV cache configuration, fixed at start (exported as vLLM's cache_config_info)
    block_size: int = 0
    num_gpu_blocks: int = 0
    enable_prefix_caching: bool = True
