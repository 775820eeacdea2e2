"""AsyncEngine: the one scheduler coroutine, the depth-1/2 step pipeline and per-request streams.

Loop, depth 2: schedule and launch step N+1 while step N runs, then take step N's sampled tokens,
append them, detokenize, check stop conditions and push deltas. A request that finishes at step N
is already in step N+1: that extra token arrives for a finished request and is dropped by the
scheduler (append_token returns None), never streamed, never counted. Depth 1 waits for each step
before scheduling the next; both produce the same tokens for greedy and seeded requests.

Structured outputs keep that promise: a guided request's mask for step N+1 needs the token step
N samples. At depth 2 a step with guided rows samples in two passes: the first, launched with
the forward, samples every other row, so the next step can launch behind it; the masks fill on a
grammar thread (as soon as every guide has seen its request's last token: at launch, or once N
is processed) and the second pass samples the guided rows with them. A guided request whose
second pass is not launched when the next step is scheduled sits that step out (the scheduler's
`hold`), so no row ever waits for a mask but its own, and the masks are the ones depth 1 would
compute (docs/structured_outputs.md). A step whose masks are still filling when it is waited for
has its free rows' tokens processed first (streamed, stop conditions checked) while they fill.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import os
import random
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vt.config import EngineConfig, ModelConfig
from vt.engine.admission import AdmissionLimits, check_params, check_token_ids
from vt.engine.outputs import (
    EngineDeadError,
    PromptTooLongError,
    QueueFullError,
    RequestOutput,
    RequestStream,
    TokenLogprob,
)
from vt.engine.probe import ProbeUnavailable, run_probe
from vt.engine.stats import EngineStats
from vt.engine.trace import StepTrace
from vt.kernels import get_backend
from vt.runner.runner import MAX_BANNED, ModelRunner, StepHandle, StepOutput
from vt.sampling_params import SamplingParams
from vt.sched.kv_events import AllBlocksCleared, KVEventLog
from vt.sched.output import ScheduledBatch
from vt.sched.request import Request, RequestStatus
from vt.sched.scheduler import Scheduler, SchedulerConfig
from vt.structured.compiler import CompiledGrammar, GrammarCompiler
from vt.structured.guide import Guide
from vt.structured.spec import GrammarSpec
from vt.text.tokenizer import DetokStream, Tokenizer

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("vt.engine")
# Failures in a row (each a failed step whose probe step failed too, or could not run) after
# which the device counts as unusable; any step that runs resets the count.
MAX_CONSECUTIVE_FAILURES = 3
SPLIT_MIN_DECODES = 32  # the fewest decodes a mixed step is split for (split_decode_sms)


@dataclass
class _State:
    request: Request
    detok: DetokStream
    stream: RequestStream
    stop_ids: frozenset[int]
    guide: Guide | None = None  # structured outputs: the grammar state the next mask comes from
    finished: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None


@dataclass
class StepEvent:
    kind: str        # "launch" | "done"
    step_id: int
    time: float = field(default_factory=time.monotonic)


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer.from_dir(config.model)
        device = {"cpu": "numpy"}.get(config.device, config.device)
        self.ops = get_backend(device, config.tensor_parallel_size)
        mml = config.max_model_len or self.model_config.max_position_embeddings
        if mml < 2:
            raise ValueError("--max-model-len must be at least 2")
        if mml > self.model_config.max_position_embeddings:
            raise ValueError(f"--max-model-len {mml} exceeds the model's max_position_embeddings "
                             f"{self.model_config.max_position_embeddings}")
        self.max_model_len = mml
        if config.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {config.scheduling_policy!r} (fcfs | priority)")
        if config.prefill_pacing and not config.enable_chunked_prefill:
            raise ValueError("prefill pacing spreads prompts over several steps: it needs chunked prefill")
        split = config.split_decode_sms
        if split is None:
            text = os.environ.get("VT_SPLIT_DECODE_SMS", "0") or "0"
            if not text.isdigit():
                raise ValueError(f"VT_SPLIT_DECODE_SMS must be a number of SMs (0: off), got {text!r}")
            split = int(text)
        if split < 0:
            raise ValueError(f"split_decode_sms must be >= 0, got {split}")
        self.split_decode_sms = split
        self.split_steps = 0  # scheduled steps launched as their decodes and prompt rows beside them
        self.runner = ModelRunner(self.model_config, config, self.ops, mml)
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
        self._states: dict[str, _State] = {}
        self._stats = EngineStats(block_size=config.block_size, num_gpu_blocks=self.runner.num_blocks,
                                  enable_prefix_caching=config.enable_prefix_caching)
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._seq = 0
        self._seeds = random.Random(config.seed)
        self._dead: str | None = None
        self._consecutive_failures = 0
        self.record_events = False
        self.events: collections.deque[StepEvent] = collections.deque(maxlen=100_000)
        self._inflight: collections.deque[StepHandle] = collections.deque()
        # Late steps: their free rows are processed and their slot still holds them while their
        # guided rows' masks fill; the next steps launch meanwhile. Oldest first.
        self._late: collections.deque[StepHandle] = collections.deque()
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
        self._suspect: BaseException | None = None  # a step failed: a probe step tells whose fault
        # masks being filled on the grammar thread, by the step id of the in-flight step they are for
        self._masks: dict[int, concurrent.futures.Future] = {}
        self.held_total = 0  # guided requests that sat a step out waiting for their masks
        self.early_first_passes = 0  # steps whose free rows were processed while their masks filled
        self.late_steps = 0  # of those, steps left behind (late) while later steps launched
        self.grammars = GrammarCompiler(self.tokenizer.raw.to_str, self.model_config.vocab_size,
                                        self.eos_token_ids)
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
            self._wakeup = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vt-scheduler")
            self.grammars.warm_up()

    async def stop(self, timeout: float = 0.0) -> None:
        """Let unfinished requests run for up to `timeout` seconds, abort the rest, stop the loop."""
        deadline = time.monotonic() + timeout
        while self._states and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for rid in list(self._states):
            self.abort(rid)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for h in (*self._late, *self._inflight):
            self._launch_masked(h)  # joins masks a crashed loop may have left filling
            try:
                await h.wait()
            except Exception:
                pass
        self._late.clear()
        self._inflight.clear()
        self._step_rids.clear()
        self.runner.shutdown()
        self.grammars.shutdown()
        if self.step_trace is not None:
            self.step_trace.close()
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.shutdown()

    @property
    def idle(self) -> bool:
        """No request held, no step in flight and no probe step pending: every KV block is the
        prefix cache's or free."""
        return (not self._states and not self._inflight and not self._late and self._suspect is None
                and not self.scheduler.has_unfinished())

    @property
    def healthy(self) -> bool:
        return self.health_problem is None

    @property
    def health_problem(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        if self._dead is not None:
            return f"the engine stopped after an error: {self._dead}"
        if self._task is not None and self._task.done():
            return "the engine's scheduler loop has stopped"
        return None

    # ---- requests -----------------------------------------------------------------------------
    async def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile a structured-output grammar off the event loop (cached by spec); raises
        GrammarError (a ValueError) for one that does not compile. Requests whose params carry
        it then start without compiling on the loop."""
        return await self.grammars.compile(spec)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> RequestStream:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead}")
        if request_id in self._states:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        if params.seed is None:  # drawn from --seed's stream: a restarted server samples the same
            params = dataclasses.replace(params, seed=self._seeds.getrandbits(63))
        self._seq += 1
        req = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                      arrival=time.monotonic(), seq=self._seq, priority=priority, max_tokens=max_tokens)
        self.scheduler.add(req)  # raises ValueError for a request that can never fit
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        stop_ids = frozenset(params.stop_token_ids) | eos
        detok = DetokStream(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens,
                            params.stop, params.include_stop_str_in_output)
        state = _State(req, detok, RequestStream(self, request_id), stop_ids, guide)
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

    def _fill_masks(self, request_ids: Sequence[str], out: np.ndarray) -> None:
        """The runner's MaskFiller: each request's allowed tokens now (all tokens for a request
        that has finished meanwhile: its token is dropped anyway)."""
        self.grammars.fill_masks(self._guides(request_ids), out)

    def _guides(self, request_ids: Sequence[str], unguided: Container[str] = ()) -> list[Guide | None]:
        """Each request's guide; None (every token allowed) for one that is gone or in `unguided`."""
        states = self._states
        return [s.guide if (s := states.get(rid)) is not None and rid not in unguided else None
                for rid in request_ids]

    def _start_masks(self, h: StepHandle, rejected: Container[str] = ()) -> None:
        """Start filling the masks of an in-flight step on the grammar thread; every guide of its
        guided rows has seen its request's last token (a guide that rejected its token gets every
        token: that request ends and its token is dropped)."""
        rids, out = self.runner.deferred_masks(h)
        self._masks[h.step_id] = self.grammars.fill_masks_async(self._guides(rids, rejected), out)

    def _masks_after(self, rejected: set[str]) -> None:
        """Tokens were just processed: the steps whose guides have now seen every earlier token
        of their guided requests start filling their masks."""
        for h in (*self._late, *self._inflight):
            if h.awaiting_masks and h.step_id not in self._masks and self._guides_current(h):
                self._start_masks(h, rejected)

    def _guides_current(self, h: StepHandle) -> bool:
        """Whether every guided request of h has no token in flight but h's: an earlier step's
        (a late one's, still filling its masks) must be processed before h's masks are built."""
        states = self._states
        return all((s := states.get(rid)) is None or s.request.num_pending <= 1
                   for rid in h.pending_mask_request_ids)

    def _launch_masked(self, h: StepHandle) -> None:
        """Launch a step's second sampler pass with its masks, waiting for them if they are still
        filling (and for their fill if it never started: on the mask thread all the same, after
        any fill still running for a dropped step that held the same slot's buffer)."""
        if not h.awaiting_masks:
            return
        if h.step_id not in self._masks:
            self._start_masks(h)
        job = self._masks.pop(h.step_id)
        self.runner.sample_deferred(h, lambda _rids, _out: job.result())

    def _masks_ready(self, h: StepHandle) -> bool:
        job = self._masks.get(h.step_id)
        return job is not None and job.done()

    def _launch_ready_masks(self) -> frozenset[str]:
        """Launch the second pass of every in-flight step whose masks are filled; the requests of
        the others sit the next step out (their tokens are not on the device yet)."""
        hold: set[str] = set()
        for h in (*self._late, *self._inflight):
            if not h.awaiting_masks:
                continue
            if self._masks_ready(h):
                self._launch_masked(h)
            else:
                hold.update(h.pending_mask_request_ids)
        self.held_total += len(hold)
        return frozenset(hold)

    # ---- the scheduler coroutine -------------------------------------------------------------
    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as exc:
            # A bug past the step boundary (processing, scheduling): no request may wait forever on
            # a loop that is gone, so fail them all and report the engine dead.
            log.exception("the scheduler loop crashed")
            self._mark_dead(exc)

    def _step_parts(self, batch: ScheduledBatch) -> list[tuple[ScheduledBatch, bool, int]]:
        """The launches a scheduled step becomes: (batch, beside the one before, GEMM SMs). One,
        unless split_decode_sms is set and the step mixes decodes with prompt rows and has no
        guided row: then its decodes, then its prompt rows beside them (two free slots needed),
        the decodes' GEMMs on split_decode_sms SMs and the prompt rows' on the rest. Only with
        SPLIT_MIN_DECODES decodes or more: the decodes' step reads every weight again, which their
        attention, hidden beside the prompt rows' GEMMs, must outweigh."""
        k = self.split_decode_sms
        if not k or self.runner.free_slots < 2:
            return [(batch, False, 0)]
        decodes = tuple(s for s in batch.seqs if s.num_tokens == 1)
        prompts = tuple(s for s in batch.seqs if s.num_tokens > 1)
        states = self._states
        if len(decodes) < SPLIT_MIN_DECODES or not prompts or any(
                (st := states.get(s.request_id)) is not None and st.guide is not None for s in batch.seqs):
            return [(batch, False, 0)]
        rest = max(self.ops.num_sms() - k, 0)
        self.split_steps += 1
        return [(ScheduledBatch(decodes, batch.released, len(decodes)), False, k),
                (ScheduledBatch(prompts, (), batch.num_tokens - len(decodes)), True, rest)]

    def _mark_dead(self, exc: BaseException) -> None:
        self._dead = f"{type(exc).__name__}: {exc}"
        log.error("engine marked dead: %s", self._dead)
        msg = f"the engine stopped after an error: {self._dead}"
        for rid, state in list(self._states.items()):
            try:
                self._finish(state, RequestStatus.FINISHED_ABORTED, "error", None, "", error=msg)
            except Exception:  # the scheduler itself may be what broke: still end the stream
                self._states.pop(rid, None)
                req = state.request
                state.stream.put(RequestOutput(
                    rid, "", (), None, True, "error", None, len(req.prompt_token_ids),
                    len(req.output_token_ids), req.num_cached_tokens, msg))

    async def _loop(self) -> None:
        inflight = self._inflight
        while True:
            if self.kv_publisher is not None:
                self._publish_kv_events()
            launched = False
            if self._late:
                self._advance_late()
            if self._suspect is not None and not inflight and not self._late and self._dead is None:
                await self._probe()
                continue
            if (len(inflight) < self.depth and self.runner.has_free_slot and self._dead is None
                    and self._suspect is None):
                batch = self.scheduler.schedule(sit_out=self._launch_ready_masks())
                if not batch.empty:
                    # An admitted request starts past the prompt tokens the prefix cache had.
                    for s in batch.seqs:
                        if s.new is not None:
                            self._stats.prefix_cache_hit_tokens_total += s.start_pos
                            self._stats.prefix_cache_queries_total += (
                                len(s.new.prompt_token_ids) + len(s.new.output_token_ids))
                    now = time.monotonic()
                    if not inflight and self._last_done is not None and self._busy_after_done:
                        # The device sat idle from the last completion to this launch with work
                        # waiting: the gap async scheduling exists to close.
                        self._stats.gpu_idle_seconds_total += max(0.0, now - self._last_done)
                    for part, beside, sms in self._step_parts(batch):
                        try:
                            # At depth 2 guided rows sample in a second pass, once their masks
                            # are filled on the grammar thread.
                            h = self.runner.execute(part, self._eos_for, self._fill_masks,
                                                    defer_masks=self.depth > 1, parallel_to_previous=beside,
                                                    gemm_sms=sms)
                        except Exception as exc:  # staging failed: fail this batch's requests
                            log.exception("step launch failed")
                            # On CUDA the launch runs the device work inline: its errors count too.
                            self._step_failed([s.request_id for s in part.seqs], exc)
                            break
                        inflight.append(h)
                        if h.awaiting_masks and self._guides_current(h):
                            self._start_masks(h)  # its guides have seen every token already
                        # Every sequence of the step, not only the sampling ones: a failed prefill
                        # chunk leaves its KV unwritten, so its request cannot go on either.
                        self._step_rids[h.step_id] = [s.request_id for s in part.seqs]
                        launched = True
                        if self.step_trace is not None:
                            self.step_trace.launched(h.step_id, part)
                        if self.record_events:
                            self.events.append(StepEvent("launch", h.step_id))
                    if not launched:
                        continue
                else:
                    for rid in batch.released:
                        self.runner.release(rid)
            if inflight and (not launched or len(inflight) >= self.depth):
                h = inflight.popleft()
                step_rids = self._step_rids.pop(h.step_id, [])
                if h.awaiting_masks and h.has_free_rows and not self._masks_ready(h):
                    # The masks are still filling: the free rows' tokens are processed meanwhile.
                    # The guided requests were held out of the step launched since, so nothing
                    # in flight reads their tokens before the second part is processed.
                    try:
                        first = await h.wait_first()
                    except Exception as exc:
                        self._drop_failed_step(h, step_rids, exc)
                        continue
                    self._process(first)
                    step_rids = list(h.masked_request_ids)
                    self.early_first_passes += 1
                    if self.runner.has_free_slot:
                        # h keeps its slot until its guided rows are sampled; the next step
                        # launches now, whatever the masks take (its guided requests sit out).
                        self._step_done(h, first)
                        self._step_rids[h.step_id] = step_rids
                        self._late.append(h)
                        self.late_steps += 1
                        self._busy_after_done = self.scheduler.has_unfinished()
                        continue
                if self._late and h.awaiting_masks and h.step_id not in self._masks:
                    await self._finish_late()  # h's masks need tokens of older, late steps
                await self._launch_when_masked(h)
                try:
                    out = await h.wait()
                except Exception as exc:
                    self._drop_failed_step(h, step_rids, exc)
                    continue
                self._step_done(h, out)
                self._process(out)
                # The next step's masks now fill on the mask thread; its second pass is launched
                # before the next schedule if they are done, else before it is waited for.
                self._busy_after_done = self.scheduler.has_unfinished()
                continue
            if self._late and not launched:
                await self._finish_late(one=True)  # nothing else to do meanwhile
                continue
            if not launched:
                self._wakeup.clear()
                if not self.scheduler.has_unfinished() or self._dead is not None:
                    await self._wakeup.wait()
                else:
                    # Work exists but nothing is schedulable right now (e.g. blocks are short).
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), 0.01)
                    except asyncio.TimeoutError:
                        pass
            else:
                await asyncio.sleep(0)  # let HTTP callbacks run between launches

    def _step_done(self, h: StepHandle, out: StepOutput) -> None:
        """Account a completed step (a late one's first pass: the device is done with its
        forward): device time, trace line, counters."""
        self._consecutive_failures = 0
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

    def _advance_late(self) -> None:
        """Without waiting: launch the second pass of each late step whose masks are filled, and
        process the guided rows of the oldest ones whose second pass has ended, in step order."""
        late = self._late
        for h in late:
            if h.awaiting_masks and self._masks_ready(h):
                self._launch_masked(h)
        while late and late[0].done():
            h = late.popleft()
            rids = self._step_rids.pop(h.step_id, [])
            try:
                out = h.result()
            except Exception as exc:
                self._drop_failed_step(h, rids, exc)
                continue
            self._process(out)

    async def _launch_when_masked(self, h: StepHandle) -> None:
        """Launch h's second pass once its masks are filled, the loop serving HTTP (the free
        rows' chunks) meanwhile. Only for the oldest step not yet collected: every earlier token
        of its guided requests is processed, so masks it never started are started here, on the
        mask thread. A failed fill fails the step in the launch."""
        if h.awaiting_masks and h.step_id not in self._masks:
            self._start_masks(h)
        if (job := self._masks.get(h.step_id)) is not None and not job.done():
            filled = asyncio.wrap_future(job)
            await asyncio.wait([filled])
            filled.exception()  # taken here so it is not logged as lost; job.result() raises it
        self._launch_masked(h)

    async def _finish_late(self, one: bool = False) -> None:
        """Wait for the late steps' masks and second passes, oldest first, and process their
        guided rows (one: the oldest only)."""
        late = self._late
        while late:
            h = late[0]
            await self._launch_when_masked(h)
            try:
                out = await h.wait()
            except Exception as exc:
                late.popleft()
                self._drop_failed_step(h, self._step_rids.pop(h.step_id, []), exc)
            else:
                late.popleft()
                self._step_rids.pop(h.step_id, None)
                self._process(out)
            if one:
                return

    def _publish_kv_events(self) -> None:
        """Hand the prefix cache's new events to the publisher (it queues; it never blocks)."""
        pool = self.scheduler.pool
        if pool.events:
            self.kv_publisher.publish(pool.events.take(), pool.cached_blocks)

    def _drop_failed_step(self, h: StepHandle, rids: list[str], exc: BaseException) -> None:
        """A step that raised when waited for (first pass or whole): its requests fail, its masks
        and trace line go, and the steps waiting for it start their masks."""
        log.exception("step %d failed", h.step_id)
        self._masks.pop(h.step_id, None)
        if self.step_trace is not None:
            self.step_trace.dropped(h.step_id)
        self._step_failed(rids, exc)
        self._masks_after(set())

    def _step_failed(self, rids: list[str], exc: BaseException) -> None:
        # The step's requests fail; whether the engine is at fault is for a probe step to say
        # once nothing else is in flight (new steps wait for it).
        self._fail_requests(rids, exc)
        if self._suspect is None:
            self._suspect = exc

    async def _probe(self) -> None:
        """Run a probe step alone: if it runs, the failure belonged to the failed step's requests
        and does not count; if it fails MAX_CONSECUTIVE_FAILURES times in a row, the engine is dead."""
        err = await run_probe(self.runner, self.scheduler.pool)
        if isinstance(err, ProbeUnavailable):
            # Every block is held (their owners' next steps will tell): count the failure
            # unexplained and go on, so those owners can run and free blocks.
            err = self._suspect
            self._suspect = None
            self._consecutive_failures += 1
            if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
                self._mark_dead(err)
            return
        if err is None:
            log.warning("a step failed (%s: %s) but a probe step ran: the device is fine",
                        type(self._suspect).__name__, self._suspect)
            self._suspect = None
            self._consecutive_failures = 0
            self._wakeup.set()
            return
        self._consecutive_failures += 1
        log.error("probe step %d failed: %s: %s", self._consecutive_failures, type(err).__name__, err)
        if self._consecutive_failures >= MAX_CONSECUTIVE_FAILURES:
            self._suspect = None
            self._mark_dead(err)
        else:
            await asyncio.sleep(0.05 * self._consecutive_failures)

    def _fail_requests(self, rids: list[str], exc: BaseException) -> None:
        msg = f"the engine step failed: {type(exc).__name__}: {exc}"
        for rid in rids:
            state = self._states.get(rid)
            if state is not None:
                self._finish(state, RequestStatus.FINISHED_ABORTED, "error", None, "", error=msg)

    def _process(self, out: StepOutput) -> None:
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
        for tok in out.sampled:
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
        self._masks_after(set(rejected))
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

    def _finish(self, state: _State, status: RequestStatus, reason: str, stop_reason: str | int | None,
                text: str, token_ids: tuple[int, ...] = (), lp: tuple[TokenLogprob, ...] | None = None,
                error: str | None = None) -> None:
        if state.finished:
            return
        state.finished = True
        req = state.request
        self.scheduler.finish(req.request_id, status)
        del self._states[req.request_id]
        now = time.monotonic()
        self._stats.request_success_total[reason] += 1
        self._stats.e2e_request_latency_seconds.observe(now - req.arrival)
        state.stream.put(RequestOutput(
            req.request_id, text, token_ids, lp, True, reason, stop_reason, len(req.prompt_token_ids),
            len(req.output_token_ids), req.num_cached_tokens, error))
        self._wakeup.set()
