"""The projections and the lm_head on cuBLAS (cublas_capture.CublasGemm: each slot's own handle
and workspace, callable inside a graph capture), and the weight layout they stream fastest."""

from __future__ import annotations

import cupy
import numpy as np

from vt.kernels.cublas_capture import CublasGemm
from vt.kernels.cuda_core import CudaCore, check_rows

# Weights with N >= this * K are stored column-major (gemm_layout).
COLUMN_MAJOR_MIN_ASPECT = 4
_i32 = np.int32


class GemmOps(CudaCore):
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
        check_rows(residual, "linear_residual residual")
        if residual.shape != (x.shape[0], w.shape[0]):
            raise ValueError(f"linear_residual: residual {residual.shape} is not {(x.shape[0], w.shape[0])}")
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
