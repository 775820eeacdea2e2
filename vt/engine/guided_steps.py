"""Guided steps at depth 2: their grammar masks, their second sampler pass, and masked steps.

A guided request's mask for step N+1 needs the token step N samples. At depth 2 a step with
guided rows is launched with its first sampler pass only (ModelRunner.execute with defer_masks),
which samples every other row, so the next step can launch behind it. Its masks fill on the
grammar thread as soon as every guide has seen its request's last token (at launch, or once the
step before is processed), and its second pass (ModelRunner.sample_deferred) samples the guided
rows with them. A guided request whose second pass is not launched when the next step is
scheduled sits that step out, so no row ever waits for a mask but its own, and the masks are the
ones depth 1 computes (docs/structured_outputs.md).

A masked step is one whose free rows were processed while its masks still filled: it keeps its
slot (the runner has three) while the next step runs, and its guided rows are processed once its
second pass is collected, oldest masked step first.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Container, Mapping, Sequence
from typing import TYPE_CHECKING

from vt.engine.request_state import RequestState
from vt.runner.runner import ModelRunner, StepHandle
from vt.structured.compiler import GrammarCompiler
from vt.structured.guide import Guide

if TYPE_CHECKING:
    import numpy as np


class GuidedSteps:
    """The mask fills of the steps in flight and the masked steps, for the engine's loop.

    `states` is the engine's map of the requests it holds and `in_flight` its steps in flight,
    oldest first: both are read here, never changed. The engine collects and processes every
    step; this class starts masks, launches second passes and keeps the masked steps in order.
    """

    def __init__(self, runner: ModelRunner, grammars: GrammarCompiler, states: Mapping[str, RequestState],
                 in_flight: Sequence[StepHandle]) -> None:
        self._runner, self._grammars = runner, grammars
        self._states, self._in_flight = states, in_flight
        # masks being filled on the grammar thread, by the step id of the step they are for
        self._fills: dict[int, concurrent.futures.Future] = {}
        # steps whose free rows are processed and whose slot is kept while their guided rows'
        # masks fill and the next steps launch; oldest first
        self.masked: collections.deque[StepHandle] = collections.deque()
        self.sat_out_total = 0  # guided requests that sat a step out waiting for their masks
        self.early_first_passes = 0  # steps whose free rows were processed while their masks filled
        self.masked_steps_total = 0  # of those, steps kept masked while later steps launched

    # ---- masks ----------------------------------------------------------------------------------
    def fill_masks(self, request_ids: Sequence[str], out: np.ndarray) -> None:
        """The runner's MaskFiller: each request's allowed tokens now (all tokens for a request
        that has finished meanwhile: its token is dropped anyway)."""
        self._grammars.fill_masks(self._guides(request_ids), out)

    def _guides(self, request_ids: Sequence[str], unguided: Container[str] = ()) -> list[Guide | None]:
        """Each request's guide; None (every token allowed) for one that is gone or in `unguided`."""
        states = self._states
        return [s.guide if (s := states.get(rid)) is not None and rid not in unguided else None
                for rid in request_ids]

    def _start_masks(self, h: StepHandle, rejected: Container[str] = ()) -> None:
        """Start filling the masks of an in-flight step on the grammar thread; every guide of its
        guided rows has seen its request's last token (a guide that rejected its token gets every
        token: that request ends and its token is dropped)."""
        rids, out = self._runner.deferred_masks(h)
        self._fills[h.step_id] = self._grammars.fill_masks_async(self._guides(rids, rejected), out)

    def _guides_current(self, h: StepHandle) -> bool:
        """Whether every guided request of h has no token in flight but h's: an earlier step's
        (a masked one's, still filling its masks) must be processed before h's masks are built."""
        states = self._states
        return all((s := states.get(rid)) is None or s.request.num_pending <= 1
                   for rid in h.pending_mask_request_ids)

    def masks_started(self, h: StepHandle) -> bool:
        return h.step_id in self._fills

    def masks_ready(self, h: StepHandle) -> bool:
        job = self._fills.get(h.step_id)
        return job is not None and job.done()

    def launched(self, h: StepHandle) -> None:
        """A step was just launched: its masks start now if its guides have seen every token."""
        if h.awaiting_masks and self._guides_current(h):
            self._start_masks(h)

    def tokens_processed(self, rejected: Container[str]) -> None:
        """Tokens were just processed: the steps whose guides have now seen every earlier token
        of their guided requests start filling their masks."""
        for h in (*self.masked, *self._in_flight):
            if h.awaiting_masks and h.step_id not in self._fills and self._guides_current(h):
                self._start_masks(h, rejected)

    def dropped(self, h: StepHandle) -> None:
        """A step failed: its masks are not wanted."""
        self._fills.pop(h.step_id, None)

    # ---- second passes --------------------------------------------------------------------------
    def launch_second_pass(self, h: StepHandle) -> None:
        """Launch a step's second sampler pass with its masks, waiting for them if they are still
        filling (and for their fill if it never started: on the mask thread all the same, after
        any fill still running for a dropped step that held the same slot's buffer)."""
        if not h.awaiting_masks:
            return
        if h.step_id not in self._fills:
            self._start_masks(h)
        job = self._fills.pop(h.step_id)
        self._runner.sample_deferred(h, lambda _rids, _out: job.result())

    async def launch_when_masked(self, h: StepHandle) -> None:
        """Launch h's second pass once its masks are filled, the loop serving HTTP (the free
        rows' chunks) meanwhile. Only for the oldest step not yet collected: every earlier token
        of its guided requests is processed, so masks it never started are started here, on the
        mask thread. A failed fill fails the step in the launch."""
        if h.awaiting_masks and h.step_id not in self._fills:
            self._start_masks(h)
        if (job := self._fills.get(h.step_id)) is not None and not job.done():
            filled = asyncio.wrap_future(job)
            await asyncio.wait([filled])
            filled.exception()  # taken here so it is not logged as lost; job.result() raises it
        self.launch_second_pass(h)

    def launch_ready_second_passes(self) -> frozenset[str]:
        """Before the next step is scheduled: launch the second pass of every step whose masks are
        filled; the guided requests of the others sit the next step out (their tokens are not on
        the device yet)."""
        sit_out: set[str] = set()
        for h in (*self.masked, *self._in_flight):
            if not h.awaiting_masks:
                continue
            if self.masks_ready(h):
                self.launch_second_pass(h)
            else:
                sit_out.update(h.pending_mask_request_ids)
        self.sat_out_total += len(sit_out)
        return frozenset(sit_out)

    # ---- masked steps ---------------------------------------------------------------------------
    def keep_masked(self, h: StepHandle) -> None:
        """h's free rows are processed and its masks still fill: it keeps its slot until its
        second pass is collected, and the next step launches meanwhile."""
        self.masked.append(h)
        self.masked_steps_total += 1

    def launch_masked_ready(self) -> None:
        """Without waiting: launch the second pass of each masked step whose masks are filled."""
        for h in self.masked:
            if h.awaiting_masks and self.masks_ready(h):
                self.launch_second_pass(h)

    def pop_done(self) -> StepHandle | None:
        """The oldest masked step if its second pass has ended (taken off the masked steps), else
        None: masked steps are processed in step order."""
        masked = self.masked
        return masked.popleft() if masked and masked[0].done() else None
