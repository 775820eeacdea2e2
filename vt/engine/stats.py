"""Engine counters and latency histograms, read by /metrics and `vt bench`."""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                   2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's buckets for the families its Grafana dashboard reads, so its panels and alerts carry over:
# a request's phases (queue, prefill, decode, inference) in seconds, the tokens of one engine step
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                           60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MAX_MODEL_LEN = 1 << 20  # bounds the token-count buckets of stats made without an engine


def token_count_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets for per-request token counts: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


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


def _request_latency() -> Histogram:
    return Histogram(REQUEST_LATENCY_BUCKETS)


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
    # A finished request's phases, as vLLM splits them: queue (arrival to first scheduled),
    # prefill (first scheduled to first token), decode (first to last token), inference (first
    # scheduled to last token)
    request_queue_time_seconds: Histogram = field(default_factory=_request_latency)
    request_prefill_time_seconds: Histogram = field(default_factory=_request_latency)
    request_decode_time_seconds: Histogram = field(default_factory=_request_latency)
    request_inference_time_seconds: Histogram = field(default_factory=_request_latency)
    iteration_tokens_total: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    # KV cache configuration, fixed at start (exported as vLLM's cache_config_info)
    block_size: int = 0
    num_gpu_blocks: int = 0
    enable_prefix_caching: bool = True
    max_model_len: int = 0  # bounds the per-request token histograms' buckets (0: unknown)
    request_prompt_tokens: Histogram = field(init=False)
    request_generation_tokens: Histogram = field(init=False)

    def __post_init__(self) -> None:
        buckets = token_count_buckets(self.max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.request_prompt_tokens = Histogram(buckets)
        self.request_generation_tokens = Histogram(buckets)

    def observe_finished(self, num_prompt_tokens: int, num_generation_tokens: int, arrival: float,
                         scheduled: float | None, first_token: float | None,
                         last_token: float | None) -> None:
        """A finished request's token counts and phases; a phase it never reached is not observed
        (a request aborted while waiting was never scheduled)."""
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        if scheduled is None:
            return
        self.request_queue_time_seconds.observe(max(0.0, scheduled - arrival))
        if first_token is None or last_token is None:
            return
        self.request_prefill_time_seconds.observe(max(0.0, first_token - scheduled))
        self.request_decode_time_seconds.observe(max(0.0, last_token - first_token))
        self.request_inference_time_seconds.observe(max(0.0, last_token - scheduled))
