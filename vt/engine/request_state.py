"""What the engine keeps for each request it holds, from add_request to its finishing output."""

from __future__ import annotations

from dataclasses import dataclass

from vt.engine.outputs import RequestStream
from vt.sched.request import Request
from vt.structured.guide import Guide
from vt.text.tokenizer import DetokStream


@dataclass
class RequestState:
    request: Request
    detok: DetokStream
    stream: RequestStream
    stop_ids: frozenset[int]
    guide: Guide | None = None  # structured outputs: the grammar state the next mask comes from
    finished: bool = False
    scheduled_time: float | None = None  # first admitted to a step: its queue time ends there
    first_token_time: float | None = None
    last_token_time: float | None = None
    dimensions: int | None = None  # an embedding request's Matryoshka truncation (vt.engine.pooling)
