"""ModelRunner: ScheduledBatch -> staged inputs -> forward -> sample -> sampled ids on the host.

The runner speaks only of arrays. Each of the backend's slots (base.NUM_SLOTS: two steps in
flight and a masked step) owns its own staging buffers (pinned on CUDA), device input buffers
and output buffers (buffers.py), so that step N+1 can be staged (staging.py) and launched while
step N still runs, and a step whose guided rows wait for their masks can keep its slot while the
next steps run on the others. The sampler's per-request state lives on the device (sampler.py);
decode and per-layer CUDA graphs are graphs.py's.

Numpy backend: the device part of a step runs in one worker thread, in launch order.
CUDA backend: it is enqueued on the slot's stream from the calling thread; a waiter thread
blocks on the slot's event so that completion reaches the event loop without blocking it.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.config import EngineConfig, ModelConfig
from vt.kernels.base import Backend
from vt.model.loader import load_weights
from vt.model.pooling import PoolingConfig
from vt.model.quantization import checkpoint_format, require_fp8_device
from vt.model.quantization import resolve as resolve_quantization
from vt.model.transformer import Transformer
from vt.runner.buffers import MAX_BANNED, SlotBuffers
from vt.runner.graphs import LAYER_GRAPH_SIZES, DecodeGraph, LayerGraphs, StepGraphs, padded_size
from vt.runner.memory_plan import (
    check_serves_full_context,
    kv_cache_blocks,
    plan_step_memory,
    reserve_step_memory,
)
from vt.runner.pooling import PooledRow, StepPooler
from vt.runner.sampler import StepSampler
from vt.runner.staging import EosFor, SamplerRows, StagedBatch, stage_batch, upload_inputs
from vt.sampling_params import MAX_LOGPROBS, SamplingParams
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq
from vt.structured.spec import GrammarSpec, StructuredOutput

# Also importable from here: the engine's admission limit on banned stop ids (MAX_BANNED), and
# the layer-graph sizes bench/serving/schedule_sim.py pads its simulated steps to.
__all__ = ["LAYER_GRAPH_SIZES", "MAX_BANNED", "MaskFiller", "ModelRunner", "SampledToken", "StepHandle",
           "StepLaunch", "StepOutput", "padded_size", "slot_waiters"]

# fill(request_ids, out): out i32[len(request_ids), mask words] gets each request's allowed-token
# bitmask (structured outputs); the engine supplies it, the runner only moves the arrays.
MaskFiller = Callable[[Sequence[str], np.ndarray], None]


@dataclass(slots=True)  # one per sampled token: slotted and unfrozen, cheap to build
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None


@dataclass(frozen=True)
class StepOutput:
    step_id: int
    sampled: tuple[SampledToken, ...]   # one per sequence of the batch with sample=True
    launch_time: float
    done_time: float
    # an embedding model's step samples nothing: the pooled state of each sequence with sample=True
    pooled: tuple[PooledRow, ...] = ()


@dataclass(frozen=True)
class StepLaunch:
    """A staged step as the runner launches it: its slot, how it runs and what it runs after."""

    slot: int
    staged: StagedBatch
    route: str                           # "graph" (decode), "layer_graphs" or "eager"
    padded: int                          # the captured size the step is padded to (0: eager)
    fences: tuple[int, ...]              # slots whose second passes this step runs after
    parallel_to_previous: bool           # runs beside the step launched just before, not after it
    gemm_sms: int                        # SMs its GEMMs are held to (0: all)

    @property
    def deferred(self) -> bool:
        """A masked step: its guided rows sample in a second pass, once their masks are in."""
        return self.staged.deferred

    @property
    def num_masks(self) -> int:
        return self.staged.num_masks

    # The step's sizes by the names bench/serving (emulated_device.py, host_overhead.py) reads.
    @property
    def nseq(self) -> int:
        return self.staged.num_seqs

    @property
    def ntok(self) -> int:
        return self.staged.num_tokens


class StepHandle:
    """A launched step. `wait()` (async) or `result()` (blocking) gives its StepOutput.

    A masked step (`awaiting_masks`: its guided rows sample after their masks) is launched with
    its first sampler pass, which samples and records every other row, so that the next step can
    launch behind it; `ModelRunner.sample_deferred` gives it the masks and launches the second
    pass, which samples the guided rows, and only then may it be waited for. Its first pass can
    be collected before that (`wait_first()`: every row but the guided ones), so that the free
    rows are processed while the masks fill; `wait()` then gives the guided rows alone."""

    def __init__(self, runner: ModelRunner, step_id: int, slot: int, staged: StagedBatch,
                 future: concurrent.futures.Future | None, launch_time: float,
                 deferred: StepLaunch | None = None, first: concurrent.futures.Future | None = None) -> None:
        self.runner, self.step_id, self.slot, self.staged = runner, step_id, slot, staged
        self.future = future
        self.launch_time = launch_time
        self.deferred = deferred
        self.first = first  # a masked step's first pass: when its free rows are on the host
        self.first_collected = False

    @property
    def awaiting_masks(self) -> bool:
        return self.deferred is not None

    @property
    def pending_mask_request_ids(self) -> tuple[str, ...]:
        """The requests whose tokens the second pass samples; () once it is launched."""
        return self.deferred.staged.mask_request_ids if self.deferred is not None else ()

    @property
    def has_free_rows(self) -> bool:
        """Whether the first pass samples any row (a masked step's are not all guided)."""
        return len(self.staged.masked_rows) < len(self.staged.sampled)

    @property
    def masked_request_ids(self) -> tuple[str, ...]:
        """The requests the second pass samples, before and after it is launched."""
        masked = self.staged.masked_rows
        return tuple(rid for b, rid in self.staged.sampled if b in masked)

    def _check_sampled(self) -> concurrent.futures.Future:
        if self.deferred is not None or self.future is None:
            raise RuntimeError(f"step {self.step_id} is waited for before its sampler was launched")
        return self.future

    def done(self) -> bool:
        return self.deferred is None and self.future is not None and self.future.done()

    def result(self) -> StepOutput:
        future = self._check_sampled()
        try:
            future.result()  # re-raises a failure of the step
        except BaseException:
            self.runner._free_slot(self)
            raise
        return self.runner._collect(self)

    async def wait(self) -> StepOutput:
        import asyncio

        future = self._check_sampled()
        try:
            await asyncio.wrap_future(future)
        except BaseException:
            if future.done():  # the step failed (not the waiter cancelled): its slot is free
                self.runner._free_slot(self)
            raise
        return self.runner._collect(self)

    async def wait_first(self) -> StepOutput:
        """A masked step's first pass, before its second is launched: the tokens of every
        sampling row but the guided ones (which wait() gives afterwards)."""
        import asyncio

        if self.first is None or self.deferred is None:
            raise RuntimeError(f"step {self.step_id} has no first pass of its own to wait for")
        try:
            await asyncio.wrap_future(self.first)
        except BaseException:
            if self.first.done():
                self.runner._free_slot(self)
            raise
        out = self.runner._collect(self, first=True)
        self.first_collected = True
        return out


def slot_waiters(slots: int) -> list[concurrent.futures.ThreadPoolExecutor]:
    """One single-thread executor per slot: a slot's waits end in launch order, independently of
    the other slots'."""
    return [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"vt-wait{i}") for i in range(slots)]


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, ops: Backend, max_model_len: int,
                 pooling: PoolingConfig | None = None) -> None:
        """pooling: an embedding model (the pooling runner): its steps end at each finishing
        sequence's pooled state (StepOutput.pooled), with no lm_head, logits or sampling."""
        self.model_cfg, self.cfg, self.ops = model_cfg, cfg, ops
        self.max_model_len = max_model_len
        self.block_size = cfg.block_size
        self.cascade = not cfg.disable_cascade_attn
        self.pooling = pooling
        # fp8 weights: the checkpoint's format, or --quantization fp8 on an unquantized one
        self.fp8 = resolve_quantization(checkpoint_format(model_cfg.quantization_config), cfg.quantization)
        if self.fp8 is not None and cfg.tensor_parallel_size == 1:  # (a split refuses fp8 in the model)
            require_fp8_device(self.fp8, ops.fp8_weights_unsupported())  # before gigabytes are read
        weights = load_weights(cfg.model, model_cfg, self.fp8, pooling is None)  # lm_head: not for pooling
        self.model = Transformer(model_cfg, weights, ops, cfg.tensor_parallel_size, self.fp8,
                                 lm_head=pooling is None, kv_cache_dtype=cfg.kv_cache_dtype)
        del weights
        self.max_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.max_seqs = cfg.max_num_seqs
        self.max_blocks = -(-max_model_len // self.block_size)
        # Everything a step needs is reserved before the KV cache takes the rest.
        self.step_memory = plan_step_memory(model_cfg, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                            cfg.tensor_parallel_size, self.fp8, pooling is not None)
        reserve_step_memory(ops, cfg, self.step_memory)
        self.mask_words = -(-model_cfg.vocab_size // 32)
        # An embedding model samples nothing: its sampler keeps the rows' last tokens only (the
        # per-token tables are one column wide instead of max_num_seqs x vocab).
        sampled_vocab = 1 if pooling is not None else model_cfg.vocab_size
        self.sampler = StepSampler(ops, cfg.max_num_seqs, sampled_vocab, self.mask_words)
        self.slots = [SlotBuffers(ops, self.max_tokens, self.max_seqs, self.max_blocks, self.mask_words)
                      for _ in range(ops.num_slots())]
        self.pooler = StepPooler(ops, self.model, ops.num_slots(), self.max_seqs) if pooling else None
        # slot -> (logits or decode graph, arena offset) of a masked step whose sampler waits for
        # its masks
        self._parked: dict[int, tuple[Any, int | None]] = {}
        self.num_blocks = kv_cache_blocks(ops, cfg, model_cfg, max_model_len)
        self.kv = self.model.allocate_kv(self.num_blocks, self.block_size)
        self.sampler_rows = SamplerRows(cfg.max_num_seqs, self.max_blocks)
        self.step_id = 0
        # The slots the next step runs after (the last step's, and that of a step launched beside
        # it), and the ones the last step itself ran after (what a step beside it runs after).
        self.prev_slots: tuple[int, ...] = ()
        self._prev_waits: tuple[int, ...] = ()
        # The step id holding each slot, until its tokens are all collected: a masked step keeps
        # its slot (staged inputs, parked logits, outputs) while the next steps take the others.
        self._owner: list[int | None] = [None] * len(self.slots)
        self._last_slot = -1  # the slot the last step was launched on (host side)
        # Slots where a second pass was launched since the last step: the next step runs after
        # them, as it may read their tokens (the stream order of the step before it covers only
        # its own slot).
        self._fences: set[int] = set()
        # numpy: the step's device part runs here, in launch order (the one device).
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vt-step")
        # cuda: one thread per slot waits on that slot's stream. With one thread for all, a
        # masked step's wait (queued once its masks are in) sat behind the next step's, queued
        # at that step's launch: its tokens came a whole step late and the device idled while
        # they were processed.
        self.waiters = slot_waiters(ops.num_slots()) if ops.name != "numpy" else []
        self.step_graphs = StepGraphs(ops, self.model, self.kv, self.slots, self.sampler, self.max_seqs,
                                      self.max_tokens, self.max_blocks, max_model_len, decode=pooling is None)
        self.routes: Counter = Counter()  # steps launched by route, for tests and benchmarks
        self.guided_routes: Counter = Counter()  # the same, for steps with guided rows
        self.cascade_steps = 0  # steps whose decodes attended a shared prefix once (cascade)
        self.deferred_samples = 0  # masked steps: their sampler waited for the previous step's tokens
        if ops.name == "cuda" and not cfg.enforce_eager:
            self.capture_graphs()
        if ops.name == "cuda":
            self.profile_run()

    # ---- graphs -----------------------------------------------------------------------------
    @property
    def use_graphs(self) -> bool:
        return self.step_graphs.enabled

    @property
    def graphs(self) -> dict[tuple[int, int], DecodeGraph]:
        """Decode graphs by (slot, batch size)."""
        return self.step_graphs.decode

    @property
    def layer_graphs(self) -> dict[tuple[int, int], LayerGraphs]:
        """Per-layer graphs by (slot, token count)."""
        return self.step_graphs.layer

    @property
    def graph_sizes(self) -> tuple[int, ...]:
        return self.step_graphs.decode_sizes

    @property
    def layer_graph_sizes(self) -> tuple[int, ...]:
        return self.step_graphs.layer_sizes

    @property
    def padded_step_sizes(self) -> tuple[int, ...]:
        """Token counts a step that no decode graph serves is padded to (its per-layer graphs);
        empty where steps run at their own size."""
        return tuple(sorted({size for _, size in self.step_graphs.layer}))

    def capture_graphs(self) -> None:
        """Capture every graph up front and turn graph replay on: a capture in the middle of
        serving stalls the pipeline for as long as the capture takes."""
        self.step_graphs.capture()

    # ---- setup ------------------------------------------------------------------------------
    def check_serves_full_context(self) -> None:
        """Refuse to serve (StartupMemoryError naming the flags) where a request within
        --max-model-len could never run."""
        check_serves_full_context(self.cfg, self.max_model_len, self.num_blocks)

    def profile_run(self) -> None:
        """Run the largest step the flags allow once on each slot, at start: the most tokens over
        the most sequences, every one sampled with MAX_LOGPROBS logprobs and guided (so both
        sampler passes run), all at the longest context (decodes beside one long prompt chunk).
        A step that cannot run fails here, not on a request. Its tokens write only into block 0
        (nothing is cached yet) and its sampler rows are released before any request is
        admitted. An embedding model's largest step pools every sequence instead."""
        plan, mml = self.step_memory, self.max_model_len
        pooling = self.pooler is not None
        blocks = (0,) * self.max_blocks
        guided = StructuredOutput(GrammarSpec("regex", "a"))  # never compiled: every token allowed
        params = SamplingParams(max_tokens=1, temperature=0.0) if pooling else SamplingParams(
            max_tokens=1, temperature=0.0, logprobs=MAX_LOGPROBS, structured=guided)
        new = NewRequestData((1,), (), params)
        lens = [1] * plan.seqs
        extra = plan.tokens - plan.seqs
        for i in range(plan.seqs - 1, -1, -1):  # the rest as prompt chunks of at most mml tokens
            more = min(extra, mml - 1)
            lens[i] += more
            extra -= more
        seqs = tuple(ScheduledSeq(f"profile-{i}", mml - n, n, (1,) * n, False, blocks, True, 0, new)
                     for i, n in enumerate(lens))
        batch = ScheduledBatch(seqs, (), sum(lens))
        def allow_all(_rids: Sequence[str], out: np.ndarray) -> None:
            out.fill(-1)

        for _ in range(self.ops.num_slots()):
            h = self.execute(batch, lambda _rid: (), allow_all, defer_masks=not pooling)
            self.sample_deferred(h, allow_all)  # nothing to do for a step with no guided rows
            h.result()
        for i in range(plan.seqs):
            self.release(f"profile-{i}")
        # the counters describe served steps: the profile's guided, masked steps are not
        self.routes.clear()
        self.guided_routes.clear()
        self.cascade_steps = 0
        self.deferred_samples = 0

    def release(self, request_id: str) -> None:
        """The request left the running set: its sampler row takes another request."""
        self.sampler_rows.release(request_id)

    # ---- a step -----------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, eos_for: EosFor, fill_masks: MaskFiller | None = None,
                defer_masks: bool = False, parallel_to_previous: bool = False,
                gemm_sms: int = 0) -> StepHandle:
        """Stage and launch one step; never waits for the device. eos_for(request_id) gives the
        token ids that min_tokens keeps banned; fill_masks the token bitmasks of guided rows.

        parallel_to_previous: the step shares no sequence with the one launched just before (a
        mixed step's prompt rows, that one its decodes), so it runs beside it on the device, after
        what that one runs after; the next step runs after both. gemm_sms > 0 holds the step's
        GEMMs to that many SMs (the step runs eager, so that every GEMM is held).

        A guided row whose input is the previous step's token (input_in_flight) cannot have its
        mask yet: the grammar must first see that token. Such a step (and, with defer_masks, any
        step with guided rows, whose masks then fill off the caller's thread) is a masked step: it
        samples in two passes. The first, launched now behind the forward, samples and records
        every other row; the logits stay parked for the second, which sample_deferred() launches
        with the masks and which samples and records the guided rows. The masks (and the tokens)
        are exactly those of depth 1, and the rows that need no mask never wait for one."""
        launch_time = time.monotonic()
        for request_id in batch.released:
            self.release(request_id)
        slot = self._take_slot()
        staged = stage_batch(self.slots[slot], batch, self.sampler_rows, self.block_size, eos_for,
                             defer_masks, self.cascade)
        if staged.num_masks:
            if fill_masks is None:
                raise ValueError("a guided request is in the step but no mask filler was given")
            if not staged.deferred:
                fill_masks(staged.mask_request_ids, self._mask_view(slot, staged.num_masks))
        step = self._plan_launch(slot, staged, parallel_to_previous, gemm_sms)
        return self._launch(step, launch_time)

    def _plan_launch(self, slot: int, staged: StagedBatch, parallel_to_previous: bool,
                     gemm_sms: int) -> StepLaunch:
        """The staged step's route (counted) and what it runs after."""
        route, padded = self.step_graphs.route(staged, gemm_sms)
        self.routes[route] += 1
        self.cascade_steps += bool(staged.cascade_blocks)
        if staged.num_masks:
            self.guided_routes[route] += 1
        return StepLaunch(slot, staged, route, padded, fences=tuple(self._fences - {slot}),
                          parallel_to_previous=parallel_to_previous, gemm_sms=gemm_sms)

    def _launch(self, step: StepLaunch, launch_time: float) -> StepHandle:
        """Run the step's device part (numpy: queued on the worker; CUDA: enqueued on its slot's
        stream now), give it the slot, and hand back its handle."""
        slot, deferred = step.slot, step.deferred
        self.step_id += 1
        future: concurrent.futures.Future | None = None
        first: concurrent.futures.Future | None = None
        if self.ops.name == "numpy":
            future = self.worker.submit(self._timed, self._device_step, step)
            first = future if deferred else None
        else:
            self._device_step(step)
        self._fences.clear()
        self._owner[slot] = self.step_id - 1
        if self.ops.name != "numpy":
            # A masked step's wait is for its first pass until sample_deferred() launches the
            # second (the slot records no other work before that).
            done = self._completion(slot)
            future, first = (None, done) if deferred else (done, None)
        return StepHandle(self, self.step_id - 1, slot, step.staged, future, launch_time,
                          step if deferred else None, first)

    # ---- slots ------------------------------------------------------------------------------
    @property
    def has_free_slot(self) -> bool:
        """Whether a step can be launched now: some slot holds no uncollected step."""
        return None in self._owner

    @property
    def free_slots(self) -> int:
        """Slots that hold no uncollected step."""
        return self._owner.count(None)

    def _take_slot(self) -> int:
        """The first free slot after the last one launched on (slots rotate when all are free)."""
        n = len(self.slots)
        for k in range(1, n + 1):
            if self._owner[(self._last_slot + k) % n] is None:
                self._last_slot = (self._last_slot + k) % n
                return self._last_slot
        raise RuntimeError("every slot holds a step whose tokens are not collected yet")

    def _free_slot(self, h: StepHandle) -> None:
        """h's tokens are all collected (or it failed): its slot takes new steps."""
        if self._owner[h.slot] == h.step_id:
            self._owner[h.slot] = None

    # ---- masked steps -----------------------------------------------------------------------
    def _mask_view(self, slot: int, rows: int) -> np.ndarray:
        return self.slots[slot].bitmask[0][: rows * self.mask_words].reshape(rows, self.mask_words)

    def deferred_masks(self, h: StepHandle) -> tuple[tuple[str, ...], np.ndarray]:
        """The request ids of a step awaiting its masks and the buffer their masks go to, in
        that order (what sample_deferred's filler gets)."""
        st = h.deferred
        if st is None:
            raise ValueError(f"step {h.step_id} does not wait for masks")
        return st.staged.mask_request_ids, self._mask_view(st.slot, st.staged.num_masks)

    def sample_deferred(self, h: StepHandle, fill_masks: MaskFiller) -> None:
        """Fill the masks of a step launched without its sampler and launch the sampler (never
        waits for the device). Call it once the step before h has been processed; a failure
        (of the masks or of the launch) fails h, whose wait() then raises it."""
        st = h.deferred
        if st is None:
            return
        rids, masks = self.deferred_masks(h)
        h.deferred = None
        self.deferred_samples += 1
        # A guided request that finished, or was preempted and admitted again, since the step was
        # staged may have lost its sampler row to another request: its masked token is not recorded.
        masked_record_host = self.slots[st.slot].masked_record_rows[0]
        for b, rid, row in st.staged.masked_owners:
            if self.sampler_rows.get(rid) is not row:
                masked_record_host[b] = -1
        forward = h.future  # numpy: the forward's job; the sampler's job checks its outcome
        try:
            fill_masks(rids, masks)
            if self.ops.name == "numpy":
                h.future = self.worker.submit(self._timed, self._resume_sample, (st, forward))
                return
            self._resume_sample((st, None))
            self._fences.add(st.slot)
            h.future = self._completion(st.slot)
        except Exception as exc:
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(exc)
            h.future = failed

    def _resume_sample(self, job: tuple[StepLaunch, concurrent.futures.Future | None]) -> None:
        """A masked step's second pass, on the logits its first pass parked."""
        st, forward = job
        if forward is not None:
            forward.result()  # the forward failed: so does the step
        parked, mark = self._parked.pop(st.slot)
        ops = self.ops
        with ops.slot(st.slot):
            if mark is not None:
                ops.arena_reserve(mark)  # the logits and the first pass's outputs stay where they are
            staged = st.staged
            logits = parked.logits[: staged.num_seqs] if isinstance(parked, DecodeGraph) else parked
            self.sampler.sample_masked(self.slots[st.slot], logits, staged.num_seqs, staged.logprobs_k,
                                       staged.num_masks)
            ops.record(st.slot)

    def _completion(self, slot: int) -> concurrent.futures.Future:
        """A future of when the work launched so far on `slot` ends (device backends)."""
        return self.waiters[slot].submit(self._timed, self.ops.wait, slot)

    @staticmethod
    def _timed(fn: Any, arg: Any) -> float:
        """Run fn(arg) and return when it ended: the step's completion time, not its collection."""
        fn(arg)
        return time.monotonic()

    # ---- the device part of a step ----------------------------------------------------------
    def _device_step(self, st: StepLaunch) -> None:
        """On the step's slot: wait for the steps it runs after, run the forward, the first
        sampler pass, and park a masked step's logits for its second."""
        ops, slot = self.ops, st.slot
        with ops.slot(slot):
            self._order_after_previous(st)
            ops.limit_gemm_sms(slot, st.gemm_sms)
            if self.pooler is not None:  # an embedding model: no logits, no sampler
                hidden, rows = self._hidden(st)
                self.pooler.pool(slot, hidden, rows, st.staged.num_seqs)
                ops.record(slot)
                return
            forward = self._forward(st)
            self._sample_first_pass(st, forward)
            ops.record(slot)  # the next step launches behind this (the first pass, if deferred)
            if st.deferred:  # sample_deferred() brings the masks and launches the second pass
                mark = ops.arena_mark()
                if isinstance(forward, DecodeGraph) and forward.high:
                    mark = max(mark, forward.high)  # the second pass allocates past the graphs' buffers
                self._parked[slot] = (forward, mark)

    def _order_after_previous(self, st: StepLaunch) -> None:
        """The step's stream waits for the steps it runs after: the last one's slots (or, beside
        it, what it ran after) and the second passes launched since."""
        slot = st.slot
        waits = self._prev_waits if st.parallel_to_previous else self.prev_slots
        for other in dict.fromkeys((*waits, *st.fences)):
            if other != slot:
                self.ops.after(slot, other)
        if st.parallel_to_previous:
            self.prev_slots = (*self.prev_slots, slot)
        else:
            self._prev_waits, self.prev_slots = self.prev_slots, (slot,)

    def _forward(self, st: StepLaunch) -> Any:
        """The step's forward by its route: the decode graph (its forward part replayed), or the
        logits of the per-layer graphs or of an eager forward."""
        staged = st.staged
        if st.route == "graph":
            return self.step_graphs.replay_decode_forward(st.slot, staged, st.padded)
        for row, new in staged.penalty_inits:
            self.sampler.init_penalty_row(row, new)
        for row, tokens, biases in staged.bias_inits:
            self.sampler.init_bias_row(row, tokens, biases)
        if st.route == "layer_graphs":
            return self.step_graphs.replay_layers(st.slot, staged, st.padded)
        fb = upload_inputs(self.ops, self.slots[st.slot], self.sampler.last_tokens, staged.num_tokens,
                           staged.num_seqs, staged.max_blocks, staged.max_query_len, staged.max_seq_len,
                           staged.num_decodes, staged.cascade_blocks)
        return self.model.forward(fb, self.kv)

    def _hidden(self, st: StepLaunch) -> tuple[Any, Any]:
        """An embedding model's forward by its route (per-layer graphs or eager; it has no decode
        graphs): the residual stream and the row each sequence ends on."""
        staged = st.staged
        if st.route == "layer_graphs":
            hidden, fb = self.step_graphs.replay_hidden(st.slot, staged, st.padded)
            return hidden, fb.logits_indices
        fb = upload_inputs(self.ops, self.slots[st.slot], self.sampler.last_tokens, staged.num_tokens,
                           staged.num_seqs, staged.max_blocks, staged.max_query_len, staged.max_seq_len,
                           staged.num_decodes, staged.cascade_blocks)
        return self.model.hidden(fb, self.kv), fb.logits_indices

    def _sample_first_pass(self, st: StepLaunch, forward: Any) -> None:
        """The sampler of a step whose forward ran: the decode graph's sampler part after the
        masks, or the sampler on the logits. A masked step's masks come later: this pass leaves
        its guided rows unrecorded (record_rows) for the second."""
        buf, staged = self.slots[st.slot], st.staged
        masks = 0 if staged.deferred else staged.num_masks
        if isinstance(forward, DecodeGraph):
            self.sampler.apply_masks(buf, forward.logits, masks)
            forward.sample.replay()
        else:
            self.sampler.sample(buf, forward, staged.num_seqs, staged.logprobs_k, staged.any_penalty,
                                staged.any_ban, masks, staged.num_biased)

    # ---- results ------------------------------------------------------------------------------
    def _collect(self, h: StepHandle, first: bool = False) -> StepOutput:
        """The step's sampled tokens; first: only its first pass's rows (every row but the
        masked ones), and once those are collected, a later call gives the masked rows alone.
        An embedding model's step gives its finished prompts' pooled states instead."""
        if self.pooler is not None:
            done = h.future.result()
            pooled = self.pooler.collect(h.slot, h.staged.sampled)
            self._free_slot(h)
            return StepOutput(h.step_id, (), h.launch_time, done, pooled)
        buf = self.slots[h.slot]
        k = h.staged.logprobs_k
        masked = h.staged.masked_rows
        out = []
        for b, rid in h.staged.sampled:
            is_masked = b in masked
            if (first and is_masked) or (h.first_collected and not is_masked):
                continue
            got = buf.masked_out if is_masked else buf.out
            if k:
                top = tuple((int(i), float(v)) for i, v in zip(got.top_ids[b * k:(b + 1) * k],
                                                               got.top_lp[b * k:(b + 1) * k]))
                out.append(SampledToken(rid, int(got.ids[b]), float(got.logprob[b]), top))
            else:
                out.append(SampledToken(rid, int(got.ids[b]), None, None))
        done = (h.first if first else h.future).result()
        if not first:
            self._free_slot(h)
        return StepOutput(h.step_id, tuple(out), h.launch_time, done)

    def shutdown(self) -> None:
        self.worker.shutdown(wait=True)
        for w in self.waiters:
            w.shutdown(wait=True)
