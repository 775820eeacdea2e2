"""`--step-trace FILE`: one JSON line per completed step, for finding where serving time goes.

A line holds the step's id, its launch and completion times (monotonic seconds, the engine's
clock), its device time as the engine counts it (from launch, or from the previous step's
completion when that came later), and what it computed: sequences, tokens, decodes (sequences
with one new token whose input comes from a previous step), prompt tokens and the largest
context. Lines are buffered by the file object and flushed on close; the trace costs a dict and
a write per step on the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO

from vt.sched.output import ScheduledBatch


@dataclass(frozen=True)
class StepShape:
    """What one step computes, taken at its launch."""

    seqs: int
    tokens: int
    decodes: int
    prompt_tokens: int
    max_context: int

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepShape:
        decodes = sum(1 for s in batch.seqs if s.input_in_flight or (s.num_tokens == 1 and s.new is None))
        tokens = batch.num_tokens
        return cls(seqs=len(batch.seqs), tokens=tokens, decodes=decodes, prompt_tokens=tokens - decodes,
                   max_context=max((s.start_pos + s.num_tokens for s in batch.seqs), default=0))


class StepTrace:
    """Writes StepShape and timing of each completed step to `path` as JSON lines."""

    def __init__(self, path: str) -> None:
        self._file: IO[str] | None = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._shapes: dict[int, StepShape] = {}

    def launched(self, step_id: int, batch: ScheduledBatch) -> None:
        self._shapes[step_id] = StepShape.of(batch)

    def done(self, step_id: int, launch: float, start: float, end: float) -> None:
        shape = self._shapes.pop(step_id, None)
        if self._file is None or shape is None:
            return
        line = {"step": step_id, "launch": round(launch, 6), "start": round(start, 6), "end": round(end, 6),
                "device_ms": round(1000.0 * (end - start), 3), **shape.__dict__}
        self._file.write(json.dumps(line) + "\n")

    def dropped(self, step_id: int) -> None:
        """A step that failed: no line."""
        self._shapes.pop(step_id, None)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
