"""The CUDA backend's core: compiled kernels and how they launch, device memory, the slots
(stream, workspace arena, kernel scratch, events, cuBLAS handle each) and graph capture.

Act arrays are cupy uint16 arrays holding bf16 bits. Outputs of ops come from the current slot's
workspace arena (a bump allocator over one preallocated buffer) so a step never allocates from
the pool and a captured graph sees the same pointers on every replay; outside any slot context
ops allocate plainly from CuPy's pool (tests, setup).

Each op family's launchers live beside its kernels and build on this class: elementwise.py
(elementwise.cu), attention.py (attention*.cu), sampling.py (sampling.cu), gemm.py (cuBLAS);
cuda_ops.CudaBackend is all of them together.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import cupy
import ml_dtypes
import numpy as np

from vt.kernels.arena import ArenaLedger, aligned
from vt.kernels.base import NUM_SLOTS
from vt.kernels.cublas_capture import CublasGemm, load_libcublas
from vt.kernels.dependent_launch import DependentLauncher
from vt.kernels.sources import KERNEL_FILES, translation_unit

_DTYPES = {"act": np.uint16, "f32": np.float32, "i32": np.int32, "u8": np.uint8, "i64": np.int64,
           "fp8": np.uint8}  # fp8: e4m3 codes as their bytes (an fp8 KV cache)


def requested_count(value: int | None, env: str, default: int, limit: int) -> int:
    """A backend knob of 0..limit: the argument, or for benchmarks that start vt as a server the
    environment variable `env`, else `default`; ValueError naming `env` otherwise."""
    if value is None:
        text = os.environ.get(env, "") or str(default)
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"{env} must be an integer, got {text!r}") from None
    if not 0 <= value <= limit:
        raise ValueError(f"{env} must be 0 to {limit}, got {value}")
    return value


def requested_switch(env: str) -> bool:
    """An on/off backend knob, on unless the environment variable `env` is 0 (benchmarks that
    start vt as a server use it to compare a path with the one it replaced); ValueError naming
    `env` for anything but 0 or 1."""
    return requested_count(None, env, 1, 1) == 1


def bf16_bits(host: np.ndarray) -> np.ndarray:
    """Host float32 / float16 / bfloat16 (or uint16 bf16 bits, as the loader keeps them) -> uint16 bits."""
    if host.dtype == np.uint16:
        return np.ascontiguousarray(host)
    if host.dtype == ml_dtypes.bfloat16:
        return np.ascontiguousarray(host).view(np.uint16)
    if host.dtype in (np.float32, np.float16, np.float64):
        return np.ascontiguousarray(host.astype(ml_dtypes.bfloat16)).view(np.uint16)
    raise TypeError(f"cannot upload dtype {host.dtype} as bf16; expected float32, float16 or bfloat16")


def is_fp8_cache(cache: cupy.ndarray) -> bool:
    """A KV cache of e4m3 codes (zeros(..., "fp8"): bytes) rather than bf16 bits."""
    return cache.dtype == np.uint8


def kv_cache_args(cache: cupy.ndarray, kv_scales: tuple[float, float]) -> tuple[Any, Any, Any]:
    """The KV write kernels' last arguments: k_scale, v_scale and whether the cache is fp8 (the
    scales are kernel scalars: fixed per layer at load, so a captured graph holds them)."""
    fp8 = is_fp8_cache(cache)
    return np.float32(kv_scales[0] if fp8 else 1.0), np.float32(kv_scales[1] if fp8 else 1.0), np.int32(fp8)


def token_stride(x: cupy.ndarray, name: str) -> int:
    """Element stride of dim 0 for x[T, N, D] whose inner two dims are contiguous bf16."""
    if x.ndim != 3 or x.dtype != np.uint16:
        raise ValueError(f"{name} must be a 3-d act array, got shape {x.shape} dtype {x.dtype}")
    _, n, d = x.shape
    if x.strides[2] != 2 or (n > 1 and x.strides[1] != 2 * d) or x.strides[0] % 16 or x.data.ptr % 16:
        raise ValueError(f"{name} must have contiguous heads and 16-byte aligned rows (strides {x.strides})")
    return x.strides[0] // 2


def check_rows(x: cupy.ndarray, name: str) -> None:
    """x must be a C-contiguous act[T, N] with N a multiple of 8 on 16-byte aligned memory."""
    if x.dtype != np.uint16 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"{name} must be a C-contiguous 2-d act array, got {x.dtype}{x.shape}")
    if x.shape[1] % 8 or x.data.ptr % 16:
        raise ValueError(f"{name}: rows must hold a multiple of 8 elements on 16-byte aligned memory")


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
    """One held step's stream, arena, kernel scratch, events and cuBLAS handle.

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


class CudaCore:
    """Kernels, memory, slots and graphs; the ops are the families' (see the module docstring).

    Beyond base.Backend: arena_reserve(mark) on the active slot's arena, capture_layer_graphs()
    (a capture cut into graphs that uncaptured launches run between; capture_parts() cuts it
    between given callables), and the dtype "i64" in zeros/from_host (sampler seeds)."""

    name = "cuda"

    def __init__(self, kernel_names: Mapping[str, Sequence[str]], workspace_bytes: int,
                 cublas_workspace_bytes: int, partials_bytes: int) -> None:
        if workspace_bytes <= 0 or partials_bytes < 0:
            raise ValueError(f"workspace_bytes must be positive and partials_bytes >= 0, got "
                             f"{workspace_bytes}, {partials_bytes}")
        self._tls = threading.local()  # per-thread open slot (cupy's current stream is per thread too)
        self._kernels = self._compile(kernel_names)
        self._num_sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._dependent = DependentLauncher.open()
        lib = load_libcublas()
        new_gemm = lambda: CublasGemm(lib, cupy.empty((cublas_workspace_bytes,), dtype=np.uint8))
        # The split sampler keeps at most one (score, id) partial per SM.
        self._sampler_bytes = aligned(self._num_sms * 4) * 2
        self._slots = [_Slot(workspace_bytes, new_gemm(), partials_bytes, self._sampler_bytes)
                       for _ in range(NUM_SLOTS)]
        self._loose_gemm = new_gemm()  # for ops outside slots, on whatever stream is current

    # ---- kernels ----------------------------------------------------------------------------
    @staticmethod
    def _compile(kernel_names: Mapping[str, Sequence[str]]) -> dict[str, Any]:
        """Every kernel file of sources.KERNEL_FILES as one module; the named kernels of each."""
        modules: dict[str, Any] = {}
        for fname in KERNEL_FILES:
            module = cupy.RawModule(code=translation_unit(fname), options=("-std=c++17",))
            module.compile()
            modules[fname] = module
        return {n: modules[f].get_function(n) for f, names in kernel_names.items() for n in names}

    def _function(self, name: str) -> Any:
        """The driver function behind a compiled kernel (RawKernel -> Function)."""
        fn = self._kernels[name]
        return getattr(fn, "kernel", None) or getattr(fn, "function", fn)

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
        return self._settled(cupy.asarray(bf16_bits(np.asarray(host))))

    def zeros(self, shape: tuple[int, ...], dtype: str) -> cupy.ndarray:
        return self._settled(cupy.zeros(shape, dtype=self._dtype(dtype)))

    def from_host(self, host: np.ndarray, dtype: str) -> cupy.ndarray:
        host = np.asarray(host)
        if dtype == "act":
            return self._settled(cupy.asarray(bf16_bits(host)))
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

    # ---- slots ------------------------------------------------------------------------------
    def num_slots(self) -> int:
        return NUM_SLOTS

    def _slot(self, i: int) -> _Slot:
        if not 0 <= i < NUM_SLOTS:
            raise ValueError(f"slot {i} out of range 0..{NUM_SLOTS - 1}")
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

    def fp8_weights_unsupported(self) -> str:
        # cuBLASLt's fp8 matmuls and gemv.cu's e4m3 MMA need fp8 tensor cores (Ada, Hopper and later)
        dev = cupy.cuda.Device()
        cc = dev.compute_capability
        if (int(cc[:-1]), int(cc[-1])) >= (8, 9):
            return ""
        name = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"]
        name = name.decode() if isinstance(name, bytes) else str(name)
        return f"{name} is compute capability {cc[:-1]}.{cc[-1]}, without them (8.9 or newer needed)"

    def limit_gemm_sms(self, i: int, sms: int) -> None:
        self._slot(i).gemm.set_sm_count_target(min(max(sms, 0), self._num_sms))

    def wait(self, i: int) -> None:
        self._slot(i).done_event.synchronize()

    # ---- graphs -----------------------------------------------------------------------------
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
        so far and opens the next, so the caller can run uncaptured work between the graphs'
        replays. Returns the graphs and the arena's high-water mark: on replay, reserve up to it
        before anything between or after the graphs takes arena memory."""
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
