"""Launchers of fp8.cu (activation quantization, fused into the norm and SiLU-mul) and the fp8
GEMMs on cuBLASLt (cublas_lt.CublasLtFp8), or on gemv.cu's GEMV at up to 16 tokens. Semantics are
numpy_fp8.NumpyFp8Ops'; weights and activations cross the interface as quantized.Fp8Weight /
Fp8Activation.

On CUDA an activation's e4m3 codes are uint8 [T, K]; its scales are f32 [T] per token, or per token
and 128 columns group-major, f32 [G, T] (cuBLASLt's VEC128 layout for the B operand).
"""

from __future__ import annotations

import cupy
import numpy as np

from vt.kernels.cublas_lt import CublasLtFp8
from vt.kernels.cuda_core import CudaCore, check_rows, requested_count
from vt.kernels.gemm import launch_gemv
from vt.kernels.quantized import (
    HELD_NORM_CHUNKS,
    HELD_SILU_CHUNKS,
    UNIT_SCALE_MAX_ROWS,
    Fp8Activation,
    Fp8Weight,
    PendingResidual,
    PendingScales,
    gemm_rows,
    held_chunks,
    unit_scale_rows,
)

KERNELS = {"fp8.cu": ("quantize_rows_k", "rms_norm_quant_k", "silu_mul_quant_k", "silu_mul_quant_scaled_k",
                      "add_rows_k", "add_scaled_rows_k", "add_scaled_rms_norm_quant_k",
                      *(f"{kind}_held{c}_k" for c in HELD_NORM_CHUNKS
                        for kind in ("rms_norm_quant", "add_scaled_rms_norm_quant", "quantize_rows")),
                      *(f"{kind}_held{c}_k" for c in HELD_SILU_CHUNKS
                        for kind in ("silu_mul_quant", "silu_mul_quant_scaled")))}
_THREADS = 256  # FP8_THREADS in fp8.cu
_i32, _f32 = np.int32, np.float32


# The largest bound VT_FP8_UNIT_QKV_ROWS and VT_FP8_UNIT_GATE_UP_ROWS take (every step).
UNIT_ROWS_LIMIT = 1 << 30


def requested_fp8_per_tensor_rows(value: int | None) -> int:
    """The most rows whose residual projections take the unit-scale path (quantized.unit_scale_rows;
    0: never): the argument, or for benchmarks that start vt as a server VT_FP8_PER_TENSOR_ROWS,
    else UNIT_SCALE_MAX_ROWS. It may only lower that bound, which the memory plan counts."""
    return requested_count(value, "VT_FP8_PER_TENSOR_ROWS", UNIT_SCALE_MAX_ROWS, UNIT_SCALE_MAX_ROWS)


def _overlap(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    """Whether two device arrays' bytes overlap."""
    return a.data.ptr < b.data.ptr + b.nbytes and b.data.ptr < a.data.ptr + a.nbytes


class Fp8Ops(CudaCore):
    _fp8_gemm: CublasLtFp8 | None = None
    _unit_scale: cupy.ndarray | None = None  # f32[1] = 1.0: both scales of a unit-scale GEMM
    fp8_per_tensor_rows: int = UNIT_SCALE_MAX_ROWS
    fp8_unit_qkv_rows: int = UNIT_SCALE_MAX_ROWS
    fp8_fold_add: bool = True
    fp8_unit_gate_up_rows: int = UNIT_SCALE_MAX_ROWS
    fp8_held_rows: bool = True  # per-token rows through the held-row kernels where one fits

    def _held(self, group: int | None, width: int, counts: tuple[int, ...]) -> int:
        """The held-row kernel's chunk count for per-token rows of `width`, 0 for the generic kernel."""
        return held_chunks(width, counts) if group is None and self.fp8_held_rows else 0

    def _lt(self) -> CublasLtFp8:
        # Made at the first fp8 weight (setup, outside any capture): bf16 models never load it.
        if self._fp8_gemm is None:
            self._fp8_gemm = CublasLtFp8()
            self._unit_scale = self._settled(cupy.ones((1,), dtype=np.float32))
        return self._fp8_gemm

    @staticmethod
    def _group_code(group: int | None, k: int) -> int:
        if group is None:
            return 0
        if group != 128 or k % 128:
            raise ValueError(f"fp8 activations group by 128 columns of a multiple of 128, got group {group}, "
                             f"width {k}")
        return 128

    def _activation(self, rows: int, k: int, group: int | None) -> Fp8Activation:
        """Codes and scales for `rows` tokens, padded to the rows the GEMM runs (quantized.gemm_rows)."""
        padded = gemm_rows(rows, group)
        q = self._out((padded, k), np.uint8)
        scale = self._out((padded,) if group is None else (k // 128, padded), np.float32)
        return Fp8Activation(q, scale, group, rows)

    # ---- weights (setup) ---------------------------------------------------------------------
    def upload_fp8(self, q: np.ndarray, scale: np.ndarray) -> Fp8Weight:
        """Block scales are stored with each row of k-blocks padded to a multiple of 4 (16 bytes):
        cuBLASLt reads BLK128x128 scales at that stride (an H100 computes garbage for 2 or 3
        k-blocks at stride 2 or 3, and right with 1, 4, 8 or 32)."""
        self._lt()
        codes = cupy.asarray(np.ascontiguousarray(q).view(np.uint8))
        scale = np.asarray(scale, np.float32)
        block = scale.ndim == 2
        if block:
            padded = np.zeros((scale.shape[0], -(-scale.shape[1] // 4) * 4), np.float32)
            padded[:, : scale.shape[1]] = scale
            scale = padded
        return Fp8Weight(self._settled(codes), self._settled(cupy.asarray(scale)), block=block)

    def quantize_weight(self, w: cupy.ndarray) -> Fp8Weight:
        """Per output channel, on the device (the bf16 weight may be dropped afterwards)."""
        self._lt()
        check_rows(w, "quantize_weight w")
        n, k = w.shape
        q = cupy.empty((n, k), dtype=np.uint8)
        scale = cupy.empty((n,), dtype=np.float32)
        if n:
            args = (w, np.int64(k), q, scale, _i32(k), _i32(0), _i32(n))
            self._launch("quantize_rows_k", (n,), (_THREADS,), args)
        return Fp8Weight(self._settled(q), self._settled(scale), block=False)

    # ---- activations ------------------------------------------------------------------------
    def quantize_fp8(self, x: cupy.ndarray, group: int | None) -> Fp8Activation:
        if x.ndim != 2 or x.dtype != np.uint16 or x.strides[1] != 2 or x.shape[1] % 8 or x.strides[0] % 16:
            raise ValueError(f"quantize_fp8 needs act rows of a multiple of 8 on 16-byte strides, got "
                             f"{x.dtype}{x.shape} strides {x.strides}")
        t, k = x.shape
        code = self._group_code(group, k)
        a = self._activation(t, k, group)
        if t:
            ld = np.int64(x.strides[0] // 2)
            if held := self._held(group, k, HELD_NORM_CHUNKS):
                self._launch(f"quantize_rows_held{held}_k", (t,), (_THREADS,), (x, ld, a.q, a.scale, _i32(k)))
            else:
                args = (x, ld, a.q, a.scale, _i32(k), _i32(code), _i32(a.q.shape[0]))
                self._launch("quantize_rows_k", (t,), (_THREADS,), args)
        return a

    def rms_norm_quant(self, x: cupy.ndarray, weight: cupy.ndarray, eps: float,
                       group: int | None, pending: PendingResidual | None = None) -> Fp8Activation:
        """The input norm's codes of x; a pending product is added to x first (x is the residual
        stream), in the same launch."""
        check_rows(x, "rms_norm_quant x")
        t, k = x.shape
        code = self._group_code(group, k)
        a = self._activation(t, k, group)
        if pending is not None:
            if group is not None or pending.product.shape != (t, k) or not x.flags.c_contiguous:
                raise ValueError(f"rms_norm_quant: a pending product {pending.product.shape} needs "
                                 f"contiguous per-token rows {(t, k)}")
            # the pending product may lie in arena memory rewound since (the layer before's): the
            # launch that reads it must not write over it
            held = (pending.product, pending.x_scale)
            if any(_overlap(out, h) for out in (a.q, a.scale) for h in held):
                raise RuntimeError("rms_norm_quant: its outputs would overwrite the pending product it adds")
            if t:
                args = (x, pending.product, pending.x_scale, pending.w_scale, weight, _f32(eps), a.q, a.scale,
                        _i32(k))
                held = self._held(group, k, HELD_NORM_CHUNKS)
                name = f"add_scaled_rms_norm_quant_held{held}_k" if held else "add_scaled_rms_norm_quant_k"
                self._launch(name, (t,), (_THREADS,), args)
            return a
        if t:
            if held := self._held(group, k, HELD_NORM_CHUNKS):
                self._launch(f"rms_norm_quant_held{held}_k", (t,), (_THREADS,),
                             (x, weight, _f32(eps), a.q, a.scale, _i32(k)))
            else:
                self._launch("rms_norm_quant_k", (t,), (_THREADS,),
                             (x, weight, _f32(eps), a.q, a.scale, _i32(k), _i32(code), _i32(a.q.shape[0])))
        return a

    def silu_mul_quant(self, x: cupy.ndarray, group: int | None) -> Fp8Activation:
        check_rows(x, "silu_mul_quant x")
        t, k2 = x.shape
        inter = k2 // 2
        if inter % 8:
            raise ValueError(f"silu_mul_quant: the intermediate size {inter} must be a multiple of 8")
        code = self._group_code(group, inter)
        a = self._activation(t, inter, group)
        if t:
            if held := self._held(group, inter, HELD_SILU_CHUNKS):
                args = (x, a.q, a.scale, _i32(inter))
                self._launch(f"silu_mul_quant_held{held}_k", (t,), (_THREADS,), args)
            else:
                args = (x, a.q, a.scale, _i32(inter), _i32(code), _i32(a.q.shape[0]))
                self._launch("silu_mul_quant_k", (t,), (_THREADS,), args)
        return a

    # ---- GEMMs ------------------------------------------------------------------------------
    def linear_fp8(self, x: Fp8Activation, w: Fp8Weight, bias: cupy.ndarray | None) -> cupy.ndarray:
        t, n = x.rows, w.q.shape[0]
        y = self._out((x.q.shape[0], n), np.uint16)
        self._fp8_gemm_into(x, w, y, accumulate=False)
        y = y[:t]
        if bias is not None and t:
            if n % 8:
                raise ValueError(f"bias width {n} must be a multiple of 8")
            self._launch("bias_add_k", (-(-(t * n // 8) // 256),), (256,), (y, bias, _i32(t), _i32(n)))
        return y

    def linear_fp8_defer(self, x: Fp8Activation, w: Fp8Weight) -> tuple[cupy.ndarray, PendingScales | None]:
        """x @ w^T for a consumer that can apply the scales as it reads the product (qkv: the
        attention prologue's scales). Steps past the GEMV's rows, up to fp8_unit_qkv_rows (256 by
        default), with per-token activations and per-channel weights get the per-tensor kernel's
        unit-scale sums and the scales to apply (faster than the outer-vector kernel at decode
        sizes, slower in a prompt step: bench/RESULTS.md); others linear_fp8's product and None.
        Same buffer either way."""
        if x.rows <= self.fp8_unit_qkv_rows and self._unit_product_fits(x, w):
            return self._unit_scale_product(x, w), PendingScales(x.scale, w.scale)
        return self.linear_fp8(x, w, None), None

    def mlp_act_fp8(self, r: cupy.ndarray, weight: cupy.ndarray, eps: float, group: int | None,
                    w: Fp8Weight, pending: PendingResidual | None = None) -> Fp8Activation:
        """down_proj's input: silu_mul_quant(linear_fp8(rms_norm_quant(r, weight, eps, group,
        pending), w, None), group), w the stacked gate and up. Steps past the GEMV's rows, up to
        fp8_unit_gate_up_rows (256 by default: quantized.unit_scale_rows' steps), run gate_up on the
        per-tensor kernel with unit scales and give its sums both scales in
        silu_mul_quant_scaled_k: the same buffers as the other path, the outer-vector kernel's
        extra time at those rows saved."""
        check_rows(r, "mlp_act_fp8 r")
        t = r.shape[0]
        n = w.q.shape[0]
        x = self.rms_norm_quant(r, weight, eps, group, pending)
        if not (n % 16 == 0 and x.rows <= self.fp8_unit_gate_up_rows and self._unit_product_fits(x, w)):
            return self.silu_mul_quant(self.linear_fp8(x, w, None), group)
        y = self._unit_scale_product(x, w)
        inter = n // 2
        a = self._activation(t, inter, group)
        args = (y, x.scale, w.scale, a.q, a.scale, _i32(inter))
        held = self._held(group, inter, HELD_SILU_CHUNKS)
        name = f"silu_mul_quant_scaled_held{held}_k" if held else "silu_mul_quant_scaled_k"
        self._launch(name, (t,), (_THREADS,), args)
        return a

    def linear_fp8_residual(self, x: Fp8Activation, w: Fp8Weight, residual: cupy.ndarray,
                            defer: bool = False) -> PendingResidual | None:
        """residual += x @ w^T (both scales). With defer, a unit-scale product (17-256 rows) may
        be returned instead of added, for the next norm of the residual stream to add
        (rms_norm_quant's pending; only while fp8_fold_add), or add_pending where no norm
        follows: the caller must pass it on before anything else reads the residual stream."""
        check_rows(residual, "linear_fp8_residual residual")
        t, n = x.rows, w.q.shape[0]
        if residual.shape != (t, n):
            raise ValueError(f"linear_fp8_residual: residual {residual.shape} is not {(t, n)}")
        if self._unit_scales_fit(x, w) and residual.flags.c_contiguous:
            if defer and self.fp8_fold_add:
                return PendingResidual(self._unit_scale_product(x, w), x.scale, w.scale)
            self._residual_unit_scales(x, w, residual)
            return None
        if x.q.shape[0] == t or self._gemv_fits(x, x.q.shape[1]):  # the GEMV runs the real rows only
            self._fp8_gemm_into(x, w, residual, accumulate=True)
            return None
        # padded rows (block scales): the product lands beside the residual, then is added to it
        y = self._out((x.q.shape[0], n), np.uint16)
        self._fp8_gemm_into(x, w, y, accumulate=False)
        if t:
            chunks = t * n // 8
            self._launch("add_rows_k", (-(-chunks // 256),), (256,), (residual, y, np.int64(chunks)))
        return None

    def _fp8_gemm_into(self, x: Fp8Activation, w: Fp8Weight, y: cupy.ndarray, accumulate: bool) -> None:
        t, k = x.q.shape  # the GEMM's rows, padded ones included
        n, kw = w.q.shape
        if k != kw or (x.group is not None) != w.block:
            raise ValueError(f"fp8 GEMM: activations {x.q.shape} grouped by {x.group} do not fit weight "
                             f"{w.q.shape} ({'block' if w.block else 'channel'} scales)")
        if not t or not n:
            return
        if self._gemv_fits(x, k):
            self._fp8_gemv(x, w, y, accumulate)
            return
        gemm = self._current_gemm()
        self._lt().linear(cupy.cuda.get_current_stream().ptr, x.q.data.ptr, x.scale.data.ptr, w.q.data.ptr,
                          w.scale.data.ptr, y.data.ptr, t, n, k, w.block, accumulate, gemm.workspace_ptr,
                          gemm.workspace_bytes, sm_target=gemm.sm_count_target)

    def _unit_scales_fit(self, x: Fp8Activation, w: Fp8Weight) -> bool:
        """quantized.unit_scale_rows' residual projections, up to fp8_per_tensor_rows rows."""
        return (unit_scale_rows(x.rows, x.group) and x.rows <= self.fp8_per_tensor_rows
                and self._unit_product_fits(x, w))

    def _unit_product_fits(self, x: Fp8Activation, w: Fp8Weight) -> bool:
        """Whether x @ w^T can run as unit-scale sums: per-token activations, per-channel weights,
        rows the GEMV does not take, whole 16-byte rows of the product, channel scales on 16 bytes
        (the kernels that apply them read 8 at a time in vector loads)."""
        return (x.group is None and not w.block and x.rows > 0 and not self._gemv_fits(x, x.q.shape[1])
                and x.q.shape[0] == x.rows and w.q.shape[1] == x.q.shape[1] and w.q.shape[0] % 8 == 0
                and w.scale.data.ptr % 16 == 0)

    def _unit_scale_product(self, x: Fp8Activation, w: Fp8Weight) -> cupy.ndarray:
        """bf16 sums of the codes' products, x @ w^T with unit scales (the per-tensor kernel): the
        caller applies the token's and the channel's scales."""
        t, k = x.q.shape
        n = w.q.shape[0]
        y = self._out((t, n), np.uint16)
        gemm, lt = self._current_gemm(), self._lt()
        unit = self._unit_scale.data.ptr
        stream = cupy.cuda.get_current_stream().ptr
        lt.linear(stream, x.q.data.ptr, unit, w.q.data.ptr, unit, y.data.ptr, t, n, k, False, False,
                  gemm.workspace_ptr, gemm.workspace_bytes, sm_target=gemm.sm_count_target, per_tensor=True)
        return y

    def _residual_unit_scales(self, x: Fp8Activation, w: Fp8Weight, residual: cupy.ndarray) -> None:
        """residual += x @ w^T with both scales applied after the product (add_scaled_rows_k)."""
        self.add_pending(residual, PendingResidual(self._unit_scale_product(x, w), x.scale, w.scale))

    def add_pending(self, residual: cupy.ndarray, pending: PendingResidual) -> None:
        """residual[t, n] += product[t, n] * (x_scale[t] * w_scale[n]), rounded once (add_scaled_rows_k):
        a deferred product that no norm took (the last layer's down_proj)."""
        t, n = pending.product.shape
        if residual.shape != (t, n) or not residual.flags.c_contiguous:
            raise ValueError(f"add_pending: residual {residual.shape} is not contiguous {(t, n)}")
        chunks = t * n // 8
        if chunks:
            self._launch("add_scaled_rows_k", (-(-chunks // 256),), (256,),
                         (residual, pending.product, pending.x_scale, pending.w_scale, _i32(n),
                          np.int64(chunks)))

    def _gemv_fits(self, x: Fp8Activation, k: int) -> bool:
        """gemv.cu takes up to gemv_max_tokens (<= 16) tokens over whole 64-column chunks (128 with
        block scales, whose groups each chunk must stay inside)."""
        return 0 < x.rows <= self.gemv_max_tokens and k % (128 if x.group else 64) == 0

    def _fp8_gemv(self, x: Fp8Activation, w: Fp8Weight, y: cupy.ndarray, accumulate: bool) -> None:
        n, k = w.q.shape
        xs_ld = x.scale.shape[-1] if x.group else 0  # group-major block scales: [groups, padded rows]
        ws_ld = w.scale.shape[1] if w.block else 0
        args = (x.q, x.scale, _i32(xs_ld), w.q, w.scale, _i32(ws_ld), y, _i32(y.strides[0] // 2),
                _i32(x.rows), _i32(n), _i32(k), _i32(int(w.block)), _i32(int(accumulate)))
        launch_gemv(self, "fp8", x.rows, n, args)
