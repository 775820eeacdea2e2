"""When each request of a run is sent, as `vllm bench serve` schedules them (serve.py get_request).

With a finite rate R and burstiness b, the gaps between arrivals are gamma-distributed with shape b
and scale 1 / (R * b): mean 1 / R, Poisson arrivals at b = 1, burstier below, more even above,
evenly spaced at b = inf. Like vLLM, the first request also waits one gap, and the send times are
then scaled so the last one falls at exactly N / R: the run's offered rate is R whatever the draws.
The gaps come from numpy's legacy RandomState(seed), the generator vLLM seeds with np.random.seed,
so the same seed gives vLLM's schedule.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_delays(n: int, rate: float, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send offsets (s) from the start of the run for n requests; all zero for rate inf."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = [1.0 / rate] * n
    else:
        rng = np.random.RandomState(seed)
        scale = 1.0 / (rate * burstiness)
        gaps = [float(rng.gamma(shape=burstiness, scale=scale)) for _ in range(n)]  # one at a time, as vLLM
    out, t = [], 0.0
    for gap in gaps:
        t += gap
        out.append(t)
    if out and out[-1] > 0:
        factor = (n / rate) / out[-1]
        out = [x * factor for x in out]
    return out
