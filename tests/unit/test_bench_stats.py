"""vt.bench.stats on a hand-made set of recorded requests whose figures are worked out by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vt.bench.stats import (
    RequestRecord,
    e2els,
    gpu_stats,
    itls,
    peak_concurrency,
    peak_output_throughput,
    percentile,
    summarize,
    throughput_over_time,
    tpots,
    ttfts,
)


def rec(index: int, start: float, chunks: list[float], end: float, out: int, *, inp: int = 10,
        ok: bool = True, error: str = "") -> RequestRecord:
    return RequestRecord(index=index, input_tokens=inp, start=start,
                         first_token=chunks[0] if chunks else None, chunk_times=list(chunks), end=end,
                         output_tokens=out, success=ok, error=error)


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        # A: TTFT 0.1, latency 0.5, 5 tokens -> TPOT 0.4 / 4 = 0.1; gaps 0.1, 0.1, 0.1, 0.1
        rec(0, 0.0, [0.1, 0.2, 0.3, 0.4, 0.5], 0.5, 5),
        # B: TTFT 0.2, latency 0.8, 3 tokens in 2 chunks -> TPOT 0.6 / 2 = 0.3; gap 0.6
        rec(1, 0.2, [0.4, 1.0], 1.0, 3, inp=20),
        # C: one output token: no TPOT, no gap
        rec(2, 0.3, [0.6], 0.6, 1),
        # D: failed; must not enter any latency figure but must be counted
        rec(3, 0.1, [], 0.15, 0, ok=False, error="HTTP 503: queue full"),
        rec(4, 0.1, [], 0.12, 0, ok=False, error="HTTP 503: queue full"),
        rec(5, 0.9, [], 0.95, 0, ok=False, error="ConnectionResetError: reset"),
    ]


@pytest.mark.parametrize("q", [0, 10, 33.3, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q: float) -> None:
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_by_hand() -> None:
    assert percentile([10.0, 20.0, 30.0, 40.0], 50) == pytest.approx(25.0)
    assert percentile([10.0, 20.0, 30.0, 40.0], 90) == pytest.approx(37.0)
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40), st.floats(0, 100))
def test_percentile_property(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


def test_ttft_and_e2el_skip_failures(records: list[RequestRecord]) -> None:
    assert ttfts(records) == pytest.approx([0.1, 0.2, 0.3])
    assert e2els(records) == pytest.approx([0.5, 0.8, 0.3])


def test_tpot_excludes_first_token_and_single_token_requests(records: list[RequestRecord]) -> None:
    assert tpots(records) == pytest.approx([0.1, 0.3])


def test_itl_pools_every_gap_over_all_requests(records: list[RequestRecord]) -> None:
    assert sorted(itls(records)) == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.6])


def test_summary_figures(records: list[RequestRecord]) -> None:
    s = summarize(records, duration_s=2.0)
    assert (s.successful_requests, s.failed_requests) == (3, 3)
    assert s.total_input_tokens == 40  # failed requests' prompts are not counted as processed
    assert s.total_output_tokens == 9
    assert s.request_throughput == pytest.approx(1.5)
    assert s.output_throughput == pytest.approx(4.5)
    assert s.total_token_throughput == pytest.approx(24.5)
    assert s.ttft.mean_ms == pytest.approx(200.0)
    assert s.ttft.median_ms == pytest.approx(200.0)
    assert s.ttft.p90_ms == pytest.approx(280.0)
    assert s.tpot.mean_ms == pytest.approx(200.0)
    assert s.tpot.count == 2
    assert s.itl.median_ms == pytest.approx(100.0)
    assert s.itl.p99_ms == pytest.approx(100.0 + 0.96 * 500.0)
    assert s.e2el.p99_ms == pytest.approx(500.0 + 0.98 * 300.0)  # sorted 300, 500, 800
    assert s.errors == {"HTTP 503: queue full": 2, "ConnectionResetError: reset": 1}
    assert s.goodput is None
    assert s.gpu is None
    figures = s.figures()
    assert figures["failed_requests"] == 3
    assert figures["tpot_p90_ms"] == pytest.approx(s.tpot.p90_ms)


def test_peak_output_throughput_sliding_window(records: list[RequestRecord]) -> None:
    # token times: A 0.1..0.5 (5), B 0.4 and 1.0 x2 (its 3 tokens came in 2 chunks), C 0.6
    # a 1.2 s window holds all 9 tokens; the best 0.45 s window, (0.05, 0.5] or (0.15, 0.6], holds 6
    assert peak_output_throughput(records, 1.2) == pytest.approx(9 / 1.2)
    assert peak_output_throughput(records, 0.45) == pytest.approx(6 / 0.45)
    assert peak_output_throughput(records, 0.05) == pytest.approx(2 / 0.05)  # 0.4 twice, 1.0 twice


def test_peak_window_shrinks_to_short_runs() -> None:
    fast = [rec(i, 0.0, [0.01, 0.02], 0.02, 2) for i in range(4)]
    s = summarize(fast, duration_s=0.02)
    assert s.peak_output_throughput == pytest.approx(s.output_throughput)


def test_token_times_put_unknown_tokens_on_last_chunk() -> None:
    r = rec(0, 0.0, [0.1, 0.3], 0.3, 4)
    assert r.token_times() == [0.1, 0.3, 0.3, 0.3]
    assert rec(0, 0.0, [0.1, 0.2, 0.3], 0.3, 2).token_times() == [0.1, 0.2]


def test_peak_concurrency(records: list[RequestRecord]) -> None:
    # at t=0.3: A (0-0.5), B (0.2-1.0), C (0.3-0.6) in flight; D and E ended at 0.15 / 0.12
    assert peak_concurrency(records) == 3
    back_to_back = [rec(0, 0.0, [0.5], 1.0, 1), rec(1, 1.0, [1.5], 2.0, 1)]
    assert peak_concurrency(back_to_back) == 1
    overlapping = [rec(0, 0.0, [0.5], 1.0, 1), rec(1, 0.0, [1.5], 2.0, 1), rec(2, 0.5, [0.6], 0.7, 1)]
    assert peak_concurrency(overlapping) == 3


def test_goodput_counts_requests_meeting_every_slo(records: list[RequestRecord]) -> None:
    # TTFTs 100, 200, 300 ms; TPOTs 100, 300, n/a; E2ELs 500, 800, 300
    assert summarize(records, 2.0, {"ttft": 250.0}).goodput == pytest.approx(2 / 2.0)
    # C has no TPOT (one token) and still meets a TPOT bound
    assert summarize(records, 2.0, {"tpot": 150.0}).goodput == pytest.approx(2 / 2.0)
    assert summarize(records, 2.0, {"ttft": 250.0, "tpot": 150.0}).goodput == pytest.approx(1 / 2.0)
    assert summarize(records, 2.0, {"e2el": 400.0}).goodput == pytest.approx(1 / 2.0)
    assert summarize(records, 2.0, {"ttft": 1.0}).goodput == 0.0


def test_summarize_validates() -> None:
    with pytest.raises(ValueError, match="duration"):
        summarize([], 0.0)
    with pytest.raises(ValueError, match="unknown SLO"):
        summarize([], 1.0, {"itl": 5.0})


def test_all_failed_gives_empty_latencies() -> None:
    s = summarize([rec(0, 0.0, [], 0.1, 0, ok=False, error="boom")], 1.0)
    assert s.successful_requests == 0 and s.failed_requests == 1
    assert s.ttft.mean_ms is None and s.itl.p99_ms is None
    assert s.errors == {"boom": 1}


def test_gpu_stats_differences_counters() -> None:
    before = {"vt:steps_total": 10.0, "vt:step_time_seconds_total": 0.5, "vt:gpu_idle_seconds_total": 0.1}
    after = {"vt:steps_total": 110.0, "vt:step_time_seconds_total": 1.5, "vt:gpu_idle_seconds_total": 0.6}
    g = gpu_stats(before, after, duration_s=2.0)
    assert g is not None
    assert g.steps == 100
    assert g.mean_step_time_ms == pytest.approx(10.0)
    assert g.gpu_idle_fraction == pytest.approx(0.25)
    assert gpu_stats({}, after, 2.0) is None


def test_throughput_over_time_buckets(records: list[RequestRecord]) -> None:
    series = throughput_over_time(records, 0.5)
    # buckets [0, 0.5): 0.1 0.2 0.3 0.4 0.4 -> 5; [0.5, 1.0): 0.5 0.6 -> 2; [1.0, 1.5): 1.0 1.0 -> 2
    assert series == [(0.0, 10.0), (0.5, 4.0), (1.0, 4.0)]


def test_gpu_stats_leave_what_the_server_does_not_count_unmeasured() -> None:
    # a server with step counters but no idle counter; and one with none of vt's counters (vLLM's)
    before = {"vt:steps_total": 1.0, "vt:step_time_seconds_total": 0.1}
    after = {"vt:steps_total": 11.0, "vt:step_time_seconds_total": 1.1}
    g = gpu_stats(before, after, duration_s=2.0)
    assert g is not None and g.steps == 10 and g.mean_step_time_ms == pytest.approx(100.0)
    assert g.gpu_idle_seconds is None and g.gpu_idle_fraction is None
    vllm = {"vllm:num_requests_running": 0.0, "vllm:generation_tokens_total": 50.0}
    assert gpu_stats(vllm, vllm, 2.0) is None


def test_latency_stats_std_and_asked_for_percentiles() -> None:
    s = summarize([rec(i, 0.0, [t], t, 1) for i, t in enumerate((0.1, 0.2, 0.3, 0.4))], 1.0,
                  percentiles=(25, 99.9))
    # TTFTs 100, 200, 300, 400 ms: population std sqrt(12500); P25 at rank 0.75 -> 175
    assert s.ttft.std_ms == pytest.approx(12500 ** 0.5)
    assert s.ttft.percentiles_ms == pytest.approx({"25": 175.0, "99.9": 300.0 + 0.997 * 100.0})
    assert summarize([], 1.0, percentiles=(50,)).ttft.percentiles_ms == {}
