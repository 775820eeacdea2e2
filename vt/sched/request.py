"""A request as the scheduler sees it: token ids, counts, blocks and a status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vt.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """Invariants: num_computed_tokens <= num_tokens + num_pending; num_pending counts tokens
    sampled by steps still in flight (at most one per step, so at most 2 at depth 2);
    len(output_token_ids) + num_pending <= max_tokens."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float                      # monotonic time of arrival
    seq: int = 0                        # arrival counter, breaks arrival ties
    priority: int = 0                   # lower runs first (priority policy)
    cache_salt: str | None = None       # prefix-cache hits only among requests with the same salt
    max_tokens: int = 16                # resolved by the engine (params or max_model_len - prompt)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0        # tokens whose KV is written or scheduled to be
    num_pending: int = 0                # sampled in a step in flight, not yet appended
    paused: bool = False                # its reader is behind: keep its blocks, schedule nothing
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0          # prefix-cache hit length at the last admission
    num_preemptions: int = 0
    needs_row: bool = True              # the runner must (re)build this request's sampler row
    next_full_at: int = 0               # known-and-computed tokens at which the next block to
                                        # register fills up (0: not tracked, check now)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt + appended outputs."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_planned(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def sort_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival, self.seq)
