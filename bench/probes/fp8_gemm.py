"""fp8 GEMMs through cuBLASLt on Hopper: which scale modes and layouts work, and how fast.

    python3 -m bench.probes.fp8_gemm [--preset 8b] [--json out.json]

Checks, on small random operands against a float64 product of the dequantized values:
  tensor   A = W (op T) and B = x (op N), one fp32 scale each (SCALAR_32F)
  channel  the same with OUTER_VEC_32F: a scale per output channel (W's rows) and per token
  wblock   A = W with BLK128x128_32F, B = x with VEC128_32F (128x128 weight blocks, 1x128
           activation groups: the layout of Qwen3's FP8 checkpoints), both scale layouts tried
  xblock   A = x with VEC128_32F, B = W with BLK128x128_32F (the order of NVIDIA's sample),
           D column-major (transposed output) and, where accepted, row-major
  accum    channel scales with beta = 1 into a bf16 residual (o_proj, down_proj)
and that a channel-scaled call captured in a CUDA graph replays to the same bits.
Then each mode that works is timed beside bf16 cublasGemmEx on the model's projections at
decode and prefill row counts (a graph of REPS calls, weights rotating through copies so that
each call reads its weight from HBM; the median of REPLAYS replays).
"""

from __future__ import annotations

import argparse
import ctypes
import json

import cupy
import ml_dtypes
import numpy as np

from bench.graph_timing import median_per_call
from vt.kernels.cublas_capture import CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, CublasGemm, load_libcublas
from vt.kernels.cublas_lt import Algo, HeuristicResult, load_libcublaslt

CUDA_R_8F_E4M3 = 28
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18
DESC_FAST_ACCUM = 25
DESC_POINTER_MODE = 2
POINTER_ALPHA_VECTOR_BETA_HOST = 4
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32
LAYOUT_ORDER = 1
ORDER_ROW = 1
PREF_MAX_WORKSPACE_BYTES = 1
SCALAR, OUTER, VEC128, BLK = 0, 3, 4, 5
E4M3_MAX = 448.0
WORKSPACE = 32 << 20
REPS, REPLAYS = 36, 7
COPY_BYTES = 512 << 20
HBM = {"H100": 3.35e12, "H200": 4.8e12}
_VP = ctypes.c_void_p

SHAPES = {
    "8b": {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)},
    "0.6b": {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
}


class LtFp8:
    def __init__(self) -> None:
        self.lib = lib = load_libcublaslt()
        for fn in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                   "cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutSetAttribute",
                   "cublasLtMatmulPreferenceCreate", "cublasLtMatmulPreferenceSetAttribute",
                   "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul", "cublasLtGetVersion"):
            getattr(lib, fn).restype = ctypes.c_int if fn != "cublasLtGetVersion" else ctypes.c_size_t
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(_VP), ctypes.c_int, ctypes.c_uint64,
                                                   ctypes.c_uint64, ctypes.c_int64]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [_VP, ctypes.c_int, _VP, ctypes.c_size_t]
        lib.cublasLtMatrixLayoutSetAttribute.argtypes = [_VP, ctypes.c_int, _VP, ctypes.c_size_t]
        lib.cublasLtMatmul.argtypes = [_VP] * 12 + [ctypes.POINTER(Algo), _VP, ctypes.c_size_t, _VP]
        self.handle = _VP()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)), "create")
        self.ws = cupy.empty(WORKSPACE, dtype=cupy.uint8)
        self.version = lib.cublasLtGetVersion()

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def _set(self, desc: _VP, attr: int, value: ctypes._SimpleCData) -> None:
        size = ctypes.sizeof(value)
        status = self.lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), size)
        self._ok(status, f"desc attr {attr}")

    def plan(self, m: int, n: int, k: int, a_mode: int, b_mode: int, a_scale: int, b_scale: int,
             d_row: bool = False, fast: bool = False, alpha_vector: bool = False, algo: int = 0) -> tuple:
        """D[m, n] (column-major unless d_row) = op_T(A)[m, k] op_N(B)[k, n], A and B e4m3 with
        K innermost, D and C bf16. Returns (desc, A, B, C, D layouts, algo) or raises."""
        lib = self.lib
        desc = _VP()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        self._set(desc, DESC_TRANSA, ctypes.c_int32(1))
        self._set(desc, DESC_TRANSB, ctypes.c_int32(0))
        self._set(desc, DESC_A_SCALE_MODE, ctypes.c_int32(a_mode))
        self._set(desc, DESC_B_SCALE_MODE, ctypes.c_int32(b_mode))
        self._set(desc, DESC_A_SCALE_POINTER, _VP(a_scale))
        self._set(desc, DESC_B_SCALE_POINTER, _VP(b_scale))
        if fast:
            self._set(desc, DESC_FAST_ACCUM, ctypes.c_int8(1))
        if alpha_vector:  # alpha: a device vector of m values (one per output channel), beta on the host
            self._set(desc, DESC_POINTER_MODE, ctypes.c_int32(POINTER_ALPHA_VECTOR_BETA_HOST))
        lay = []
        for dtype, rows, cols, ld in ((CUDA_R_8F_E4M3, k, m, k), (CUDA_R_8F_E4M3, k, n, k),
                                      (CUDA_R_16BF, m, n, n if d_row else m),
                                      (CUDA_R_16BF, m, n, n if d_row else m)):
            h = _VP()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), dtype, rows, cols, ld), "layout")
            lay.append(h)
        if d_row:
            for h in lay[2:]:
                order = ctypes.c_int32(ORDER_ROW)
                status = lib.cublasLtMatrixLayoutSetAttribute(h, LAYOUT_ORDER, ctypes.byref(order), 4)
                self._ok(status, "order")
        pref = _VP()
        self._ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        wsz = ctypes.c_uint64(WORKSPACE)
        status = lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(wsz),
                                                          8)
        self._ok(status, "pref ws")
        res = (HeuristicResult * 8)()
        got = ctypes.c_int()
        self._ok(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, *lay, pref, 8, res, ctypes.byref(got)),
                 "heuristic")
        if got.value <= algo:
            raise RuntimeError(f"{got.value} algorithms")
        return (desc, *lay, res[algo].algo)

    def run(self, plan: tuple, a: int, b: int, d: int, stream: int, beta: float = 0.0,
            alpha_ptr: int = 0) -> None:
        desc, la, lb, lc, ld, algo = plan
        alpha, beta_c = ctypes.c_float(1.0), ctypes.c_float(beta)
        alpha_arg = _VP(alpha_ptr) if alpha_ptr else ctypes.byref(alpha)
        self._ok(self.lib.cublasLtMatmul(self.handle, desc, alpha_arg, _VP(a), la, _VP(b), lb,
                                         ctypes.byref(beta_c), _VP(d), lc, _VP(d), ld, ctypes.byref(algo),
                                         _VP(self.ws.data.ptr), WORKSPACE, _VP(stream)), "matmul")


def quantize_rows(x: np.ndarray, group: int | None) -> tuple[np.ndarray, np.ndarray]:
    """e4m3 of x[r, k] with one fp32 scale per row (group None) or per row and `group` columns."""
    r, k = x.shape
    g = k if group is None else group
    blocks = x.reshape(r, k // g, g)
    scale = np.maximum(np.abs(blocks).max(axis=2), 1e-12) / E4M3_MAX
    q = (blocks / scale[:, :, None]).clip(-E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(r, k), scale.astype(np.float32)


def quantize_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, k = w.shape
    blocks = w.reshape(n // 128, 128, k // 128, 128)
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)), 1e-12) / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clip(-E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(n, k), scale.astype(np.float32)


def deq(q: np.ndarray) -> np.ndarray:
    return q.astype(np.float64)


def dev(a: np.ndarray) -> cupy.ndarray:
    return cupy.asarray(np.ascontiguousarray(a).view(np.uint8) if a.dtype == ml_dtypes.float8_e4m3fn else a)


def bf16_to_f64(d: cupy.ndarray) -> np.ndarray:
    return (cupy.asnumpy(d).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def checks(lt: LtFp8, rng) -> dict:
    m_tok, n_out, k = 200, 384, 1024  # tokens not a multiple of 128 on purpose
    x = rng.standard_normal((m_tok, k)).astype(np.float32)
    w = (rng.standard_normal((n_out, k)) / np.sqrt(k)).astype(np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    out: dict = {"cublasLt_version": lt.version}

    def attempt(name: str, fn) -> None:
        try:
            out[name] = fn()
        except Exception as exc:  # each mode stands alone: report and go on
            out[name] = {"error": str(exc)}
        print(name, out[name], flush=True)

    def gemm_wx(a_mode, b_mode, wq, ws, xq, xs, beta=0.0, c=None):
        dw, dx = dev(wq), dev(xq)
        dws, dxs = cupy.asarray(ws), cupy.asarray(xs)
        d = cupy.zeros((m_tok, n_out), dtype=cupy.uint16) if c is None else cupy.asarray(c)
        plan = lt.plan(n_out, m_tok, k, a_mode, b_mode, dws.data.ptr, dxs.data.ptr)
        cupy.cuda.Device().synchronize()
        lt.run(plan, dw.data.ptr, dx.data.ptr, d.data.ptr, stream.ptr, beta)
        stream.synchronize()
        return bf16_to_f64(d)

    def tensor():
        wq, ws = quantize_rows(w.reshape(1, -1), None)
        xq, xs = quantize_rows(x.reshape(1, -1), None)
        wq, xq = wq.reshape(w.shape), xq.reshape(x.shape)
        ref = (deq(xq) * xs[0, 0]) @ (deq(wq) * ws[0, 0]).T
        got = gemm_wx(SCALAR, SCALAR, wq, ws.reshape(1), xq, xs.reshape(1))
        return {"rel": rel(got, ref)}

    def channel():
        wq, ws = quantize_rows(w, None)
        xq, xs = quantize_rows(x, None)
        ref = (deq(xq) * xs) @ (deq(wq) * ws).T
        got = gemm_wx(OUTER, OUTER, wq, ws.reshape(-1), xq, xs.reshape(-1))
        return {"rel": rel(got, ref), "rel_vs_f32": rel(got, x.astype(np.float64) @ w.T.astype(np.float64))}

    def accum():
        wq, ws = quantize_rows(w, None)
        xq, xs = quantize_rows(x, None)
        res = rng.standard_normal((m_tok, n_out)).astype(np.float32)
        res_bf = (res.view(np.uint32) >> 16).astype(np.uint16)
        ref = (deq(xq) * xs) @ (deq(wq) * ws).T + (res_bf.astype(np.uint32) << 16).view(np.float32)
        got = gemm_wx(OUTER, OUTER, wq, ws.reshape(-1), xq, xs.reshape(-1), beta=1.0, c=res_bf)
        return {"rel": rel(got, ref)}

    def wblock():
        wq, wsb = quantize_blocks(w)  # [n/128, k/128]
        xq, xsg = quantize_rows(x, 128)  # [m, k/128]
        ref = np.einsum("mgi,ngi->mn", (deq(xq).reshape(m_tok, k // 128, 128) * xsg[:, :, None]),
                        (deq(wq).reshape(n_out, k // 128, 128)
                         * np.repeat(wsb, 128, axis=0)[:, :, None]))
        res = {}
        layouts = {
            "w_kmajor_x_mmajor": (wsb, xsg.T),  # w scales [n/128][k/128]; x scales [k/128][m]
            "w_nmajor_x_mmajor": (wsb.T, xsg.T),
            "w_kmajor_x_kmajor": (wsb, xsg),
            "w_nmajor_x_kmajor": (wsb.T, xsg),
        }
        for name, (sw, sx) in layouts.items():
            try:
                got = gemm_wx(BLK, VEC128, wq, np.ascontiguousarray(sw), xq, np.ascontiguousarray(sx))
                res[name] = rel(got, ref)
            except Exception as exc:
                res[name] = str(exc)
        return res

    def xblock(d_row: bool):
        wq, wsb = quantize_blocks(w)
        xq, xsg = quantize_rows(x, 128)
        ref = np.einsum("mgi,ngi->mn", (deq(xq).reshape(m_tok, k // 128, 128) * xsg[:, :, None]),
                        (deq(wq).reshape(n_out, k // 128, 128)
                         * np.repeat(wsb, 128, axis=0)[:, :, None]))
        res = {}
        for name, (sx, sw) in {"x_mmajor_w_kmajor": (xsg.T, wsb), "x_mmajor_w_nmajor": (xsg.T, wsb.T),
                               "x_kmajor_w_kmajor": (xsg, wsb), "x_kmajor_w_nmajor": (xsg, wsb.T)}.items():
            try:
                dx, dw = dev(xq), dev(wq)
                dsx, dsw = cupy.asarray(np.ascontiguousarray(sx)), cupy.asarray(np.ascontiguousarray(sw))
                plan = lt.plan(m_tok, n_out, k, VEC128, BLK, dsx.data.ptr, dsw.data.ptr, d_row=d_row)
                d = cupy.zeros((m_tok, n_out) if d_row else (n_out, m_tok), dtype=cupy.uint16)
                lt.run(plan, dx.data.ptr, dw.data.ptr, d.data.ptr, stream.ptr)
                stream.synchronize()
                got = bf16_to_f64(d)
                res[name] = rel(got if d_row else got.T, ref)
            except Exception as exc:
                res[name] = str(exc)
        return res

    def graph():
        wq, ws = quantize_rows(w, None)
        xq, xs = quantize_rows(x, None)
        dw, dx, dws, dxs = dev(wq), dev(xq), cupy.asarray(ws.reshape(-1)), cupy.asarray(xs.reshape(-1))
        d1 = cupy.zeros((m_tok, n_out), dtype=cupy.uint16)
        d2 = cupy.zeros((m_tok, n_out), dtype=cupy.uint16)
        plan = lt.plan(n_out, m_tok, k, OUTER, OUTER, dws.data.ptr, dxs.data.ptr)
        cupy.cuda.Device().synchronize()
        lt.run(plan, dw.data.ptr, dx.data.ptr, d1.data.ptr, stream.ptr)
        stream.begin_capture()
        lt.run(plan, dw.data.ptr, dx.data.ptr, d2.data.ptr, stream.ptr)
        g = stream.end_capture()
        g.launch(stream)
        stream.synchronize()
        return {"same_bits": bool((d1 == d2).all())}

    def convert():
        # NVRTC's e4m3 conversion (saturating, nearest even) against ml_dtypes on the same floats
        src = r"""
        #include <cuda_fp8.h>
        extern "C" __global__ void to_e4m3(const float* x, unsigned char* y, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) y[i] = __nv_cvt_float_to_fp8(x[i], __NV_SATFINITE, __NV_E4M3);
        }"""
        kern = cupy.RawKernel(src, "to_e4m3", options=("--std=c++17",))
        vals = np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * 50,
                               np.arange(-1000, 1000, 0.0625, dtype=np.float32)])
        clipped = vals.clip(-E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        dx, dy = cupy.asarray(vals), cupy.zeros(vals.size, dtype=cupy.uint8)
        kern(((vals.size + 255) // 256,), (256,), (dx, dy, np.int32(vals.size)))
        got = cupy.asnumpy(dy)
        return {"mismatches": int((got != clipped).sum()), "of": int(vals.size)}

    attempt("convert", convert)
    attempt("tensor", tensor)
    attempt("channel", channel)
    attempt("accum", accum)
    attempt("wblock", wblock)
    attempt("xblock_dcol", lambda: xblock(False))
    attempt("xblock_drow", lambda: xblock(True))
    attempt("graph", graph)
    return out


def time_graph(stream: cupy.cuda.Stream, launch, reps: int) -> float:
    """Median ms per call of `reps` calls captured in one graph."""
    stream.begin_capture()
    for i in range(reps):
        launch(i)
    g = stream.end_capture()
    g.launch(stream)
    stream.synchronize()
    return median_per_call(stream, lambda: g.launch(stream), reps, REPLAYS) * 1e3


def timings(lt: LtFp8, preset: str, rows_list: list[int], modes: list[str], hbm: float) -> list[dict]:
    stream = cupy.cuda.Stream(non_blocking=True)
    lib = load_libcublas()
    bf = CublasGemm(lib, cupy.empty(WORKSPACE, dtype=cupy.uint8))
    out = []
    for name, (n, k) in SHAPES[preset].items():
        copies8 = max(2, COPY_BYTES // (n * k))
        copies16 = max(2, COPY_BYTES // (2 * n * k))
        w8 = [cupy.random.randint(0, 0x7E, (n, k), dtype=cupy.uint8) for _ in range(copies8)]  # finite e4m3
        w16 = [cupy.random.randint(0x3C00, 0x3E00, (n, k), dtype=cupy.uint16) for _ in range(copies16)]
        wscale = cupy.full(max(n, (n // 128) * (k // 128)), 1e-3, dtype=cupy.float32)
        for rows in rows_list:
            x8 = cupy.random.randint(0, 0x7E, (rows, k), dtype=cupy.uint8)
            x16 = cupy.random.randint(0x3C00, 0x3E00, (rows, k), dtype=cupy.uint16)
            xscale = cupy.full(max(rows, 1) * (k // 128) + 4 * (k // 128), 1e-2, dtype=cupy.float32)
            d = cupy.empty((rows, n), dtype=cupy.uint16)
            row = {"shape": name, "n": n, "k": k, "rows": rows}
            cupy.cuda.Device().synchronize()
            row["bf16_ms"] = time_graph(stream, lambda i: bf.linear(  # noqa: B023 (called at once)
                stream.ptr, x16.data.ptr, k, w16[i % copies16].data.ptr, d.data.ptr, rows, n, k, False), REPS)  # noqa: B023
            for mode in modes:
                a_mode, b_mode = {"tensor": (SCALAR, SCALAR), "channel": (OUTER, OUTER),
                                  "wblock": (BLK, VEC128)}[mode]
                try:
                    plan = lt.plan(n, rows, k, a_mode, b_mode, wscale.data.ptr, xscale.data.ptr)
                    row[f"{mode}_ms"] = time_graph(stream, lambda i, plan=plan: lt.run(
                        plan, w8[i % copies8].data.ptr, x8.data.ptr, d.data.ptr, stream.ptr), REPS)  # noqa: B023
                except Exception as exc:
                    row[f"{mode}_ms"] = str(exc)
            floor8 = (n * k + rows * k + 2 * rows * n) / hbm * 1e3
            flops = 2 * rows * n * k
            row["fp8_floor_ms"] = floor8
            fp8_ms = [v for key, v in row.items() if key.endswith("_ms") and isinstance(v, float)
                      and key not in ("bf16_ms", "fp8_floor_ms")]
            best = min(fp8_ms, default=None)
            if best:
                row["best_fp8_tflops"] = flops / best / 1e9
                row["best_fp8_x_floor"] = best / floor8
            row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


VARIANTS = {  # name: (A = W scale mode, B = x scale mode, fast accumulation, alpha vector)
    "tensor": (SCALAR, SCALAR, False, False),
    "tensor_fast": (SCALAR, SCALAR, True, False),
    "channel": (OUTER, OUTER, False, False),
    "channel_fast": (OUTER, OUTER, True, False),
    "wtensor_xtoken": (SCALAR, OUTER, False, False),
    "wtensor_xtoken_fast": (SCALAR, OUTER, True, False),
    "alphavec_xtensor": (SCALAR, SCALAR, False, True),
    "alphavec_xtoken": (SCALAR, OUTER, False, True),
    "wblock_fast": (BLK, VEC128, True, False),
}


def variants(lt: LtFp8, preset: str, rows_list: list[int], only: list[str] | None = None) -> list[dict]:
    """Every variant (or those named in only), each of cuBLASLt's first 8 heuristic picks: the best
    time and its index, and the first pick's time (`<variant>_first`)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    out = []
    for name, (n, k) in SHAPES[preset].items():
        copies8 = max(2, COPY_BYTES // (n * k))
        w8 = [cupy.random.randint(0, 0x7E, (n, k), dtype=cupy.uint8) for _ in range(copies8)]
        wscale = cupy.full(max(n, (n // 128) * (k // 128)), 1e-3, dtype=cupy.float32)
        for rows in rows_list:
            x8 = cupy.random.randint(0, 0x7E, (rows, k), dtype=cupy.uint8)
            xscale = cupy.full(max(rows, 4) * (k // 128), 1e-2, dtype=cupy.float32)
            d = cupy.empty((rows, n), dtype=cupy.uint16)
            row: dict = {"shape": name, "rows": rows}
            for vname, (am, bm, fast, avec) in VARIANTS.items():
                if only and vname not in only:
                    continue
                best = None
                for idx in range(8):
                    try:
                        plan = lt.plan(n, rows, k, am, bm, 0 if avec and am == SCALAR else wscale.data.ptr,
                                       xscale.data.ptr, fast=fast, alpha_vector=avec, algo=idx)
                        t = time_graph(stream, lambda i, plan=plan, avec=avec: lt.run(  # noqa: B023
                            plan, w8[i % copies8].data.ptr, x8.data.ptr, d.data.ptr, stream.ptr,  # noqa: B023
                            alpha_ptr=wscale.data.ptr if avec else 0), REPS)  # noqa: B023
                    except Exception as exc:
                        if idx == 0:
                            row[vname] = str(exc)[:60]
                        break
                    if idx == 0:
                        row[vname + "_first"] = round(t * 1e3, 2)  # us: the pick vt takes
                    if best is None or t < best[0]:
                        best = (t, idx)
                if best:
                    row[vname] = round(best[0] * 1e3, 2)  # us
                    row[vname + "_algo"] = best[1]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--rows", default="1,8,64,128,256,512,2048,8192")
    ap.add_argument("--json")
    ap.add_argument("--variants", action="store_true", help="time every scale variant and algorithm pick")
    ap.add_argument("--only", default="", help="with --variants: these variants only (comma-separated)")
    args = ap.parse_args()
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    hbm = next((v for key, v in HBM.items() if key in name), 3.35e12)
    lt = LtFp8()
    rng = np.random.default_rng(0)
    result = {"device": name, "checks": checks(lt, rng)}
    if args.variants:
        only = [v for v in args.only.split(",") if v]
        result["variants"] = variants(lt, args.preset, [int(r) for r in args.rows.split(",")], only)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        return
    modes = [m for m in ("tensor", "channel", "wblock") if "error" not in result["checks"].get(
        {"tensor": "tensor", "channel": "channel", "wblock": "wblock"}[m], {})]
    result["timings"] = timings(lt, args.preset, [int(r) for r in args.rows.split(",")], modes, hbm)
    head = " ".join(f"{m:>8}" for m in modes)
    print(f"{'shape':8} {'rows':>5} {'bf16':>8} {head}  (ms; fp8 x floor)")
    for r in result["timings"]:
        vals = " ".join(f"{r[m + '_ms']:8.4f}" if isinstance(r[m + "_ms"], float) else f"{'err':>8}"
                        for m in modes)
        print(f"{r['shape']:8} {r['rows']:5d} {r['bf16_ms']:8.4f} {vals}  {r.get('best_fp8_x_floor', 0):.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
