"""A probe, not used by vt: the stream-K decode GEMM of streamk_gemm.cu (source generation,
compilation for sm_90a, launch with a fixed workspace, so launches can be captured).
bench/probes/gemm_decode.py times it against cuBLAS.

The kernel needs Hopper's wgmma, which NVRTC only emits for the arch-specific target sm_90a;
CuPy's RawModule always adds its own -arch for the device's generic target, so this module
compiles with NVRTC directly and loads the cubin.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vt.kernels.sources import read_source

if TYPE_CHECKING:
    import cupy

    from vt.kernels.dependent_launch import DependentLauncher

TOKEN_TILES = (16, 32, 64, 128)  # padded token counts compiled (the wgmma N side)
WEIGHT_ROWS = 128                # weight rows per tile (a 64-row slab per warpgroup)
K_CHUNK = 64                     # k per unit of work
THREADS = 256
_SMEM_LIMIT = 227 * 1024         # per block, sm_90
_MAX_STAGES = 10


def stages(tokens: int) -> int:
    """Pipeline depth for a token tile: as many units as shared memory holds (the 1 KB is the
    alignment pad of the 1024-byte swizzle)."""
    per_stage = (WEIGHT_ROWS + tokens) * K_CHUNK * 2
    return min(_MAX_STAGES, (_SMEM_LIMIT - 1024 - 64) // per_stage)


def smem_bytes(tokens: int) -> int:
    return stages(tokens) * (WEIGHT_ROWS + tokens) * K_CHUNK * 2 + 1024


def kernel_name(tokens: int) -> str:
    return f"gemm_sk_n{tokens}"


def source(tokens: tuple[int, ...] = TOKEN_TILES, replace: Mapping[str, str] | None = None) -> str:
    """cuda_common.cu, the PTX wrappers (tensor_core.cu, wgmma.cu: m64nNk16 for N of 16 to 128),
    the probe, and one entry point per token tile; `replace` swaps a wrapper file's text (the
    host simulator's)."""
    body = (Path(__file__).parent / "streamk_gemm.cu").read_text()
    kernels = "".join(
        f'extern "C" __global__ void __launch_bounds__({THREADS}, 1)\n'
        f"{kernel_name(n)}(const bf16_t* w, const bf16_t* x, bf16_t* y, float* partials, int* counters,\n"
        f"    int m, int n, int k, int ldx, int ldy, int accumulate) {{\n"
        f"    gemm_streamk<{n}, {stages(n)}>(w, x, y, partials, counters, m, n, k, ldx, ldy, accumulate);\n"
        f"}}\n"
        for n in tokens
    )
    replace = replace or {}
    wrappers = [replace.get(f, read_source(f)) for f in ("cuda_common.cu", "tensor_core.cu", "wgmma.cu")]
    return "\n".join(wrappers) + "\n" + body.replace("//@KERNELS@", kernels)


def compile_cubin(src: str, arch: str = "sm_90a") -> bytes:
    from vt.kernels.cuda_core import compile_cubin as nvrtc_cubin

    return nvrtc_cubin(src, "streamk_gemm.cu", arch)


class StreamKGemm:
    """Compiled kernels plus the chip's CTA count; workspaces come from new_workspace()."""

    def __init__(self, tokens: tuple[int, ...] = TOKEN_TILES) -> None:
        import cupy
        from cupy_backends.cuda.api import driver

        self.tokens = tuple(sorted(tokens))
        self._module = cupy.cuda.function.Module()
        self._module.load(compile_cubin(source(self.tokens)))
        self._fns: dict[int, Any] = {}
        smem_attr = driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        for n in self.tokens:
            fn = self._module.get_function(kernel_name(n))
            driver.funcSetAttribute(fn.ptr, smem_attr, smem_bytes(n))
            self._fns[n] = fn
        self.ctas = cupy.cuda.Device().attributes["MultiProcessorCount"]

    @property
    def max_rows(self) -> int:
        return self.tokens[-1]

    def new_workspace(self, max_tiles: int = 4096) -> tuple[cupy.ndarray, cupy.ndarray]:
        """(partials, counters) for one stream: two fp32 tile partials per CTA, one counter per
        tile (zero, and left zero by every launch)."""
        import cupy

        partials = cupy.empty((2 * self.ctas * WEIGHT_ROWS * self.max_rows,), dtype=np.float32)
        counters = cupy.zeros((max_tiles,), dtype=np.int32)
        return partials, counters

    def launch(self, workspace: tuple[cupy.ndarray, cupy.ndarray], x: cupy.ndarray, ldx: int, w: cupy.ndarray,
               y: cupy.ndarray, rows: int, n: int, k: int, accumulate: bool,
               dependent: DependentLauncher | None = None) -> None:
        """y[rows, n] (+)= x[rows, k] @ w[n, k]^T on the current stream; w row-major, y rows of n.
        With `dependent`, launched as a programmatic dependent of the kernel before it."""
        partials, counters = workspace
        if not (0 < rows <= self.max_rows and n % WEIGHT_ROWS == 0 and k % K_CHUNK == 0 and ldx % 8 == 0
                and x.data.ptr % 16 == 0 and n // WEIGHT_ROWS <= counters.size):
            raise ValueError(f"stream-K GEMM: no kernel for rows {rows}, n {n}, k {k}, ldx {ldx} "
                             f"(rows <= {self.max_rows}, n % {WEIGHT_ROWS}, k % {K_CHUNK}, 16-byte rows)")
        tokens = next(t for t in self.tokens if t >= rows)
        # No more CTAs than units: every CTA's run is then non-empty, which the kernel's count of
        # a split tile's parts relies on.
        ctas = min(self.ctas, n // WEIGHT_ROWS * (k // K_CHUNK))
        args = (w, x, y, partials, counters, np.int32(rows), np.int32(n), np.int32(k), np.int32(ldx),
                np.int32(n), np.int32(1 if accumulate else 0))
        fn = self._fns[tokens]
        if dependent is not None:
            dependent.launch(fn.ptr, (ctas,), (THREADS,), args, smem_bytes(tokens))
        else:
            fn((ctas,), (THREADS,), args, shared_mem=smem_bytes(tokens))
