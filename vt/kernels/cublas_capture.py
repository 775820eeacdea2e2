"""cuBLAS bf16 GEMM called through ctypes on the libcublas that CuPy loaded.

CuPy refuses its own cuBLAS wrappers while a stream is being captured into a CUDA graph; calling
cublasGemmEx directly is legal there as long as the handle has a fixed workspace (no allocation
inside the capture). Eager and captured steps use this same path, so they compute the same thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
OP_N = 0
OP_T = 1

_VP = ctypes.c_void_p
_INT = ctypes.c_int


def _loaded_libcublas_path() -> str | None:
    """Path of the libcublas mapped into this process (CuPy loads it on first cuBLAS use)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(" ")[-1]
                if os.path.basename(path).startswith("libcublas.so"):
                    return path
    except OSError:
        return None
    return None


def load_libcublas() -> ctypes.CDLL:
    """The libcublas CuPy uses: make CuPy load it, then open the same file (dlopen shares it)."""
    import cupy

    cupy.cuda.device.get_cublas_handle()  # forces CuPy to load and initialise its cuBLAS
    candidates = [
        _loaded_libcublas_path(),
        "libcublas.so.13",
        "libcublas.so.12",
        ctypes.util.find_library("cublas"),
    ]
    errors = []
    for name in candidates:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise RuntimeError("could not open libcublas: " + "; ".join(errors or ["no candidate found"]))


class CublasGemm:
    """One cuBLAS handle with its own fixed workspace; gemm() runs on the stream it is given."""

    def __init__(self, lib: ctypes.CDLL, workspace: Any) -> None:
        self._lib = lib
        self._workspace = workspace  # cupy array kept alive as long as the handle
        self._declare()
        handle = _VP()
        self._check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate_v2")
        self._handle = handle
        self._stream: int | None = None
        self._sm_target = 0
        self._alpha = ctypes.c_float(1.0)
        self._beta = (ctypes.c_float(0.0), ctypes.c_float(1.0))  # overwrite C, accumulate into C

    def _declare(self) -> None:
        lib = self._lib
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(_VP)]
        lib.cublasDestroy_v2.argtypes = [_VP]
        lib.cublasSetStream_v2.argtypes = [_VP, _VP]
        lib.cublasSetWorkspace_v2.argtypes = [_VP, _VP, ctypes.c_size_t]
        lib.cublasGemmEx.argtypes = [
            _VP,
            _INT,
            _INT,
            _INT,
            _INT,
            _INT,
            _VP,
            _VP,
            _INT,
            _INT,
            _VP,
            _INT,
            _INT,
            _VP,
            _VP,
            _INT,
            _INT,
            _INT,
            _INT,
        ]
        for fn in (
            lib.cublasCreate_v2,
            lib.cublasDestroy_v2,
            lib.cublasSetStream_v2,
            lib.cublasSetWorkspace_v2,
            lib.cublasGemmEx,
        ):
            fn.restype = _INT

    @property
    def workspace_ptr(self) -> int:
        """The handle's workspace, lent to this slot's cuBLASLt calls too: both run in stream order."""
        return int(self._workspace.data.ptr)

    @property
    def workspace_bytes(self) -> int:
        return int(self._workspace.nbytes)

    @property
    def sm_count_target(self) -> int:
        """The SMs the GEMMs launched now are sized to (0: the whole device); the slot's fp8
        cuBLASLt calls take the same target."""
        return self._sm_target

    def set_sm_count_target(self, sms: int) -> None:
        """Have the GEMMs launched from now on use about `sms` SMs (0: the whole device), so
        that work on another stream can run beside them (cublasSetSmCountTarget)."""
        if sms == self._sm_target:
            return
        fn = self._lib.cublasSetSmCountTarget
        fn.argtypes, fn.restype = [_VP, _INT], _INT
        self._check(fn(self._handle, sms), "cublasSetSmCountTarget")
        self._sm_target = sms

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def _bind(self, stream_ptr: int) -> None:
        # cublasSetStream resets the workspace to cuBLAS's own pool, so set ours again after it.
        if self._stream == stream_ptr:
            return
        self._check(self._lib.cublasSetStream_v2(self._handle, _VP(stream_ptr)), "cublasSetStream_v2")
        ws = self._workspace
        self._check(
            self._lib.cublasSetWorkspace_v2(self._handle, _VP(ws.data.ptr), ws.nbytes),
            "cublasSetWorkspace_v2",
        )
        self._stream = stream_ptr

    def gemm(
        self,
        stream_ptr: int,
        transa: int,
        transb: int,
        m: int,
        n: int,
        k: int,
        a_ptr: int,
        lda: int,
        b_ptr: int,
        ldb: int,
        c_ptr: int,
        ldc: int,
        c_type: int,
        accumulate: bool = False,
    ) -> None:
        """Column-major C[m, n] = op(A) op(B) (+ C with accumulate), bf16 operands, fp32
        compute and accumulation, C in bf16 or f32."""
        self._bind(stream_ptr)
        status = self._lib.cublasGemmEx(
            self._handle,
            transa,
            transb,
            m,
            n,
            k,
            ctypes.byref(self._alpha),
            _VP(a_ptr),
            CUDA_R_16BF,
            lda,
            _VP(b_ptr),
            CUDA_R_16BF,
            ldb,
            ctypes.byref(self._beta[accumulate]),
            _VP(c_ptr),
            c_type,
            ldc,
            CUBLAS_COMPUTE_32F,
            CUBLAS_GEMM_DEFAULT,
        )
        self._check(status, "cublasGemmEx")

    def linear(
        self,
        stream_ptr: int,
        x_ptr: int,
        x_ld: int,
        w_ptr: int,
        y_ptr: int,
        rows: int,
        n: int,
        k: int,
        out_f32: bool,
        accumulate: bool = False,
        w_col_major: bool = False,
    ) -> None:
        """Row-major y[rows, n] (+)= x[rows, k] @ w[n, k]^T: column-major y^T = op_T(w) x^T, or
        op_N(w) when w is stored column-major (w_col_major: element (i, j) at j * n + i)."""
        self.gemm(
            stream_ptr,
            OP_N if w_col_major else OP_T,
            OP_N,
            n,
            rows,
            k,
            w_ptr,
            n if w_col_major else k,
            x_ptr,
            x_ld,
            y_ptr,
            n,
            CUDA_R_32F if out_f32 else CUDA_R_16BF,
            accumulate,
        )

    def close(self) -> None:
        if self._handle:
            self._lib.cublasDestroy_v2(self._handle)
            self._handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may be gone already
            pass
