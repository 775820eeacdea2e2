"""The bench scripts' one way to time a captured CUDA graph: event-timed replays on a stream, the
median of each replay's time divided by the calls the graph holds."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any


def median_per_call(stream: Any, replay: Callable[[], None], calls: int, replays: int) -> float:
    """Median seconds of one of the `calls` calls a graph holds, over `replays` runs of replay()
    (which launches the graph on `stream`) between two events recorded on that stream."""
    import cupy

    times = []
    for _ in range(replays):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        replay()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3 / calls)
    return statistics.median(times)
