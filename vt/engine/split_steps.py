"""Split steps, an experiment off by default: a mixed step launched as its decodes, then its
prompt rows beside them on the device, each with its GEMMs held to a share of the SMs.

The decodes' attention then hides beside the prompt rows' GEMMs. Only with SPLIT_MIN_DECODES
decodes or more: the decodes' step reads every weight again, which that attention must outweigh.
A step with a guided row is never split. On numpy the tokens are the mixed step's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

from vt.sched.output import ScheduledBatch

SPLIT_MIN_DECODES = 32  # the fewest decodes a mixed step is split for


class StepPart(NamedTuple):
    """One launch of a scheduled step (ModelRunner.execute's arguments)."""

    batch: ScheduledBatch
    parallel_to_previous: bool  # runs beside the part launched before it
    gemm_sms: int               # the SMs its GEMMs are held to (0: all of them)


def split_decode_sms(configured: int | None) -> int:
    """The decodes' share of SMs (0: steps are never split): the configured value, else
    VT_SPLIT_DECODE_SMS."""
    sms = configured
    if sms is None:
        text = os.environ.get("VT_SPLIT_DECODE_SMS", "0") or "0"
        if not text.isdigit():
            raise ValueError(f"VT_SPLIT_DECODE_SMS must be a number of SMs (0: off), got {text!r}")
        sms = int(text)
    if sms < 0:
        raise ValueError(f"split_decode_sms must be >= 0, got {sms}")
    return sms


def split_mixed_step(batch: ScheduledBatch, decode_sms: int, num_sms: Callable[[], int],
                     is_guided: Callable[[str], bool]) -> tuple[StepPart, StepPart] | None:
    """The decodes with their GEMMs on `decode_sms` SMs, then the prompt rows beside them on the
    rest; None (launch the step whole) unless it mixes SPLIT_MIN_DECODES decodes or more with
    prompt rows and has no guided row. Both parts need a free slot."""
    decodes = tuple(s for s in batch.seqs if s.num_tokens == 1)
    prompts = tuple(s for s in batch.seqs if s.num_tokens > 1)
    if len(decodes) < SPLIT_MIN_DECODES or not prompts or any(is_guided(s.request_id) for s in batch.seqs):
        return None
    rest = max(num_sms() - decode_sms, 0)
    return (StepPart(ScheduledBatch(decodes, batch.released, len(decodes)), False, decode_sms),
            StepPart(ScheduledBatch(prompts, (), batch.num_tokens - len(decodes)), True, rest))
