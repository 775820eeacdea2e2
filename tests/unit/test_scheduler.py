"""Scheduler: budgets, chunked prefill, decode in flight, policies, preemption, prefix caching,
and a simulated engine (one or two steps deep) over many random requests."""

from __future__ import annotations

import random
from collections import deque

import pytest

from vt.sampling_params import SamplingParams
from vt.sched.request import Request, RequestStatus
from vt.sched.scheduler import Scheduler, SchedulerConfig

BS = 4
VOCAB = 40
EOS = 0


def _cfg(**kw) -> SchedulerConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=BS, num_blocks=64)
    base.update(kw)
    return SchedulerConfig(**base)


def _req(rid: str, prompt: list[int] | int, arrival: float = 0.0, seq: int = 0, priority: int = 0,
         max_tokens: int = 8) -> Request:
    if isinstance(prompt, int):
        base = sum(ord(c) * 131 ** k for k, c in enumerate(rid)) % 10_000 * 100
        prompt = [base + i + 1 for i in range(prompt)]  # distinct per request: no cache hits
    return Request(request_id=rid, prompt_token_ids=list(prompt), params=SamplingParams(),
                   arrival=arrival, seq=seq, priority=priority, max_tokens=max_tokens)


def _ids(batch) -> list[str]:
    return [s.request_id for s in batch.seqs]


def _by_id(batch) -> dict:
    return {s.request_id: s for s in batch.seqs}


def _next_token(history: list[int]) -> int:
    """The fake model: the next token is a function of the whole history it reads."""
    h = 7
    for t in history:
        h = (h * 31 + t) % 1_000_003
    return h % VOCAB


def _reference(prompt: list[int], max_tokens: int, stop_at_eos: bool) -> list[int]:
    hist, out = list(prompt), []
    while len(out) < max_tokens:
        t = _next_token(hist)
        out.append(t)
        hist.append(t)
        if stop_at_eos and t == EOS:
            break
    return out


class FakeRunner:
    """Executes a batch against a paged token store: writes each input token into its slot, then
    reads the whole context back from the slots to 'sample'. Wrong block tables, wrong inputs or
    a shared block overwritten by another request change the sampled tokens."""

    def __init__(self, block_size: int) -> None:
        self.bs = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.last_sampled: dict[str, int] = {}  # the previous step's sampled id per request
        self.rows: set[str] = set()

    def run(self, batch) -> dict[str, int]:
        for rid in batch.released:
            self.rows.discard(rid)
        sampled: dict[str, int] = {}
        for s in batch.seqs:
            if s.new is not None:
                self.rows.add(s.request_id)
            assert s.request_id in self.rows, "a seq without a sampler row"
            if s.input_in_flight:
                assert s.num_tokens == 1 and s.token_ids == ()
                inputs = [self.last_sampled[s.request_id]]
            else:
                assert len(s.token_ids) == s.num_tokens
                inputs = list(s.token_ids)
            for i, t in enumerate(inputs):
                pos = s.start_pos + i
                self.slots[(s.block_ids[pos // self.bs], pos % self.bs)] = t
            if s.sample:
                end = s.start_pos + s.num_tokens
                hist = [self.slots[(s.block_ids[p // self.bs], p % self.bs)] for p in range(end)]
                sampled[s.request_id] = _next_token(hist)
        self.last_sampled = sampled
        return sampled


class Engine:
    """Drives a Scheduler like the engine does, `depth` steps in flight."""

    def __init__(self, sched: Scheduler, depth: int, stop_at_eos: bool = True) -> None:
        self.sched = sched
        self.depth = depth
        self.stop_at_eos = stop_at_eos
        self.runner = FakeRunner(sched.cfg.block_size)
        self.in_flight: deque[dict[str, int]] = deque()
        self.done: dict[str, tuple[list[int], RequestStatus]] = {}
        self.batches: list = []

    def step(self) -> None:
        batch = self.sched.schedule()
        self.sched.check_invariants()
        self.batches.append(batch)
        self.in_flight.append(self.runner.run(batch))
        # An empty step means nothing can run until results arrive: wait for all of them.
        while len(self.in_flight) >= self.depth or (self.in_flight and batch.empty):
            self._complete(self.in_flight.popleft())

    def _complete(self, sampled: dict[str, int]) -> None:
        for rid, tok in sampled.items():
            req = self.sched.append_token(rid, tok)
            if req is None:
                continue  # finished or aborted while this step was in flight
            if self.stop_at_eos and tok == EOS:
                self.finish(rid, RequestStatus.FINISHED_STOPPED)
            elif len(req.output_token_ids) >= req.max_tokens:
                self.finish(rid, RequestStatus.FINISHED_LENGTH)
        self.sched.check_invariants()

    def finish(self, rid: str, status: RequestStatus) -> None:
        req = self.sched.get(rid)
        if req is not None:
            self.done[rid] = (list(req.output_token_ids), status)
        self.sched.finish(rid, status)

    def run_to_end(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished() and not self.in_flight:
                return
            self.step()
        raise AssertionError("requests did not finish")


# ---- budgets ------------------------------------------------------------------------------------
def test_token_budget_and_max_num_seqs_respected():
    s = Scheduler(_cfg(max_num_seqs=3, max_num_batched_tokens=10))
    for i in range(6):
        s.add(_req(f"r{i}", 4, arrival=i))
    b = s.schedule()
    assert _ids(b) == ["r0", "r1", "r2"]  # seats run out before tokens
    assert b.num_tokens == sum(x.num_tokens for x in b.seqs) == 10
    assert [x.num_tokens for x in b.seqs] == [4, 4, 2]  # the last one is chunked
    assert s.num_running == 3 and s.num_waiting == 3


def test_chunked_prefill_splits_and_samples_only_on_last_chunk():
    s = Scheduler(_cfg(max_num_batched_tokens=4))
    prompt = list(range(1, 11))
    s.add(_req("a", prompt))
    chunks = []
    for _ in range(3):
        (seq,) = s.schedule().seqs
        chunks.append(seq)
    assert [(c.start_pos, c.num_tokens) for c in chunks] == [(0, 4), (4, 4), (8, 2)]
    assert [c.token_ids for c in chunks] == [tuple(prompt[0:4]), tuple(prompt[4:8]), tuple(prompt[8:])]
    assert [c.sample for c in chunks] == [False, False, True]
    assert chunks[2].output_index == 0
    assert chunks[0].new is not None and chunks[1].new is None and chunks[2].new is None
    assert len(chunks[2].block_ids) == 3
    # Nothing more until the sampled token arrives... unless two steps deep: then a decode input_in_flight.
    (dec,) = s.schedule().seqs
    assert dec.input_in_flight and dec.token_ids == () and dec.start_pos == 10 and dec.output_index == 1


def test_chunking_off_whole_prompt_waits_for_budget():
    s = Scheduler(_cfg(max_num_batched_tokens=8, enable_chunked_prefill=False))
    s.add(_req("a", 5, arrival=0))
    s.add(_req("b", 5, arrival=1))
    b = s.schedule()
    assert _ids(b) == ["a"] and b.seqs[0].num_tokens == 5
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        s.add(_req("c", 9))
    s.append_token("a", 3)
    b = s.schedule()
    assert [(x.request_id, x.num_tokens) for x in b.seqs] == [("a", 1), ("b", 5)]


def test_depth_one_decode_feeds_the_appended_token():
    s = Scheduler(_cfg())
    s.add(_req("a", [5, 6, 7]))
    s.schedule()
    s.append_token("a", 9)
    (seq,) = s.schedule().seqs
    assert not seq.input_in_flight and seq.token_ids == (9,) and seq.start_pos == 3 and seq.sample
    assert seq.output_index == 1


def test_max_tokens_never_overshoots_with_pending_tokens():
    s = Scheduler(_cfg())
    s.add(_req("a", 3, max_tokens=2))
    first, second, third = s.schedule(), s.schedule(), s.schedule()
    assert first.seqs[0].output_index == 0
    assert second.seqs[0].input_in_flight and second.seqs[0].output_index == 1
    assert third.empty  # both tokens are planned: nothing more may be sampled
    assert s.append_token("a", 1) is not None
    assert s.schedule().empty
    req = s.append_token("a", 2)
    assert req.output_token_ids == [1, 2]
    s.finish("a", RequestStatus.FINISHED_LENGTH)
    assert s.append_token("a", 3) is None  # the token of a finished request is discarded
    assert s.pool.num_free == s.cfg.num_blocks


def test_paused_request_keeps_its_blocks_and_gets_no_tokens():
    s = Scheduler(_cfg())
    s.add(_req("a", 3, max_tokens=20))
    s.add(_req("b", 3, max_tokens=20))
    s.schedule()
    s.append_token("a", 1)
    s.append_token("b", 1)
    blocks = list(s.get("a").block_ids)
    s.set_paused("a", True)
    for k in range(3):  # b decodes on; a sits still, blocks and all
        b = s.schedule()
        assert _ids(b) == ["b"]
        s.append_token("b", 2 + k)
    assert s.get("a").block_ids == blocks and len(s.get("a").output_token_ids) == 1
    s.set_paused("a", False)
    assert "a" in _ids(s.schedule())
    s.set_paused("nobody", True)  # unknown ids are a no-op
    s.check_invariants()


def test_paused_waiting_request_is_not_admitted_and_does_not_preempt():
    s = Scheduler(_cfg(max_num_seqs=1, policy="priority"))
    s.add(_req("low", 3, arrival=0, priority=5, max_tokens=20))
    _decode_all(s, s.schedule())
    s.add(_req("urgent", 3, arrival=1, priority=0))
    s.set_paused("urgent", True)
    b = s.schedule()
    assert _ids(b) == ["low"] and not b.released  # no preemption for a request that would not run
    s.set_paused("urgent", False)
    b = s.schedule()
    assert b.released == ("low",) and "urgent" in _ids(b)
    s.check_invariants()


# ---- policies -----------------------------------------------------------------------------------
def test_fcfs_admits_in_arrival_order_not_add_order():
    s = Scheduler(_cfg(max_num_seqs=2))
    s.add(_req("late", 3, arrival=5.0))
    s.add(_req("early", 3, arrival=1.0))
    s.add(_req("tie2", 3, arrival=3.0, seq=2))
    s.add(_req("tie1", 3, arrival=3.0, seq=1))
    assert _ids(s.schedule()) == ["early", "tie1"]
    s.finish("early", RequestStatus.FINISHED_ABORTED)
    s.finish("tie1", RequestStatus.FINISHED_ABORTED)
    assert _ids(s.schedule()) == ["tie2", "late"]


def test_priority_order_with_ties_by_arrival():
    s = Scheduler(_cfg(max_num_seqs=1, policy="priority"))
    s.add(_req("low", 3, arrival=0, priority=5))
    s.add(_req("hi_late", 3, arrival=2, priority=-1))
    s.add(_req("hi_early", 3, arrival=1, priority=-1))
    order = []
    for _ in range(3):
        b = s.schedule()
        order += [x.request_id for x in b.seqs if x.new is not None]
        s.finish(order[-1], RequestStatus.FINISHED_STOPPED)
    assert order == ["hi_early", "hi_late", "low"]


def test_fcfs_never_skips_a_head_that_does_not_fit():
    s = Scheduler(_cfg(num_blocks=4, max_num_batched_tokens=64))
    s.add(_req("a", 8, arrival=0, max_tokens=4))   # 2 blocks
    s.add(_req("big", 12, arrival=1, max_tokens=2))  # 3 blocks: does not fit next to a
    s.add(_req("small", 2, arrival=2, max_tokens=2))
    assert _ids(s.schedule()) == ["a"]


# ---- preemption ---------------------------------------------------------------------------------
def _decode_all(s: Scheduler, batch) -> None:
    for x in batch.seqs:
        if x.sample:
            s.append_token(x.request_id, 1)


def test_fcfs_preempts_most_recently_admitted():
    # 3 requests, 1 block each (prompt 3); the pool has 4 blocks: decode past the block edge of
    # two of them needs 2 new blocks but only 1 is free.
    s = Scheduler(_cfg(num_blocks=4, max_num_seqs=3))
    s.add(_req("a", 3, arrival=0))
    s.add(_req("b", 3, arrival=1))
    s.add(_req("c", 3, arrival=2))
    b = s.schedule()
    assert _ids(b) == ["a", "b", "c"]
    _decode_all(s, b)
    b = s.schedule()   # positions 3: still in block 0
    _decode_all(s, b)
    b = s.schedule()   # position 4: a gets the free block, b needs one: c (newest) is preempted
    assert _ids(b) == ["a", "b"]
    assert "c" in b.released
    c = s.get("c")
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.needs_row
    assert c.num_preemptions == 1 and s.num_preemptions_total == 1 and c.block_ids == []
    s.check_invariants()


def test_priority_preempts_largest_priority_key_on_kv_exhaustion():
    s = Scheduler(_cfg(num_blocks=4, max_num_seqs=3, policy="priority"))
    s.add(_req("mid", 3, arrival=0, priority=1))
    s.add(_req("worst", 3, arrival=1, priority=2))
    s.add(_req("best", 3, arrival=2, priority=0))
    b = s.schedule()
    assert _ids(b) == ["best", "mid", "worst"]  # running order is priority order
    _decode_all(s, b)
    _decode_all(s, s.schedule())
    b = s.schedule()
    assert _ids(b) == ["best", "mid"] and b.released == ("worst",)


def test_request_preempting_itself_stops_for_the_step():
    s = Scheduler(_cfg(num_blocks=2, max_num_seqs=2))
    s.add(_req("a", 4, arrival=0, max_tokens=4))
    s.add(_req("b", 4, arrival=1, max_tokens=4))
    b = s.schedule()
    _decode_all(s, b)
    b = s.schedule()  # a needs a block: b is preempted; then b is not scheduled at all
    assert _ids(b) == ["a"] and b.released == ("b",)
    s.check_invariants()


def test_preempted_request_resumes_before_later_arrivals_with_same_output():
    s = Scheduler(_cfg(num_blocks=4, max_num_seqs=3))
    e = Engine(s, depth=1, stop_at_eos=False)
    for i, rid in enumerate("abc"):
        s.add(_req(rid, 3, arrival=i, max_tokens=6))
    for _ in range(3):
        e.step()
    assert s.get("c").status == RequestStatus.PREEMPTED
    s.add(_req("d", 3, arrival=10, max_tokens=6))
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    b = s.schedule()
    new = [x.request_id for x in b.seqs if x.new is not None]
    assert new == ["c"]  # c goes back in its arrival place, ahead of d
    c_seq = _by_id(b)["c"]
    assert c_seq.new.output_token_ids == tuple(s.get("c").output_token_ids)
    e.runner.run(b)  # keep the fake device in step with the scheduler
    s.check_invariants()


def test_preempted_request_waits_for_its_pending_token():
    s = Scheduler(_cfg(num_blocks=4, max_num_seqs=3))
    for i, rid in enumerate("abc"):
        s.add(_req(rid, 3, arrival=i, max_tokens=8))
    s.schedule()                 # prefill all, sample token 0 (pending)
    s.schedule()                 # input_in_flight decode at position 3, token 1 pending too
    for rid in "abc":            # token 0 arrives
        s.append_token(rid, 5)
    b = s.schedule()             # position 4 needs a block each: c is preempted, token 1 in flight
    assert b.released == ("c",)
    c = s.get("c")
    assert c.num_pending == 1
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("b", RequestStatus.FINISHED_ABORTED)
    assert s.schedule().empty    # plenty of room, but c's history is incomplete
    s.append_token("c", 6)
    (seq,) = s.schedule().seqs
    assert seq.request_id == "c" and seq.new is not None and seq.start_pos == 0
    assert seq.token_ids == tuple(c.prompt_token_ids + [5, 6]) and seq.output_index == 2


def test_priority_preempts_worst_running_for_better_waiting_when_seats_full():
    s = Scheduler(_cfg(max_num_seqs=2, policy="priority"))
    s.add(_req("p1", 3, arrival=0, priority=1, max_tokens=50))
    s.add(_req("p2", 3, arrival=1, priority=2, max_tokens=50))
    _decode_all(s, s.schedule())
    s.add(_req("urgent", 3, arrival=2, priority=0))
    s.add(_req("same", 3, arrival=3, priority=2))  # not strictly better than p2: no preemption
    b = s.schedule()
    assert b.released == ("p2",)
    assert set(_ids(b)) == {"p1", "urgent"}
    assert s.get("p2").status == RequestStatus.PREEMPTED
    s.check_invariants()


def test_priority_preempts_for_better_waiting_when_blocks_full():
    s = Scheduler(_cfg(num_blocks=4, max_num_seqs=8, policy="priority"))
    s.add(_req("low", 8, arrival=0, priority=3, max_tokens=8))   # 2 blocks, 3rd at decode 4
    s.add(_req("lower", 7, arrival=1, priority=4, max_tokens=8))  # 2 blocks
    _decode_all(s, s.schedule())
    assert s.pool.num_free == 0
    s.add(_req("urgent", 4, arrival=2, priority=0, max_tokens=2))
    b = s.schedule()
    assert "lower" in b.released and "urgent" in _ids(b)
    s.check_invariants()


def test_fcfs_does_not_preempt_for_waiting_requests():
    s = Scheduler(_cfg(max_num_seqs=1))
    s.add(_req("a", 3, arrival=0, priority=9, max_tokens=50))
    _decode_all(s, s.schedule())
    s.add(_req("b", 3, arrival=1, priority=-9))
    b = s.schedule()
    assert _ids(b) == ["a"] and b.released == ()


# ---- finish, abort, prefix caching --------------------------------------------------------------
def test_finish_and_abort_are_idempotent_and_release_once():
    s = Scheduler(_cfg(max_num_seqs=1))
    s.add(_req("a", 5, arrival=0))
    s.add(_req("w", 5, arrival=1))
    s.schedule()
    assert s.get("w").status == RequestStatus.WAITING
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    s.finish("nope", RequestStatus.FINISHED_ABORTED)
    s.finish("w", RequestStatus.FINISHED_ABORTED)
    s.check_invariants()
    assert s.pool.num_free == s.cfg.num_blocks
    b = s.schedule()
    assert b.empty and b.released == ("a",)  # w never ran: only a left the running set
    assert s.schedule().released == ()
    assert not s.has_unfinished()
    with pytest.raises(ValueError):
        s.finish("a", RequestStatus.RUNNING)


def test_add_rejects_requests_that_can_never_fit():
    s = Scheduler(_cfg(num_blocks=4))
    with pytest.raises(ValueError, match="blocks"):
        s.add(_req("huge", 17, max_tokens=1))
    with pytest.raises(ValueError, match="blocks"):
        s.add(_req("long_output", 8, max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        s.add(_req("empty", []))
    s.add(_req("ok", 8, max_tokens=9))
    with pytest.raises(ValueError, match="already"):
        s.add(_req("ok", 8))
    with pytest.raises(ValueError, match="policy"):
        _cfg(policy="lifo")


def test_prefix_cache_hit_across_requests_leaves_one_token():
    s = Scheduler(_cfg())
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    s.add(_req("a", prompt, arrival=0))
    (a,) = s.schedule().seqs
    s.add(_req("b", prompt, arrival=1))
    s.add(_req("c", prompt[:8], arrival=2))  # exactly two blocks: the last one is recomputed
    s.append_token("a", 3)
    b = _by_id(s.schedule())
    assert (b["b"].start_pos, b["b"].num_tokens) == (8, 2)
    assert b["b"].block_ids[:2] == a.block_ids[:2]
    assert s.get("b").num_cached_tokens == 8
    assert (b["c"].start_pos, b["c"].num_tokens) == (4, 4)
    assert s.get("c").num_cached_tokens == 4
    s.check_invariants()
    for rid in "abc":
        s.finish(rid, RequestStatus.FINISHED_STOPPED)
    # Freed blocks stay cached: a new request with the same prompt hits them again.
    s.add(_req("d", prompt, arrival=3))
    (d,) = s.schedule().seqs
    assert d.start_pos == 8
    s.check_invariants()


def test_generated_tokens_are_cached_once_computed():
    s = Scheduler(_cfg())
    s.add(_req("a", [1, 2, 3]))
    s.schedule()
    s.append_token("a", 4)   # block 0 = [1,2,3,4] known, but 4 is not computed yet
    s.schedule()             # 4 computed: block 0 registered
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    s.add(_req("b", [1, 2, 3, 4, 5]))
    (b,) = s.schedule().seqs
    assert b.start_pos == 4


@pytest.mark.parametrize("depth", [1, 2])
def test_every_block_generation_fills_is_cached(depth):
    # Decode steps fill block after block; each is registered once known and computed, also
    # after a preemption recomputes the request, and at depth 2 where a token is in flight.
    s = Scheduler(_cfg())
    s.add(_req("a", [1, 2, 3], max_tokens=4 * BS + 2))
    nxt = iter(range(100, 200))
    produced: list[int] = []
    pending = []
    for step in range(4 * BS + 1):
        pending.append(s.schedule())
        if step == 2 * BS:
            s._preempt(s.get("a"), set())  # recompute from scratch, then go on
        if len(pending) >= depth:
            batch = pending.pop(0)
            if any(q.sample for q in batch.seqs):
                tok = next(nxt)
                if s.append_token("a", tok) is not None:
                    produced.append(tok)
    s.finish("a", RequestStatus.FINISHED_STOPPED)
    history = [1, 2, 3] + produced
    computed_blocks = (len(history) - depth) // BS  # the newest tokens may not be computed yet
    s.add(_req("b", history + [999]))
    (b,) = s.schedule().seqs
    assert b.start_pos >= computed_blocks * BS >= 2 * BS


def test_prefix_caching_off():
    s = Scheduler(_cfg(enable_prefix_caching=False))
    s.add(_req("a", list(range(1, 11))))
    s.schedule()
    s.add(_req("b", list(range(1, 11))))
    b = _by_id(s.schedule())
    assert b["b"].start_pos == 0 and s.get("b").num_cached_tokens == 0


# ---- simulated engine ---------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
def test_outputs_match_reference_under_preemption(depth, policy, chunked):
    cfg = _cfg(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=16, policy=policy,
               enable_chunked_prefill=chunked)
    s, _ = _run_against_reference(cfg, depth, seed=1, requests=10, longest_prompt=13)
    assert s.num_preemptions_total > 0  # the pool is small on purpose


def _run_against_reference(cfg: SchedulerConfig, depth: int, seed: int, requests: int,
                           longest_prompt: int) -> tuple[Scheduler, Engine]:
    """Random requests run to their length: every output equals the reference's, every block
    comes back."""
    s = Scheduler(cfg)
    e = Engine(s, depth=depth, stop_at_eos=False)
    rng = random.Random(seed)
    reqs = []
    for i in range(requests):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(2, longest_prompt + 1))]
        r = _req(f"r{i}", prompt, arrival=i, seq=i, priority=rng.randrange(3),
                 max_tokens=rng.randrange(1, 20))
        reqs.append(r)
        s.add(r)
    e.run_to_end()
    for r in reqs:
        out, status = e.done[r.request_id]
        assert out == _reference(r.prompt_token_ids, r.max_tokens, stop_at_eos=False)
        assert status == RequestStatus.FINISHED_LENGTH
    assert s.pool.num_free == cfg.num_blocks
    s.check_invariants()
    return s, e


@pytest.mark.parametrize("seed", range(6))
def test_random_simulation_ends_with_all_blocks_free(seed):
    rng = random.Random(seed)
    depth = 1 + seed % 2
    cfg = _cfg(num_blocks=rng.choice([10, 16, 40]), max_num_seqs=rng.choice([2, 4, 8]),
               max_num_batched_tokens=rng.choice([8, 16, 32]),
               policy=rng.choice(["fcfs", "priority"]), enable_chunked_prefill=rng.random() < 0.7,
               enable_prefix_caching=rng.random() < 0.8)
    s = Scheduler(cfg)
    e = Engine(s, depth=depth, stop_at_eos=True)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]  # common prefixes make cache hits
    reqs: dict[str, Request] = {}
    aborted: set[str] = set()
    n_added = 0
    for step in range(400):
        if n_added < 40 and rng.random() < 0.4:
            n = rng.randrange(1, min(cfg.max_num_batched_tokens, 14) + 1)
            prompt = (shared[:rng.randrange(0, 13)] + [rng.randrange(1, VOCAB) for _ in range(n)])
            prompt = prompt[:cfg.max_num_batched_tokens]
            max_tokens = rng.randrange(1, 12)
            r = _req(f"r{n_added}", prompt, arrival=step, seq=n_added, priority=rng.randrange(3),
                     max_tokens=max_tokens)
            try:
                s.add(r)
            except ValueError:
                continue
            reqs[r.request_id] = r
            n_added += 1
        if reqs and rng.random() < 0.05:
            rid = rng.choice(sorted(reqs))
            if rid not in e.done:
                aborted.add(rid)
            e.finish(rid, RequestStatus.FINISHED_ABORTED)
            s.check_invariants()
        e.step()
        b = e.batches[-1]
        assert b.num_tokens <= cfg.max_num_batched_tokens
        assert len(b.seqs) <= cfg.max_num_seqs
        assert len({x.request_id for x in b.seqs}) == len(b.seqs)
    e.run_to_end()
    assert s.pool.num_free == cfg.num_blocks and s.kv_usage == 0.0
    assert s.num_running == 0 and s.num_waiting == 0
    s.check_invariants()
    for rid, r in reqs.items():
        out, status = e.done[rid]
        ref = _reference(r.prompt_token_ids, r.max_tokens, stop_at_eos=True)
        if rid in aborted:
            assert out == ref[:len(out)]
        else:
            assert out == ref
            assert status == (RequestStatus.FINISHED_STOPPED if out[-1] == EOS
                              else RequestStatus.FINISHED_LENGTH)


# ---- prefill pacing -------------------------------------------------------------------------------
def _decoding(s: Scheduler, rid: str, max_tokens: int) -> Request:
    """A running request past its prompt, its last sampled token appended."""
    r = _req(rid, 4, max_tokens=max_tokens)
    s.add(r)
    b = s.schedule()
    assert _by_id(b)[rid].sample
    s.append_token(rid, 1)
    return r


def _paced(**kw) -> SchedulerConfig:
    return _cfg(num_blocks=256, max_num_batched_tokens=64, prefill_pacing=True, pacing_floor=8,
                step_sizes=(16, 24, 32, 48, 64), **kw)


def test_pacing_spreads_the_last_prompt_over_the_steps_until_a_decode_finishes():
    s = Scheduler(_paced())
    d = _decoding(s, "d", max_tokens=13)  # 12 more tokens: 12 steps until it finishes
    s.add(_req("p", 100, max_tokens=4))
    chunks = []
    for _ in range(12):
        b = _by_id(s.schedule())
        assert b["d"].num_tokens == 1
        s.append_token("d", 1)
        if "p" in b and b["p"].start_pos < 100:
            # 100 tokens over 12 steps: 9 a step, the step's total rounded up to 16
            chunks.append(b["p"].num_tokens)
            assert b["p"].num_tokens + 1 in (16, 24, 32, 48, 64) or b["p"].sample
        if "p" in b and b["p"].sample:
            s.append_token("p", 1)
    assert chunks[:6] == [15] * 6 and sum(chunks) == 100
    assert d.num_output_planned == 13
    # unpaced, the prompt would go in two steps: 63 + 37 tokens
    plain = Scheduler(_cfg(num_blocks=256, max_num_batched_tokens=64))
    _decoding(plain, "d", max_tokens=13)
    plain.add(_req("p", 100, max_tokens=4))
    assert _by_id(plain.schedule())["p"].num_tokens == 63


def test_pacing_runs_every_prompt_but_the_last_in_full_steps():
    s = Scheduler(_paced())
    _decoding(s, "d", max_tokens=40)
    s.add(_req("a", 30, seq=1))
    s.add(_req("b", 100, seq=2))
    b = _by_id(s.schedule())
    # a whole, then b's share: 39 steps left, a's 30 tokens take none of them whole,
    # b's 100 over 39 steps is under the floor: 1 + 30 + 8 rounded up to 48
    assert b["a"].num_tokens == 30
    assert b["b"].num_tokens == 48 - 1 - 30


def test_pacing_leaves_full_steps_when_nothing_decodes_or_the_work_fills_them():
    s = Scheduler(_paced())
    s.add(_req("p", 100))
    assert s.schedule().num_tokens == 64  # no decode beside: nothing to pace for
    s2 = Scheduler(_paced())
    _decoding(s2, "d", max_tokens=3)  # 2 steps left; 150 tokens fill them
    s2.add(_req("p", 150))
    assert _by_id(s2.schedule())["p"].num_tokens == 63


def test_pacing_config_checks_step_sizes():
    with pytest.raises(ValueError, match="step_sizes"):
        _cfg(step_sizes=(32, 16))
    with pytest.raises(ValueError, match="pacing_floor"):
        _cfg(pacing_floor=0)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_paced_outputs_match_reference_under_preemption(depth, policy):
    cfg = _cfg(num_blocks=20, max_num_seqs=6, max_num_batched_tokens=32, policy=policy, prefill_pacing=True,
               pacing_floor=2, step_sizes=(8, 16, 24, 32))
    s, e = _run_against_reference(cfg, depth, seed=4, requests=12, longest_prompt=60)
    assert s.num_preemptions_total > 0
    # paced chunks ran: prompt chunks short of both their prompt's end and the budget
    assert any(b.num_tokens < 32 and any(q.num_tokens > 1 and not q.sample for q in b.seqs)
               for b in e.batches)
