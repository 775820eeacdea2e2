"""What the scheduler hands the runner each step: requests, token counts and block ids only."""

from __future__ import annotations

from dataclasses import dataclass

from vt.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """Sent when a request (re)enters the running set, so the runner can build its sampler row."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]   # outputs so far (non-empty after a preemption)
    params: SamplingParams


# Made per sequence per step: a plain slotted class, as a frozen one costs ~5x more to build.
@dataclass(slots=True)
class ScheduledSeq:
    request_id: str
    start_pos: int                 # num_computed_tokens before this step
    num_tokens: int                # new tokens computed this step
    token_ids: tuple[int, ...]     # the new tokens; empty when input_in_flight
    input_in_flight: bool                # a decode whose input is the token the previous step samples
    block_ids: tuple[int, ...]     # the request's whole block table
    sample: bool                   # this step reaches the request's end: sample its next token
    output_index: int              # index of the output token sampled here (rng offset, min_tokens)
    new: NewRequestData | None     # set on (re)admission


@dataclass(frozen=True)
class ScheduledBatch:
    seqs: tuple[ScheduledSeq, ...]
    released: tuple[str, ...]      # left the running set since the last batch; the runner handles
                                   # these before this batch's `new` entries
    num_tokens: int

    @property
    def empty(self) -> bool:
        return not self.seqs
