"""The CUDA backend: bf16 weights and activations, RawKernels from the *.cu files, cuBLAS GEMMs.

Act arrays are cupy uint16 arrays holding bf16 bits. Outputs of ops come from the current slot's
workspace arena (a bump allocator over one preallocated buffer) so a step never allocates from
the pool and a captured graph sees the same pointers on every replay; outside any slot context
ops allocate plainly from CuPy's pool (tests, setup).

Beyond base.Backend: arena_reserve(mark) on the active slot's arena, capture_layer_graphs() (a
capture cut into graphs that uncaptured launches run between; capture_parts() cuts it between
given callables), and the dtype "i64" in zeros/from_host (sampler seeds).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from vt.kernels.arena import ArenaLedger, aligned
from vt.kernels.attention_plan import (
    DEFAULT_PREFILL_TILING,
    FALLBACK_PREFILL_TILING,
    MAX_KEY_SPLITS,
    PREFILL_TILINGS,
    TC_HEAD_DIMS,
    attention_kernel,
    attention_partial_bytes,
    key_splits,
    max_splits_within,
)
from vt.kernels.base import norm_rope_write_kv_unfused, prologue_fused
from vt.kernels.cublas_capture import CublasGemm, load_libcublas
from vt.kernels.dependent_launch import DependentLauncher
from vt.kernels.sources import ARCH_KERNEL_FILES, KERNEL_FILES, translation_unit

_DTYPES = {"act": np.uint16, "f32": np.float32, "i32": np.int32, "u8": np.uint8, "i64": np.int64}
# Two steps in flight, and a third slot for a step whose guided rows' second sampler pass
# still waits for its masks (the runner's late steps) while the next steps run.
_NUM_SLOTS = 3
_ATTN_SMEM_MAX = 200 * 1024
_SM90_SMEM_MAX = 227 * 1024  # an sm_90 block's opt-in shared memory (wgr's three 64 KB stages need it)
_GREEDY_EPS = 1e-5
_SAMPLE_SPLIT_MIN = 16384  # fewest logits per block when a sampler row is split
_LOG2E = 1.4426950408889634
_COLUMN_MAJOR_MIN_ASPECT = 4  # gemm_layout: weights with N >= this * K are stored column-major
_i32 = np.int32
_f32 = np.float32


def _bf16_bits(host: np.ndarray) -> np.ndarray:
    """Host float32 / float16 / bfloat16 (or uint16 bf16 bits, as the loader keeps them) -> uint16 bits."""
    if host.dtype == np.uint16:
        return np.ascontiguousarray(host)
    if host.dtype == ml_dtypes.bfloat16:
        return np.ascontiguousarray(host).view(np.uint16)
    if host.dtype in (np.float32, np.float16, np.float64):
        return np.ascontiguousarray(host.astype(ml_dtypes.bfloat16)).view(np.uint16)
    raise TypeError(f"cannot upload dtype {host.dtype} as bf16; expected float32, float16 or bfloat16")


class _Arena:
    """Bump allocator over one device buffer, its offsets kept by a vt.kernels.arena ledger."""

    def __init__(self, nbytes: int) -> None:
        self.buf = cupy.empty((nbytes,), dtype=np.uint8)
        self.ledger = ArenaLedger(nbytes)

    @property
    def nbytes(self) -> int:
        return self.buf.nbytes

    def take(self, shape: tuple[int, ...], dtype: Any) -> cupy.ndarray:
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = self.ledger.take(size)
        return cupy.ndarray(shape, dtype=dtype, memptr=self.buf.data + start)


class _Slot:
    """One in-flight step's stream, arena, kernel scratch, events and cuBLAS handle.

    Kernel scratch holds what one op keeps between its own launches (split-key attention
    partials, sampler partials): ops of a slot run in stream order, so every op reuses it."""

    def __init__(self, workspace_bytes: int, gemm: CublasGemm, partials_bytes: int,
                 sampler_bytes: int) -> None:
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.arena = _Arena(workspace_bytes)
        self.partials = cupy.empty((partials_bytes,), dtype=np.uint8)
        self.sampler = cupy.empty((sampler_bytes,), dtype=np.uint8)
        self.done_event = cupy.cuda.Event(disable_timing=True)
        self.fence_event = cupy.cuda.Event(disable_timing=True)
        self.gemm = gemm


class _Graph:
    """A captured CUDA graph replayed on its slot's stream."""

    def __init__(self, graph: Any, stream: cupy.cuda.Stream) -> None:
        self._graph = graph
        self._stream = stream

    def replay(self) -> None:
        self._graph.launch(self._stream)


def _token_stride(x: cupy.ndarray, name: str) -> int:
    """Element stride of dim 0 for x[T, N, D] whose inner two dims are contiguous bf16."""
    if x.ndim != 3 or x.dtype != np.uint16:
        raise ValueError(f"{name} must be a 3-d act array, got shape {x.shape} dtype {x.dtype}")
    _, n, d = x.shape
    if x.strides[2] != 2 or (n > 1 and x.strides[1] != 2 * d) or x.strides[0] % 16 or x.data.ptr % 16:
        raise ValueError(f"{name} must have contiguous heads and 16-byte aligned rows (strides {x.strides})")
    return x.strides[0] // 2


def compile_cubin(source: str, name: str, arch: str = "sm_90a") -> bytes:
    """NVRTC straight to a cubin for an arch-specific target (wgmma needs sm_90a; CuPy's RawModule
    always adds the device's generic -arch). RuntimeError with the compile log on failure."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(source, name, [], [])
    try:
        nvrtc.compileProgram(prog, ["-std=c++17", f"-arch={arch}"])
        return nvrtc.getCUBIN(prog)
    except nvrtc.NVRTCError as exc:
        raise RuntimeError(f"{name} failed to compile for {arch}:\n{nvrtc.getProgramLog(prog)}") from exc
    finally:
        nvrtc.destroyProgram(prog)


class CudaBackend:
    name = "cuda"

    def __init__(self, workspace_bytes: int = 512 << 20, cublas_workspace_bytes: int = 32 << 20,
                 partials_bytes: int = 64 << 20, prefill_tiling: str | None = None) -> None:
        if workspace_bytes <= 0 or partials_bytes < 0:
            raise ValueError(f"workspace_bytes must be positive and partials_bytes >= 0, got "
                             f"{workspace_bytes}, {partials_bytes}")
        # Which tensor-core tiling prompts run on (attention_plan.PREFILL_TILINGS); the
        # environment picks one for benchmarks that start vt as a server.
        requested = prefill_tiling or os.environ.get("VT_PREFILL_TILING")
        if requested and requested not in PREFILL_TILINGS:
            raise ValueError(f"prefill tiling (VT_PREFILL_TILING) {requested!r} is not one of "
                             f"{sorted(PREFILL_TILINGS)}")
        self._tls = threading.local()  # per-thread open slot (cupy's current stream is per thread too)
        self._arch_modules: list[Any] = []
        self._kernels = self._compile()
        self.prefill_tiling = FALLBACK_PREFILL_TILING
        self.use_prefill_tiling(requested or DEFAULT_PREFILL_TILING, strict=bool(requested))
        self._num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._occupancy: dict[tuple[str, int, int], int] = {}
        for d in TC_HEAD_DIMS:  # the model's kernels, asked up front; any other on first use
            for q_len in (1, 16, 64):
                k = attention_kernel(1, q_len, d, prefill=self.prefill_tiling)
                self._resident_blocks(k.name, k.smem, k.threads)
        self._dependent = DependentLauncher.open()
        lib = load_libcublas()
        new_gemm = lambda: CublasGemm(lib, cupy.empty((cublas_workspace_bytes,), dtype=np.uint8))
        # The split sampler keeps at most one (score, id) partial per SM.
        self._sampler_bytes = aligned(self._num_sms * 4) * 2
        self._slots = [_Slot(workspace_bytes, new_gemm(), partials_bytes, self._sampler_bytes)
                       for _ in range(_NUM_SLOTS)]
        self._loose_gemm = new_gemm()  # for ops outside slots, on whatever stream is current

    # ---- compilation ----------------------------------------------------------------------
    def _compile(self) -> dict[str, Any]:
        kernels: dict[str, Any] = {}
        for fname in KERNEL_FILES:
            module = cupy.RawModule(code=translation_unit(fname), options=("-std=c++17",))
            module.compile()
            kernels[fname] = module
        names = {
            "elementwise.cu": (
                "gather_rows_k",
                "rms_norm_k",
                "head_rms_norm_k",
                "rope_k",
                "write_kv_k",
                "qk_norm_rope_write_kv_k",
                "silu_mul_k",
                "rms_scale_k",
                "scale_columns_k",
                "bias_add_k",
                "fill_from_last_k",
            ),
            "attention.cu": ("attention_r1", "attention_r2", "attention_r4", "attention_combine_k"),
            "attention_tc.cu": (
                *(f"attention_tc_d{d}_{kind}" for d in TC_HEAD_DIMS for kind in ("decode", "decode8")),
                *(k for t in PREFILL_TILINGS.values() if not t.sm90_only for k in t.kernels()),
            ),
            "sampling.cu": (
                "log_softmax_topk_k",
                "penalize_k",
                "ban_tokens_k",
                "apply_token_bitmask_k",
                "bias_logits_k",
                "record_sampled_k",
                "sample_k",
                "sample_combine_k",
            ),
        }
        fns = {n: kernels[f].get_function(n) for f, ns in names.items() for n in ns}
        for n in ("attention_r1", "attention_r2", "attention_r4", *names["attention_tc.cu"]):
            fn = fns[n]
            getattr(fn, "function", fn).max_dynamic_shared_size_bytes = _ATTN_SMEM_MAX
        return fns

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
            for name in (k for t in PREFILL_TILINGS.values() if t.sm90_only for k in t.kernels()):
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

    def _token_grid(self, tokens: int, most_parts: int) -> tuple[int, int]:
        """Grid (parts, token blocks) of a kernel that splits each token's row into at most
        most_parts blocks: as few as keep about four blocks per SM in flight, so a long prompt
        runs one block per token (one reduction of its scale, not one per part) and a decode
        batch still fills the chip. Blocks stride over tokens beyond the grid's y limit."""
        parts = min(most_parts, max(1, -(-4 * self._num_sms // tokens)))
        return parts, min(tokens, 65535)

    def _launch(
        self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
    ) -> None:
        self._kernels[name](grid, block, args, shared_mem=shared_mem)

    def _launch_after(
        self, name: str, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int = 0
    ) -> None:
        """Launch as a programmatic dependent of the kernel before it (the kernel must wait with
        griddepcontrol before it reads what that one writes); plainly where the driver cannot."""
        if self._dependent is None:
            self._launch(name, grid, block, args, shared_mem)
            return
        self._dependent.launch(self._function(name).ptr, grid, block, args, shared_mem)

    def _function(self, name: str) -> Any:
        """The driver function behind a compiled kernel (RawKernel -> Function)."""
        fn = self._kernels[name]
        return getattr(fn, "kernel", None) or getattr(fn, "function", fn)

    # ---- memory -------------------------------------------------------------------------
    def _slot_ctx(self) -> _Slot | None:
        return getattr(self._tls, "slot", None)

    def _arena(self) -> _Arena | None:
        s = self._slot_ctx()
        return None if s is None else s.arena

    def _out(self, shape: tuple[int, ...], dtype: Any) -> cupy.ndarray:
        arena = self._arena()
        return arena.take(shape, dtype) if arena is not None else cupy.empty(shape, dtype=dtype)

    # Setup copies and memsets run on the current stream; the slot streams are non-blocking and
    # do not order against it, so persistent buffers are finished before they are handed out.
    @staticmethod
    def _settled(x: cupy.ndarray) -> cupy.ndarray:
        cupy.cuda.get_current_stream().synchronize()
        return x

    def upload(self, host: np.ndarray) -> cupy.ndarray:
        return self._settled(cupy.asarray(_bf16_bits(np.asarray(host))))

    def zeros(self, shape: tuple[int, ...], dtype: str) -> cupy.ndarray:
        return self._settled(cupy.zeros(shape, dtype=self._dtype(dtype)))

    def from_host(self, host: np.ndarray, dtype: str) -> cupy.ndarray:
        host = np.asarray(host)
        if dtype == "act":
            return self._settled(cupy.asarray(_bf16_bits(host)))
        return self._settled(cupy.asarray(np.ascontiguousarray(host, dtype=self._dtype(dtype))))

    @staticmethod
    def _dtype(dtype: str) -> Any:
        try:
            return _DTYPES[dtype]
        except KeyError:
            raise ValueError(f"unknown backend dtype {dtype!r}; expected one of {tuple(_DTYPES)}") from None

    def to_host(self, x: cupy.ndarray) -> np.ndarray:
        # Whole-device sync: x may come from any slot stream (tests, setup; never the step path).
        cupy.cuda.Device().synchronize()
        host = cupy.asnumpy(x)
        if host.dtype == np.uint16:
            return (host.astype(np.uint32) << 16).view(np.float32)
        return host

    def ensure_workspace(self, nbytes: int, partials_bytes: int | None = None) -> None:
        """Size every slot's arena to nbytes and, when given, its attention partials to
        partials_bytes (setup only: no step may be in flight, no graph captured yet)."""
        for s in self._slots:
            if s.arena.nbytes != nbytes:
                s.arena = None  # freed before the new one is taken
                s.arena = _Arena(int(nbytes))
            if partials_bytes is not None and s.partials.nbytes != partials_bytes:
                s.partials = None
                s.partials = cupy.empty((int(partials_bytes),), dtype=np.uint8)

    def scratch(self, shape: tuple[int, ...], dtype: str) -> cupy.ndarray:
        """A buffer that lives until the current step's arena is reset (pool-backed outside slots)."""
        return self._out(tuple(shape), self._dtype(dtype))

    def mem_info(self) -> tuple[int, int]:
        """(free, total) device memory in bytes, for sizing the KV cache."""
        free, total = cupy.cuda.runtime.memGetInfo()
        # Blocks the pool caches count as free: a later engine in the same process reuses them.
        return int(free + cupy.get_default_memory_pool().free_bytes()), int(total)

    def pinned_empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        mem = cupy.cuda.alloc_pinned_memory(max(count * dtype.itemsize, 1))
        return np.frombuffer(mem, dtype=dtype, count=count).reshape(shape)

    @staticmethod
    def _copy_bytes(dst: Any, src: Any) -> int:
        n = min(len(dst), len(src))
        if n == 0:
            return 0
        if dst.dtype.itemsize != src.dtype.itemsize or dst.shape[1:] != src.shape[1:]:
            raise ValueError(f"copy between {src.dtype}{src.shape} and {dst.dtype}{dst.shape}: rows differ")
        if not (dst.flags.c_contiguous and src.flags.c_contiguous):
            raise ValueError("copy_h2d / copy_d2h need C-contiguous arrays")
        return n * (src.nbytes // len(src))

    def copy_h2d(self, dst: cupy.ndarray, src: np.ndarray) -> None:
        nbytes = self._copy_bytes(dst, src)
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(
                dst.data.ptr,
                src.ctypes.data,
                nbytes,
                cupy.cuda.runtime.memcpyHostToDevice,
                cupy.cuda.get_current_stream().ptr,
            )

    def copy_d2h(self, dst: np.ndarray, src: cupy.ndarray) -> None:
        nbytes = self._copy_bytes(dst, src)
        if nbytes:
            cupy.cuda.runtime.memcpyAsync(
                dst.ctypes.data,
                src.data.ptr,
                nbytes,
                cupy.cuda.runtime.memcpyDeviceToHost,
                cupy.cuda.get_current_stream().ptr,
            )

    # ---- model ops ----------------------------------------------------------------------
    @staticmethod
    def _rows_ok(x: cupy.ndarray, name: str) -> None:
        if x.dtype != np.uint16 or x.ndim != 2 or not x.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous 2-d act array, got {x.dtype}{x.shape}")
        if x.shape[1] % 8 or x.data.ptr % 16:
            raise ValueError(f"{name}: rows must hold a multiple of 8 elements on 16-byte aligned memory")

    def gather_rows(self, x: cupy.ndarray, idx: cupy.ndarray) -> cupy.ndarray:
        self._rows_ok(x, "gather_rows x")
        n, width = idx.shape[0], x.shape[1]
        out = self._out((n, width), np.uint16)
        if n:
            self._launch("gather_rows_k", (n,), (128,), (idx, x, out, _i32(n), _i32(width), _i32(x.shape[0])))
        return out

    def embed(self, ids: cupy.ndarray, table: cupy.ndarray) -> cupy.ndarray:
        return self.gather_rows(table, ids)

    def rms_norm(
        self, x: cupy.ndarray, weight: cupy.ndarray, eps: float, residual: cupy.ndarray | None
    ) -> tuple[cupy.ndarray, cupy.ndarray]:
        self._rows_ok(x, "rms_norm x")
        t, h = x.shape
        y = self._out((t, h), np.uint16)
        if residual is not None:
            self._rows_ok(residual, "rms_norm residual")
            r = self._out((t, h), np.uint16)
        else:
            r = x
        if t:
            threads = min(1024, max(32, -(-h // 8 // 32) * 32))
            self._launch(
                "rms_norm_k",
                (t,),
                (threads,),
                (x, residual if residual is not None else 0, weight, y, r, _i32(h), _f32(eps)),
            )
        return y, r

    def head_rms_norm(self, x: cupy.ndarray, weight: cupy.ndarray, eps: float) -> cupy.ndarray:
        stride = _token_stride(x, "head_rms_norm x")
        t, n, d = x.shape
        if d % 8:
            raise ValueError(f"head dim {d} must be a multiple of 8")
        y = self._out((t, n, d), np.uint16)
        if t:
            self._launch(
                "head_rms_norm_k",
                (-(-t * n // 4),),
                (128,),
                (x, _i32(stride), weight, y, _i32(t), _i32(n), _i32(d), _f32(eps)),
            )
        return y

    def linear(self, x: cupy.ndarray, w: cupy.ndarray, bias: cupy.ndarray | None) -> cupy.ndarray:
        y = self._gemm(x, w, out_f32=False)
        if bias is not None and y.shape[0]:
            n = y.shape[1]
            if n % 8:
                raise ValueError(f"bias width {n} must be a multiple of 8")
            chunks = y.shape[0] * n // 8
            self._launch("bias_add_k", (-(-chunks // 256),), (256,), (y, bias, _i32(y.shape[0]), _i32(n)))
        return y

    def logits(self, x: cupy.ndarray, w: cupy.ndarray) -> cupy.ndarray:
        return self._gemm(x, w, out_f32=True)

    def linear_residual(self, x: cupy.ndarray, w: cupy.ndarray, residual: cupy.ndarray) -> None:
        self._rows_ok(residual, "linear_residual residual")
        if residual.shape != (x.shape[0], w.shape[0]):
            raise ValueError(f"linear_residual: residual {residual.shape} is not {(x.shape[0], w.shape[0])}")
        self._gemm(x, w, out_f32=False, accumulate=residual)

    def gemm_layout(self, w: cupy.ndarray) -> cupy.ndarray:
        # cuBLAS streams a wide weight (gate_up: N = 6 K) a few percent faster column-major (the
        # same product, bit for bit, at the 8B shapes measured); the other projections are as
        # fast or faster row-major.
        if w.ndim == 2 and w.shape[0] >= _COLUMN_MAJOR_MIN_ASPECT * w.shape[1]:
            return self._settled(cupy.asfortranarray(w))
        return w

    def fold_norm_weight(self, w: cupy.ndarray, norm: cupy.ndarray) -> None:
        self._rows_ok(w, "fold_norm_weight w")
        rows, cols = w.shape
        if norm.shape != (cols,) or norm.dtype != np.uint16:
            raise ValueError(f"fold_norm_weight: norm {norm.dtype}{norm.shape} does not match w {w.shape}")
        chunks = rows * cols // 8
        if chunks:
            grid = (-(-chunks // 256),)
            self._launch("scale_columns_k", grid, (256,), (w, norm, np.int64(rows), _i32(cols)))
            self._settled(w)

    def _gemm(self, x: cupy.ndarray, w: cupy.ndarray, out_f32: bool,
              accumulate: cupy.ndarray | None = None) -> cupy.ndarray:
        if x.ndim != 2 or w.ndim != 2 or x.dtype != np.uint16 or w.dtype != np.uint16:
            raise ValueError(f"linear needs 2-d act arrays, got x {x.dtype}{x.shape}, w {w.dtype}{w.shape}")
        t, k = x.shape
        n, kw = w.shape
        if k != kw:
            raise ValueError(f"linear: x has {k} columns but w has {kw}")
        if not (w.flags.c_contiguous or w.flags.f_contiguous) or x.strides[1] != 2:
            raise ValueError("linear: w must be contiguous (C or Fortran order) and x rows contiguous")
        y = self._out((t, n), np.float32 if out_f32 else np.uint16) if accumulate is None else accumulate
        if t and n:
            ld = x.strides[0] // 2 if t > 1 else k
            gemm = self._current_gemm()
            gemm.linear(cupy.cuda.get_current_stream().ptr, x.data.ptr, ld, w.data.ptr, y.data.ptr, t, n, k,
                        out_f32, accumulate=accumulate is not None, w_col_major=not w.flags.c_contiguous)
        return y

    def _current_gemm(self) -> CublasGemm:
        s = self._slot_ctx()
        return self._loose_gemm if s is None else s.gemm

    def rope(self, q: cupy.ndarray, k: cupy.ndarray, positions: cupy.ndarray, inv_freq: cupy.ndarray) -> None:
        qs, ks = _token_stride(q, "rope q"), _token_stride(k, "rope k")
        t, hq, d = q.shape
        if k.shape[0] != t or k.shape[2] != d or inv_freq.shape[0] != d // 2:
            raise ValueError(f"rope: shapes q {q.shape}, k {k.shape}, inv_freq {inv_freq.shape} disagree")
        if t:
            self._launch(
                "rope_k",
                (t,),
                (256,),
                (q, _i32(qs), k, _i32(ks), positions, inv_freq, _i32(hq), _i32(k.shape[1]), _i32(d)),
            )

    def write_kv(
        self,
        k: cupy.ndarray,
        v: cupy.ndarray,
        k_cache: cupy.ndarray,
        v_cache: cupy.ndarray,
        slot_mapping: cupy.ndarray,
    ) -> None:
        kst, vst = _token_stride(k, "write_kv k"), _token_stride(v, "write_kv v")
        t, hk, d = k.shape
        nb, bs, hkc, dc = k_cache.shape
        if (hkc, dc) != (hk, d) or v_cache.shape != k_cache.shape or v.shape != k.shape:
            raise ValueError(f"write_kv: k {k.shape}, v {v.shape}, caches {k_cache.shape} disagree")
        if (hk * d) % 8:
            raise ValueError("write_kv: kv row must be a multiple of 8 elements")
        if t:
            self._launch(
                "write_kv_k",
                (t,),
                (128,),
                (k, _i32(kst), v, _i32(vst), k_cache, v_cache, slot_mapping, _i32(hk * d), np.int64(nb * bs)),
            )

    def qk_norm_rope_write_kv(
        self,
        q: cupy.ndarray,
        k: cupy.ndarray,
        v: cupy.ndarray,
        q_norm: cupy.ndarray | None,
        k_norm: cupy.ndarray | None,
        eps: float,
        positions: cupy.ndarray,
        inv_freq: cupy.ndarray,
        k_cache: cupy.ndarray,
        v_cache: cupy.ndarray,
        slot_mapping: cupy.ndarray,
        rms_of: cupy.ndarray | None = None,
        bias: cupy.ndarray | None = None,
    ) -> None:
        t, hq, d = q.shape
        hk = k.shape[1]
        nb, bs, hkc, dc = k_cache.shape
        if rms_of is not None:
            self._rows_ok(rms_of, "qk_norm_rope_write_kv rms_of")
            if rms_of.shape[0] != t:
                raise ValueError(f"qk_norm_rope_write_kv: rms_of has {rms_of.shape[0]} rows for {t} tokens")
        if bias is not None and (bias.shape != ((hq + 2 * hk) * d,) or bias.dtype != np.uint16):
            raise ValueError(f"qk_norm_rope_write_kv: bias {bias.dtype}{bias.shape} is not act[(Hq+2Hk)D]")
        width = 0 if rms_of is None else rms_of.shape[1]
        if not prologue_fused(d, q_norm, k_norm):
            # Shapes the one-warp-per-head kernel does not cover take the three-op path.
            if (rms_of is not None or bias is not None) and t:
                for x, lo in ((q, 0), (k, hq * d), (v, (hq + hk) * d)):
                    n = x.shape[1] * d
                    self._launch("rms_scale_k", (t,), (256,),
                                 (x, _i32(_token_stride(x, "qk_norm_rope_write_kv")), _i32(n),
                                  0 if rms_of is None else rms_of, _i32(width), _f32(eps),
                                  0 if bias is None else bias[lo : lo + n]))
            norm_rope_write_kv_unfused(self, q, k, v, q_norm, k_norm, eps, positions, inv_freq, k_cache,
                                       v_cache, slot_mapping)
            return
        qs, ks, vs = (_token_stride(x, "qk_norm_rope_write_kv") for x in (q, k, v))
        bad = k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or (hkc, dc) != (hk, d)
        if bad or inv_freq.shape[0] != d // 2 or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"qk_norm_rope_write_kv: q {q.shape}, k {k.shape}, v {v.shape}, caches {k_cache.shape}, "
                f"{v_cache.shape}, inv_freq {inv_freq.shape} disagree"
            )
        if t:
            lanes = 1 << (d // 8 - 1).bit_length()  # a row's lanes: the power of two >= d/8
            self._launch(
                "qk_norm_rope_write_kv_k",
                self._token_grid(t, -(-(hq + 2 * hk) * lanes // 256)),
                (256,),
                (q, _i32(qs), k, _i32(ks), v, _i32(vs), 0 if q_norm is None else q_norm,
                 0 if k_norm is None else k_norm, _f32(eps), positions, inv_freq, k_cache, v_cache,
                 slot_mapping, np.int64(nb * bs), _i32(t), _i32(hq), _i32(hk), _i32(d),
                 0 if rms_of is None else rms_of, _i32(width), 0 if bias is None else bias),
            )

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
    ) -> cupy.ndarray:
        """Grid sized from max_query_len and max_seq_len: on a graph replay they must still bound
        the real values (capture with the largest ones the graph will serve). out, if given, is
        a contiguous act[T, Hq, D] the result goes into. follows_kv_write: the kernel launched
        right before on this stream wrote only q and this step's K/V (qk_norm_rope_write_kv):
        the tensor-core kernels then start while it runs, on the block tables and older keys."""
        qst = _token_stride(q, "attention q")
        t, hq, d = q.shape
        nb, bs, hk, dc = k_cache.shape
        if dc != d or hq % hk or d % 8 or d > 256:
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
                           follows_kv_write=follows_kv_write)
            return self.attention(q, k_cache, v_cache, query_start_loc[d_:], seq_lens[d_:], block_tables[d_:],
                                  scale, max_query_len, max_seq_len, out)
        plan = attention_kernel(hq // hk, max_query_len, d, k_cache.size, prefill=self.prefill_tiling)
        kernel, tensor_cores, row_tiles, smem, threads = plan
        part_buf = None if (s := self._slot_ctx()) is None else s.partials
        cap = max_splits_within(part_buf.nbytes, t, hq, d) if part_buf is not None else MAX_KEY_SPLITS
        resident = self._resident_blocks(kernel, smem, threads)
        splits = key_splits(row_tiles * hk * b, resident, max_seq_len, cap)
        if splits > 1:
            if part_buf is None:  # outside a step (tests, setup): from the pool
                part_buf = cupy.empty((attention_partial_bytes(splits, t, hq, d),), dtype=np.uint8)
            o_bytes = aligned(splits * t * hq * d * 4)
            part_o = cupy.ndarray((splits, t, hq, d), np.float32, memptr=part_buf.data)
            part_ml = cupy.ndarray((splits, t, hq, 2), np.float32, memptr=part_buf.data + o_bytes)
        else:
            part_o = part_ml = 0
        scale_log2 = _f32(scale * _LOG2E)
        common = (q, _i32(qst), k_cache, v_cache, query_start_loc, seq_lens, block_tables,
                  _i32(block_tables.shape[1]), out, part_o, part_ml, _i32(t), _i32(hq), _i32(hk))
        tail = (_i32(bs), scale_log2, _i32(splits))
        args = common + tail if tensor_cores else common + (_i32(d),) + tail
        launch = self._launch_after if follows_kv_write and tensor_cores else self._launch
        launch(kernel, (row_tiles, hk, b * splits), (threads,), args, shared_mem=smem)
        if splits > 1:
            self._launch(
                "attention_combine_k",
                (t * hq,),
                (64,),
                (part_o, part_ml, query_start_loc, _i32(b), out, _i32(t), _i32(hq), _i32(d), _i32(splits)),
            )
        return out

    def silu_mul(self, x: cupy.ndarray, rms_of: cupy.ndarray | None = None, eps: float = 0.0) -> cupy.ndarray:
        self._rows_ok(x, "silu_mul x")
        t, two_i = x.shape
        inter = two_i // 2
        if inter % 8:
            raise ValueError(f"silu_mul: half width {inter} must be a multiple of 8")
        if rms_of is not None:
            self._rows_ok(rms_of, "silu_mul rms_of")
            if rms_of.shape[0] != t:
                raise ValueError(f"silu_mul: rms_of has {rms_of.shape[0]} rows for {t} tokens")
        out = self._out((t, inter), np.uint16)
        if t and inter:
            threads = 256  # a thread does every parts-th chunk of 8 outputs of its block's row
            self._launch("silu_mul_k", self._token_grid(t, -(-inter // 8 // threads)), (threads,),
                         (x, out, _i32(t), _i32(inter), 0 if rms_of is None else rms_of,
                          _i32(0 if rms_of is None else rms_of.shape[1]), _f32(eps)))
        return out

    # ---- step plumbing --------------------------------------------------------------------
    def fill_from_last(
        self, input_ids: cupy.ndarray, src_rows: cupy.ndarray, last_tokens: cupy.ndarray
    ) -> None:
        n = src_rows.shape[0]
        if n:
            self._launch(
                "fill_from_last_k",
                (-(-n // 256),),
                (256,),
                (input_ids, src_rows, last_tokens, _i32(n), _i32(last_tokens.shape[0])),
            )

    # ---- sampling -------------------------------------------------------------------------
    @staticmethod
    def _logits_ok(logits: cupy.ndarray) -> tuple[int, int]:
        if logits.dtype != np.float32 or logits.ndim != 2 or not logits.flags.c_contiguous:
            raise ValueError(f"logits must be C-contiguous f32[B, V], got {logits.dtype}{logits.shape}")
        return logits.shape

    def log_softmax_topk(
        self, logits: cupy.ndarray, ids: cupy.ndarray, k: int
    ) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
        b, v = self._logits_ok(logits)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        k = min(k, v)
        chosen = self._out((b,), np.float32)
        top_ids = self._out((b, k), np.int32)
        top_lp = self._out((b, k), np.float32)
        if b:
            self._launch(
                "log_softmax_topk_k", (b,), (1024,), (logits, ids, chosen, top_ids, top_lp, _i32(v), _i32(k))
            )
        return chosen, top_ids, top_lp

    def penalize(
        self,
        logits: cupy.ndarray,
        rows: cupy.ndarray,
        out_counts: cupy.ndarray,
        prompt_mask: cupy.ndarray,
        presence: cupy.ndarray,
        frequency: cupy.ndarray,
        repetition: cupy.ndarray,
    ) -> None:
        b, v = self._logits_ok(logits)
        if out_counts.shape[1] != v or prompt_mask.shape[1] != v:
            raise ValueError(
                f"penalize: vocab {v} vs out_counts {out_counts.shape}, prompt_mask {prompt_mask.shape}"
            )
        if b:
            self._launch(
                "penalize_k",
                (-(-v // 256), b),
                (256,),
                (logits, rows, out_counts, prompt_mask, presence, frequency, repetition, _i32(v)),
            )

    def ban_tokens(self, logits: cupy.ndarray, ban: cupy.ndarray) -> None:
        b, v = self._logits_ok(logits)
        if b and ban.shape[1]:
            self._launch("ban_tokens_k", (b,), (128,), (logits, ban, _i32(ban.shape[1]), _i32(v)))

    def bias_logits(self, logits: cupy.ndarray, sel: cupy.ndarray, tokens: cupy.ndarray,
                    biases: cupy.ndarray) -> None:
        b, v = self._logits_ok(logits)
        m = sel.shape[0]
        if sel.dtype != np.int32 or sel.ndim != 2 or sel.shape[1] != 4 or not sel.flags.c_contiguous:
            raise ValueError(f"sel must be C-contiguous i32[{m}, 4], got {sel.dtype}{sel.shape}")
        if tokens.shape != biases.shape or tokens.dtype != np.int32 or biases.dtype != np.float32:
            raise ValueError(f"tokens i32[R, C] and biases f32[R, C] must match, got "
                             f"{tokens.dtype}{tokens.shape} and {biases.dtype}{biases.shape}")
        if m and b:
            self._launch("bias_logits_k", (-(-v // 256), m), (256,),
                         (logits, sel, tokens, biases, _i32(tokens.shape[1]), _i32(b), _i32(v)))

    def apply_token_bitmask(self, logits: cupy.ndarray, bitmask: cupy.ndarray, rows: cupy.ndarray) -> None:
        b, v = self._logits_ok(logits)
        m = rows.shape[0]
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != m \
                or not bitmask.flags.c_contiguous:
            raise ValueError(f"bitmask must be C-contiguous i32[{m}, W], got {bitmask.dtype}{bitmask.shape}")
        if m and b:
            self._launch("apply_token_bitmask_k", (-(-v // 256), m), (256,),
                         (logits, bitmask, rows, _i32(bitmask.shape[1]), _i32(b), _i32(v)))

    def sample(
        self,
        logits: cupy.ndarray,
        temperature: cupy.ndarray,
        top_k: cupy.ndarray,
        top_p: cupy.ndarray,
        min_p: cupy.ndarray,
        seeds: cupy.ndarray,
        offsets: cupy.ndarray,
    ) -> cupy.ndarray:
        b, v = self._logits_ok(logits)
        if seeds.dtype.itemsize != 8:
            raise ValueError(f"seeds must be 64-bit, got {seeds.dtype}")
        out = self._out((b,), np.int32)
        if b:
            # Rows without filters (greedy, plain temperature) split over several blocks when
            # the batch leaves SMs idle; their (score, id) partials are combined exactly.
            splits = max(1, min(self._num_sms // b, v // _SAMPLE_SPLIT_MIN, 32))
            part_v = part_i = 0
            if splits > 1:
                s = self._slot_ctx()
                scratch = s.sampler if s is not None else cupy.empty((self._sampler_bytes,), np.uint8)
                part_v = cupy.ndarray((b * splits,), np.float32, memptr=scratch.data)
                part_i = cupy.ndarray((b * splits,), np.int32, memptr=scratch.data + self._sampler_bytes // 2)
            self._launch(
                "sample_k",
                (splits, b),
                (1024,),
                (logits, temperature, top_k, top_p, min_p, seeds, offsets, out, part_v, part_i, _i32(v),
                 _i32(splits)),
            )
            if splits > 1:
                self._launch("sample_combine_k", (b,), (32,), (part_v, part_i, out, _i32(splits)))
        return out

    def record_sampled(
        self, last_tokens: cupy.ndarray, out_counts: cupy.ndarray, rows: cupy.ndarray, ids: cupy.ndarray
    ) -> None:
        n = rows.shape[0]
        if n:
            self._launch(
                "record_sampled_k",
                (-(-n // 256),),
                (256,),
                (
                    last_tokens,
                    out_counts,
                    rows,
                    ids,
                    _i32(n),
                    _i32(out_counts.shape[0]),
                    _i32(out_counts.shape[1]),
                ),
            )

    # ---- async plumbing ------------------------------------------------------------------------
    def num_slots(self) -> int:
        return _NUM_SLOTS

    def _slot(self, i: int) -> _Slot:
        if not 0 <= i < _NUM_SLOTS:
            raise ValueError(f"slot {i} out of range 0..{_NUM_SLOTS - 1}")
        return self._slots[i]

    @contextlib.contextmanager
    def slot(self, i: int) -> Iterator[None]:
        s = self._slot(i)
        s.arena.ledger.reset()
        previous = self._slot_ctx()
        self._tls.slot = s
        try:
            with s.stream:
                yield
        finally:
            self._tls.slot = previous

    def _open_ledger(self, op: str) -> ArenaLedger:
        """The active slot's arena ledger."""
        arena = self._arena()
        if arena is None:
            raise RuntimeError(f"{op}() needs an open slot context")
        return arena.ledger

    def arena_mark(self) -> int:
        """Current offset of the active slot's arena (to keep outputs across arena_reset)."""
        return self._open_ledger("arena_mark").offset

    def arena_reset(self, mark: int) -> None:
        """Free everything the active slot's arena handed out after `mark`."""
        self._open_ledger("arena_reset").rewind(mark)

    def arena_reserve(self, mark: int) -> None:
        """Hand out nothing below mark from now on (a replayed graph's buffers live there)."""
        self._open_ledger("arena_reserve").reserve(mark)

    def after(self, i: int, j: int) -> None:
        si, sj = self._slot(i), self._slot(j)
        if i == j:
            return
        sj.fence_event.record(sj.stream)
        si.stream.wait_event(sj.fence_event)

    def record(self, i: int) -> None:
        s = self._slot(i)
        s.done_event.record(s.stream)

    def done(self, i: int) -> bool:
        return self._slot(i).done_event.done

    def num_sms(self) -> int:
        return self._num_sms

    def limit_gemm_sms(self, i: int, sms: int) -> None:
        self._slot(i).gemm.set_sm_count_target(min(max(sms, 0), self._num_sms))

    def wait(self, i: int) -> None:
        self._slot(i).done_event.synchronize()

    def capture(self, i: int, fn: Callable[[], Any]) -> _Graph:
        """fn() runs once under capture on slot i (arena reset, like slot(i)); nothing in it may
        allocate from the pool or synchronize. Its outputs live in slot i's arena, rewritten in
        place by every replay."""
        s = self._slot(i)
        with self.slot(i):
            s.stream.begin_capture()
            try:
                fn()
            finally:
                graph = s.stream.end_capture()
        return _Graph(graph, s.stream)

    def capture_parts(self, i: int, parts: Sequence[Callable[[], Any]]) -> list[_Graph]:
        """capture_layer_graphs() with a cut between consecutive parts: one graph per part."""
        def run(cut: Callable[[], None]) -> None:
            for k, part in enumerate(parts):
                if k:
                    cut()
                part()

        graphs, _ = self.capture_layer_graphs(i, run)
        return graphs

    def capture_layer_graphs(self, i: int,
                             fn: Callable[[Callable[[], None]], Any]) -> tuple[list[_Graph], int]:
        """fn(cut) runs once under capture on slot i, like capture(); each cut() closes the graph
        so far and opens the next, so the caller can run uncaptured work between the pieces'
        replays. Returns the pieces and the arena's high-water mark: on replay, reserve up to it
        before anything between or after the pieces takes arena memory."""
        s = self._slot(i)
        graphs: list[_Graph] = []

        def cut() -> None:
            graphs.append(_Graph(s.stream.end_capture(), s.stream))
            s.stream.begin_capture()

        with self.slot(i):
            s.stream.begin_capture()
            try:
                fn(cut)
            finally:
                graphs.append(_Graph(s.stream.end_capture(), s.stream))
            high = s.arena.ledger.high
        return graphs, high
