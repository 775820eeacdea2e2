"""Failed steps: whose fault a failure was, and when the device counts as unusable.

A step that fails fails its requests at once (the engine ends them with the error). Whether the
engine is at fault is for a probe step to say (vt/engine/probe.py), run alone once nothing else is
in flight; new steps wait for it. A probe that runs clears the failure: it belonged to the failed
step's requests. MAX_CONSECUTIVE_FAILURES failures in a row, each a failed step whose probe failed
too or could not run, mark the engine dead; any step that runs resets the count.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from vt.engine.probe import ProbeUnavailable, run_probe

if TYPE_CHECKING:
    from vt.runner.runner import ModelRunner
    from vt.sched.kv_cache import BlockPool

log = logging.getLogger("vt.engine")
MAX_CONSECUTIVE_FAILURES = 3


class StepFailures:
    """The failure a probe step has yet to explain, the failures in a row, and why the engine
    stopped once it has. Steps launch only while no failure is unexplained and the engine lives."""

    def __init__(self) -> None:
        self.suspect: BaseException | None = None  # a step failed: a probe step tells whose fault
        self.consecutive = 0
        self.dead: str | None = None  # why the engine stopped after an error

    @property
    def may_launch(self) -> bool:
        return self.dead is None and self.suspect is None

    @property
    def probe_due(self) -> bool:
        """A failure waits for a probe step (which runs once nothing else is in flight)."""
        return self.suspect is not None and self.dead is None

    def step_ran(self) -> None:
        self.consecutive = 0

    def step_failed(self, exc: BaseException) -> None:
        if self.suspect is None:
            self.suspect = exc

    async def probe(self, runner: ModelRunner, pool: BlockPool) -> BaseException | None:
        """Run a probe step alone: if it runs, the failure belonged to the failed step's requests
        and does not count. Returns the error the engine dies of once MAX_CONSECUTIVE_FAILURES
        are counted in a row, else None (after a pause that grows with the count)."""
        err = await run_probe(runner, pool)
        if isinstance(err, ProbeUnavailable):
            # Every block is held (their owners' next steps will tell): count the failure
            # unexplained and go on, so those owners can run and free blocks.
            err, self.suspect = self.suspect, None
            self.consecutive += 1
            return err if self.consecutive >= MAX_CONSECUTIVE_FAILURES else None
        if err is None:
            log.warning("a step failed (%s: %s) but a probe step ran: the device is fine",
                        type(self.suspect).__name__, self.suspect)
            self.suspect = None
            self.consecutive = 0
            return None
        self.consecutive += 1
        log.error("probe step %d failed: %s: %s", self.consecutive, type(err).__name__, err)
        if self.consecutive >= MAX_CONSECUTIVE_FAILURES:
            self.suspect = None
            return err
        await asyncio.sleep(0.05 * self.consecutive)
        return None

    def mark_dead(self, exc: BaseException) -> str:
        """Record why the engine stopped; the message every open request ends with."""
        self.dead = f"{type(exc).__name__}: {exc}"
        log.error("engine marked dead: %s", self.dead)
        return f"the engine stopped after an error: {self.dead}"
