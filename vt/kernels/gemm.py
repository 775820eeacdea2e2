"""The projections and the lm_head on cuBLAS (cublas_capture.CublasGemm: each slot's own handle
and workspace, callable inside a graph capture), the weight layout they stream fastest, and the
decode GEMVs (gemv.cu) that take the projections of steps of up to 16 tokens."""

from __future__ import annotations

import cupy
import numpy as np

from vt.kernels.cublas_capture import CublasGemm
from vt.kernels.cuda_core import CudaCore, check_rows, requested_count
from vt.kernels.quantized import GEMV_TOKENS

KERNELS = {"gemv.cu": ("gemv_bf16_8_k", "gemv_bf16_16_k", "gemv_fp8_8_k", "gemv_fp8_16_k")}
# Weights with N >= this * K are stored column-major (gemm_layout).
COLUMN_MAJOR_MIN_ASPECT = 4
# gemv.cu: a block's weight rows and threads, and the most tokens it takes (two tiles of 8).
GEMV_ROWS, GEMV_THREADS, GEMV_TOKENS_LIMIT = 16, 256, GEMV_TOKENS
# Steps of up to this many tokens take the GEMV by default. Measured on an H100 (bench/probes/gemv.py,
# 8B shapes, 2026-12-06): at 1-8 tokens it beats cuBLAS(Lt) on every projection or ties; at 9-16 (the
# two-tile kernel) it wins on o_proj and down and loses on fp8 qkv and gate_up, about even a layer.
GEMV_MAX_TOKENS = 16
_i32 = np.int32


def requested_gemv_max_tokens(value: int | None) -> int:
    """Steps of up to this many tokens run their projections on gemv.cu (0: never): the argument,
    or for benchmarks that start vt as a server VT_GEMV_MAX_TOKENS, else GEMV_MAX_TOKENS."""
    return requested_count(value, "VT_GEMV_MAX_TOKENS", GEMV_MAX_TOKENS, GEMV_TOKENS_LIMIT)


def launch_gemv(ops: CudaCore, kind: str, tokens: int, n: int, args: tuple) -> None:
    """gemv.cu's `kind` (bf16, fp8) kernel for `tokens` (one tile of 8, or two), a block per 16
    weight rows, launched as a dependent of the kernel that makes x: its first weights stream while
    that one ends."""
    name = f"gemv_{kind}_{8 if tokens <= 8 else 16}_k"
    ops._launch_after(name, (-(-n // GEMV_ROWS),), (GEMV_THREADS,), args)


class GemmOps(CudaCore):
    gemv_max_tokens: int = GEMV_MAX_TOKENS

    def linear(self, x: cupy.ndarray, w: cupy.ndarray, bias: cupy.ndarray | None) -> cupy.ndarray:
        if self._bf16_gemv_fits(x, w):
            y = self._out((x.shape[0], w.shape[0]), np.uint16)
            self._bf16_gemv(x, w, bias, y, accumulate=False)
            return y
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
        check_rows(residual, "linear_residual residual")
        if residual.shape != (x.shape[0], w.shape[0]):
            raise ValueError(f"linear_residual: residual {residual.shape} is not {(x.shape[0], w.shape[0])}")
        if self._bf16_gemv_fits(x, w):
            self._bf16_gemv(x, w, None, residual, accumulate=True)
            return
        self._gemm(x, w, out_f32=False, accumulate=residual)

    def gemm_layout(self, w: cupy.ndarray) -> cupy.ndarray:
        # cuBLAS streams a wide weight (gate_up: N = 6 K) a few percent faster column-major (the
        # same product, bit for bit, at the 8B shapes measured); the other projections are as
        # fast or faster row-major.
        if w.ndim == 2 and w.shape[0] >= COLUMN_MAJOR_MIN_ASPECT * w.shape[1]:
            return self._settled(cupy.asfortranarray(w))
        return w

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

    def _bf16_gemv_fits(self, x: cupy.ndarray, w: cupy.ndarray) -> bool:
        """gemv.cu streams a row-major weight (a column-major one, gate_up's, stays on cuBLAS,
        which reads it at its floor already) against 1..gemv_max_tokens rows of 32-column chunks
        on 16-byte aligned rows."""
        if x.ndim != 2 or w.ndim != 2 or x.dtype != np.uint16 or w.dtype != np.uint16:
            return False
        t, k = x.shape
        return (0 < t <= self.gemv_max_tokens and k == w.shape[1] and k % 32 == 0 and w.flags.c_contiguous
                and x.strides[1] == 2 and x.strides[0] % 16 == 0 and x.data.ptr % 16 == 0
                and w.data.ptr % 16 == 0)

    def _bf16_gemv(self, x: cupy.ndarray, w: cupy.ndarray, bias: cupy.ndarray | None, y: cupy.ndarray,
                   accumulate: bool) -> None:
        t, k = x.shape
        n = w.shape[0]
        args = (x, _i32(x.strides[0] // 2), w, 0 if bias is None else bias, y, _i32(y.strides[0] // 2),
                _i32(t), _i32(n), _i32(k), _i32(int(accumulate)))
        launch_gemv(self, "bf16", t, n, args)
