"""A device step's completion is seen when its own slot's work ends.

At depth 2 a step with guided rows is waited for only once its masks are in, after the next
step (on the other slot) was launched and waited for. Were both waits on one thread, the first
step's tokens would come only when the second step ended: a step late, with the device idle
while they are processed.
"""

from __future__ import annotations

import concurrent.futures
import threading
from types import SimpleNamespace

import pytest

from vt.runner.runner import ModelRunner, slot_waiters


def test_a_slot_completes_while_the_other_slot_still_runs() -> None:
    runner = ModelRunner.__new__(ModelRunner)  # only the wait path: no model
    running = [threading.Event(), threading.Event()]
    runner.ops = SimpleNamespace(wait=lambda i: running[i].wait(10))
    runner.waiters = slot_waiters(2)
    try:
        next_step = runner._completion(1)  # queued at its launch
        deferred = runner._completion(0)  # queued once the masks were in
        running[0].set()
        deferred.result(timeout=2)  # would time out behind slot 1 on a shared thread
        assert not next_step.done()
        running[1].set()
        assert next_step.result(timeout=2) >= deferred.result()
    finally:
        for e in running:
            e.set()
        for w in runner.waiters:
            w.shutdown(wait=True)


def test_one_slot_completes_in_launch_order() -> None:
    runner = ModelRunner.__new__(ModelRunner)
    order: list[int] = []
    gate = threading.Event()

    def wait(i: int) -> None:
        gate.wait(10)
        order.append(i)

    runner.ops = SimpleNamespace(wait=wait)
    runner.waiters = slot_waiters(1)
    try:
        futures = [runner._completion(0) for _ in range(3)]
        with pytest.raises(concurrent.futures.TimeoutError):
            futures[0].result(timeout=0.05)
        gate.set()
        done = [f.result(timeout=2) for f in futures]
        assert done == sorted(done) and order == [0, 0, 0]
    finally:
        gate.set()
        runner.waiters[0].shutdown(wait=True)
