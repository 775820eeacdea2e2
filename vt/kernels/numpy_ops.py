"""The float32 numpy backend: the CPU runtime and the reference every CUDA op is checked against.

Inside a slot context every op output is also entered, at its CUDA size, in that slot's arena
ledger (vt.kernels.arena) exactly where the CUDA backend would take it from its arena, so a step
that needs more workspace than the memory plan reserved fails here as it would on the GPU.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from vt.kernels.arena import ITEM_BYTES, ArenaLedger
from vt.kernels.base import NUM_SLOTS, norm_rope_write_kv_unfused, prologue_fused
from vt.kernels.numpy_fp8 import E4M3, NumpyFp8Ops, quantize_rows_pow2, to_e4m3
from vt.kernels.numpy_matmul import matmul_rows
from vt.kernels.quantized import PendingScales

_DTYPES = {"act": np.float32, "f32": np.float32, "i32": np.int32, "u8": np.uint8, "i64": np.int64,
           "fp8": E4M3}


def _np_dtype(dtype: str) -> type:
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown backend dtype {dtype!r}; expected one of {tuple(_DTYPES)}") from None


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    """sqrt(mean(x ** 2) + eps) over the last axis, kept as an axis of size 1."""
    var = np.mean(np.square(x, dtype=np.float32), axis=-1, keepdims=True)
    return np.sqrt(var + np.float32(eps))


class _Replay:
    """What capture() returns on numpy: replaying simply re-runs the function."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn

    def replay(self) -> Any:
        return self._fn()


def _qkv_columns(per_column: np.ndarray, q: np.ndarray, k: np.ndarray) -> list[np.ndarray]:
    """A vector over qkv's columns (a bias, channel scales) split into its q, k and v parts."""
    return np.split(per_column, [q[0].size, q[0].size + k[0].size])


class NumpyBackend(NumpyFp8Ops):
    name = "numpy"

    def __init__(self) -> None:
        self._ledgers = [ArenaLedger(None) for _ in range(NUM_SLOTS)]
        self._tls = threading.local()  # the ledger of the slot open on this thread

    def _ledger(self) -> ArenaLedger | None:
        return getattr(self._tls, "ledger", None)

    def _took(self, shape: tuple[int, ...], dtype: str) -> None:
        """Enter an op output of CUDA dtype `dtype` in the open slot's ledger."""
        ledger = self._ledger()
        if ledger is not None:
            ledger.take(int(np.prod(shape, dtype=np.int64)) * ITEM_BYTES[dtype])

    # ---- memory -------------------------------------------------------------------------
    def upload(self, host: np.ndarray) -> np.ndarray:
        # A real copy: checkpoint arrays are read-only memory maps of the file.
        return np.array(host, dtype=np.float32, copy=True, order="C")

    def zeros(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.zeros(shape, dtype=_np_dtype(dtype))

    def from_host(self, host: np.ndarray, dtype: str) -> np.ndarray:
        return np.array(host, dtype=_np_dtype(dtype), copy=True, order="C")

    def to_host(self, x: np.ndarray) -> np.ndarray:
        return np.array(x, copy=True)

    def pinned_empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        return np.empty(shape, dtype=dtype)

    def copy_h2d(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = min(len(dst), len(src))
        dst[:n] = src[:n]

    def copy_d2h(self, dst: np.ndarray, src: np.ndarray) -> None:
        n = min(len(dst), len(src))
        dst[:n] = src[:n]

    # ---- model ops ----------------------------------------------------------------------
    def embed(self, ids: np.ndarray, table: np.ndarray) -> np.ndarray:
        self._took((ids.shape[0], table.shape[1]), "act")
        return table[ids]

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float,
                 residual: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        self._took(x.shape, "act")
        if residual is not None:
            self._took(x.shape, "act")
        r = x if residual is None else x + residual
        return (r / _rms(r, eps)) * weight, r

    def head_rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        self._took(x.shape, "act")
        return (x / _rms(x, eps)) * weight

    def linear(self, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        self._took((x.shape[0], w.shape[0]), "act")
        y = matmul_rows(x, w.T)
        return y if bias is None else y + bias

    def linear_residual(self, x: np.ndarray, w: np.ndarray, residual: np.ndarray) -> None:
        if residual.shape != (x.shape[0], w.shape[0]):
            raise ValueError(f"linear_residual: residual {residual.shape} is not {(x.shape[0], w.shape[0])}")
        residual += matmul_rows(x, w.T)

    def gemm_layout(self, w: np.ndarray) -> np.ndarray:
        return w

    def fold_norm_weight(self, w: np.ndarray, norm: np.ndarray) -> None:
        if norm.shape != (w.shape[1],):
            raise ValueError(f"fold_norm_weight: norm {norm.shape} does not match w {w.shape}")
        w *= norm[None, :]

    def rope(self, q: np.ndarray, k: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> None:
        angle = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]
        cos = np.cos(angle)[:, None, :]
        sin = np.sin(angle)[:, None, :]
        for x in (q, k):
            half = x.shape[-1] // 2
            x1 = x[..., :half].copy()
            x2 = x[..., half:].copy()
            x[..., :half] = x1 * cos - x2 * sin
            x[..., half:] = x2 * cos + x1 * sin

    def write_kv(self, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                 slot_mapping: np.ndarray, kv_scales: tuple[float, float] = (1.0, 1.0)) -> None:
        nb, bs, hk, d = k_cache.shape
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if slots.size and int(slots.max()) >= nb * bs:
            raise IndexError(f"slot {int(slots.max())} is outside the KV cache ({nb} blocks of {bs})")
        ks, vs = k[keep], v[keep]
        if k_cache.dtype == E4M3:  # vLLM's fp8 cache: codes of x / scale
            ks = to_e4m3(ks / np.float32(kv_scales[0]))
            vs = to_e4m3(vs / np.float32(kv_scales[1]))
        k_cache.reshape(nb * bs, hk, d)[slots] = ks
        v_cache.reshape(nb * bs, hk, d)[slots] = vs

    def qk_norm_rope_write_kv(self, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                              q_norm: np.ndarray | None, k_norm: np.ndarray | None, eps: float,
                              positions: np.ndarray, inv_freq: np.ndarray, k_cache: np.ndarray,
                              v_cache: np.ndarray, slot_mapping: np.ndarray,
                              rms_of: np.ndarray | None = None, bias: np.ndarray | None = None,
                              kv_scales: tuple[float, float] = (1.0, 1.0),
                              scales: PendingScales | None = None) -> None:
        if scales is not None:  # a unit-scale product's scales, before the rest (numpy never defers them)
            x_scale = np.asarray(scales.x_scale, np.float32)[:, None, None]
            w_parts = _qkv_columns(np.asarray(scales.w_scale, np.float32), q, k)
            for x, w in zip((q, k, v), w_parts, strict=True):
                x[...] = x * (x_scale * w.reshape(x.shape[1:]))
        if rms_of is not None or bias is not None:
            rms = np.float32(1) if rms_of is None else _rms(rms_of, eps)[:, :, None]
            parts = _qkv_columns(bias, q, k) if bias is not None else (None,) * 3
            for x, b in zip((q, k, v), parts, strict=True):
                x[...] = x / rms if b is None else x / rms + b.reshape(x.shape[1:])
        # CUDA's fused kernel works in place; only its three-op path allocates head-norm outputs.
        fused = prologue_fused(q.shape[2], q_norm, k_norm)
        with self._counting_into(None if fused else self._ledger()):
            norm_rope_write_kv_unfused(self, q, k, v, q_norm, k_norm, eps, positions, inv_freq, k_cache,
                                       v_cache, slot_mapping, kv_scales)
        if k_cache.dtype == E4M3:  # over an fp8 cache every attention kernel reads q as e4m3 x 2^n
            q[...] = quantize_rows_pow2(q)

    @contextlib.contextmanager
    def _counting_into(self, ledger: ArenaLedger | None) -> Iterator[None]:
        """Op outputs go to `ledger` (None: not counted) on this thread until the block ends."""
        previous = self._ledger()
        self._tls.ledger = ledger
        try:
            yield
        finally:
            self._tls.ledger = previous

    def attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                  query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                  scale: float, max_query_len: int, max_seq_len: int,
                  out: np.ndarray | None = None, decode_seqs: int = 0,
                  follows_kv_write: bool = False,
                  kv_scales: tuple[float, float] = (1.0, 1.0), cascade_blocks: int = 0) -> np.ndarray:
        t, hq, d = q.shape
        if decode_seqs and (np.diff(query_start_loc[: decode_seqs + 1]) != 1).any():
            raise ValueError(f"attention: the first {decode_seqs} sequences must have one query row each")
        _, bs, hk, _ = k_cache.shape
        group = hq // hk
        if out is None:
            self._took((t, hq, d), "act")
            out = np.zeros((t, hq, d), dtype=np.float32)
        elif out.shape != (t, hq, d):
            raise ValueError(f"attention: out must be [{t}, {hq}, {d}], got {list(out.shape)}")
        first = 0
        if cascade_blocks > 0:
            first = len(seq_lens) if max_query_len == 1 else decode_seqs
            if first:
                cascade_attention(q[:first], k_cache, v_cache, seq_lens[:first], block_tables[:first], scale,
                                  cascade_blocks, kv_scales, out[:first])
        for b in range(first, len(seq_lens)):
            start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
            length, ctx = end - start, int(seq_lens[b])
            if length == 0:
                continue
            if ctx < length:
                raise ValueError(f"sequence {b}: seq_len {ctx} is shorter than its {length} query rows")
            blocks = block_tables[b, : -(-ctx // bs)]
            keys = _kv_rows(k_cache, blocks, kv_scales[0])[:ctx]
            vals = _kv_rows(v_cache, blocks, kv_scales[1])[:ctx]
            qb = q[start:end].reshape(length, hk, group, d)
            scores = np.einsum("lkgd,skd->kgls", qb, keys) * np.float32(scale)
            # Row j sits at position ctx - length + j and sees keys 0..itself.
            row_pos = np.arange(ctx - length, ctx)[:, None]
            scores = np.where(np.arange(ctx)[None, :] <= row_pos, scores, -np.inf)
            scores = scores - scores.max(axis=-1, keepdims=True)
            p = np.exp(scores)
            p /= p.sum(axis=-1, keepdims=True)
            out[start:end] = np.einsum("kgls,skd->lkgd", p, vals).reshape(length, hq, d)
        return out

    def silu_mul(self, x: np.ndarray, rms_of: np.ndarray | None = None, eps: float = 0.0) -> np.ndarray:
        half = x.shape[-1] // 2
        self._took((x.shape[0], half), "act")
        gate, up = x[:, :half], x[:, half:]
        if rms_of is not None:
            rms = _rms(rms_of, eps)
            gate, up = gate / rms, up / rms
        return gate / (np.float32(1) + np.exp(-gate)) * up

    def gather_rows(self, x: np.ndarray, idx: np.ndarray) -> np.ndarray:
        self._took((idx.shape[0], x.shape[1]), "act")
        return x[idx]

    def logits(self, x: np.ndarray, w: np.ndarray) -> np.ndarray:
        self._took((x.shape[0], w.shape[0]), "f32")
        return matmul_rows(x, w.T).astype(np.float32, copy=False)

    # ---- step plumbing --------------------------------------------------------------------
    def fill_from_last(self, input_ids: np.ndarray, src_rows: np.ndarray, last_tokens: np.ndarray) -> None:
        take = src_rows >= 0
        input_ids[take] = last_tokens[src_rows[take]]

    # ---- sampling (vt.kernels.numpy_sampling holds the implementations) --------------------
    def log_softmax_topk(self, logits: np.ndarray, ids: np.ndarray, k: int) -> tuple[Any, Any, Any]:
        from vt.kernels import numpy_sampling

        b, v = logits.shape
        kk = min(max(k, 0), v)
        for shape, dtype in (((b,), "f32"), ((b, kk), "i32"), ((b, kk), "f32")):
            self._took(shape, dtype)
        return numpy_sampling.log_softmax_topk(logits, ids, k)

    def penalize(self, logits: np.ndarray, rows: np.ndarray, out_counts: np.ndarray,
                 prompt_mask: np.ndarray, presence: np.ndarray, frequency: np.ndarray,
                 repetition: np.ndarray) -> None:
        from vt.kernels import numpy_sampling

        numpy_sampling.penalize(logits, rows, out_counts, prompt_mask, presence, frequency, repetition)

    def ban_tokens(self, logits: np.ndarray, ban: np.ndarray) -> None:
        from vt.kernels import numpy_sampling

        numpy_sampling.ban_tokens(logits, ban)

    def sample(self, logits: np.ndarray, temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
               min_p: np.ndarray, seeds: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        from vt.kernels import numpy_sampling

        self._took((logits.shape[0],), "i32")
        return numpy_sampling.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets)

    def record_sampled(self, last_tokens: np.ndarray, out_counts: np.ndarray, rows: np.ndarray,
                       ids: np.ndarray) -> None:
        from vt.kernels import numpy_sampling

        numpy_sampling.record_sampled(last_tokens, out_counts, rows, ids)

    def bias_logits(self, logits: np.ndarray, sel: np.ndarray, tokens: np.ndarray,
                    biases: np.ndarray) -> None:
        from vt.kernels import numpy_sampling

        numpy_sampling.bias_logits(logits, sel, tokens, biases)

    def apply_token_bitmask(self, logits: np.ndarray, bitmask: np.ndarray, rows: np.ndarray) -> None:
        from vt.kernels import numpy_sampling

        numpy_sampling.apply_token_bitmask(logits, bitmask, rows)

    # ---- async plumbing: numpy runs ops eagerly, so streams and events are trivial ----------
    def ensure_workspace(self, nbytes: int, partials_bytes: int | None = None) -> None:
        """Every op allocates on numpy; the slots' ledgers hold it to nbytes at CUDA sizes."""
        self._ledgers = [ArenaLedger(int(nbytes)) for _ in range(NUM_SLOTS)]

    def scratch(self, shape: tuple[int, ...], dtype: str) -> np.ndarray:
        self._took(tuple(shape), dtype)
        return np.empty(shape, dtype=_np_dtype(dtype))

    def arena_mark(self) -> int | None:
        """The open slot's ledger offset; None outside a slot (nothing to rewind)."""
        ledger = self._ledger()
        return None if ledger is None else ledger.offset

    def arena_reset(self, mark: int | None) -> None:
        ledger = self._ledger()
        if ledger is not None and mark is not None:
            ledger.rewind(mark)

    def arena_reserve(self, mark: int) -> None:
        """Hand out nothing below mark from now on (as CUDA's: a step resumed in a new slot
        context keeps what it took before)."""
        ledger = self._ledger()
        if ledger is not None:
            ledger.reserve(mark)

    def arena_high(self, i: int) -> int:
        """The furthest offset slot i's ledger reached in its last step (tests of the plan)."""
        self._check_slot(i)
        return self._ledgers[i].high

    def num_slots(self) -> int:
        return NUM_SLOTS

    def _check_slot(self, i: int) -> None:
        if not 0 <= i < NUM_SLOTS:
            raise ValueError(f"slot {i} out of range 0..{NUM_SLOTS - 1}")

    def slot(self, i: int) -> contextlib.AbstractContextManager[None]:
        self._check_slot(i)  # at the call, as CUDA does, not only on entry
        ledger = self._ledgers[i]
        ledger.reset()
        return self._counting_into(ledger)

    def after(self, i: int, j: int) -> None:
        self._check_slot(i)
        self._check_slot(j)

    def num_sms(self) -> int:
        return 0

    def fp8_weights_unsupported(self) -> str:
        return ""

    def limit_gemm_sms(self, i: int, sms: int) -> None:
        self._check_slot(i)

    def record(self, i: int) -> None:
        self._check_slot(i)

    def done(self, i: int) -> bool:
        self._check_slot(i)
        return True

    def wait(self, i: int) -> None:
        self._check_slot(i)

    def capture(self, i: int, fn: Callable[[], Any]) -> _Replay:
        self._check_slot(i)
        return _Replay(fn)

    def capture_parts(self, i: int, parts: Sequence[Callable[[], Any]]) -> list[_Replay]:
        self._check_slot(i)
        return [_Replay(part) for part in parts]


def _kv_rows(cache: np.ndarray, blocks: np.ndarray, scale: float) -> np.ndarray:
    """The cached rows of `blocks` in order, [len * block_size, Hk, D]: an fp8 cache's codes read
    as code * scale in f32, any other cache as stored."""
    rows = cache[blocks].reshape(-1, *cache.shape[2:])
    return rows.astype(np.float32) * np.float32(scale) if cache.dtype == E4M3 else rows


def attention_partial(q: np.ndarray, keys: np.ndarray, vals: np.ndarray, scale_log2: float
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The split-key partial of rows q f32[R, Hk, G, D] over keys and vals f32[S, Hk, D], every
    key seen by every row: (o, m, l), o the unnormalised sum of exp2(s - m) v [R, Hk, G, D], m the
    rows' largest score and l their exp2 sums [R, Hk, G], scores s in the log2 domain, as the
    CUDA kernels write partials."""
    s = np.einsum("rkgd,skd->rkgs", q.astype(np.float32), keys) * np.float32(scale_log2)
    m = s.max(axis=-1)
    e = np.exp2(s - m[..., None])
    return np.einsum("rkgs,skd->rkgd", e, vals), m, e.sum(axis=-1)


def merge_partials(parts: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Normalised rows from partials (o, m, l) of disjoint key sets, weighed by exp2(m - max m)."""
    top = np.max([m for _, m, _ in parts], axis=0)
    o = sum(np.exp2(m - top)[..., None] * part for part, m, _ in parts)
    den = sum(np.exp2(m - top) * sums for _, m, sums in parts)
    return o / den[..., None]


def cascade_attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, seq_lens: np.ndarray,
                      block_tables: np.ndarray, scale: float, cascade_blocks: int,
                      kv_scales: tuple[float, float], out: np.ndarray) -> None:
    """Decode rows q [B, Hq, D] whose first cascade_blocks blocks are the same (row 0's): every
    row against those shared keys as one partial, each row's own later keys as another, merged
    into out [B, Hq, D]. The twin of CUDA's cascade (prefix launch, suffix launch, merge).
    kv_scales: an fp8 cache's (k_scale, v_scale); other caches ignore them."""
    b, hq, d = q.shape
    _, bs, hk, _ = k_cache.shape
    prefix_len = cascade_blocks * bs
    if (np.asarray(seq_lens[:b]) <= prefix_len).any():
        raise ValueError(f"attention: cascade over {prefix_len} keys needs every decode longer than that")
    if (block_tables[:, :cascade_blocks] != block_tables[0, :cascade_blocks]).any():
        raise ValueError(f"attention: the decodes do not share their first {cascade_blocks} blocks")
    scale_log2 = float(scale) * 1.4426950408889634
    k_scale, v_scale = kv_scales
    qr = q.reshape(b, hk, hq // hk, d)
    shared = block_tables[0, :cascade_blocks]
    prefix = attention_partial(qr, _kv_rows(k_cache, shared, k_scale), _kv_rows(v_cache, shared, v_scale),
                               scale_log2)
    for i in range(b):
        ctx = int(seq_lens[i])
        own = block_tables[i, cascade_blocks: -(-ctx // bs)]
        keys = _kv_rows(k_cache, own, k_scale)[: ctx - prefix_len]
        vals = _kv_rows(v_cache, own, v_scale)[: ctx - prefix_len]
        suffix = attention_partial(qr[i: i + 1], keys, vals, scale_log2)
        row = merge_partials([tuple(x[i: i + 1] for x in prefix), suffix])
        out[i] = row.reshape(hq, d)
