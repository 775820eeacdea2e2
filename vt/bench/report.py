"""`vt bench`'s printed results: vLLM's summary block for one run, and the async on/off table."""

from __future__ import annotations

from collections.abc import Sequence

from vt.bench.config import DEFAULT_METRIC_PERCENTILES, DEFAULT_PERCENTILE_METRICS
from vt.bench.stats import BenchSummary, LatencyStats, RequestRecord, percentile_word

LATENCY_TITLES = {"ttft": ("TTFT", "Time to First Token"),
                  "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                  "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _row(name: str, value: float | None, digits: int = 2) -> str:
    return f"{name:<40} {_fmt(value, digits)}"


def _percentile_ms(st: LatencyStats, q: float) -> float | None:
    word = percentile_word(q)
    if word in st.percentiles_ms:
        return st.percentiles_ms[word]
    return {"50": st.median_ms, "90": st.p90_ms, "99": st.p99_ms}.get(word)


def format_summary(s: BenchSummary, title: str = "Serving Benchmark Result", *,
                   metrics: Sequence[str] = DEFAULT_PERCENTILE_METRICS,
                   percentiles: Sequence[float] = DEFAULT_METRIC_PERCENTILES,
                   max_concurrency: int | None = None, request_rate: float | None = None) -> str:
    """vLLM's block. The server's step figures follow the throughputs, each only where the
    server's /metrics gave it; `metrics` and `percentiles` pick the latency sections and rows."""
    lines = [f"{' ' + title + ' ':=^50}",
             _row("Successful requests:", s.successful_requests),
             _row("Failed requests:", s.failed_requests)]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate is not None and request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", request_rate))
    lines += [_row("Benchmark duration (s):", s.duration_s),
              _row("Total input tokens:", s.total_input_tokens),
              _row("Total generated tokens:", s.total_output_tokens),
              _row("Request throughput (req/s):", s.request_throughput)]
    if s.goodput is not None:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (s.goodput_slo_ms or {}).items())
        lines.append(_row("Request goodput (req/s):", s.goodput) + f" ({slo})")
    lines += [_row("Output token throughput (tok/s):", s.output_throughput),
              _row("Peak output token throughput (tok/s):", s.peak_output_throughput),
              _row("Peak concurrent requests:", s.peak_concurrent_requests),
              _row("Total token throughput (tok/s):", s.total_token_throughput)]
    g = s.gpu
    server_rows = [] if g is None else [
        _row(name, value, digits) for name, value, digits in (
            ("Engine steps:", g.steps, 2), ("Mean step time (ms):", g.mean_step_time_ms, 3),
            ("GPU idle fraction:", g.gpu_idle_fraction, 4)) if value is not None]
    if server_rows:
        lines += [f"{'Server steps':-^50}", *server_rows]
    for key in metrics:
        short, long = LATENCY_TITLES[key]
        st: LatencyStats = getattr(s, key)
        lines.append(f"{long:-^50}")
        lines += [_row(f"Mean {short} (ms):", st.mean_ms), _row(f"Median {short} (ms):", st.median_ms)]
        lines += [_row(f"P{percentile_word(q)} {short} (ms):", _percentile_ms(st, q)) for q in percentiles]
    if s.errors:
        lines.append(f"{'Errors':-^50}")
        lines += [f"{count:>6} x {text}" for text, count in s.errors.items()]
    lines.append("=" * 50)
    return "\n".join(lines)


def mean_figures(summaries: Sequence[BenchSummary]) -> dict[str, float | None]:
    """Each figure averaged over repeats (None if any run lacks it)."""
    per_run = [s.figures() for s in summaries]
    out: dict[str, float | None] = {}
    for key in per_run[0]:
        vals = [f[key] for f in per_run]
        out[key] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    return out


def ratios(on: dict[str, float | None], off: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (on[k] / off[k] if on[k] is not None and off.get(k) not in (None, 0) else None) for k in on}


def format_comparison(on: dict[str, float | None], off: dict[str, float | None], identical: bool,
                      mismatched: int, repeats: int) -> str:
    """Both arms side by side; a figure neither arm measured (a server without step counters) is left out."""
    r = ratios(on, off)
    title = " Async scheduling: on vs off " + (f"(mean of {repeats} runs each) " if repeats > 1 else "")
    lines = [f"{title:=^78}", f"{'figure':<34} {'async on':>14} {'async off':>14} {'on/off':>12}"]
    for key in on:
        if on[key] is None and off.get(key) is None:
            continue
        lines.append(f"{key:<34} {_fmt(on[key], 3):>14} {_fmt(off.get(key), 3):>14} {_fmt(r[key], 3):>12}")
    verdict = "yes" if identical else f"NO ({mismatched} prompts differ)"
    lines += [f"{'greedy outputs identical:':<34} {verdict}", "=" * 78]
    return "\n".join(lines)


def compare_outputs(a: list[RequestRecord], b: list[RequestRecord]) -> list[int]:
    """Prompt indices whose generated texts differ (or that failed in either run)."""
    by_b = {r.index: r for r in b}
    bad = []
    for ra in a:
        rb = by_b.get(ra.index)
        if rb is None or not (ra.success and rb.success) or ra.text != rb.text:
            bad.append(ra.index)
    return bad
