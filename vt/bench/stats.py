"""Pure statistics for `vt bench`: latency and throughput figures from recorded request timestamps.

Times in a RequestRecord are seconds from the start of the run; figures are reported in ms (latencies)
and per second (throughputs). Nothing here does I/O.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

SLO_KEYS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's --percentile-metrics names for them
PEAK_WINDOW_S = 1.0  # peak throughput window; a shorter run uses its whole duration instead
ERROR_TEXT_LIMIT = 200  # long error bodies are cut so that equal causes group together


@dataclass
class RequestRecord:
    """One benchmark request as the client saw it."""

    index: int                      # prompt index in the dataset (same index = same prompt across runs)
    input_tokens: int
    priority: int | None = None
    start: float = 0.0              # request sent
    first_token: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # every streamed chunk carrying output
    end: float = 0.0                # stream finished (or failed)
    output_tokens: int = 0          # from the final usage chunk
    success: bool = False
    error: str = ""
    text: str = ""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.start

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """(latency - TTFT) / (output tokens - 1); undefined with fewer than 2 output tokens."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """Gaps between consecutive chunks (a chunk may carry several tokens)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    def token_times(self) -> list[float]:
        """When each output token arrived: one token per chunk, the remainder on the last chunk.

        The stream does not say how many tokens a chunk holds (the detokenizer may hold back partial
        characters), so this puts the unknown ones as late as possible.
        """
        n = self.output_tokens
        if n <= 0:
            return []
        if not self.chunk_times:
            return [self.end] * n
        times = self.chunk_times[:n]
        return times + [times[-1]] * (n - len(times))


@dataclass
class LatencyStats:
    """Mean, median, P90, P99 and standard deviation in ms, and any other asked-for percentiles
    (`percentiles_ms`, keyed as vLLM names them: "99", "99.9"); all None when there is no sample."""

    mean_ms: float | None = None
    median_ms: float | None = None
    p90_ms: float | None = None
    p99_ms: float | None = None
    count: int = 0
    std_ms: float | None = None     # population standard deviation, as numpy's (and vLLM's) np.std
    percentiles_ms: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of_seconds(cls, values: Sequence[float], percentiles: Sequence[float] = ()) -> LatencyStats:
        if not values:
            return cls()
        ms = [v * 1000.0 for v in values]
        mean = sum(ms) / len(ms)
        return cls(mean_ms=mean, median_ms=percentile(ms, 50), p90_ms=percentile(ms, 90),
                   p99_ms=percentile(ms, 99), count=len(ms),
                   std_ms=math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),
                   percentiles_ms={percentile_word(q): percentile(ms, q) for q in percentiles})


@dataclass
class GpuStats:
    """Server-side step counters over the run (from /metrics, read before and after); a figure is
    None where the server does not expose its counter."""

    steps: int | None
    mean_step_time_ms: float | None
    gpu_idle_seconds: float | None
    gpu_idle_fraction: float | None


@dataclass
class BenchSummary:
    successful_requests: int
    failed_requests: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    peak_output_throughput: float
    peak_concurrent_requests: int
    total_token_throughput: float
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    goodput: float | None = None               # req/s meeting every SLO; None without --goodput
    goodput_slo_ms: dict[str, float] | None = None
    errors: dict[str, int] = field(default_factory=dict)  # error text -> count
    gpu: GpuStats | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def figures(self) -> dict[str, float | None]:
        """Every scalar figure under a flat name, for JSON and side-by-side comparison."""
        out: dict[str, float | None] = {
            "successful_requests": self.successful_requests,
            "failed_requests": self.failed_requests,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "peak_output_throughput": self.peak_output_throughput,
            "peak_concurrent_requests": self.peak_concurrent_requests,
            "total_token_throughput": self.total_token_throughput,
        }
        for name in ("ttft", "tpot", "itl", "e2el"):
            stats: LatencyStats = getattr(self, name)
            for part in ("mean", "median", "p90", "p99"):
                out[f"{name}_{part}_ms"] = getattr(stats, f"{part}_ms")
        out["request_goodput"] = self.goodput
        g = self.gpu
        out["gpu_steps"] = None if g is None else g.steps
        out["mean_step_time_ms"] = None if g is None else g.mean_step_time_ms
        out["gpu_idle_fraction"] = None if g is None else g.gpu_idle_fraction
        return out


def percentile_word(q: float) -> str:
    """A percentile as vLLM writes it in a figure's name: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(q)) if int(q) == q else str(q)


def percentile(values: Sequence[float], q: float) -> float:
    """q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _ok(records: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.success]


def ttfts(records: Iterable[RequestRecord]) -> list[float]:
    return [r.ttft for r in _ok(records) if r.ttft is not None]


def tpots(records: Iterable[RequestRecord]) -> list[float]:
    return [r.tpot for r in _ok(records) if r.tpot is not None]


def itls(records: Iterable[RequestRecord]) -> list[float]:
    """Every gap between consecutive chunks, pooled over all successful requests."""
    return [gap for r in _ok(records) for gap in r.itls()]


def e2els(records: Iterable[RequestRecord]) -> list[float]:
    return [r.latency for r in _ok(records)]


def peak_output_throughput(records: Iterable[RequestRecord], window_s: float = 1.0) -> float:
    """Most output tokens that arrived within any window of `window_s` seconds, per second."""
    times = sorted(t for r in _ok(records) for t in r.token_times())
    best, lo = 0, 0
    for hi, t in enumerate(times):  # sliding window [t - window, t]
        while times[lo] <= t - window_s:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window_s


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Most requests in flight at once (failed ones included: they held a slot too)."""
    events = []
    for r in records:
        events.append((r.start, 1))
        events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # an end at the same instant as a start comes first
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def meets_slo(r: RequestRecord, slo_ms: dict[str, float]) -> bool:
    """A successful request meets the SLO if each given bound holds (TPOT is vacuous for 1 token)."""
    if not r.success:
        return False
    got = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
    for key, bound in slo_ms.items():
        value = got[key]
        if value is None:
            if key == "tpot":
                continue
            return False
        if value * 1000.0 > bound:
            return False
    return True


def error_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    c = Counter((r.error or "unknown error")[:ERROR_TEXT_LIMIT] for r in records if not r.success)
    return dict(c.most_common())


def gpu_stats(before: dict[str, float], after: dict[str, float], duration_s: float) -> GpuStats | None:
    """Step counters differenced over the run; None if the server exposes none of them (a figure
    whose counter is missing stays None: it was not measured, not zero)."""
    def delta(name: str) -> float | None:
        return after[name] - before[name] if name in before and name in after else None

    steps_d, step_time, idle = (delta(n) for n in ("vt:steps_total", "vt:step_time_seconds_total",
                                                   "vt:gpu_idle_seconds_total"))
    if steps_d is None and step_time is None and idle is None:
        return None
    steps = None if steps_d is None else int(round(steps_d))
    mean_step = step_time / steps * 1000.0 if step_time is not None and steps else None
    fraction = idle / duration_s if idle is not None and duration_s > 0 else None
    return GpuStats(steps=steps, mean_step_time_ms=mean_step, gpu_idle_seconds=idle,
                    gpu_idle_fraction=fraction)


def summarize(records: Sequence[RequestRecord], duration_s: float,
              goodput_slo_ms: dict[str, float] | None = None,
              gpu: GpuStats | None = None, percentiles: Sequence[float] = ()) -> BenchSummary:
    """All figures of one run. `duration_s` is the wall time from the first send to the last end;
    `percentiles` are computed for every latency figure besides P90 and P99."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    if goodput_slo_ms:
        unknown = set(goodput_slo_ms) - set(SLO_KEYS)
        if unknown:
            raise ValueError(f"unknown SLO {sorted(unknown)}; use {', '.join(SLO_KEYS)}")
    ok = _ok(records)
    total_in = sum(r.input_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    goodput = None
    if goodput_slo_ms:
        goodput = sum(meets_slo(r, goodput_slo_ms) for r in ok) / duration_s
    return BenchSummary(
        successful_requests=len(ok), failed_requests=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s, output_throughput=total_out / duration_s,
        peak_output_throughput=peak_output_throughput(ok, min(PEAK_WINDOW_S, duration_s)),
        peak_concurrent_requests=peak_concurrency(records),
        total_token_throughput=(total_in + total_out) / duration_s,
        ttft=LatencyStats.of_seconds(ttfts(ok), percentiles),
        tpot=LatencyStats.of_seconds(tpots(ok), percentiles),
        itl=LatencyStats.of_seconds(itls(ok), percentiles),
        e2el=LatencyStats.of_seconds(e2els(ok), percentiles),
        goodput=goodput, goodput_slo_ms=dict(goodput_slo_ms) if goodput_slo_ms else None,
        errors=error_counts(records), gpu=gpu,
    )


def throughput_over_time(records: Iterable[RequestRecord],
                         bucket_s: float = 1.0) -> list[tuple[float, float]]:
    """(bucket start, output tokens/s in that bucket) from the run start to the last token."""
    times = [t for r in _ok(records) for t in r.token_times()]
    if not times:
        return []
    n = int(max(times) // bucket_s) + 1
    counts = [0] * n
    for t in times:
        counts[max(0, int(t // bucket_s))] += 1
    return [(i * bucket_s, c / bucket_s) for i, c in enumerate(counts)]
