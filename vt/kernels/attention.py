"""Launchers of the attention kernels (attention.cu on CUDA cores, attention_tc.cu on tensor cores,
attention_wg.cu on Hopper's wgmma) and the prompt tiling they run on. Which kernel a batch runs
and how its keys split is attention_plan.py's (no CuPy there, so it is tested anywhere)."""

from __future__ import annotations

import os
from typing import Any

import cupy
import numpy as np

from vt.kernels.arena import aligned
from vt.kernels.attention_plan import (
    DEFAULT_PREFILL_TILING,
    FALLBACK_PREFILL_TILING,
    KV8_SUFFIX,
    MAX_KEY_SPLITS,
    PREFILL_TILINGS,
    QK8_KERNEL,
    TC_HEAD_DIMS,
    attention_kernel,
    attention_partial_bytes,
    combine_key_tile,
    key_splits,
    launch_shape,
    max_splits_within,
)
from vt.kernels.cascade_plan import cascade_scratch, cascade_splits_within
from vt.kernels.cuda_core import CudaCore, compile_cubin, is_fp8_cache, requested_switch, token_stride
from vt.kernels.sources import ARCH_KERNEL_FILES, translation_unit

# Each kernel and its twin reading an fp8 (e4m3) KV cache (KV8_SUFFIX).
_TC_KERNELS = (
    *(f"attention_tc_d{d}_{kind}{s}" for d in TC_HEAD_DIMS for kind in ("decode", "decode8")
      for s in ("", KV8_SUFFIX)),
    *(k for t in PREFILL_TILINGS.values() if not t.sm90_only for kv8 in (False, True)
      for k in t.kernels(kv8)),
)
_SCALAR_KERNELS = tuple(f"attention_r{r}{s}" for r in (1, 2, 4) for s in ("", KV8_SUFFIX))
# The kernels these launchers call from the files every GPU builds (sm_90a's are built on demand).
KERNELS = {
    "attention.cu": (*_SCALAR_KERNELS, "attention_combine_k", "attention_cascade_prep_k",
                     "attention_cascade_combine_k"),
    "attention_tc.cu": _TC_KERNELS,
}
_LARGE_SMEM_KERNELS = (*_SCALAR_KERNELS, *_TC_KERNELS)
_ATTN_SMEM_MAX = 200 * 1024
_SM90_SMEM_MAX = 227 * 1024  # an sm_90 block's opt-in shared memory (wgr's three 64 KB stages need it)
_LOG2E = 1.4426950408889634
_i32 = np.int32
_f32 = np.float32


def requested_prefill_tiling(name: str | None) -> str | None:
    """The tiling asked for by argument or, for benchmarks that start vt as a server, by
    VT_PREFILL_TILING; ValueError for one that does not exist."""
    requested = name or os.environ.get("VT_PREFILL_TILING")
    if requested and requested not in PREFILL_TILINGS:
        raise ValueError(f"prefill tiling (VT_PREFILL_TILING) {requested!r} is not one of "
                         f"{sorted(PREFILL_TILINGS)}")
    return requested


class AttentionOps(CudaCore):
    kv8_qk8: bool = False

    def _init_attention(self, requested_tiling: str | None) -> None:
        """Opt the kernels into their shared memory, pick the prompt tiling (the requested one,
        strictly, or the default where it builds) and ask the model's kernels' occupancy up front."""
        for n in _LARGE_SMEM_KERNELS:
            fn = self._kernels[n]
            getattr(fn, "function", fn).max_dynamic_shared_size_bytes = _ATTN_SMEM_MAX
        self._arch_modules: list[Any] = []
        # Prompts over an fp8 cache run Q K^T in e4m3 (attention_wgq) unless VT_KV8_QK8=0: the
        # prologue leaves q rounded to e4m3 x 2^n, so every kernel reads the same query
        self.kv8_qk8 = requested_switch("VT_KV8_QK8")
        self.prefill_tiling = FALLBACK_PREFILL_TILING
        self.use_prefill_tiling(requested_tiling or DEFAULT_PREFILL_TILING, strict=bool(requested_tiling))
        self._occupancy: dict[tuple[str, int, int], int] = {}
        for d in TC_HEAD_DIMS:  # the model's kernels, asked up front; any other on first use
            for q_len in (1, 16, 64):
                k = attention_kernel(1, q_len, d, prefill=self.prefill_tiling)
                self._resident_blocks(k.name, k.smem, k.threads)

    def use_prefill_tiling(self, name: str, strict: bool = True) -> None:
        """Prompt attention runs on tiling `name` from now on. A tiling of sm_90a kernels has
        them built on first use; where that fails (another GPU, or NVRTC refuses), a strict
        call raises and otherwise the fallback tiling stays."""
        if name not in PREFILL_TILINGS:
            raise ValueError(f"prefill tiling {name!r} is not one of {sorted(PREFILL_TILINGS)}")
        t = PREFILL_TILINGS[name]
        if t.sm90_only and not all(k in self._kernels for k in t.kernels()):
            why = self._compile_sm90a()
            if why:
                if strict:
                    raise ValueError(f"prefill tiling (VT_PREFILL_TILING) {name!r} is not available: {why}")
                name = FALLBACK_PREFILL_TILING
        self.prefill_tiling = name

    def _compile_sm90a(self) -> str:
        """Build the kernel files that need sm_90a (wgmma) into self._kernels; '' or why not.
        CuPy's RawModule always adds the device's generic -arch, so these go through NVRTC
        directly and load as a cubin."""
        from cupy_backends.cuda.api import driver

        cc = cupy.cuda.Device().compute_capability
        if cc != "90":
            return f"its kernels need an sm_90 GPU (this one is sm_{cc})"
        fns: dict[str, Any] = {}
        for fname in ARCH_KERNEL_FILES:
            try:
                cubin = compile_cubin(translation_unit(fname), fname)
            except RuntimeError as exc:
                head, _, log = str(exc).partition("\n")
                return f"{head}\n{log[-2000:]}"
            module = cupy.cuda.function.Module()
            module.load(cubin)
            self._arch_modules.append(module)  # functions live as long as their module
            smem_attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            for name in (*(k for t in PREFILL_TILINGS.values() if t.sm90_only for kv8 in (False, True)
                           for k in t.kernels(kv8)), QK8_KERNEL):
                fn = module.get_function(name)
                driver.funcSetAttribute(fn.ptr, smem_attr, _SM90_SMEM_MAX)
                fns[name] = fn
        self._kernels.update(fns)
        return ""

    def _resident_blocks(self, kernel: str, smem: int, threads: int = 128) -> int:
        """How many blocks of `kernel` the whole chip runs at once (cached)."""
        key = (kernel, smem, threads)
        if key not in self._occupancy:
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(self._function(kernel).ptr,
                                                                                 threads, smem)
            self._occupancy[key] = max(1, per_sm) * self._num_sms
        return self._occupancy[key]

    def attention(
        self,
        q: cupy.ndarray,
        k_cache: cupy.ndarray,
        v_cache: cupy.ndarray,
        query_start_loc: cupy.ndarray,
        seq_lens: cupy.ndarray,
        block_tables: cupy.ndarray,
        scale: float,
        max_query_len: int,
        max_seq_len: int,
        out: cupy.ndarray | None = None,
        decode_seqs: int = 0,
        follows_kv_write: bool = False,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        cascade_blocks: int = 0,
    ) -> cupy.ndarray:
        """Grid sized from max_query_len and max_seq_len: on a graph replay they must still bound
        the real values (capture with the largest ones the graph will serve). out, if given, is
        a contiguous act[T, Hq, D] the result goes into. follows_kv_write: the kernel launched
        right before on this stream wrote only q and this step's K/V (qk_norm_rope_write_kv):
        the tensor-core kernels then start while it runs, on the block tables and older keys.
        An fp8 cache (uint8 codes) runs the _kv8 kernels: k_scale folded into the score scale,
        v_scale a kernel scalar multiplying the output. cascade_blocks > 0: the decodes (the
        first decode_seqs sequences, or all of a one-token-a-sequence launch) all begin with that
        many of the same blocks, each with keys past them (cascade_plan.py): the shared keys are
        read once for all of them."""
        qst = token_stride(q, "attention q")
        t, hq, d = q.shape
        nb, bs, hk, dc = k_cache.shape
        kv8 = is_fp8_cache(k_cache)
        if dc != d or hq % hk or d % 8 or d > 256 or is_fp8_cache(v_cache) != kv8:
            raise ValueError(
                f"attention: q {q.shape} vs cache {k_cache.shape} (head dim multiple of 8, <= 256)"
            )
        if not block_tables.flags.c_contiguous or block_tables.ndim != 2:
            raise ValueError("attention: block_tables must be a C-contiguous i32[B, max_blocks]")
        if out is None:
            out = self._out((t, hq, d), np.uint16)
        elif out.shape != (t, hq, d) or out.dtype != np.uint16 or not out.flags.c_contiguous:
            raise ValueError(f"attention: out must be a contiguous act{[t, hq, d]}, got {out.shape}")
        b = seq_lens.shape[0]
        if t == 0 or b == 0 or max_query_len <= 0:
            return out
        if 0 < decode_seqs < b and max_query_len > 1:
            # One launch would put the decodes on prefill tiles too (4 live rows of 64 at GQA
            # group 4), so they get the decode tiles and the rest a launch of its own.
            # The decodes' rows are the step's first d_ tokens: their launch sizes its split
            # partials by those rows alone.
            d_ = decode_seqs
            self.attention(q[:d_], k_cache, v_cache, query_start_loc[: d_ + 1], seq_lens[:d_],
                           block_tables[:d_], scale, 1, max_seq_len, out[:d_],
                           follows_kv_write=follows_kv_write, kv_scales=kv_scales,
                           cascade_blocks=cascade_blocks)
            return self.attention(q, k_cache, v_cache, query_start_loc[d_:], seq_lens[d_:], block_tables[d_:],
                                  scale, max_query_len, max_seq_len, out, kv_scales=kv_scales)
        if cascade_blocks > 0 and max_query_len == 1 and self._cascade(
                q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, max_seq_len, out,
                kv_scales, cascade_blocks):
            return out
        plan = attention_kernel(hq // hk, max_query_len, d, k_cache.size, prefill=self.prefill_tiling,
                                kv8=kv8, qk8=self.kv8_qk8)
        kernel, tensor_cores, row_tiles, smem, threads = plan
        splits, part_o, part_ml = self._key_split_partials(kernel, smem, threads, row_tiles * hk * b,
                                                           max_seq_len, t, hq, d)
        # An fp8 cache reads code * scale: k_scale scales every score, v_scale the output.
        k_scale, v_scale = kv_scales if kv8 else (1.0, 1.0)
        scale_log2 = _f32(scale * _LOG2E * k_scale)
        common = (q, _i32(qst), k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                  _i32(block_tables.shape[1]), out, part_o, part_ml, _i32(t), _i32(hq), _i32(hk))
        tail = (_i32(bs), scale_log2, _i32(splits), _f32(v_scale))
        args = common + tail if tensor_cores else common + (_i32(d),) + tail
        launch = self._launch_after if follows_kv_write and tensor_cores else self._launch
        grid, items = launch_shape(kernel, row_tiles, hk, b * splits,
                                   self._resident_blocks(kernel, smem, threads))
        launch(kernel, grid, (threads,), args + tuple(_i32(x) for x in items), shared_mem=smem)
        if splits > 1:
            # a decode launch's combine reads only the splits that hold each row's keys
            key_tile = combine_key_tile(plan, max_query_len)
            self._launch(
                "attention_combine_k",
                (t * hq,),
                (64,),
                (part_o, part_ml, query_start_loc, seq_lens, _i32(b), out, _i32(t), _i32(hq), _i32(d),
                 _i32(splits), _i32(key_tile)),
            )
        return out

    def _cascade(self, q: cupy.ndarray, k_cache: cupy.ndarray, v_cache: cupy.ndarray,
                 query_start_loc: cupy.ndarray, seq_lens: cupy.ndarray, block_tables: cupy.ndarray,
                 scale: float, max_seq_len: int, out: cupy.ndarray,
                 kv_scales: tuple[float, float], cascade_blocks: int) -> bool:
        """Decodes (one query row each) whose first cascade_blocks blocks are the same: the shared
        keys attended once by every decode's queries (a prompt-kernel launch), each decode's later
        keys by the decode kernel, both as split partials, merged into out. False (nothing
        launched) where the slot's partials scratch cannot hold two splits of each part."""
        b, hq, d = q.shape
        _, bs, hk, _ = k_cache.shape
        group, kv8 = hq // hk, is_fp8_cache(k_cache)
        if cascade_blocks >= block_tables.shape[1]:
            raise ValueError(f"attention: cascade_blocks {cascade_blocks} leaves no block of the "
                             f"{block_tables.shape[1]} in the table")
        part_buf = None if (s := self._slot_ctx()) is None else s.partials
        cap = (cascade_splits_within(part_buf.nbytes, b, hq, d) if part_buf is not None
               else MAX_KEY_SPLITS)
        if not cap:
            return False
        prefix_len = cascade_blocks * bs
        pre = attention_kernel(b * group, 1, d, k_cache.size, prefill=self.prefill_tiling, kv8=kv8)
        suf = attention_kernel(group, 1, d, k_cache.size, prefill=self.prefill_tiling, kv8=kv8)
        sp = max(2, key_splits(pre.row_tiles * hk, self._resident_blocks(pre.name, pre.smem, pre.threads),
                               prefix_len, cap - 2))
        ss = max(2, key_splits(suf.row_tiles * hk * b, self._resident_blocks(suf.name, suf.smem, suf.threads),
                               max(1, max_seq_len - prefix_len), cap - sp))
        lay = cascade_scratch(sp, ss, b, hq, d)
        if part_buf is None:  # outside a step (tests, setup): from the pool
            part_buf = cupy.empty((lay.end,), dtype=np.uint8)
        base = part_buf.data
        rows = b * hq
        q_perm = cupy.ndarray((1, rows, d), np.uint16, memptr=base + lay.q_perm)
        ints = cupy.ndarray((b + 3,), np.int32, memptr=base + lay.ints)
        part_o = cupy.ndarray((sp + ss, rows, d), np.float32, memptr=base + lay.part_o)
        part_ml = cupy.ndarray((sp + ss, rows, 2), np.float32, memptr=base + lay.part_ml)
        stride = block_tables.shape[1]
        # The suffix launch reads each row's table from its column cascade_blocks on, at the
        # table's own row stride.
        suffix_tables = cupy.ndarray((b * stride - cascade_blocks,), np.int32,
                                     memptr=block_tables.data + cascade_blocks * 4)
        k_scale, v_scale = kv_scales if kv8 else (1.0, 1.0)
        scale_log2 = _f32(scale * _LOG2E * k_scale)
        qst = _i32(token_stride(q, "attention q"))
        self._launch("attention_cascade_prep_k", (b,), (128,),
                     (q, qst, seq_lens, _i32(b), _i32(hq), _i32(hk), _i32(d), _i32(prefix_len), q_perm, ints))
        tail = (_i32(bs), scale_log2)
        for plan, args, splits, seqs in (
            (pre, (q_perm, _i32(rows * d), k_cache, v_cache, ints[b:], ints[b + 2:], block_tables,
                   _i32(stride), out, part_o[:sp], part_ml[:sp], _i32(1), _i32(rows), _i32(hk)), sp, 1),
            (suf, (q, qst, k_cache, v_cache, query_start_loc, ints,
                   suffix_tables, _i32(stride), out, part_o[sp:], part_ml[sp:], _i32(b), _i32(hq), _i32(hk)),
             ss, b),
        ):
            full = args + tail + (_i32(splits), _f32(v_scale)) if plan.tensor_cores else \
                args + (_i32(d),) + tail + (_i32(splits), _f32(v_scale))
            grid, items = launch_shape(plan.name, plan.row_tiles, hk, seqs * splits,
                                       self._resident_blocks(plan.name, plan.smem, plan.threads))
            self._launch(plan.name, grid, (plan.threads,), full + tuple(_i32(x) for x in items),
                         shared_mem=plan.smem)
        self._launch("attention_cascade_combine_k", (rows,), (64,),
                     (part_o, part_ml, _i32(sp), _i32(ss), _i32(b), _i32(hq), _i32(hk), _i32(d), out))
        return True

    def _key_split_partials(self, kernel: str, smem: int, threads: int, blocks: int, max_seq_len: int,
                            t: int, hq: int, d: int) -> tuple[int, Any, Any]:
        """Key splits of a launch of `blocks` blocks per split, and its partials (o, (m, l)) in
        the slot's kernel scratch, or 0, 0 with one split."""
        part_buf = None if (s := self._slot_ctx()) is None else s.partials
        cap = max_splits_within(part_buf.nbytes, t, hq, d) if part_buf is not None else MAX_KEY_SPLITS
        resident = self._resident_blocks(kernel, smem, threads)
        splits = key_splits(blocks, resident, max_seq_len, cap)
        if splits <= 1:
            return splits, 0, 0
        if part_buf is None:  # outside a step (tests, setup): from the pool
            part_buf = cupy.empty((attention_partial_bytes(splits, t, hq, d),), dtype=np.uint8)
        o_bytes = aligned(splits * t * hq * d * 4)
        part_o = cupy.ndarray((splits, t, hq, d), np.float32, memptr=part_buf.data)
        part_ml = cupy.ndarray((splits, t, hq, 2), np.float32, memptr=part_buf.data + o_bytes)
        return splits, part_o, part_ml
