"""Token-budget scheduler: fcfs or priority, chunked prefill, prefix caching and preemption.

It speaks only of requests, token counts and block ids. One call of schedule() builds one step:
running requests first (in policy order), then waiting ones admitted while the token budget,
max_num_seqs and KV blocks last. Sampled tokens come back through append_token(); a request may
have up to two sampled tokens in flight when the engine runs two steps deep.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Container
from dataclasses import dataclass

from vt.sched.kv_cache import BlockPool, InvariantError, hash_block
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq
from vt.sched.request import Request, RequestStatus

POLICIES = ("fcfs", "priority")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tokens(req: Request, start: int, end: int) -> list[int]:
    """all_token_ids[start:end] without building the whole history (this runs every step)."""
    prompt = req.prompt_token_ids
    p = len(prompt)
    if end <= p:
        return prompt[start:end]
    if start >= p:
        return req.output_token_ids[start - p:end - p]
    return prompt[start:] + req.output_token_ids[:end - p]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_blocks: int
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    # Prefill pacing: while requests decode and the prompt work at hand would not fill the steps
    # until the soonest of them finishes, spread the last prompt in line over those steps (at
    # least pacing_floor tokens a step) instead of running it in full steps followed by
    # decode-only ones, whose weight reads then carry no prompt rows (_paced_prompt_tokens).
    # step_sizes: the token counts the device pads a step to (its captured graphs); a paced step
    # is filled up to one of them.
    prefill_pacing: bool = False
    pacing_floor: int = 256
    step_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "pacing_floor"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if list(self.step_sizes) != sorted(set(self.step_sizes)) or any(n < 1 for n in self.step_sizes):
            raise ValueError(f"step_sizes must be ascending positive token counts, got {self.step_sizes}")


class Scheduler:
    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.pool = BlockPool(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self._requests: dict[str, Request] = {}
        # fcfs orders by arrival; priority by (priority, arrival, seq). Both queues are sorted
        # lists: removing an aborted request from the middle stays simple.
        self._key: Callable[[Request], tuple] = (
            (lambda r: r.sort_key) if cfg.policy == "priority" else (lambda r: (r.arrival, r.seq)))
        self._waiting: list[Request] = []
        # Running set in preemption order: the last one is always the next victim
        # (fcfs: most recently admitted; priority: largest (priority, arrival, seq)).
        self._running: list[Request] = []
        self._hashes: dict[str, list[int]] = {}  # chained hashes of a running request's full blocks
        self._released: list[str] = []
        self.num_preemptions_total = 0

    # ---- views --------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # ---- request lifecycle --------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a new request. Raises ValueError for a request that could never be served."""
        cfg = self.cfg
        if req.request_id in self._requests:
            raise ValueError(f"request id {req.request_id!r} is already in the scheduler")
        if not req.prompt_token_ids:
            raise ValueError(f"request {req.request_id!r} has an empty prompt")
        if req.max_tokens < 1:
            raise ValueError(f"request {req.request_id!r}: max_tokens must be >= 1, got {req.max_tokens}")
        # The last sampled token is never fed back, so at most prompt + max_tokens - 1 KV slots.
        max_len = len(req.prompt_token_ids) + req.max_tokens - 1
        if _cdiv(max_len, cfg.block_size) > cfg.num_blocks:
            raise ValueError(
                f"request {req.request_id!r} needs up to {max_len} tokens of KV cache "
                f"({_cdiv(max_len, cfg.block_size)} blocks) but the pool has only {cfg.num_blocks} "
                f"blocks of {cfg.block_size} tokens")
        if not cfg.enable_chunked_prefill and len(req.prompt_token_ids) > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {req.request_id!r} has a {len(req.prompt_token_ids)}-token prompt, longer "
                f"than max_num_batched_tokens={cfg.max_num_batched_tokens} with chunked prefill off")
        req.status = RequestStatus.WAITING
        req.needs_row = True
        self._requests[req.request_id] = req
        self._enqueue(req)

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """End a request (stop, length or abort) and free its blocks. Unknown ids are a no-op."""
        if not status.finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        if req in self._running:
            self._running.remove(req)
            self._released.append(req.request_id)
        elif req in self._waiting:
            self._waiting.remove(req)
        self._free_blocks(req)
        req.status = status

    def set_paused(self, request_id: str, paused: bool) -> None:
        """A paused request keeps its place and its blocks but is given no tokens to compute
        (steps already in flight still deliver theirs). Unknown ids are a no-op."""
        req = self._requests.get(request_id)
        if req is not None:
            req.paused = paused

    def append_token(self, request_id: str, token_id: int) -> Request | None:
        """A sampled token arrived. None (and nothing changes) if the request is gone."""
        req = self._requests.get(request_id)
        if req is None or req.status.finished:
            return None
        if req.num_pending < 1:
            raise ValueError(f"request {request_id!r} has no sampled token in flight")
        req.num_pending -= 1
        req.output_token_ids.append(token_id)
        if req.status == RequestStatus.RUNNING:
            self._register_if_filled(req)
        return req

    # ---- scheduling ---------------------------------------------------------------------------
    def schedule(self, sit_out: Container[str] = ()) -> ScheduledBatch:
        """The next step. Requests in `sit_out` get no tokens in it (their last sampled token is not
        on the device in time to be this step's input); they keep their place and blocks."""
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        preempted_now: set[str] = set()

        if cfg.policy == "priority":
            self._preempt_for_better_waiting(preempted_now)

        # Prompt tokens this step may take (pacing), decodes aside.
        paced = cfg.prefill_pacing
        prompt_left = self._paced_prompt_tokens(sit_out) if paced else budget

        # Running requests first; a victim is always at or after the current index.
        kv_preempted = False
        idx = 0
        while idx < len(self._running) and budget > 0:
            req = self._running[idx]
            n = 0
            if req.request_id not in sit_out:
                paced_now = paced and self._prompt_work(req) > 1
                n = self._num_to_schedule(req, min(budget, prompt_left) if paced_now else budget)
            if n == 0:
                idx += 1
                continue
            need = _cdiv(req.num_computed_tokens + n, cfg.block_size) - len(req.block_ids)
            got = self.pool.allocate(need) if need > 0 else []
            while got is None:
                victim = self._running[-1]
                self._preempt(victim, preempted_now)
                kv_preempted = True
                if victim is req:
                    break
                got = self.pool.allocate(need)
            if got is None:
                break  # req preempted itself: everything after it is gone too
            req.block_ids.extend(got)
            if n > 1:
                prompt_left -= n
            seqs.append(self._emit(req, n))
            budget -= n
            idx += 1

        # Admit waiting requests, unless the running set is already short of KV blocks.
        if not kv_preempted:
            budget -= self._admit(min(budget, prompt_left), seqs, preempted_now)

        released = tuple(self._released)
        self._released.clear()
        return ScheduledBatch(seqs=tuple(seqs), released=released,
                              num_tokens=cfg.max_num_batched_tokens - budget)

    def _admit(self, budget: int, seqs: list[ScheduledSeq], preempted_now: set[str]) -> int:
        """Admit waiting requests into at most `budget` tokens; returns the tokens taken."""
        cfg = self.cfg
        start = budget
        pos = 0
        while pos < len(self._waiting) and budget > 0 and len(self._running) < cfg.max_num_seqs:
            req = self._waiting[pos]
            if req.num_pending > 0 or req.paused or req.request_id in preempted_now:
                pos += 1  # history incomplete (or paused, or just preempted): later ones may go first
                continue
            tokens = req.all_token_ids
            hit_blocks, cached = self._find_prefix(tokens, req.cache_salt)
            n = len(tokens) - cached
            if n > budget:
                # Chunking off: a prompt must fit whole; a resumed history longer than the
                # whole budget is recomputed in chunks anyway, or it could never come back.
                if cfg.enable_chunked_prefill or n > cfg.max_num_batched_tokens:
                    n = budget
                else:
                    self.pool.free(hit_blocks)
                    break
            got = self.pool.allocate(_cdiv(cached + n, cfg.block_size) - len(hit_blocks))
            if got is None:
                self.pool.free(hit_blocks)
                break
            self._waiting.pop(pos)
            req.block_ids = hit_blocks + got
            req.num_computed_tokens = cached
            req.num_cached_tokens = cached
            req.status = RequestStatus.RUNNING
            self._hashes[req.request_id] = self._chain(tokens, len(hit_blocks), req.cache_salt)
            req.next_full_at = 0
            if cfg.policy == "priority":
                bisect.insort(self._running, req, key=self._key)
            else:
                self._running.append(req)
            seqs.append(self._emit(req, n))
            budget -= n
        return start - budget

    def _prompt_work(self, req: Request) -> int:
        """Known tokens of a running request not yet computed: its prompt (or, after a
        preemption, its history) still to prefill; 0 or 1 for a decode."""
        return req.num_tokens + req.num_pending - req.num_computed_tokens

    def _paced_prompt_tokens(self, sit_out: Container[str]) -> int:
        """The prompt tokens this step takes under pacing. Every prompt in line but the last
        runs at full steps; the last one is spread over the steps left until the soonest running
        decode finishes (after the others' full steps), at least pacing_floor a step, and the
        step's total is rounded up to a step size. Spreading any other prompt would keep a
        request from decoding that could; the last one's work is what would otherwise run out
        before a finishing request brings more, leaving steps in which the weights are read for
        the decodes alone. The whole budget when no decode runs beside, or when the work in line
        fills those steps anyway."""
        cfg = self.cfg
        decodes, steps_left, work, last = 0, 1 << 30, 0, 0
        for r in self._running:
            left = self._prompt_work(r)
            if left > 1:
                work += left
                last = left
            elif r.request_id not in sit_out and not r.paused and r.num_output_planned < r.max_tokens:
                decodes += 1
                steps_left = min(steps_left, r.max_tokens - r.num_output_planned)
        full = cfg.max_num_batched_tokens - decodes
        if decodes == 0 or full <= 0:
            return cfg.max_num_batched_tokens
        seats = cfg.max_num_seqs - len(self._running)
        for r in self._waiting:
            if seats <= 0 or work - last >= full:
                break
            if r.num_pending == 0 and not r.paused:
                last = len(r.prompt_token_ids) + len(r.output_token_ids)
                work += last
                seats -= 1
        others = work - last
        if others >= full or work >= steps_left * full:
            return cfg.max_num_batched_tokens
        after = max(1, steps_left - others // full)
        total = decodes + others + max(cfg.pacing_floor, _cdiv(last, after))
        i = bisect.bisect_left(cfg.step_sizes, total)
        if i < len(cfg.step_sizes):
            total = cfg.step_sizes[i]
        return min(full, total - decodes)

    def _preempt_for_better_waiting(self, preempted_now: set[str]) -> None:
        """Priority policy: a waiting request with strictly better priority than the worst running
        one takes that one's place when the batch is full (seats or KV blocks)."""
        cfg = self.cfg
        seats = 0          # seats and blocks promised to better waiting requests
        blocks = 0
        tokens_promised = 0
        for req in list(self._waiting):
            if not self._running or tokens_promised >= cfg.max_num_batched_tokens:
                return
            if req.num_pending > 0 or req.paused:
                continue
            if req.priority >= self._running[-1].priority:
                return  # the queue is sorted: no later request is better either
            tokens = req.all_token_ids
            cached, revived = self._peek_prefix(tokens, req.cache_salt)
            chunk = min(len(tokens) - cached, cfg.max_num_batched_tokens)
            need = _cdiv(cached + chunk, cfg.block_size) - cached // cfg.block_size + revived
            running_need = sum(self._next_block_need(r) for r in self._running)
            while (self._batch_full(seats, blocks + need + running_need) and self._running
                   and self._running[-1].priority > req.priority):
                running_need -= self._next_block_need(self._running[-1])
                self._preempt(self._running[-1], preempted_now)
            if self._batch_full(seats, blocks + need + running_need):
                return
            seats += 1
            blocks += need
            tokens_promised += chunk

    def _batch_full(self, extra_seats: int, extra_blocks: int) -> bool:
        """No room for one more request next to extra_seats promised ones and extra_blocks."""
        return (len(self._running) + extra_seats >= self.cfg.max_num_seqs
                or self.pool.num_free < extra_blocks)

    def _next_block_need(self, req: Request) -> int:
        n = self._num_to_schedule(req, self.cfg.max_num_batched_tokens)
        if n == 0:
            return 0
        return max(0, _cdiv(req.num_computed_tokens + n, self.cfg.block_size) - len(req.block_ids))

    def _num_to_schedule(self, req: Request, budget: int) -> int:
        """Tokens this request can compute now (0: not now)."""
        if req.paused or req.num_output_planned >= req.max_tokens:
            return 0  # its last token is in flight; it finishes when that arrives
        known = req.num_tokens
        # Inputs must be known tokens, or the one token the previous step samples.
        if req.num_pending > 1 or (req.num_pending == 1 and req.num_computed_tokens != known):
            return 0
        remaining = known + req.num_pending - req.num_computed_tokens
        if remaining <= 0:
            return 0
        if remaining <= budget:
            return remaining
        if self.cfg.enable_chunked_prefill or remaining > self.cfg.max_num_batched_tokens:
            return budget
        return 0

    def _emit(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        input_in_flight = req.num_pending == 1
        token_ids = () if input_in_flight else tuple(_tokens(req, start, start + n))
        sample = start + n == req.num_tokens + req.num_pending
        output_index = req.num_output_planned
        if sample:
            req.num_pending += 1
        req.num_computed_tokens = start + n
        new = None
        if req.needs_row:
            new = NewRequestData(prompt_token_ids=tuple(req.prompt_token_ids),
                                 output_token_ids=tuple(req.output_token_ids), params=req.params)
            req.needs_row = False
        self._register_if_filled(req)
        return ScheduledSeq(request_id=req.request_id, start_pos=start, num_tokens=n,
                            token_ids=token_ids, input_in_flight=input_in_flight,
                            block_ids=tuple(req.block_ids),
                            sample=sample, output_index=output_index, new=new)

    def _preempt(self, req: Request, preempted_now: set[str]) -> None:
        self._running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.needs_row = True
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self._released.append(req.request_id)
        preempted_now.add(req.request_id)
        self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self._waiting, req, key=self._key)

    # ---- blocks -------------------------------------------------------------------------------
    def _free_blocks(self, req: Request) -> None:
        # Tail first, so the prefix blocks stay cached longest under LRU eviction.
        self.pool.free(reversed(req.block_ids))
        req.block_ids = []
        self._hashes.pop(req.request_id, None)
        req.next_full_at = 0

    def _find_prefix(self, tokens: list[int], salt: str | None) -> tuple[list[int], int]:
        if not self.cfg.enable_prefix_caching:
            return [], 0
        # Leave at least one token to compute: its step produces the next token's logits.
        return self.pool.find_prefix(tokens[:len(tokens) - 1], salt)

    def _peek_prefix(self, tokens: list[int], salt: str | None) -> tuple[int, int]:
        if not self.cfg.enable_prefix_caching:
            return 0, 0
        return self.pool.peek_prefix(tokens[:len(tokens) - 1], salt)

    def _chain(self, tokens: list[int], num_blocks: int, salt: str | None) -> list[int]:
        """Chained hashes of the first num_blocks full blocks of tokens (the first salted)."""
        if not self.cfg.enable_prefix_caching:
            return []
        bs = self.cfg.block_size
        hashes: list[int] = []
        for i in range(num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs:(i + 1) * bs], salt))
        return hashes

    @staticmethod
    def _known_and_computed(req: Request) -> int:
        # len() sums, not the num_tokens property: this runs twice a token
        return min(req.num_computed_tokens, len(req.prompt_token_ids) + len(req.output_token_ids))

    def _register_if_filled(self, req: Request) -> None:
        """The per-token check: register only once the next block can have filled."""
        if self._known_and_computed(req) >= req.next_full_at:
            self._register_full_blocks(req)

    def _register_full_blocks(self, req: Request) -> None:
        """Register each block whose tokens are all known and computed."""
        if not self.cfg.enable_prefix_caching:
            req.next_full_at = 1 << 62  # nothing to register, ever
            return
        bs = self.cfg.block_size
        limit = self._known_and_computed(req) // bs
        hashes = self._hashes.get(req.request_id)
        if hashes is None:
            hashes = self._hashes[req.request_id] = []
        for i in range(len(hashes), limit):
            parent = hashes[-1] if hashes else None
            block_tokens = _tokens(req, i * bs, (i + 1) * bs)
            hashes.append(self.pool.register_full(req.block_ids[i], parent, block_tokens, req.cache_salt))
        # _register_if_filled skips this method until the next block fills (~1.5 us twice a token).
        req.next_full_at = (len(hashes) + 1) * bs

    # ---- integrity ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantError if blocks, queues or counts disagree."""
        self.pool.check_invariants()
        owners: dict[int, int] = {}
        running_ids = {r.request_id for r in self._running}
        waiting_ids = {r.request_id for r in self._waiting}
        if len(running_ids) != len(self._running) or len(waiting_ids) != len(self._waiting):
            raise InvariantError("a request is queued twice")
        if running_ids & waiting_ids:
            raise InvariantError(f"requests both running and waiting: {running_ids & waiting_ids}")
        if running_ids | waiting_ids != set(self._requests):
            raise InvariantError("the request table and the queues disagree")
        if len(self._running) > self.cfg.max_num_seqs:
            raise InvariantError(f"{len(self._running)} running > max_num_seqs")
        for r in self._waiting:
            if r.block_ids:
                raise InvariantError(f"waiting request {r.request_id!r} holds blocks")
        for r in self._running:
            if r.status != RequestStatus.RUNNING:
                raise InvariantError(f"request {r.request_id!r} in the running set has status {r.status}")
            if len(set(r.block_ids)) != len(r.block_ids):
                raise InvariantError(f"request {r.request_id!r} holds a block twice")
            if len(r.block_ids) * self.cfg.block_size < r.num_computed_tokens:
                raise InvariantError(f"request {r.request_id!r}: blocks do not cover computed tokens")
            if r.num_output_planned > r.max_tokens:
                raise InvariantError(f"request {r.request_id!r} overshoots max_tokens")
            for b in r.block_ids:
                owners[b] = owners.get(b, 0) + 1
        for b in range(self.cfg.num_blocks):
            if self.pool.ref_count(b) != owners.get(b, 0):
                raise InvariantError(
                    f"block {b}: ref count {self.pool.ref_count(b)} but {owners.get(b, 0)} owners")
            if owners.get(b, 0) > 1 and not self.pool.is_cached(b):
                raise InvariantError(f"block {b} is shared but is not a cached prefix block")
