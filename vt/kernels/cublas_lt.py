"""fp8 GEMMs on Hopper's tensor cores through cuBLASLt, called with ctypes (capturable in graphs).

y[rows, n] (+)= dequant(x)[rows, k] @ dequant(w)[n, k]^T, both operands e4m3 with k innermost,
fp32 accumulation, bf16 output (or accumulated into a bf16 residual, beta = 1). cuBLASLt sees the
column-major product y^T[n, rows] = op_T(w) op_N(x^T), so w is its A and x its B:
- channel scales: A (w) gets a scale per row of op(A) = per output channel, B (x) a scale per
  column of op(B) = per token (OUTER_VEC_32F both), with fast accumulation: measured on an H100
  (bench/probes/fp8_gemm.py, 2026-12-06) 5-15% faster than without at every 8B shape;
- block scales: A a scale per 128x128 block, stored as the checkpoints store weight_scale_inv
  ([ceil(n/128), ceil(k/128)] row-major) but with each row padded to a multiple of 4 scales, B a
  scale per token and 128 columns stored group-major ([ceil(k/128)][rows], rows a multiple of 4)
  (BLK128x128_32F / VEC128_32F; fast accumulation is not offered there). Both strides were found
  on an H100 (2026-12-06): cuBLASLt reads every scale row 16-byte aligned and says so nowhere.
Mixed modes (a per-tensor weight with per-token activations) have no cuBLASLt kernel on Hopper.
- unit scales (per_tensor): one fp32 scale each (SCALAR_32F, pointing at a device 1.0), fast
  accumulation: the plain product of the codes, whose per-token and per-channel scales the caller
  applies afterwards. At 64-256 rows these kernels run the 8B decode projections 1.03-1.5x faster
  than the outer-vector ones (o_proj and down most; bench/RESULTS.md, H100, 2026-12-06).

Plans (descriptors and the heuristic's algorithm) are made once per shape and kept; the scale
pointers are set on the descriptor at every call, as they change with the layer and the slot.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

from vt.kernels.cublas_capture import CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, load_libcublas

CUDA_R_8F_E4M3 = 28
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_SM_COUNT_TARGET = 15
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_PREF_MAX_WORKSPACE_BYTES = 1
_SCALE_SCALAR, _SCALE_OUTER_VEC, _SCALE_VEC128, _SCALE_BLK128 = 0, 3, 4, 5
_VP = ctypes.c_void_p


class Algo(ctypes.Structure):
    """cublasLtMatmulAlgo_t."""

    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t."""

    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_libcublaslt() -> ctypes.CDLL:
    """The libcublasLt that the libcublas CuPy loaded was built with (it loads it as a dependency)."""
    load_libcublas()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.rstrip("\n").split(" ")[-1]
            if os.path.basename(path).startswith("libcublasLt.so"):
                return ctypes.CDLL(path)
    for name in ("libcublasLt.so.13", "libcublasLt.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("could not open libcublasLt")


@dataclass
class _Plan:
    desc: _VP
    layouts: tuple[_VP, _VP, _VP, _VP]  # A (w), B (x), C, D
    algo: Algo


class CublasLtFp8:
    """One cuBLASLt handle; fp8 GEMMs on the stream and with the workspace given at each call."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        self._lib = lib = lib or load_libcublaslt()
        for fn in ("cublasLtCreate", "cublasLtDestroy", "cublasLtMatmulDescCreate",
                   "cublasLtMatmulDescSetAttribute", "cublasLtMatrixLayoutCreate",
                   "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute",
                   "cublasLtMatmulPreferenceDestroy", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul"):
            getattr(lib, fn).restype = ctypes.c_int
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(_VP), ctypes.c_int, ctypes.c_uint64,
                                                   ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [_VP, ctypes.c_int, _VP, ctypes.c_size_t]
        lib.cublasLtMatmul.argtypes = [_VP] * 12 + [ctypes.POINTER(Algo), _VP, ctypes.c_size_t, _VP]
        self._handle = _VP()
        self._check(lib.cublasLtCreate(ctypes.byref(self._handle)), "cublasLtCreate")
        self._plans: dict[tuple[int, int, int, bool, int, int, bool], _Plan] = {}
        self._one = ctypes.c_float(1.0)
        self._beta = (ctypes.c_float(0.0), ctypes.c_float(1.0))

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _set(self, desc: _VP, attr: int, value: ctypes._SimpleCData) -> None:
        size = ctypes.sizeof(value)
        self._check(self._lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), size),
                    f"cublasLtMatmulDescSetAttribute({attr})")

    def _plan(self, rows: int, n: int, k: int, block: bool, workspace_bytes: int, w_scale_ptr: int,
              x_scale_ptr: int, sm_target: int, per_tensor: bool = False) -> _Plan:
        """The shape's plan, made on its first call (the heuristic wants the scale pointers set:
        without them it refuses the scaled modes). sm_target > 0 asks for a kernel sized to that
        many SMs (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), so work on another stream keeps the rest.
        per_tensor: one scale each operand (the module docstring's unit scales)."""
        key = (rows, n, k, block, workspace_bytes, sm_target, per_tensor)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        lib = self._lib
        desc = _VP()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        self._set(desc, _DESC_TRANSA, ctypes.c_int32(1))
        self._set(desc, _DESC_TRANSB, ctypes.c_int32(0))
        a_mode, b_mode = ((_SCALE_SCALAR, _SCALE_SCALAR) if per_tensor else (_SCALE_BLK128, _SCALE_VEC128)
                          if block else (_SCALE_OUTER_VEC, _SCALE_OUTER_VEC))
        self._set(desc, _DESC_A_SCALE_MODE, ctypes.c_int32(a_mode))
        self._set(desc, _DESC_B_SCALE_MODE, ctypes.c_int32(b_mode))
        if per_tensor or not block:
            self._set(desc, _DESC_FAST_ACCUM, ctypes.c_int8(1))
        self._set(desc, _DESC_A_SCALE_POINTER, _VP(w_scale_ptr))
        self._set(desc, _DESC_B_SCALE_POINTER, _VP(x_scale_ptr))
        if sm_target > 0:
            self._set(desc, _DESC_SM_COUNT_TARGET, ctypes.c_int32(sm_target))
        layouts = []
        for dtype, r, c, ld in ((CUDA_R_8F_E4M3, k, n, k), (CUDA_R_8F_E4M3, k, rows, k),
                                (CUDA_R_16BF, n, rows, n), (CUDA_R_16BF, n, rows, n)):
            lay = _VP()
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), dtype, r, c, ld), "layout")
            layouts.append(lay)
        pref = _VP()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ws = ctypes.c_uint64(workspace_bytes)
        status = lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                          ctypes.sizeof(ws))
        self._check(status, "preference workspace")
        found = HeuristicResult()
        count = ctypes.c_int()
        status = lib.cublasLtMatmulAlgoGetHeuristic(self._handle, desc, *layouts, pref, 1,
                                                    ctypes.byref(found), ctypes.byref(count))
        lib.cublasLtMatmulPreferenceDestroy(pref)
        if status != 0 or count.value == 0:
            raise RuntimeError(f"cuBLASLt has no fp8 kernel for {rows} x {n} x {k} "
                               f"({'block' if block else 'channel'} scales; status {status})")
        plan = _Plan(desc, (layouts[0], layouts[1], layouts[2], layouts[3]), found.algo)
        self._plans[key] = plan
        return plan

    def linear(self, stream_ptr: int, x_ptr: int, x_scale_ptr: int, w_ptr: int, w_scale_ptr: int, y_ptr: int,
               rows: int, n: int, k: int, block: bool, accumulate: bool, workspace_ptr: int,
               workspace_bytes: int, sm_target: int = 0, per_tensor: bool = False) -> None:
        """Row-major y[rows, n] = x @ w^T (+ y with accumulate), x e4m3[rows, k] with its scales,
        w e4m3[n, k] with its scales (the module docstring gives both layouts), y bf16; on about
        sm_target SMs when it is positive (the slot's cuBLAS target, for split steps). per_tensor:
        the scale pointers each point at one fp32 scale."""
        plan = self._plan(rows, n, k, block, workspace_bytes, w_scale_ptr, x_scale_ptr, sm_target, per_tensor)
        self._set(plan.desc, _DESC_A_SCALE_POINTER, _VP(w_scale_ptr))
        self._set(plan.desc, _DESC_B_SCALE_POINTER, _VP(x_scale_ptr))
        a, b, c, d = plan.layouts
        status = self._lib.cublasLtMatmul(
            self._handle, plan.desc, ctypes.byref(self._one), _VP(w_ptr), a, _VP(x_ptr), b,
            ctypes.byref(self._beta[accumulate]), _VP(y_ptr), c, _VP(y_ptr), d, ctypes.byref(plan.algo),
            _VP(workspace_ptr), workspace_bytes, _VP(stream_ptr))
        self._check(status, "cublasLtMatmul")
