"""AsyncEngine: requests and their streams, the one scheduler coroutine, and processing outputs.

Loop, depth 2: schedule and launch step N+1 while step N runs, then take step N's sampled tokens,
append them, detokenize, check stop conditions and push deltas. A request that finishes at step N
is already in step N+1: that extra token arrives for a finished request and is dropped by the
scheduler (append_token returns None), never streamed, never counted. Depth 1 waits for each step
before scheduling the next; both produce the same tokens for greedy and seeded requests.

Structured outputs keep that promise (guided_steps.py): at depth 2 a step with guided rows
samples them in a second pass once their masks are filled, and a guided request whose second
pass is not launched when the next step is scheduled sits that step out. A step whose masks are
still filling when it is collected has its free rows' tokens processed first (streamed, stop
conditions checked) and, with a slot free, becomes a masked step: it keeps its slot while the next
step launches, and its guided rows are processed once its second pass ends. A failed step fails
its requests, and a probe step tells whether the device is at fault (failures.py).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vt.config import EngineConfig, ModelConfig
from vt.engine.admission import AdmissionLimits, check_first_token, check_params, check_token_ids, held_back
from vt.engine.allowed_tokens import NO_TOKEN, no_token_error
from vt.engine.failures import StepFailures
from vt.engine.guided_steps import GuidedSteps
from vt.engine.outputs import (
    ERROR_ENGINE,
    ERROR_REQUEST,
    ERROR_STOPPED,
    EngineDeadError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    RequestStream,
    TokenLogprob,
)
from vt.engine.pooling import NOT_GENERATING, NOT_POOLING, POOLING_PARAMS, check_embedding_prompt
from vt.engine.request_state import RequestState
from vt.engine.split_steps import StepPart, split_decode_sms, split_mixed_step
from vt.engine.stats import EngineStats
from vt.engine.trace import StepTrace
from vt.kernels import get_backend
from vt.model.pooling import load_pooling_config, pooled_vector
from vt.runner.runner import MAX_BANNED, ModelRunner, StepHandle, StepOutput
from vt.sampling_params import SamplingParams
from vt.sched.kv_events import AllBlocksCleared, KVEventLog
from vt.sched.output import ScheduledBatch
from vt.sched.request import Request, RequestStatus
from vt.sched.scheduler import Scheduler, SchedulerConfig
from vt.structured.compiler import CompiledGrammar, GrammarCompiler
from vt.structured.spec import GrammarSpec
from vt.text.tokenizer import DetokStream, Tokenizer

log = logging.getLogger("vt.engine")


@dataclass
class StepEvent:
    kind: str        # "launch" | "done"
    step_id: int
    time: float = field(default_factory=time.monotonic)


class Launch(enum.Enum):
    """What one turn of the loop launched."""

    NOTHING = 0   # nothing was scheduled, or nothing may launch now
    LAUNCHED = 1  # the scheduled step (or its first part) is in flight
    FAILED = 2    # the scheduled step's launch failed: a probe step comes before any other


def _checked_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """--max-model-len as the engine runs it, once the flags that depend on each other are checked."""
    mml = config.max_model_len or model_config.max_position_embeddings
    if mml < 2:
        raise ValueError("--max-model-len must be at least 2")
    if mml > model_config.max_position_embeddings:
        raise ValueError(f"--max-model-len {mml} exceeds the model's max_position_embeddings "
                         f"{model_config.max_position_embeddings}")
    if config.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"unknown scheduling policy {config.scheduling_policy!r} (fcfs | priority)")
    if config.prefill_pacing and not config.enable_chunked_prefill:
        raise ValueError("prefill pacing spreads prompts over several steps: it needs chunked prefill")
    return mml


class AsyncEngine:
    """Requests in, streams of RequestOutputs out; one scheduler coroutine runs the steps.
    Not thread-safe: call it from the thread of the event loop that runs start()."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.tokenizer or config.model)
        device = {"cpu": "numpy"}.get(config.device, config.device)
        self.ops = get_backend(device, config.tensor_parallel_size)
        self.max_model_len = mml = _checked_max_model_len(config, self.model_config)
        self.split_decode_sms = split_decode_sms(config.split_decode_sms)
        self.split_steps = 0  # scheduled steps launched as their decodes and prompt rows beside them
        # An embedding model (the pooling runner) pools each prompt instead of generating (embed()).
        self.pooling = load_pooling_config(config.model, config.runner)
        self.runner = ModelRunner(self.model_config, config, self.ops, mml, pooling=self.pooling)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size,
            num_blocks=self.runner.num_blocks,
            policy=config.scheduling_policy,
            enable_chunked_prefill=config.enable_chunked_prefill,
            enable_prefix_caching=config.enable_prefix_caching,
            prefill_pacing=config.prefill_pacing,
            step_sizes=self.runner.padded_step_sizes,
        ))
        self.depth = 2 if config.async_scheduling else 1
        self._states: dict[str, RequestState] = {}
        self._stats = EngineStats(block_size=config.block_size, num_gpu_blocks=self.runner.num_blocks,
                                  enable_prefix_caching=config.enable_prefix_caching, max_model_len=mml)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False  # stop() has ended the requests: new ones are refused
        self._seq = 0
        self._seeds = random.Random(config.seed)
        self._failures = StepFailures()
        self.record_events = False
        self.events: collections.deque[StepEvent] = collections.deque(maxlen=100_000)
        # Steps launched and not yet collected, oldest first (a masked step is collected).
        self._inflight: collections.deque[StepHandle] = collections.deque()
        self._step_rids: dict[int, list[str]] = {}  # step id -> request ids of its sequences
        self._last_done: float | None = None
        self._busy_after_done = False
        # Outputs for streams with a delivery callback, handed over in one loop callback a step.
        self._posted: list[tuple[Callable[[RequestOutput], None], RequestOutput]] = []
        eos = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.eos_token_ids = frozenset(eos)
        self.limits = AdmissionLimits(vocab_size=self.model_config.vocab_size, max_model_len=mml,
                                      max_waiting=config.max_waiting, max_banned=MAX_BANNED,
                                      eos_token_ids=self.eos_token_ids,
                                      kv_tokens=self.runner.num_blocks * config.block_size,
                                      priority_scheduling=config.scheduling_policy == "priority")
        self.grammars = GrammarCompiler(self.tokenizer.raw.to_str, self.model_config.vocab_size,
                                        self.eos_token_ids)
        self.guided_steps = GuidedSteps(self.runner, self.grammars, self._states, self._inflight)
        self.step_trace = StepTrace(config.step_trace) if config.step_trace else None
        self.kv_publisher = None
        if config.kv_events_config is not None and config.kv_events_config.enabled:
            from vt.sched.kv_publisher import ZmqEventPublisher

            self.kv_publisher = ZmqEventPublisher(config.kv_events_config)
            self.scheduler.pool.events = KVEventLog(config.block_size)
            # A restarted replica's subscribers must forget what its previous process cached.
            self.kv_publisher.publish([AllBlocksCleared()], self.scheduler.pool.cached_blocks)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._stopping = False
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vt-scheduler")
            self.grammars.warm_up()

    async def stop(self, timeout: float = 0.0) -> None:
        """Let unfinished requests run for up to `timeout` seconds, then end the rest with an
        error output (ERROR_STOPPED: their clients read why, rather than see a stream cut), and
        stop the loop, the runner and the grammar compiles. New requests are refused from then on."""
        deadline = time.monotonic() + timeout
        while self._states and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._stopping = True
        for state in list(self._states.values()):
            self._finish(state, RequestStatus.FINISHED_ABORTED, "error", None, "", error=(
                "the server stopped before the request was done (its shutdown timeout ran out); retry "
                "on another replica"), error_kind=ERROR_STOPPED)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self._drain_steps()
        self.runner.shutdown()
        self.grammars.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.shutdown()

    async def _drain_steps(self) -> None:
        """With the loop stopped: wait for every masked step and step in flight, processing none."""
        guided = self.guided_steps
        for h in (*guided.masked, *self._inflight):
            guided.launch_second_pass(h)  # joins masks a crashed loop may have left filling
            try:
                await h.wait()
            except Exception:
                pass
        guided.masked.clear()
        self._inflight.clear()
        self._step_rids.clear()

    @property
    def idle(self) -> bool:
        """No request held, no step in flight and no probe step pending: every KV block is the
        prefix cache's or free."""
        return (not self._states and not self._inflight and not self.guided_steps.masked
                and self._failures.suspect is None and not self.scheduler.has_unfinished())

    @property
    def healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        if self._failures.dead is not None:
            return f"the engine stopped after an error: {self._failures.dead}"
        if self._task is not None and self._task.done():
            return "the engine's scheduler loop has stopped"
        return None

    # ---- requests -----------------------------------------------------------------------------
    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile a structured-output grammar off the event loop (cached by spec); raises
        GrammarError (a ValueError) for one that does not compile. Requests whose params carry
        it then start without compiling on the loop."""
        return await self.grammars.compile(spec)

    def _check_new(self, request_id: str) -> None:
        """A new request may be added: the engine runs, is not stopping, and the id is free."""
        if self._failures.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._failures.dead}")
        if self._stopping:
            raise EngineDeadError("the server is shutting down; retry on another replica")
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        self._check_new(request_id)
        if self.pooling is not None:
            raise ValueError(NOT_GENERATING)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        check_token_ids(prompt_token_ids, self.limits, "prompt")
        params = check_params(params, self.limits)
        if n >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {n} tokens, but the model's maximum context length "
                                     f"is {self.max_model_len} tokens")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"this model's maximum context length is {self.max_model_len} tokens; the request has "
                f"{n} prompt tokens and max_tokens {max_tokens} ({n + max_tokens} in all)")
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        guide = self.grammars.guide(params.structured) if params.structured is not None else None
        if guide is not None and held_back(params, self.eos_token_ids, 0):
            # the grammar's first tokens against those min_tokens holds back (allowed_tokens.py)
            check_first_token(params, self.eos_token_ids, self.model_config.vocab_size,
                              guide.next_mask(self.grammars.mask_words), guide.complete)
        if params.seed is None:  # drawn from --seed's stream: a restarted server samples the same
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        self._seq += 1
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                      arrival=time.monotonic(), seq=self._seq, priority=priority, max_tokens=max_tokens,
                      cache_salt=cache_salt)
        self.scheduler.add(req)  # raises ValueError for a request that can never fit
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        stop_ids = frozenset(params.stop_token_ids) | eos
        detok = DetokStream(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                            params.stop, params.include_stop_str_in_output,
                            params.spaces_between_special_tokens, min_tokens=params.min_tokens)
        state = RequestState(req, detok, RequestStream(self, request_id), stop_ids, guide)
        self._states[request_id] = state
        self._stats.prompt_tokens_total += n
        self._wakeup.set()
        return state.stream

    def embed(self, request_id: str, prompt_token_ids: list[int], dimensions: int | None = None,
              priority: int = 0, cache_salt: str | None = None) -> RequestStream:
        """An embedding model's request (vt.engine.pooling): its one output is finished and holds
        the prompt's vector (RequestOutput.embedding, float32; `dimensions`: its Matryoshka
        truncation). Raises as add_request does, and SamplingParamsError for `dimensions`."""
        self._check_new(request_id)
        if self.pooling is None:
            raise ValueError(NOT_POOLING)
        n = len(prompt_token_ids)
        check_embedding_prompt(n, self.max_model_len)
        check_token_ids(prompt_token_ids, self.limits, "input")
        self.pooling.check_dimensions(dimensions, self.model_config.hidden_size, self.config.model)
        if self.scheduler.num_waiting >= self.config.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self._seq += 1
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=POOLING_PARAMS,
                      arrival=time.monotonic(), seq=self._seq, priority=priority, max_tokens=1,
                      cache_salt=cache_salt)
        self.scheduler.add(req)  # raises ValueError for a prompt the KV cache can never hold
        state = RequestState(req, DetokStream(self.tokenizer, ()), RequestStream(self, request_id),
                             frozenset(), dimensions=dimensions)
        self._states[request_id] = state
        self._stats.prompt_tokens_total += n
        self._wakeup.set()
        return state.stream

    def _post(self, fn: Callable[[RequestOutput], None], out: RequestOutput) -> None:
        if not self._posted:
            asyncio.get_running_loop().call_soon(self._deliver_posted)
        self._posted.append((fn, out))

    def _deliver_posted(self) -> None:
        posted, self._posted = self._posted, []
        for fn, out in posted:
            try:
                fn(out)
            except Exception:
                log.exception("delivering an output of request %s failed", out.request_id)

    def abort(self, request_id: str) -> None:
        state = self._states.get(request_id)
        if state is None:
            return
        self._finish(state, RequestStatus.FINISHED_ABORTED, "abort", None, "")

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stop (or resume) computing tokens for a request whose reader has fallen behind; it
        keeps its KV blocks. Outputs of steps already in flight still arrive."""
        self.scheduler.set_paused(request_id, paused)
        if not paused:
            self._wakeup.set()

    def stats(self) -> EngineStats:
        s = self._stats
        s.num_requests_running = self.scheduler.num_running
        s.num_requests_waiting = self.scheduler.num_waiting
        s.kv_cache_usage_perc = self.scheduler.kv_usage
        s.num_preemptions_total = self.scheduler.num_preemptions_total
        return s

    def _eos_for(self, request_id: str) -> tuple[int, ...]:
        state = self._states.get(request_id)
        return tuple(sorted(state.stop_ids)) if state is not None else ()

    def _is_guided(self, request_id: str) -> bool:
        return (state := self._states.get(request_id)) is not None and state.guide is not None

    # ---- the scheduler coroutine -------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A bug past the step boundary (processing, scheduling): no request may wait forever on
            # a loop that is gone, so fail them all and report the engine dead.
            log.exception("the scheduler loop crashed")
            self._mark_dead(exc)

    async def _loop(self) -> None:
        """One turn: hand the KV events over, process the masked steps whose second pass ended,
        probe the device after a failed step, schedule and launch the next step, then collect the
        oldest step in flight (at depth 2 once the next one runs behind it), or finish a masked
        step, or wait for work."""
        guided = self.guided_steps
        while True:
            if self.kv_publisher is not None:
                self._publish_kv_events()
            if guided.masked:
                self._advance_masked_steps()
            if self._failures.probe_due and not self._inflight and not guided.masked:
                await self._probe()
                continue
            launch = self._launch_next_step() if self._may_launch() else Launch.NOTHING
            if launch is Launch.FAILED:
                continue  # nothing launches before a probe step has run
            launched = launch is Launch.LAUNCHED
            if self._inflight and (not launched or len(self._inflight) >= self.depth):
                await self._collect_oldest()
            elif guided.masked and not launched:
                await self._finish_masked_steps(one=True)  # nothing else to do meanwhile
            elif launched:
                await asyncio.sleep(0)  # let HTTP callbacks run between launches
            else:
                await self._wait_for_work()

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's new events to the publisher (it queues; it never blocks)."""
        pool = self.scheduler.pool
        if pool.events:
            self.kv_publisher.publish(pool.events.take(), pool.cached_blocks)

    def _may_launch(self) -> bool:
        return len(self._inflight) < self.depth and self.runner.has_free_slot and self._failures.may_launch

    async def _wait_for_work(self) -> None:
        """Nothing launched and nothing to collect: sleep until a request comes or changes."""
        self._wakeup.clear()
        if not self.scheduler.has_unfinished() or self._failures.dead is not None:
            await self._wakeup.wait()
        else:
            # Work exists but nothing is schedulable right now (e.g. blocks are short).
            try:
                await asyncio.wait_for(self._wakeup.wait(), 0.01)
            except asyncio.TimeoutError:
                pass

    # ---- launching ----------------------------------------------------------------------------
    def _launch_next_step(self) -> Launch:
        """Schedule the next step and launch it; the guided requests whose masks are not in sit it out."""
        batch = self.scheduler.schedule(sit_out=self.guided_steps.launch_ready_second_passes())
        if batch.empty:
            for rid in batch.released:
                self.runner.release(rid)
            return Launch.NOTHING
        stats = self._stats
        stats.iteration_tokens_total.observe(batch.num_tokens)
        now = time.monotonic()
        # An admitted request starts past the prompt tokens the prefix cache had.
        for s in batch.seqs:
            if s.new is not None:
                stats.prefix_cache_hit_tokens_total += s.start_pos
                stats.prefix_cache_queries_total += len(s.new.prompt_token_ids) + len(s.new.output_token_ids)
                if (state := self._states.get(s.request_id)) is not None and state.scheduled_time is None:
                    state.scheduled_time = now  # its queue time ends at its first admission
        if not self._inflight and self._last_done is not None and self._busy_after_done:
            # The device sat idle from the last completion to this launch with work waiting: the
            # gap async scheduling exists to close.
            stats.gpu_idle_seconds_total += max(0.0, time.monotonic() - self._last_done)
        launch = Launch.FAILED
        for part in self._step_parts(batch):
            if not self._launch(part):
                break
            launch = Launch.LAUNCHED
        return launch

    def _step_parts(self, batch: ScheduledBatch) -> Sequence[StepPart]:
        """The launches a scheduled step becomes: itself, or with split_decode_sms set and two
        slots free, its decodes and then its prompt rows beside them (split_steps.py)."""
        if self.split_decode_sms and self.runner.free_slots >= 2:
            parts = split_mixed_step(batch, self.split_decode_sms, self.ops.num_sms, self._is_guided)
            if parts is not None:
                self.split_steps += 1
                return parts
        return (StepPart(batch, False, 0),)

    def _launch(self, part: StepPart) -> bool:
        """Launch one part of a scheduled step; False if the launch failed (its requests fail)."""
        try:
            # At depth 2 guided rows sample in a second pass, once their masks are filled on the
            # grammar thread.
            h = self.runner.execute(part.batch, self._eos_for, self.guided_steps.fill_masks,
                                    defer_masks=self.depth > 1,
                                    parallel_to_previous=part.parallel_to_previous, gemm_sms=part.gemm_sms)
        except Exception as exc:  # staging failed: fail this batch's requests
            log.exception("step launch failed")
            # On CUDA the launch runs the device work inline: its errors count too.
            self._fail_step([s.request_id for s in part.batch.seqs], exc)
            return False
        self._inflight.append(h)
        self.guided_steps.launched(h)  # its masks start now if its guides have seen every token
        # Every sequence of the step, not only the sampling ones: a failed prefill chunk leaves
        # its KV unwritten, so its request cannot go on either.
        self._step_rids[h.step_id] = [s.request_id for s in part.batch.seqs]
        if self.step_trace is not None:
            self.step_trace.launched(h.step_id, part.batch)
        if self.record_events:
            self.events.append(StepEvent("launch", h.step_id))
        return True

    # ---- collecting ---------------------------------------------------------------------------
    async def _collect_oldest(self) -> None:
        """Collect the oldest step in flight and process its tokens. One whose masks still fill
        has its free rows processed first and, with a slot free, becomes a masked step."""
        guided = self.guided_steps
        h = self._inflight.popleft()
        rids = self._step_rids.pop(h.step_id, [])
        if h.awaiting_masks and h.has_free_rows and not guided.masks_ready(h):
            # The masks are still filling: the free rows' tokens are processed meanwhile. The
            # guided requests sat out the step launched since, so nothing in flight reads their
            # tokens before the second pass is processed.
            if (first := await self._wait(h, rids, first_pass=True)) is None:
                return
            self._process(first)
            rids = list(h.masked_request_ids)
            guided.early_first_passes += 1
            if self.runner.has_free_slot:
                # h keeps its slot until its guided rows are sampled; the next step launches
                # now, whatever the masks take (its guided requests sit out).
                self._step_done(h, first)
                self._step_rids[h.step_id] = rids
                guided.keep_masked(h)
                self._busy_after_done = self.scheduler.has_unfinished()
                return
        if guided.masked and h.awaiting_masks and not guided.masks_started(h):
            await self._finish_masked_steps()  # h's masks need tokens of older, masked steps
        await guided.launch_when_masked(h)
        if (out := await self._wait(h, rids)) is None:
            return
        self._step_done(h, out)
        self._process(out)
        # The next step's masks now fill on the mask thread; its second pass is launched before
        # the next schedule if they are done, else before it is waited for.
        self._busy_after_done = self.scheduler.has_unfinished()

    async def _wait(self, h: StepHandle, rids: list[str], first_pass: bool = False) -> StepOutput | None:
        """h's output (its first pass's: every row but the guided ones), or None if the step
        failed: then its requests (`rids`) fail."""
        try:
            return await (h.wait_first() if first_pass else h.wait())
        except Exception as exc:
            self._drop_failed_step(h, rids, exc)
            return None

    def _step_done(self, h: StepHandle, out: StepOutput) -> None:
        """Account a completed step (a masked one's first pass: the device is done with its
        forward): device time, trace line, counters."""
        self._failures.step_ran()
        # Device time of this step: from when it could start (its launch, or the previous
        # step's completion if that came later) to its completion.
        start = out.launch_time if self._last_done is None else max(out.launch_time, self._last_done)
        self._stats.step_time_seconds_total += max(0.0, out.done_time - start)
        if self.step_trace is not None:
            self.step_trace.done(h.step_id, out.launch_time, start, out.done_time)
        self._last_done = out.done_time
        self._stats.steps_total += 1
        if self.record_events:
            self.events.append(StepEvent("done", h.step_id))

    def _advance_masked_steps(self) -> None:
        """Without waiting: launch the second pass of each masked step whose masks are filled, and
        process the guided rows of the oldest ones whose second pass has ended, in step order."""
        guided = self.guided_steps
        guided.launch_masked_ready()
        while (h := guided.pop_done()) is not None:
            rids = self._step_rids.pop(h.step_id, [])
            try:
                out = h.result()
            except Exception as exc:
                self._drop_failed_step(h, rids, exc)
                continue
            self._process(out)

    async def _finish_masked_steps(self, one: bool = False) -> None:
        """Wait for the masked steps' masks and second passes, oldest first, and process their
        guided rows (one: the oldest only)."""
        guided = self.guided_steps
        masked = guided.masked
        while masked:
            h = masked[0]
            await guided.launch_when_masked(h)
            out = await self._wait(h, self._step_rids.pop(h.step_id, []))
            masked.popleft()
            if out is not None:
                self._process(out)
            if one:
                return

    # ---- failures -----------------------------------------------------------------------------
    def _drop_failed_step(self, h: StepHandle, rids: list[str], exc: BaseException) -> None:
        """A step that raised when waited for (first pass or whole): its requests fail, its masks
        and trace line go, and the steps waiting for it start their masks."""
        log.exception("step %d failed", h.step_id)
        self.guided_steps.dropped(h)
        if self.step_trace is not None:
            self.step_trace.dropped(h.step_id)
        self._fail_step(rids, exc)
        self.guided_steps.tokens_processed(())

    def _fail_step(self, rids: list[str], exc: BaseException) -> None:
        """A step's requests fail; whether the engine is at fault is for a probe step to say once
        nothing else is in flight (new steps wait for it)."""
        msg = f"the engine step failed: {type(exc).__name__}: {exc}"
        for rid in rids:
            state = self._states.get(rid)
            if state is not None:
                self._finish(state, RequestStatus.FINISHED_ABORTED, "error", None, "", error=msg)
        self._failures.step_failed(exc)

    async def _probe(self) -> None:
        """Run a probe step alone (failures.py); the engine dies of a failure it cannot explain
        MAX_CONSECUTIVE_FAILURES times in a row."""
        if (fatal := await self._failures.probe(self.runner, self.scheduler.pool)) is not None:
            self._mark_dead(fatal)

    def _mark_dead(self, exc: BaseException) -> None:
        msg = self._failures.mark_dead(exc)
        for rid, state in list(self._states.items()):
            try:
                self._finish(state, RequestStatus.FINISHED_ABORTED, "error", None, "", error=msg)
            except Exception:  # the scheduler itself may be what broke: still end the stream
                self._states.pop(rid, None)
                req = state.request
                state.stream.put(RequestOutput(
                    rid, "", (), None, True, "error", None, len(req.prompt_token_ids),
                    len(req.output_token_ids), req.num_cached_tokens, msg))

    # ---- outputs ------------------------------------------------------------------------------
    def _process(self, out: StepOutput) -> None:
        if out.pooled:  # an embedding model's step: it sampled nothing
            self._process_pooled(out)
            return
        # Runs once per token of every request: the lookups are hoisted out of the loop.
        now = time.monotonic()
        append_token, states, stats = self.scheduler.append_token, self._states, self._stats
        itl = stats.inter_token_latency_seconds
        finish = self._finish
        # First every token is appended and advances its guide, so that the next step's masks
        # can be filled while the rest of this step is processed (which then reads no matcher:
        # the mask thread holds them).
        taken = []
        rejected: dict[str, str] = {}
        grammar_done: set[str] = set()
        no_token: list[RequestState] = []
        for tok in out.sampled:
            if tok.token_id == NO_TOKEN:  # nothing was left to sample: the request ends (below)
                if (state := states.get(tok.request_id)) is not None and not state.finished:
                    no_token.append(state)
                continue
            req = append_token(tok.request_id, tok.token_id)
            state = states.get(tok.request_id)
            if req is None or state is None or state.finished:
                continue  # the extra step after a finish: dropped
            taken.append((tok, req, state))
            if (guide := state.guide) is not None:
                if (why := guide.advance(tok.token_id)) is not None:
                    rejected[tok.request_id] = why
                elif guide.finished:
                    grammar_done.add(tok.request_id)
        for state in no_token:  # before masks start: theirs must not wait for a token that never comes
            self._end_without_token(state)
        self.guided_steps.tokens_processed(set(rejected))
        for tok, req, state in taken:
            token_id = tok.token_id
            stats.generation_tokens_total += 1
            if state.first_token_time is None:
                state.first_token_time = now
                stats.time_to_first_token_seconds.observe(now - req.arrival)
            else:
                itl.observe(now - state.last_token_time)
            state.last_token_time = now
            params = req.params
            lp = None
            if tok.logprob is not None and params.logprobs is not None:
                lp = (TokenLogprob(token_id, tok.logprob, tok.top[: params.logprobs]),)
            num_out = len(req.output_token_ids)
            detok = state.detok
            text = detok.push(token_id)
            if (why := rejected.get(req.request_id)) is not None:
                finish(state, RequestStatus.FINISHED_ABORTED, "error", None, text, (token_id,), lp,
                       error=f"structured output failed: {why}")
            elif token_id in state.stop_ids and num_out > params.min_tokens:
                reason = None if token_id in self.eos_token_ids and token_id not in \
                    params.stop_token_ids else token_id
                finish(state, RequestStatus.FINISHED_STOPPED, "stop", reason, text + detok.flush(),
                       (token_id,), lp)
            elif detok.stop_str is not None:
                finish(state, RequestStatus.FINISHED_STOPPED, "stop", detok.stop_str, text, (token_id,), lp)
            elif num_out >= req.max_tokens:
                finish(state, RequestStatus.FINISHED_LENGTH, "length", None, text + detok.flush(),
                       (token_id,), lp)
            elif req.request_id in grammar_done:  # the grammar admits nothing more: as EOS
                finish(state, RequestStatus.FINISHED_STOPPED, "stop", None, text + detok.flush(),
                       (token_id,), lp)
            else:
                state.stream.put(RequestOutput(
                    req.request_id, text, (token_id,), lp, False, None, None,
                    len(req.prompt_token_ids), num_out, req.num_cached_tokens))

    def _process_pooled(self, out: StepOutput) -> None:
        """An embedding model's step: each prompt it finished ends with its vector."""
        assert self.pooling is not None
        for request_id, hidden in out.pooled:
            state = self._states.get(request_id)
            if state is None or state.finished:
                continue  # aborted while its step ran
            vector = pooled_vector(hidden, self.pooling.normalize, state.dimensions)
            self._finish(state, RequestStatus.FINISHED_STOPPED, "stop", None, "", embedding=vector)

    def _end_without_token(self, state: RequestState) -> None:
        """A request whose row had no token to sample (allowed_tokens.py): a complete grammar ends
        there, as vLLM lets it under min_tokens; anything else is the request's own error."""
        guide, req = state.guide, state.request
        if guide is not None and guide.complete:
            self._finish(state, RequestStatus.FINISHED_STOPPED, "stop", None, state.detok.flush())
            return
        error = no_token_error(req.params, self.eos_token_ids, len(req.output_token_ids), guide is not None)
        self._finish(state, RequestStatus.FINISHED_ABORTED, "error", None, "", error=error,
                     error_kind=ERROR_REQUEST)

    def _finish(self, state: RequestState, status: RequestStatus, reason: str, stop_reason: str | int | None,
                text: str, token_ids: tuple[int, ...] = (), lp: tuple[TokenLogprob, ...] | None = None,
                error: str | None = None, error_kind: str = ERROR_ENGINE, embedding: object = None) -> None:
        if state.finished:
            return
        state.finished = True
        req = state.request
        self.scheduler.finish(req.request_id, status)
        del self._states[req.request_id]
        now = time.monotonic()
        self._stats.request_success_total[reason] += 1
        self._stats.e2e_request_latency_seconds.observe(now - req.arrival)
        self._stats.observe_finished(len(req.prompt_token_ids), len(req.output_token_ids), req.arrival,
                                     state.scheduled_time, state.first_token_time, state.last_token_time)
        state.stream.put(RequestOutput(
            req.request_id, text, token_ids, lp, True, reason, stop_reason, len(req.prompt_token_ids),
            len(req.output_token_ids), req.num_cached_tokens, error, error_kind, embedding))
        self._wakeup.set()
