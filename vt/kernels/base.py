"""The backend contract: one op set, implemented by numpy_ops (float32 reference) and cuda_ops (bf16).

Conventions shared by both implementations:
- "act" arrays hold activations and weights in the backend's compute dtype (float32 on numpy,
  bf16 on CUDA). Index arrays are int32. Logits and sampling math are float32.
- Shapes: T = tokens in the step, B = sequences in the step, H = hidden size, V = vocab,
  NB = KV blocks, BS = block size, Hq / Hk = query / kv heads, D = head dim,
  R = sampler rows (one per running request, a persistent slot owned by the runner).
- Ops that return arrays may allocate on numpy. On CUDA they take their outputs from the
  workspace arena of the current slot (see `ensure_workspace`), so a step never allocates from
  the pool and a captured graph sees the same pointers on every replay; vt.runner.memory_plan sizes it.
- Ops documented "in place" return None and write into an argument.
- Scalars are Python numbers at this interface; cuda_ops converts them to np.int32 / np.float32.

The sampler's random numbers are counter based so that a seeded request draws the same numbers
whatever batch it is in, on either backend:
    x = (seed * 0x9E3779B97F4A7C15 + offset * 0xBF58476D1CE4E5B9 + token * 0x94D049BB133111EB) mod 2**64
    x ^= x >> 30; x *= 0xBF58476D1CE4E5B9; x ^= x >> 27; x *= 0x94D049BB133111EB; x ^= x >> 31
    u = ((x >> 40) + 0.5) / 2**24            (float32, strictly inside (0, 1))
    gumbel = -log(-log(u))
and a sampled token is argmax over allowed tokens of (logits / temperature + gumbel), ties to the
lowest index. `offset` is the index of the output token being sampled (0 for the first).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from vt.kernels.quantized import PendingScales

Array = Any  # numpy.ndarray on the numpy backend, cupy.ndarray on CUDA

# Steps a backend holds at once, each in its own slot (on CUDA: a stream, an arena and events):
# two in flight (depth 2), and a third for a masked step, whose guided rows wait for their
# grammar masks while the next step runs; it keeps its slot until its second sampler pass is
# collected.
NUM_SLOTS = 3


class Backend(Protocol):
    name: str  # "numpy" | "cuda"

    # ---- memory -------------------------------------------------------------------------
    def upload(self, host: np.ndarray) -> Array:
        """A weight (float32, float16 or ml_dtypes.bfloat16 host array) -> act array, persistent."""

    def zeros(self, shape: tuple[int, ...], dtype: str) -> Array:
        """Persistent zeroed buffer; dtype "act" | "f32" | "i32" | "i64" | "u8" | "fp8" (e4m3 codes:
        ml_dtypes.float8_e4m3fn on numpy, their bytes as uint8 on CUDA; an fp8 KV cache)."""

    def from_host(self, host: np.ndarray, dtype: str) -> Array:
        """Persistent copy of a host array as dtype "act" | "f32" | "i32" | "u8" (tests, setup)."""

    def to_host(self, x: Array) -> np.ndarray:
        """Synchronous copy back; act arrays come back as float32."""

    def pinned_empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """Host staging buffer (page-locked on CUDA, plain numpy otherwise), allocated once."""

    def copy_h2d(self, dst: Array, src: np.ndarray) -> None:
        """Asynchronous on the current stream; src[:n] into dst[:n] for matching leading sizes."""

    def copy_d2h(self, dst: np.ndarray, src: Array) -> None:
        """Asynchronous on the current stream into a pinned buffer."""

    def scratch(self, shape: tuple[int, ...], dtype: str) -> Array:
        """A buffer from the current slot's arena, valid until the arena is rewound."""

    def ensure_workspace(self, nbytes: int, partials_bytes: int | None = None) -> None:
        """Size each slot's arena to nbytes and (CUDA) its split-key attention partials to
        partials_bytes (setup only, before any graph is captured). numpy keeps the arena as a
        ledger at CUDA sizes and fails a step that would outgrow it (vt.runner.memory_plan)."""

    def arena_mark(self) -> int | None:
        """The open slot's arena offset, or None where there is no arena (numpy, no open slot)."""

    def arena_reset(self, mark: int | None) -> None:
        """Free what the open slot's arena handed out after mark; ops queued before stay valid
        because they run in stream order before anything that reuses the memory."""

    def arena_reserve(self, mark: int) -> None:
        """Hand out nothing below mark from now on: a step that resumes in a new context of its
        slot (the sampler of a step whose masks came later) keeps the outputs it took before."""

    # ---- model ops ----------------------------------------------------------------------
    def embed(self, ids: Array, table: Array) -> Array:
        """ids i32[T], table act[V, H] -> act[T, H]."""

    def rms_norm(self, x: Array, weight: Array, eps: float, residual: Array | None) -> tuple[Array, Array]:
        """r = x + residual (or x); returns (r * rsqrt(mean(r**2) + eps) * weight, r). Stats in fp32."""

    def head_rms_norm(self, x: Array, weight: Array, eps: float) -> Array:
        """Per-head RMS norm (Qwen3 q/k norm): x act[T, N, D], weight act[D] -> act[T, N, D]."""

    def linear(self, x: Array, w: Array, bias: Array | None) -> Array:
        """x act[T, K], w act[N, K], bias act[N] -> act[T, N] = x @ w.T + bias, fp32 accumulation."""

    def linear_residual(self, x: Array, w: Array, residual: Array) -> None:
        """In place: residual act[T, N] += x act[T, K] @ w act[N, K].T, accumulated in fp32 with
        the residual and rounded once (a layer's residual add inside its output projection)."""

    def gemm_layout(self, w: Array) -> Array:
        """At setup: projection weight w act[N, K] (after any fold_norm_weight) as linear and
        linear_residual should get it: the same matrix in the memory order this backend's GEMM
        streams fastest for its shape (maybe a copy; use the result, not w, from then on)."""

    def fold_norm_weight(self, w: Array, norm: Array) -> None:
        """In place, at setup: w act[N, K] *= norm act[K] per column, so that
        linear(rms_norm(r) without its weight, w) equals linear(rms_norm(r) with it, w before)."""

    def rope(self, q: Array, k: Array, positions: Array, inv_freq: Array) -> None:
        """In place, neox style (rotate halves): q act[T, Hq, D], k act[T, Hk, D], positions i32[T],
        inv_freq f32[D // 2]; angle = position * inv_freq[i], computed in fp32."""

    def write_kv(self, k: Array, v: Array, k_cache: Array, v_cache: Array, slot_mapping: Array,
                 kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        """In place: k, v act[T, Hk, D] into caches act[NB, BS, Hk, D] at flat slot
        slot_mapping[t] = block * BS + offset; a negative slot is skipped (padding).
        An fp8 cache (zeros(..., "fp8")) stores e4m3(k / k_scale) and e4m3(v / v_scale), with
        kv_scales = (k_scale, v_scale): nearest even, saturated to +-448 (vLLM's fp8 KV cache);
        an act cache ignores kv_scales."""

    def qk_norm_rope_write_kv(self, q: Array, k: Array, v: Array, q_norm: Array | None,
                              k_norm: Array | None, eps: float, positions: Array, inv_freq: Array,
                              k_cache: Array, v_cache: Array, slot_mapping: Array,
                              rms_of: Array | None = None, bias: Array | None = None,
                              kv_scales: tuple[float, float] = (1.0, 1.0),
                              scales: PendingScales | None = None) -> None:
        """In place, the attention prologue as one op: q and k get head_rms_norm (where a weight
        is given) and then rope, written back into q and k; then write_kv(k, v, ..., kv_scales). Equal to
        those three ops in that order, bf16 rounding after each included.
        scales (optional): q, k and v hold an fp8 projection's unit-scale sums (Fp8 linear_fp8_defer);
        every value is first multiplied by x_scale[t] * w_scale[n], n its column of the projection.
        rms_of act[T, H] (optional): first every row of q, k and v is multiplied by
        rsqrt(mean(rms_of[t] ** 2) + eps), the input norm of a projection whose norm weight was
        folded in (fold_norm_weight); bias act[(Hq + 2 Hk) D] (optional) is then added (q, k, v
        parts in that order); the results are rounded and written back into q, k and v."""

    def attention(self, q: Array, k_cache: Array, v_cache: Array, query_start_loc: Array,
                  seq_lens: Array, block_tables: Array, scale: float, max_query_len: int,
                  max_seq_len: int, out: Array | None = None, decode_seqs: int = 0,
                  follows_kv_write: bool = False, kv_scales: tuple[float, float] = (1.0, 1.0),
                  cascade_blocks: int = 0) -> Array:
        """Causal attention of a ragged batch over the paged cache -> act[T, Hq, D] (into out
        when given: rows of no sequence are left as they were). decode_seqs: the first
        decode_seqs sequences have one query row each (a hint: CUDA runs them on its decode
        tiles and the rest on prefill tiles; the result is the same attention).
        follows_kv_write: the op right before was this step's qk_norm_rope_write_kv, so q and
        the keys at positions seq_lens[b] - L_b and later are the only inputs still being
        written (a hint: CUDA overlaps the attention's start with that op; same result).
        Sequence b owns query rows query_start_loc[b] : query_start_loc[b + 1] (L_b rows); its
        context is seq_lens[b] tokens, found through block_tables i32[B, max_blocks]. Query row j
        of b sits at position seq_lens[b] - L_b + j and attends to positions 0..itself.
        GQA: query head h reads kv head h // (Hq // Hk). Softmax in fp32.
        An fp8 cache is read as code * scale, kv_scales = (k_scale, v_scale) as write_kv took them
        (CUDA folds k_scale into the score scale and v_scale into the output, so the codes
        convert to bf16 exactly).
        cascade_blocks > 0: the decodes (the first decode_seqs sequences, or every sequence when
        max_query_len is 1) all begin with the same cascade_blocks blocks, and each has keys past
        them (cascade_plan.common_prefix_blocks): their attention over those shared keys runs once
        for all of them and merges with each one's own (cascade attention; the same result up to
        the order of fp32 sums)."""

    def silu_mul(self, x: Array, rms_of: Array | None = None, eps: float = 0.0) -> Array:
        """x act[T, 2I] -> act[T, I] = silu(x[:, :I]) * x[:, I:]. With rms_of act[T, H], both
        halves of row t are first multiplied by rsqrt(mean(rms_of[t] ** 2) + eps) (the norm of
        a folded projection, as in qk_norm_rope_write_kv)."""

    def gather_rows(self, x: Array, idx: Array) -> Array:
        """x act[T, H], idx i32[B] -> act[B, H]."""

    def logits(self, x: Array, w: Array) -> Array:
        """x act[B, H], lm_head act[V, H] -> f32[B, V]."""

    # ---- step plumbing --------------------------------------------------------------------
    def fill_from_last(self, input_ids: Array, src_rows: Array, last_tokens: Array) -> None:
        """In place: input_ids[t] = last_tokens[src_rows[t]] where src_rows[t] >= 0 (i32 arrays)."""

    # ---- sampling -------------------------------------------------------------------------
    def log_softmax_topk(self, logits: Array, ids: Array, k: int) -> tuple[Array, Array, Array]:
        """Raw model logprobs: logits f32[B, V], ids i32[B] -> (logprob of ids f32[B],
        top ids i32[B, k], top logprobs f32[B, k]) sorted descending, ties to the lower id; k >= 0."""

    def penalize(self, logits: Array, rows: Array, out_counts: Array, prompt_mask: Array,
                 presence: Array, frequency: Array, repetition: Array) -> None:
        """In place, vLLM's semantics. For batch row b with r = rows[b] (skip if r < 0):
        repetition (f32[B], 1 = off): tokens seen in prompt (prompt_mask u8[R, V]) or output
        (out_counts i32[R, V] > 0) get logit / rep if logit > 0 else logit * rep;
        then logit -= frequency[b] * count + presence[b] * (count > 0)."""

    def ban_tokens(self, logits: Array, ban: Array) -> None:
        """In place: logits[b, ban[b, j]] = -inf for every ban[b, j] >= 0 (ban i32[B, E])."""

    def sample(self, logits: Array, temperature: Array, top_k: Array, top_p: Array, min_p: Array,
               seeds: Array, offsets: Array) -> Array:
        """-> i32[B]. temperature f32[B]: < 1e-5 means greedy (argmax, ties to lowest id).
        Otherwise on l = logits / T: keep tokens with l >= k-th largest (top_k i32, <= 0 = off),
        then those whose probability-sorted prefix mass before them is < top_p (f32, 1 = off),
        then those with p >= min_p * max p (f32, 0 = off); pick by the Gumbel rule in this
        module's docstring with seeds (u64 as i64[B]) and offsets i32[B]. A row whose every
        logit is -inf (no token allowed) gets -1."""

    def record_sampled(self, last_tokens: Array, out_counts: Array, rows: Array, ids: Array) -> None:
        """In place: last_tokens[rows[b]] = ids[b]; out_counts[rows[b], ids[b]] += 1 (rows[b] >= 0
        and ids[b] >= 0: a row that sampled -1 is left as it was)."""

    def bias_logits(self, logits: Array, sel: Array, tokens: Array, biases: Array) -> None:
        """In place, logit_bias and allowed_token_ids. For each m (sel i32[M, 4] = batch row b,
        table row r, count n, exclusive e): the n ids tokens[r, :n] (i32[R, C], ascending, in
        [0, V)) get biases[r, :n] (f32[R, C]) added to their logits in row b; where e != 0 every
        other token of row b becomes -inf. Rows with b < 0 or b >= B are skipped."""

    def apply_token_bitmask(self, logits: Array, bitmask: Array, rows: Array) -> None:
        """In place, structured outputs' mask: for m with rows[m] >= 0 (rows i32[M]), token t of
        batch row rows[m] keeps its logit if bit t % 32 of bitmask[m, t // 32] is set (bitmask
        i32[M, W], llguidance's layout) and becomes -inf otherwise, also where t >= 32 W."""

    # ---- async plumbing (the runner's view of streams, arenas and graphs) ------------------
    def num_slots(self) -> int:
        """How many steps may be held at once: NUM_SLOTS (one stream, arena and event set each):
        two in flight and one masked step, whose second sampler pass waits for its masks."""

    def slot(self, i: int) -> Any:
        """Context manager: while open, ops run on slot i's stream and take outputs from slot i's
        arena (reset on entry). numpy: a no-op context."""

    def after(self, i: int, j: int) -> None:
        """Make slot i's stream wait for everything enqueued so far on slot j (no host sync)."""

    def num_sms(self) -> int:
        """The device's streaming multiprocessors (numpy: 0)."""

    def fp8_weights_unsupported(self) -> str:
        """'' where fp8 weights' GEMMs run here, else why not (CUDA: fp8 tensor cores, compute
        capability 8.9 or newer; numpy: always '')."""

    def limit_gemm_sms(self, i: int, sms: int) -> None:
        """Slot i's GEMMs launched from now on use about `sms` SMs (0: all of them), leaving the
        rest to a step running beside on another slot's stream. numpy: checks the slot."""

    def record(self, i: int) -> None:
        """Record slot i's completion event after its enqueued work."""

    def done(self, i: int) -> bool:
        """Has slot i's recorded event completed? Never blocks."""

    def wait(self, i: int) -> None:
        """Block the calling thread until slot i's recorded event completed."""

    def capture(self, i: int, fn: Any) -> Any:
        """Capture fn() (ops on slot i's stream and arena, static buffers only) into a replayable
        object with .replay() that re-runs the same work on slot i's stream; numpy returns an
        object whose replay() calls fn()."""

    def capture_parts(self, i: int, parts: Any) -> list[Any]:
        """Capture the callables `parts` in order as one piece of work split into replayables,
        one per part (like capture(); outputs a part leaves in the arena stay where they are
        for the next), so that uncaptured work that takes no arena memory can run between
        their replays. numpy: objects whose replay() calls each part."""


def prologue_fused(head_dim: int, q_norm: Array | None, k_norm: Array | None) -> bool:
    """Whether CUDA's qk_norm_rope_write_kv runs as one kernel (in place) or as its three ops,
    whose two head norms then take their outputs from the arena."""
    return head_dim % 16 == 0 and head_dim <= 256 and (q_norm is None) == (k_norm is None)


def norm_rope_write_kv_unfused(ops: Backend, q: Array, k: Array, v: Array, q_norm: Array | None,
                               k_norm: Array | None, eps: float, positions: Array, inv_freq: Array,
                               k_cache: Array, v_cache: Array, slot_mapping: Array,
                               kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
    """qk_norm_rope_write_kv spelled as its three ops (the definition the fused kernel meets)."""
    if q_norm is not None:
        q[...] = ops.head_rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k[...] = ops.head_rms_norm(k, k_norm, eps)
    ops.rope(q, k, positions, inv_freq)
    ops.write_kv(k, v, k_cache, v_cache, slot_mapping, kv_scales)
