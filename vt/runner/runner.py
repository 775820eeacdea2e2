"""ModelRunner: ScheduledBatch -> staged inputs -> forward -> sample -> sampled ids on the host.

The runner speaks only of arrays. Each of the backend's slots (three) owns its own staging
buffers (pinned on CUDA), device input buffers and output buffers, so that step N+1 can be
prepared and launched while step N still runs, and a step whose guided rows wait for their masks
can keep its slot while the next steps run on the others. Per-request sampler state (the last
sampled token, output token counts, the prompt-token mask) lives on the device in one row per
running request; a decode whose input token is not yet on the host reads it from
`last_tokens[row]`, which the previous step's sampler wrote (stream order makes that safe).

Numpy backend: the device part of a step runs in one worker thread, in launch order.
CUDA backend: it is enqueued on the slot's stream from the calling thread; a waiter thread
blocks on the slot's event so that completion reaches the event loop without blocking it.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.config import EngineConfig, ModelConfig
from vt.kernels.base import Backend
from vt.model.batch import ForwardBatch
from vt.model.loader import load_weights
from vt.model.transformer import Transformer
from vt.runner.memory_plan import StepMemory, plan_step_memory
from vt.sampling_params import MAX_LOGIT_ENTRIES, MAX_LOGPROBS, SamplingParams
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq
from vt.structured.spec import GrammarSpec, StructuredOutput

MAX_BANNED = 16  # eos + stop_token_ids masked while min_tokens is not reached
# fill(request_ids, out): out i32[len(request_ids), mask words] gets each request's allowed-token
# bitmask (structured outputs); the engine supplies it, the runner only moves the arrays.
MaskFiller = Callable[[Sequence[str], np.ndarray], None]
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Token counts the piecewise graphs of other steps are captured for. Longer steps run eager:
# their GPU time dwarfs the ~7 us a launch costs on the host.
LAYER_GRAPH_SIZES = (16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)


# Device memory kept free for the captured graphs when the KV cache is sized from what is left.
GRAPH_RESERVE = 512 << 20


class StartupMemoryError(ValueError):
    """The flags ask for more device memory than the card has left; the message names them."""


def padded_size(sizes: tuple[int, ...], n: int) -> int:
    """The smallest captured size that holds n, or 0 when none does (sizes ascending)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else 0


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


_ROW_PARAM_FIELDS = (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                     ("min_p", np.float32), ("seeds", np.int64), ("presence", np.float32),
                     ("frequency", np.float32), ("repetition", np.float32))


@dataclass
class _Row:
    index: int
    params: SamplingParams
    eos_ids: tuple[int, ...]
    penalized: bool
    guided: bool = False  # a grammar masks its tokens (structured outputs)
    num_blocks: int = 0   # entries of the row's block table line written so far
    # logit_bias / allowed_token_ids as SamplingParams.logit_entries() gives them, or None
    bias: tuple[tuple[int, ...], tuple[float, ...], bool] | None = None


@dataclass(frozen=True)
class _SampledBuffers:
    """Pinned host outputs of one sampler pass."""

    ids: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_lp: np.ndarray

    @classmethod
    def pinned(cls, ops: Backend, max_seqs: int) -> _SampledBuffers:
        return cls(ops.pinned_empty((max_seqs,), np.int32), ops.pinned_empty((max_seqs,), np.float32),
                   ops.pinned_empty((max_seqs * MAX_LOGPROBS,), np.int32),
                   ops.pinned_empty((max_seqs * MAX_LOGPROBS,), np.float32))


class _SlotBuffers:
    """Host staging and device inputs/outputs of one slot, allocated once."""

    def __init__(self, ops: Backend, max_tokens: int, max_seqs: int, max_blocks: int,
                 mask_words: int) -> None:
        def pair(shape: tuple[int, ...], np_dtype: Any, dtype: str) -> tuple[np.ndarray, Any]:
            return ops.pinned_empty(shape, np_dtype), ops.zeros(shape, dtype)

        i32, f32 = np.int32, np.float32
        self.input_ids = pair((max_tokens,), i32, "i32")
        self.src_rows = pair((max_tokens,), i32, "i32")
        self.positions = pair((max_tokens,), i32, "i32")
        self.slot_mapping = pair((max_tokens,), i32, "i32")
        self.query_start_loc = pair((max_seqs + 1,), i32, "i32")
        self.seq_lens = pair((max_seqs,), i32, "i32")
        self.logits_indices = pair((max_seqs,), i32, "i32")
        self.block_tables = pair((max_seqs * max_blocks,), i32, "i32")
        self.sample_rows = pair((max_seqs,), i32, "i32")
        # The sampler rows whose tokens the step's sampler records: sample_rows, less the guided
        # rows of a step that samples them later (late_rows, recorded by its second sampler pass).
        self.record_rows = pair((max_seqs,), i32, "i32")
        self.late_rows = pair((max_seqs,), i32, "i32")
        self.temperature = pair((max_seqs,), f32, "f32")
        self.top_k = pair((max_seqs,), i32, "i32")
        self.top_p = pair((max_seqs,), f32, "f32")
        self.min_p = pair((max_seqs,), f32, "f32")
        self.seeds = ops.pinned_empty((max_seqs,), np.int64), ops.zeros((max_seqs,), "i64")
        self.offsets = pair((max_seqs,), i32, "i32")
        self.presence = pair((max_seqs,), f32, "f32")
        self.frequency = pair((max_seqs,), f32, "f32")
        self.repetition = pair((max_seqs,), f32, "f32")
        self.ban = pair((max_seqs * MAX_BANNED,), i32, "i32")
        # Structured outputs: the token bitmasks of the step's guided rows, packed, and the batch
        # row each one masks. One mask row per sequence at most, like every per-row buffer.
        self.bitmask = pair((max_seqs * mask_words,), i32, "i32")
        self.mask_rows = pair((max_seqs,), i32, "i32")
        # logit_bias / allowed_token_ids: (batch row, table row, entries, exclusive) per biased row
        self.bias_sel = pair((max_seqs * 4,), i32, "i32")
        # the sampler's outputs: the (first) pass's, and a deferred step's second pass's (its
        # guided rows'): ids, the chosen logprob, top ids and top logprobs
        self.out = _SampledBuffers.pinned(ops, max_seqs)
        self.late = _SampledBuffers.pinned(ops, max_seqs)


class StepHandle:
    """A launched step. `wait()` (async) or `result()` (blocking) gives its StepOutput.

    A step whose guided rows sample after their masks (`awaiting_masks`) is launched with its
    first sampler pass, which samples and records every other row, so that the next step can
    launch behind it; `ModelRunner.sample_deferred` gives it the masks and launches the second
    pass, which samples the guided rows, and only then may it be waited for. Its first pass can
    be collected before that (`wait_first()`: every row but the guided ones), so that the free
    rows are processed while the masks fill; `wait()` then gives the guided rows alone."""

    def __init__(self, runner: ModelRunner, step_id: int, slot: int, plan: _Plan,
                 future: concurrent.futures.Future | None, launch_time: float,
                 deferred: _Launch | None = None, first: concurrent.futures.Future | None = None) -> None:
        self.runner, self.step_id, self.slot, self.plan = runner, step_id, slot, plan
        self.future = future
        self.launch_time = launch_time
        self.deferred = deferred
        self.first = first  # a deferred step's first pass: when its free rows are on the host
        self.first_collected = False

    @property
    def awaiting_masks(self) -> bool:
        return self.deferred is not None

    @property
    def pending_mask_request_ids(self) -> tuple[str, ...]:
        """The requests whose tokens the second pass samples; () once it is launched."""
        return self.deferred.mask_rids if self.deferred is not None else ()

    @property
    def has_free_rows(self) -> bool:
        """Whether the first pass samples any row (a deferred step's are not all guided)."""
        return len(self.plan.late) < len(self.plan.sample_req)

    @property
    def masked_request_ids(self) -> tuple[str, ...]:
        """The requests the second pass samples, before and after it is launched."""
        late = self.plan.late
        return tuple(rid for b, rid in self.plan.sample_req if b in late)

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
        """A deferred step's first pass, before its second is launched: the tokens of every
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
    the other slot's."""
    return [concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"vt-wait{i}") for i in range(slots)]


@dataclass
class _Pieces:
    """One padded token count's layers, captured piecewise for steps no decode graph serves
    (prefill, mixed, penalties, logprobs): graphs[0] runs up to layer 0's attention and
    graphs[l + 1] from layer l's attention output on, the last one to the hidden state.
    Attention runs uncaptured between them (its grid depends on the batch), reading q and
    writing out in place; the final norm, lm_head and sampler run uncaptured after."""

    size: int
    graphs: list[Any]
    attention: list[tuple[Any, Any, Any, Any]]  # (q, k_cache, v_cache, out) per layer
    hidden: Any                                 # the residual stream the last graph leaves
    high: int                                   # arena bytes the graphs' buffers take


@dataclass(slots=True)
class _DecodeGraph:
    """One padded decode size, captured in two parts: `forward` stages the inputs and runs the
    model to `logits`, `sample` runs the sampler on them. A free step replays both back to back;
    a guided step applies its masks to `logits` between them, possibly only once the previous
    step's tokens are in (the forward already running), so guided rows keep the decode graph.
    On CUDA `logits` is the captured buffer every replay rewrites; on numpy each forward replay
    sets it."""

    forward: Any = None
    sample: Any = None
    logits: Any = None
    high: int = 0  # CUDA: the arena offset past the graphs' buffers (eager work goes above it)


@dataclass
class _Plan:
    """Host-side facts about a launched step that the collector needs."""

    sample_req: list[tuple[int, str]]   # (batch row, request id) of sampling sequences
    logprobs_k: int
    late: frozenset[int] = frozenset()  # batch rows sampled by the second pass (guided, deferred)


@dataclass(frozen=True)
class _Launch:
    """What the device part of a step needs from its host-side staging."""

    slot: int
    ntok: int
    nseq: int
    mb: int                              # block-table stride of this step
    penalty_inits: list
    logprobs_k: int
    any_penalty: bool
    any_ban: bool
    max_query_len: int
    max_seq_len: int
    route: str                           # "graph" (decode), "pieces" or "eager"
    padded: int                          # the captured size the step is padded to (0: eager)
    num_decodes: int                     # leading sequences with one token each
    num_masks: int = 0                   # guided rows: bitmask rows staged for the sampler
    mask_rids: tuple[str, ...] = ()      # their request ids, in bitmask row order
    deferred: bool = False               # masks come after the previous step: sample later
    bias_inits: tuple = ()               # (row, tokens, biases) of admissions that bias logits
    num_biased: int = 0                  # rows whose logits get a bias line (bias_sel entries)
    late_owners: tuple = ()              # (batch row, request id, _Row) the second pass records
    fences: tuple[int, ...] = ()         # slots whose second passes this step runs after
    parallel_to_previous: bool = False        # runs beside the step launched just before, not after it
    gemm_sms: int = 0                    # SMs its GEMMs are held to (0: all)


class ModelRunner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, ops: Backend, max_model_len: int) -> None:
        self.model_cfg, self.cfg, self.ops = model_cfg, cfg, ops
        self.max_model_len = max_model_len
        self.block_size = cfg.block_size
        weights = load_weights(cfg.model, model_cfg)
        self.model = Transformer(model_cfg, weights, ops, cfg.tensor_parallel_size)
        del weights
        self.max_tokens = max(cfg.max_num_batched_tokens, cfg.max_num_seqs)
        self.max_seqs = cfg.max_num_seqs
        self.max_blocks = -(-max_model_len // self.block_size)
        # Everything a step needs is reserved before the KV cache takes the rest.
        self.step_memory = plan_step_memory(model_cfg, cfg.max_num_batched_tokens, cfg.max_num_seqs,
                                            cfg.tensor_parallel_size)
        self._reserve_step_memory(self.step_memory)
        vocab = model_cfg.vocab_size
        rows = cfg.max_num_seqs
        self.last_tokens = ops.zeros((rows,), "i32")
        self.out_counts = ops.zeros((rows, vocab), "i32")
        self.prompt_mask = ops.zeros((rows, vocab), "u8")
        # logit_bias / allowed_token_ids by sampler row, written at admission: ids ascending and
        # their biases (a request holds at most MAX_LOGIT_ENTRIES, checked by SamplingParams)
        self.bias_tokens = ops.zeros((rows, MAX_LOGIT_ENTRIES), "i32")
        self.bias_values = ops.zeros((rows, MAX_LOGIT_ENTRIES), "f32")
        self.inv_freq = ops.from_host(model_cfg.inv_freq(), "f32")
        self.mask_words = -(-vocab // 32)
        self.slots = [_SlotBuffers(ops, self.max_tokens, self.max_seqs, self.max_blocks, self.mask_words)
                      for _ in range(ops.num_slots())]
        # slot -> (logits or decode graph, arena offset) of a step whose sampler waits for its masks
        self._parked: dict[int, tuple[Any, int | None]] = {}
        self.num_blocks = self._size_kv()
        self.kv = self.model.allocate_kv(self.num_blocks, self.block_size)
        self.rows: dict[str, _Row] = {}
        self.free_rows = list(range(rows - 1, -1, -1))
        # Sampling parameters by sampler row, set at admission: a step gathers its rows' values
        # with one indexed copy per field instead of per-sequence scalar stores.
        self.row_params = {name: np.zeros(rows, dt) for name, dt in _ROW_PARAM_FIELDS}
        # Block table lines by sampler row, kept across steps: a running request's blocks only
        # grow, so a step writes the new entries and gathers its rows' lines in one take.
        self.row_blocks = np.zeros((rows, self.max_blocks), np.int32)
        self.step_id = 0
        # The slots the next step runs after (the last step's, and that of a step launched beside
        # it), and the ones the last step itself ran after (what a step beside it runs after).
        self.prev_slots: tuple[int, ...] = ()
        self._prev_waits: tuple[int, ...] = ()
        # The step id holding each slot, until its tokens are all collected: a step whose second
        # pass waits for masks keeps its slot (staged inputs, parked logits, outputs) while the
        # next steps take the others.
        self._owner: list[int | None] = [None] * len(self.slots)
        self._last_slot = -1  # the slot the last step was launched on (host side)
        # Slots where a second pass was launched since the last step: the next step runs after
        # them, as it may read their tokens (the stream order of the step before it covers only
        # its own slot).
        self._fences: set[int] = set()
        # numpy: the step's device part runs here, in launch order (the one device).
        self.worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vt-step")
        # cuda: one thread per slot waits on that slot's stream. With one thread for both, a
        # deferred step's wait (queued once its masks are in) sat behind the next step's,
        # queued at that step's launch: its tokens came a whole step late and the device idled
        # while they were processed.
        self.waiters = slot_waiters(ops.num_slots()) if ops.name != "numpy" else []
        self.graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self.pieces: dict[tuple[int, int], _Pieces] = {}
        self.graph_sizes = tuple(n for n in GRAPH_SIZES if n <= self.max_seqs)
        top = {self.max_tokens} if self.max_tokens <= LAYER_GRAPH_SIZES[-1] else set()
        self.layer_graph_sizes = tuple(sorted({n for n in LAYER_GRAPH_SIZES if n < self.max_tokens} | top))
        self.routes: Counter = Counter()  # steps launched by route, for tests and benchmarks
        self.guided_routes: Counter = Counter()  # the same, for steps with guided rows
        self.deferred_samples = 0  # steps whose sampler waited for the previous step's tokens
        self.use_graphs = False  # capture_graphs() turns it on
        if ops.name == "cuda" and not cfg.enforce_eager:
            self.capture_graphs()
        if ops.name == "cuda":
            self.profile_run()

    @property
    def padded_step_sizes(self) -> tuple[int, ...]:
        """Token counts a step that no decode graph serves is padded to (its piece graphs);
        empty where steps run at their own size."""
        return tuple(sorted({size for _, size in self.pieces}))

    # ---- setup ------------------------------------------------------------------------------
    def _reserve_step_memory(self, plan: StepMemory) -> None:
        """Reserve every slot's step memory, or refuse to start, naming the flags that size it."""
        ops, cfg = self.ops, self.cfg
        need = ops.num_slots() * plan.per_slot_bytes
        advice = (f"the largest step these flags allow ({plan.tokens} tokens over {plan.seqs} sequences: "
                  f"--max-num-batched-tokens {cfg.max_num_batched_tokens}, --max-num-seqs "
                  f"{cfg.max_num_seqs}) needs {need / 2**30:.2f} GiB of step memory")
        if ops.name == "cuda" and hasattr(ops, "mem_info"):
            free, total = ops.mem_info()
            allowed = free - total * (1.0 - cfg.gpu_memory_utilization)
            if need > allowed:
                raise StartupMemoryError(
                    f"{advice}, but only {max(allowed, 0) / 2**30:.2f} GiB is left after the weights "
                    f"within --gpu-memory-utilization {cfg.gpu_memory_utilization}; lower "
                    f"--max-num-batched-tokens or --max-num-seqs")
        try:
            ops.ensure_workspace(plan.arena_bytes, plan.attention_partials_bytes)
        except MemoryError as e:
            raise StartupMemoryError(f"{advice} and the device could not provide it ({e}); lower "
                                     f"--max-num-batched-tokens or --max-num-seqs") from None

    def _size_kv(self) -> int:
        """KV blocks: explicit (--num-gpu-blocks, --kv-cache-memory) or what the device has left
        within --gpu-memory-utilization once weights, step memory and sampler rows are taken."""
        cfg, mc = self.cfg, self.model_cfg
        tp = cfg.tensor_parallel_size  # the budget and the block sizes are one rank's
        dtype_bytes = 2 if self.ops.name == "cuda" else 4
        per_block = Transformer.kv_bytes_per_block(mc, cfg.block_size, dtype_bytes, tp)
        if cfg.num_gpu_blocks is not None:
            if cfg.num_gpu_blocks < 1:
                raise ValueError("--num-gpu-blocks must be at least 1")
            return cfg.num_gpu_blocks
        from_memory = (cfg.kv_cache_memory is None and self.ops.name == "cuda"
                       and hasattr(self.ops, "mem_info"))
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        elif from_memory:
            free, total = self.ops.mem_info()
            graphs = 0 if cfg.enforce_eager else GRAPH_RESERVE
            budget = int(free - total * (1.0 - cfg.gpu_memory_utilization) - graphs)
        else:
            # CPU: enough for every sequence at full length, capped at 1 GiB but never below one.
            need = cfg.max_num_seqs * self.max_model_len * Transformer.kv_bytes_per_block(mc, 1, 4, tp)
            budget = max(min(need, 1024**3), self.max_blocks * per_block)
        # More blocks than every sequence at full length (twice, for prefix-cache reuse) buys
        # nothing but a longer free list.
        useful = 2 * cfg.max_num_seqs * self.max_blocks
        blocks = min(max(budget, 0) // per_block, useful)
        if from_memory and blocks < self.max_blocks:
            raise StartupMemoryError(
                f"the KV cache gets {max(budget, 0) / 2**30:.2f} GiB ({blocks} blocks of {cfg.block_size} "
                f"tokens), less than one sequence of --max-model-len {self.max_model_len} needs "
                f"({self.max_blocks} blocks, {self.max_blocks * per_block / 2**30:.2f} GiB); raise "
                f"--gpu-memory-utilization or lower --max-model-len, --max-num-batched-tokens or "
                f"--max-num-seqs")
        if blocks < 1:
            raise StartupMemoryError(f"no memory left for the KV cache ({budget} bytes, {per_block} bytes a "
                                     f"block)")
        return int(blocks)

    def check_serves_full_context(self) -> None:
        """Refuse to serve (StartupMemoryError naming the flags) where a request within
        --max-model-len could still never run: a KV cache smaller than one sequence of that
        length, or, without chunked prefill, a step too small for one such prompt."""
        cfg, mml, blocks, bs = self.cfg, self.max_model_len, self.num_blocks, self.block_size
        if blocks < self.max_blocks:
            if cfg.num_gpu_blocks is not None:
                more = f"raise --num-gpu-blocks to at least {self.max_blocks}"
            elif cfg.kv_cache_memory is not None:
                more = "raise --kv-cache-memory"
            else:
                more = "raise --gpu-memory-utilization"
            raise StartupMemoryError(
                f"the KV cache holds {blocks} blocks of {bs} tokens ({blocks * bs} tokens), less than "
                f"one sequence of --max-model-len {mml} needs ({self.max_blocks} blocks); lower "
                f"--max-model-len to at most {blocks * bs}, or {more}")
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < mml:
            raise StartupMemoryError(
                f"without chunked prefill a prompt must fit one step, and --max-num-batched-tokens "
                f"{cfg.max_num_batched_tokens} is less than --max-model-len {mml}; raise "
                f"--max-num-batched-tokens, lower --max-model-len, or enable chunked prefill")

    def profile_run(self) -> None:
        """Run the largest step the flags allow once on each slot, at start: the most tokens over
        the most sequences, every one sampled with MAX_LOGPROBS logprobs and guided (so both
        sampler passes run), all at the longest context (decodes beside one long prompt chunk).
        A step that cannot run fails here, not on a request. Its tokens write only into block 0
        (nothing is cached yet) and its sampler rows are released before any request is
        admitted."""
        plan, mml = self.step_memory, self.max_model_len
        blocks = (0,) * self.max_blocks
        guided = StructuredOutput(GrammarSpec("regex", "a"))  # never compiled: every token allowed
        new = NewRequestData((1,), (), SamplingParams(max_tokens=1, temperature=0.0, logprobs=MAX_LOGPROBS,
                                                      structured=guided))
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
            h = self.execute(batch, lambda _rid: (), allow_all, defer_masks=True)
            self.sample_deferred(h, allow_all)
            h.result()
        for i in range(plan.seqs):
            self.release(f"profile-{i}")
        # the counters describe served steps: the profile's guided, deferred steps are not
        self.routes.clear()
        self.guided_routes.clear()
        self.deferred_samples = 0

    # ---- rows ---------------------------------------------------------------------------------
    def release(self, request_id: str) -> None:
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free_rows.append(row.index)

    def _admit(self, request_id: str, new: Any, eos_ids: tuple[int, ...]) -> _Row:
        self.release(request_id)
        if not self.free_rows:
            raise RuntimeError("no free sampler row (more running requests than max_num_seqs)")
        p = new.params
        penalized = (p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1.0)
        row = _Row(self.free_rows.pop(), p, eos_ids, penalized, p.structured is not None,
                   bias=p.logit_entries())
        self.rows[request_id] = row
        self.row_blocks[row.index].fill(0)
        values = (p.temperature, p.top_k if p.top_k > 0 else 0, p.top_p, p.min_p,
                  np.uint64(p.seed if p.seed is not None else 0).astype(np.int64), p.presence_penalty,
                  p.frequency_penalty, p.repetition_penalty)
        for (name, _), value in zip(_ROW_PARAM_FIELDS, values, strict=True):
            self.row_params[name][row.index] = value
        return row

    def _init_bias_row(self, row: _Row, tokens: tuple[int, ...], biases: tuple[float, ...]) -> None:
        """Write a row's logit_bias / allowed_token_ids line (device work on the current slot;
        admissions of such requests only, through from_host like the penalty rows)."""
        n = len(tokens)
        if n:
            ops = self.ops
            self.bias_tokens[row.index, :n] = ops.from_host(np.asarray(tokens, np.int32), "i32")
            self.bias_values[row.index, :n] = ops.from_host(np.asarray(biases, np.float32), "f32")

    def _init_penalty_row(self, row: _Row, new: Any) -> None:
        """Rebuild a row's prompt mask and output counts (device work on the current slot).
        Only admissions of requests with penalties come here; their small index uploads go through
        from_host, which allocates and waits for the stream: a known cost of those steps only."""
        ops = self.ops
        self.out_counts[row.index].fill(0)
        self.prompt_mask[row.index].fill(0)
        if new.prompt_token_ids:
            ids = ops.from_host(np.asarray(sorted(set(new.prompt_token_ids)), np.int32), "i32")
            self.prompt_mask[row.index, ids] = 1
        if new.output_token_ids:
            n = len(new.output_token_ids)
            scratch = ops.zeros((self.max_seqs,), "i32")
            ops.record_sampled(scratch, self.out_counts,
                               ops.from_host(np.full(n, row.index, np.int32), "i32"),
                               ops.from_host(np.asarray(new.output_token_ids, np.int32), "i32"))

    # ---- a step -----------------------------------------------------------------------------
    def execute(self, batch: ScheduledBatch, eos_for: Any, fill_masks: MaskFiller | None = None,
                defer_masks: bool = False, parallel_to_previous: bool = False,
                gemm_sms: int = 0) -> StepHandle:
        """Stage and launch one step; never waits for the device. eos_for(request_id) gives the
        token ids that min_tokens keeps banned; fill_masks the token bitmasks of guided rows.

        parallel_to_previous: the step shares no sequence with the one launched just before (a mixed
        step's prompt rows, that one its decodes), so it runs beside it on the device, after
        what that one runs after; the next step runs after both. gemm_sms > 0 holds the step's
        GEMMs to that many SMs (the step runs eager, so that every GEMM is held).

        A guided row whose input is the previous step's token (input_in_flight) cannot have its mask
        yet: the grammar must first see that token. Such a step (and, with defer_masks, any step
        with guided rows, whose masks then fill off the caller's thread) samples in two passes:
        the first, launched now behind the forward, samples and records every other row; the
        logits stay parked for the second, which sample_deferred() launches with the masks and
        which samples and records the guided rows. The masks (and the tokens) are exactly those
        of depth 1, and the rows that need no mask never wait for one."""
        launch_time = time.monotonic()
        for rid in batch.released:
            self.release(rid)
        slot = self._take_slot()
        buf = self.slots[slot]
        seqs = batch.seqs
        nseq = len(seqs)
        # Single-token sequences first: attention then runs them on decode tiles in one launch
        # and the longer ones in another. Rows are staged, sampled and collected in this order.
        longer = [s for s in seqs if s.num_tokens != 1]
        if longer and len(longer) < nseq:
            seqs = tuple([s for s in seqs if s.num_tokens == 1] + longer)
        num_decodes = nseq - len(longer)
        bs = self.block_size
        ids_h, src_h, pos_h, slot_h = (buf.input_ids[0], buf.src_rows[0], buf.positions[0],
                                       buf.slot_mapping[0])
        qsl_h, lens_h, li_h = buf.query_start_loc[0], buf.seq_lens[0], buf.logits_indices[0]
        penalty_inits = []
        bias_inits: list[tuple[_Row, tuple[int, ...], tuple[float, ...]]] = []
        biased: list[int] = []
        sample_req: list[tuple[int, str]] = []
        logprobs_k = 0
        any_penalty = any_ban = False
        decode_only = True
        mb = max(len(s.block_ids) for s in seqs)
        bt_h = buf.block_tables[0][: nseq * mb].reshape(nseq, mb)
        row_blocks = self.row_blocks
        ban_h = buf.ban[0][: nseq * MAX_BANNED].reshape(nseq, MAX_BANNED)
        ban_h.fill(-1)
        # Per-token and per-sequence values go to Python lists first and into the pinned buffers
        # with one store per field: per-element numpy stores cost more than the rest of a step's
        # host work at a few hundred sequences.
        ids: list[int] = []
        src: list[int] = []
        pos_l: list[int] = []
        slots_l: list[int] = []
        ends: list[int] = []
        lens: list[int] = []
        row_idx: list[int] = []
        offsets: list[int] = []
        sample_rows: list[int] = []
        masked: list[int] = []
        mask_rids: list[str] = []
        mask_owners: list[tuple[int, str, _Row]] = []
        from_last_guided = False
        t = 0
        for b, s in enumerate(seqs):
            if s.new is not None:
                row = self._admit(s.request_id, s.new, eos_for(s.request_id))
                decode_only = False
                if row.penalized:
                    penalty_inits.append((row, s.new))
                if row.bias is not None:
                    bias_inits.append((row, row.bias[0], row.bias[1]))
            else:
                row = self.rows[s.request_id]
            n, p0, blocks = s.num_tokens, s.start_pos, s.block_ids
            if n == 1:
                if s.input_in_flight:
                    ids.append(0)
                    src.append(row.index)
                else:
                    ids.extend(s.token_ids)
                    src.append(-1)
                pos_l.append(p0)
                slots_l.append(blocks[p0 // bs] * bs + p0 % bs)
            else:  # one-token decodes graph whether their input is known or input_in_flight
                decode_only = False
                ids.extend(s.token_ids)
                src.extend([-1] * n)
                pos = np.arange(p0, p0 + n, dtype=np.int32)
                pos_l.extend(pos.tolist())
                slots_l.extend((np.asarray(blocks, dtype=np.int32)[pos // bs] * bs + pos % bs).tolist())
            nb = len(blocks)
            if nb != row.num_blocks:
                if nb > row.num_blocks:  # the usual change: blocks appended
                    row_blocks[row.index, row.num_blocks: nb] = blocks[row.num_blocks:]
                else:
                    row_blocks[row.index].fill(0)
                    row_blocks[row.index, :nb] = blocks
                row.num_blocks = nb
            t += n
            ends.append(t)
            lens.append(p0 + n)
            row_idx.append(row.index)
            offsets.append(s.output_index)
            p = row.params
            if s.sample:
                sample_rows.append(row.index)
                sample_req.append((b, s.request_id))
                if p.logprobs is not None:
                    logprobs_k = max(logprobs_k, p.logprobs, 1)
                any_penalty |= row.penalized
                if s.output_index < p.min_tokens and row.eos_ids:
                    banned = row.eos_ids[:MAX_BANNED]
                    ban_h[b, : len(banned)] = banned
                    any_ban = True
                if row.bias is not None:
                    biased += (b, row.index, len(row.bias[0]), int(row.bias[2]))
                if row.guided:
                    masked.append(b)
                    mask_rids.append(s.request_id)
                    mask_owners.append((b, s.request_id, row))
                    from_last_guided |= s.input_in_flight
            else:
                sample_rows.append(-1)
        ids_h[:t] = ids
        src_h[:t] = src
        pos_h[:t] = pos_l
        slot_h[:t] = slots_l
        qsl_h[0] = 0
        qsl_h[1: nseq + 1] = ends
        lens_h[:nseq] = lens
        li_h[:nseq] = ends
        li_h[:nseq] -= 1
        buf.offsets[0][:nseq] = offsets
        buf.sample_rows[0][:nseq] = sample_rows
        num_masks = len(masked)
        deferred = num_masks > 0 and (defer_masks or from_last_guided)
        record_h = buf.record_rows[0]
        record_h[:nseq] = sample_rows
        if deferred:  # the guided rows are recorded by the second pass only
            late_h = buf.late_rows[0]
            late_h[:nseq] = -1
            late_h[masked] = record_h[masked]
            record_h[masked] = -1
        idx = np.asarray(row_idx, dtype=np.intp)
        np.take(row_blocks[:, :mb], idx, axis=0, out=bt_h)
        for name, _ in _ROW_PARAM_FIELDS:
            np.take(self.row_params[name], idx, out=getattr(buf, name)[0][:nseq])
        num_biased = len(biased) // 4
        if num_biased:
            buf.bias_sel[0][: len(biased)] = biased
        if num_masks:
            if fill_masks is None:
                raise ValueError("a guided request is in the step but no mask filler was given")
            buf.mask_rows[0][:num_masks] = masked
            if not deferred:
                fill_masks(mask_rids, self._mask_view(buf, num_masks))
        plan = _Plan(sample_req, logprobs_k, frozenset(masked) if deferred else frozenset())
        # decode_only already excludes admissions, hence rows that need a penalty setup.
        # Guided rows keep the decode graph: their masks go between its forward and sampler parts.
        route, padded = "eager", 0
        if self.use_graphs and not gemm_sms:
            if decode_only and not any_penalty and not any_ban and not num_biased and logprobs_k == 0 \
                    and (padded := padded_size(self.graph_sizes, nseq)):
                route = "graph"
            elif self.pieces and (padded := padded_size(self.layer_graph_sizes, t)):
                route = "pieces"
        self.routes[route] += 1
        if num_masks:
            self.guided_routes[route] += 1
        step = _Launch(slot, t, nseq, mb, penalty_inits, logprobs_k, any_penalty, any_ban,
                       max(s.num_tokens for s in seqs), max(s.start_pos + s.num_tokens for s in seqs),
                       route, padded, num_decodes, num_masks=num_masks, mask_rids=tuple(mask_rids),
                       deferred=deferred, bias_inits=tuple(bias_inits), num_biased=num_biased,
                       late_owners=tuple(mask_owners) if deferred else (),
                       fences=tuple(self._fences - {slot}), parallel_to_previous=parallel_to_previous,
                       gemm_sms=gemm_sms)
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
            # A deferred step's wait is for its first pass until sample_deferred() launches the
            # second (the slot records no other work before that).
            done = self._completion(slot)
            future, first = (None, done) if deferred else (done, None)
        return StepHandle(self, self.step_id - 1, slot, plan, future, launch_time,
                          step if deferred else None, first)

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

    def _mask_view(self, buf: _SlotBuffers, rows: int) -> np.ndarray:
        return buf.bitmask[0][: rows * self.mask_words].reshape(rows, self.mask_words)

    def deferred_masks(self, h: StepHandle) -> tuple[tuple[str, ...], np.ndarray]:
        """The request ids of a step awaiting its masks and the buffer their masks go to, in
        that order (what sample_deferred's filler gets)."""
        st = h.deferred
        if st is None:
            raise ValueError(f"step {h.step_id} does not wait for masks")
        return st.mask_rids, self._mask_view(self.slots[st.slot], st.num_masks)

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
        # staged may have lost its sampler row to another request: its late token is not recorded.
        late_h = self.slots[st.slot].late_rows[0]
        for b, rid, row in st.late_owners:
            if self.rows.get(rid) is not row:
                late_h[b] = -1
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

    def _resume_sample(self, job: tuple[_Launch, concurrent.futures.Future | None]) -> None:
        st, forward = job
        if forward is not None:
            forward.result()  # the forward failed: so does the step
        parked, mark = self._parked.pop(st.slot)
        ops = self.ops
        with ops.slot(st.slot):
            if mark is not None:
                ops.arena_reserve(mark)  # the logits and the first pass's outputs stay where they are
            self._sample_late(self.slots[st.slot], st, parked)
            ops.record(st.slot)

    def _completion(self, slot: int) -> concurrent.futures.Future:
        """A future of when the work launched so far on `slot` ends (device backends)."""
        return self.waiters[slot].submit(self._timed, self.ops.wait, slot)

    @staticmethod
    def _timed(fn: Any, arg: Any) -> float:
        """Run fn(arg) and return when it ended: the step's completion time, not its collection."""
        fn(arg)
        return time.monotonic()

    def _device_step(self, st: _Launch) -> None:
        ops = self.ops
        slot, nseq, mb = st.slot, st.nseq, st.mb
        buf = self.slots[slot]
        with ops.slot(slot):
            waits = self._prev_waits if st.parallel_to_previous else self.prev_slots
            for other in dict.fromkeys((*waits, *st.fences)):
                if other != slot:
                    ops.after(slot, other)
            if st.parallel_to_previous:
                self.prev_slots = (*self.prev_slots, slot)
            else:
                self._prev_waits, self.prev_slots = self.prev_slots, (slot,)
            ops.limit_gemm_sms(slot, st.gemm_sms)
            forward: Any  # the decode graph, its forward replayed, or the logits
            if st.route == "graph":
                self._pad_decode(buf, nseq, mb, st.padded)
                forward = self.graphs[(slot, st.padded)]
                forward.forward.replay()
            else:
                for row, new in st.penalty_inits:
                    self._init_penalty_row(row, new)
                for row, tokens, biases in st.bias_inits:
                    self._init_bias_row(row, tokens, biases)
                if st.route == "pieces":
                    forward = self._replay_pieces(buf, st, self.pieces[(slot, st.padded)])
                else:
                    fb = self._stage(buf, st.ntok, nseq, mb, st.max_query_len, st.max_seq_len,
                                     st.num_decodes)
                    forward = self.model.forward(fb, self.kv)
            self._sample_forward(buf, st, forward)
            ops.record(slot)  # the next step launches behind this (the first pass, if deferred)
            if st.deferred:  # sample_deferred() brings the masks and launches the second pass
                mark = ops.arena_mark()
                if isinstance(forward, _DecodeGraph) and forward.high:
                    mark = max(mark, forward.high)  # the second pass allocates past the graphs' buffers
                self._parked[slot] = (forward, mark)

    def _sample_forward(self, buf: _SlotBuffers, st: _Launch, forward: Any) -> None:
        """The sampler of a step whose forward ran: the decode graph's sampler part after the
        masks, or the sampler on the logits. A deferred step's masks come later: this pass
        leaves its guided rows unrecorded (record_rows) for the second."""
        masks = 0 if st.deferred else st.num_masks
        if isinstance(forward, _DecodeGraph):
            self._apply_masks(buf, forward.logits, masks)
            forward.sample.replay()
        else:
            self._sample(buf, forward, st.nseq, st.logprobs_k, st.any_penalty, st.any_ban, masks,
                         st.num_biased)

    def _sample_late(self, buf: _SlotBuffers, st: _Launch, forward: Any) -> None:
        """The second pass of a deferred step: its guided rows' masks on the logits the first pass
        left (penalties, bans and biases are in them already), then the sampler again, recording
        only the guided rows (late_rows) and writing to the late outputs. Every row is sampled,
        as the per-row draws do not depend on the batch; the free rows' second draws are unused."""
        nseq = st.nseq
        logits = forward.logits[:nseq] if isinstance(forward, _DecodeGraph) else forward
        self._apply_masks(buf, logits, st.num_masks)
        self.ops.copy_h2d(buf.late_rows[1][:nseq], buf.late_rows[0][:nseq])
        self._draw(buf, logits, nseq, st.logprobs_k, buf.late_rows[1][:nseq], buf.late)

    def _draw(self, buf: _SlotBuffers, logits: Any, nseq: int, logprobs_k: int, record: Any,
              out: _SampledBuffers) -> None:
        """Sample the (processed) logits, record the tokens of the sampler rows `record` (-1:
        not this pass's), and copy ids and logprobs to `out`."""
        ops = self.ops
        ids = ops.sample(logits, buf.temperature[1][:nseq], buf.top_k[1][:nseq], buf.top_p[1][:nseq],
                         buf.min_p[1][:nseq], buf.seeds[1][:nseq], buf.offsets[1][:nseq])
        ops.record_sampled(self.last_tokens, self.out_counts, record, ids)
        ops.copy_d2h(out.ids[:nseq], ids)
        if k := logprobs_k:
            lp, top_ids, top_lp = ops.log_softmax_topk(logits, ids, k)
            ops.copy_d2h(out.logprob[:nseq], lp)
            ops.copy_d2h(out.top_ids[: nseq * k].reshape(nseq, k), top_ids)
            ops.copy_d2h(out.top_lp[: nseq * k].reshape(nseq, k), top_lp)

    def _stage(self, buf: _SlotBuffers, ntok: int, nseq: int, mb: int, max_query_len: int,
               max_seq_len: int, num_decodes: int = 0) -> ForwardBatch:
        ops = self.ops

        def up(pair: tuple[np.ndarray, Any], n: int) -> Any:
            ops.copy_h2d(pair[1][:n], pair[0][:n])
            return pair[1][:n]

        ids = up(buf.input_ids, ntok)
        src = up(buf.src_rows, ntok)
        ops.fill_from_last(ids, src, self.last_tokens)
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "offsets", "presence",
                     "frequency", "repetition", "sample_rows", "record_rows"):
            up(getattr(buf, name), nseq)
        up(buf.ban, nseq * MAX_BANNED)
        return ForwardBatch(
            input_ids=ids,
            positions=up(buf.positions, ntok),
            slot_mapping=up(buf.slot_mapping, ntok),
            query_start_loc=up(buf.query_start_loc, nseq + 1),
            seq_lens=up(buf.seq_lens, nseq),
            block_tables=up(buf.block_tables, nseq * mb).reshape(nseq, mb),
            logits_indices=up(buf.logits_indices, nseq),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_decodes=num_decodes,
        )

    def _sample(self, buf: _SlotBuffers, logits: Any, nseq: int, logprobs_k: int, any_penalty: bool,
                any_ban: bool, num_masks: int = 0, num_biased: int = 0) -> None:
        ops = self.ops
        rows = buf.sample_rows[1][:nseq]
        if num_biased:  # first, as vLLM's sampler: penalties and bans apply to the biased logits
            sel = buf.bias_sel
            ops.copy_h2d(sel[1][: 4 * num_biased], sel[0][: 4 * num_biased])
            ops.bias_logits(logits, sel[1][: 4 * num_biased].reshape(num_biased, 4), self.bias_tokens,
                            self.bias_values)
        if any_penalty:
            ops.penalize(logits, rows, self.out_counts, self.prompt_mask, buf.presence[1][:nseq],
                         buf.frequency[1][:nseq], buf.repetition[1][:nseq])
        if any_ban:
            ops.ban_tokens(logits, buf.ban[1][: nseq * MAX_BANNED].reshape(nseq, MAX_BANNED))
        self._apply_masks(buf, logits, num_masks)
        self._draw(buf, logits, nseq, logprobs_k, buf.record_rows[1][:nseq], buf.out)

    def _apply_masks(self, buf: _SlotBuffers, logits: Any, num_masks: int) -> None:
        """Upload the step's staged bitmasks and apply them to their rows' logits, in place (no
        arena memory: it may run between captured parts)."""
        if not num_masks:
            return
        ops, words = self.ops, num_masks * self.mask_words
        ops.copy_h2d(buf.bitmask[1][:words], buf.bitmask[0][:words])
        ops.copy_h2d(buf.mask_rows[1][:num_masks], buf.mask_rows[0][:num_masks])
        ops.apply_token_bitmask(logits, buf.bitmask[1][:words].reshape(num_masks, self.mask_words),
                                buf.mask_rows[1][:num_masks])

    # ---- CUDA graphs for decode ---------------------------------------------------------------
    def _replay_pieces(self, buf: _SlotBuffers, st: _Launch, pieces: _Pieces) -> Any:
        """Pad the step's tokens to the pieces' size (padding rows write no KV and feed no
        sequence), stage, then replay the pieces with each layer's attention between them;
        returns the logits of the step's sequences."""
        ops, ntok, nseq = self.ops, st.ntok, st.nseq
        self._pad_tokens(buf, ntok, pieces.size)
        fb = self._stage(buf, pieces.size, nseq, st.mb, st.max_query_len, st.max_seq_len, st.num_decodes)
        ops.arena_reserve(pieces.high)
        pieces.graphs[0].replay()
        for (q, k_cache, v_cache, out), graph in zip(pieces.attention, pieces.graphs[1:], strict=True):
            ops.attention(q[:ntok], k_cache, v_cache, fb.query_start_loc, fb.seq_lens, fb.block_tables,
                          self.model.scale, st.max_query_len, st.max_seq_len, out=out[:ntok],
                          decode_seqs=fb.num_decodes)
            graph.replay()
        return self.model.head(pieces.hidden, fb.logits_indices)

    @staticmethod
    def _pad_tokens(buf: _SlotBuffers, ntok: int, size: int) -> None:
        for name, value in (("input_ids", 0), ("src_rows", -1), ("positions", 0), ("slot_mapping", -1)):
            getattr(buf, name)[0][ntok:size] = value

    def _capture_pieces(self, slot: int, size: int) -> _Pieces:
        buf, ops = self.slots[slot], self.ops
        attention: list[tuple[Any, Any, Any, Any]] = []
        hidden: list[Any] = []
        # Only the per-token inputs are read inside the pieces; the rest goes to attention.
        fb = ForwardBatch(
            input_ids=buf.input_ids[1][:size], positions=buf.positions[1][:size],
            slot_mapping=buf.slot_mapping[1][:size], query_start_loc=buf.query_start_loc[1][:2],
            seq_lens=buf.seq_lens[1][:1], block_tables=buf.block_tables[1][:1].reshape(1, 1),
            logits_indices=buf.logits_indices[1][:1], max_query_len=size, max_seq_len=self.max_model_len)

        def run(cut: Any) -> None:
            def attend(q: Any, k_cache: Any, v_cache: Any, *_: Any, **__: Any) -> Any:
                out = ops.scratch(q.shape, "act")
                attention.append((q, k_cache, v_cache, out))
                cut()
                return out
            hidden.append(self.model.hidden(fb, self.kv, attend))

        graphs, high = ops.capture_layer_graphs(slot, run)
        return _Pieces(size, graphs, attention, hidden[0], high)

    def capture_graphs(self) -> None:
        """Capture every decode size up front and turn graph replay on: a capture in the middle
        of serving stalls the pipeline for as long as the capture takes. Capturing runs nothing on
        the device, and there is no warm-up run: a step reads and writes last_tokens, so running
        it twice would feed the sampled token back in (kernels and cuBLAS handles exist from
        backend start)."""
        self.use_graphs = True
        for slot in range(len(self.slots)):
            buf = self.slots[slot]
            with self.ops.slot(slot):
                for size in self.graph_sizes:
                    self._pad_decode(buf, 0, 1, size)
                    self.graphs[(slot, size)] = self._capture_decode(slot, size)
            # numpy ops return fresh arrays instead of rewriting captured ones, so nothing
            # could run between replayed pieces there: those steps stay eager.
            if self.ops.name == "cuda":
                for size in self.layer_graph_sizes:
                    self.pieces[(slot, size)] = self._capture_pieces(slot, size)

    def _capture_decode(self, slot: int, size: int) -> _DecodeGraph:
        buf, graph = self.slots[slot], _DecodeGraph()

        def forward() -> None:
            fb = self._stage(buf, size, size, self.max_blocks, 1, self.max_model_len)
            graph.logits = self.model.forward(fb, self.kv)

        def sample() -> None:
            self._sample(buf, graph.logits, size, 0, False, False)

        if self.ops.name == "cuda":
            def run(cut: Any) -> None:
                forward()
                cut()
                sample()

            (graph.forward, graph.sample), graph.high = self.ops.capture_layer_graphs(slot, run)
        else:
            graph.forward, graph.sample = self.ops.capture_parts(slot, (forward, sample))
        return graph

    def _pad_decode(self, buf: _SlotBuffers, nseq: int, mb: int, size: int) -> None:
        """Rows nseq..size-1 become harmless: no KV write, one context token, no sampler row."""
        # Re-lay the block table at the static stride the graph reads.
        src = buf.block_tables[0][: nseq * mb].reshape(nseq, mb).copy()
        full = buf.block_tables[0][: size * self.max_blocks].reshape(size, self.max_blocks)
        full.fill(0)
        full[:nseq, :mb] = src
        self._pad_tokens(buf, nseq, size)
        buf.seq_lens[0][nseq:size] = 1
        buf.query_start_loc[0][nseq + 1: size + 1] = np.arange(nseq + 1, size + 1, dtype=np.int32)
        buf.logits_indices[0][nseq:size] = np.arange(nseq, size, dtype=np.int32)
        buf.sample_rows[0][nseq:size] = -1
        buf.record_rows[0][nseq:size] = -1
        buf.temperature[0][nseq:size] = 0.0
        buf.top_k[0][nseq:size] = 0
        buf.top_p[0][nseq:size] = 1.0
        buf.min_p[0][nseq:size] = 0.0
        buf.seeds[0][nseq:size] = 0
        buf.offsets[0][nseq:size] = 0

    # ---- results ------------------------------------------------------------------------------
    def _collect(self, h: StepHandle, first: bool = False) -> StepOutput:
        """The step's sampled tokens; first: only its first pass's rows (every row but the
        late ones), and once those are collected, a later call gives the late rows alone."""
        buf = self.slots[h.slot]
        k = h.plan.logprobs_k
        late = h.plan.late
        out = []
        for b, rid in h.plan.sample_req:
            is_late = b in late
            if (first and is_late) or (h.first_collected and not is_late):
                continue
            got = buf.late if is_late else buf.out
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
