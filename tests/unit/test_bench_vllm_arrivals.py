"""`vt bench`'s arrival schedule, as `vllm bench serve` draws it: gamma-distributed gaps of shape
--burstiness and mean 1 / --request-rate, the last arrival scaled to fall at N / rate."""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from vt.bench.arrivals import arrival_delays


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip([0.0, *times], times)]


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_delays(5, float("inf"), 0, burstiness=0.3) == [0.0] * 5


def test_infinite_burstiness_spaces_arrivals_evenly() -> None:
    assert arrival_delays(4, 2.0, 0, burstiness=float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])


@pytest.mark.parametrize("burstiness", [0.2, 1.0, 5.0])
def test_the_last_arrival_is_at_n_over_rate(burstiness: float) -> None:
    times = arrival_delays(50, 10.0, 3, burstiness)
    assert times[-1] == pytest.approx(5.0)
    assert times == sorted(times) and times[0] > 0  # the first request waits one gap too, as in vLLM


def test_same_seed_same_schedule_as_vllm() -> None:
    """vLLM: np.random.seed(seed); a gamma(shape=b, scale=1/(rate*b)) draw per request; the running
    sum scaled so the last one is N / rate."""
    n, rate, b, seed = 20, 4.0, 0.5, 11
    saved = np.random.get_state()
    try:
        np.random.seed(seed)
        cumulative = np.cumsum([np.random.gamma(shape=b, scale=1.0 / (rate * b)) for _ in range(n)])
    finally:
        np.random.set_state(saved)
    want = cumulative * ((n / rate) / cumulative[-1])
    assert arrival_delays(n, rate, seed, b) == pytest.approx(want.tolist())
    assert arrival_delays(n, rate, seed + 1, b) != pytest.approx(want.tolist())


@pytest.mark.parametrize(("burstiness", "cv"), [(0.25, 2.0), (1.0, 1.0), (4.0, 0.5)])
def test_burstiness_sets_how_uneven_the_gaps_are(burstiness: float, cv: float) -> None:
    # a gamma of shape b has coefficient of variation 1 / sqrt(b): burstier below 1, evener above
    g = gaps(arrival_delays(20000, 100.0, 0, burstiness))
    assert statistics.fmean(g) == pytest.approx(0.01, rel=1e-6)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(cv, rel=0.05)


def test_burstiness_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        arrival_delays(3, 1.0, 0, burstiness=0.0)
