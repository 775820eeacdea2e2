"""Decode-size projections: every cuBLASLt algorithm configuration against gemmEx's default pick.

    python3 -m bench.probes.lt_search [--preset 8b] [--rows 64,128] [--shapes qkv,down] [--json out.json]

cuBLAS' default (and cuBLASLt's heuristic top few, which an earlier probe timed) run the 8B
decode GEMMs at 1.3-1.75x their weight floor. This probe enumerates the configuration space
instead: for each algorithm id of bf16 x bf16 -> bf16 with fp32 compute, every tile, stages id,
split-K count, reduction scheme and cluster shape that `cublasLtMatmulAlgoCheck` accepts. Each
is screened as 8 calls in a captured graph (weights rotating through copies, so they come from
HBM); the best few are timed again as 36 calls a graph, as vt runs them, beside gemmEx, and their
output is compared with gemmEx's. Operands are laid out as vt lays them out (gate_up's weight
column-major, o_proj and down accumulating into the residual stream).
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import time

import cupy
import numpy as np

from bench.probes.gemm_decode import (
    HBM_BYTES_PER_S,
    SHAPES,
    from_bf16,
    rand_bf16,
    rotating_weights,
    time_calls,
)
from vt.kernels.cublas_capture import CUBLAS_COMPUTE_32F, CUDA_R_16BF, CUDA_R_32F, CublasGemm, load_libcublas
from vt.kernels.cublas_lt import Algo, HeuristicResult, load_libcublaslt
from vt.kernels.gemm import COLUMN_MAJOR_MIN_ASPECT

WORKSPACE = 64 << 20

# cublasLt.h enums
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
CAP_SPLITK_SUPPORT, CAP_REDUCTION_SCHEME_MASK, CAP_TILE_IDS, CAP_STAGES_IDS = 0, 1, 6, 13
CFG_TILE_ID, CFG_SPLITK_NUM, CFG_REDUCTION_SCHEME, CFG_STAGES_ID, CFG_CLUSTER_SHAPE_ID = 1, 2, 3, 6, 8
REDUCTIONS = (1, 2, 4)  # in place, compute type, output type
CLUSTERS = {0: "auto", 2: "1x1", 3: "2x1", 5: "1x2", 4: "4x1", 8: "1x4"}
SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)

_VP = ctypes.c_void_p


class Lt:
    """The few cuBLASLt entry points the search needs, one handle."""

    def __init__(self) -> None:
        self.lib = lib = load_libcublaslt()
        for name in (
            "cublasLtCreate",
            "cublasLtMatmulDescCreate",
            "cublasLtMatmulDescSetAttribute",
            "cublasLtMatrixLayoutCreate",
            "cublasLtMatmulPreferenceCreate",
            "cublasLtMatmulPreferenceSetAttribute",
            "cublasLtMatmulAlgoGetHeuristic",
            "cublasLtMatmulAlgoGetIds",
            "cublasLtMatmulAlgoInit",
            "cublasLtMatmulAlgoCapGetAttribute",
            "cublasLtMatmulAlgoConfigSetAttribute",
            "cublasLtMatmulAlgoConfigGetAttribute",
            "cublasLtMatmulAlgoCheck",
            "cublasLtMatmul",
        ):
            getattr(lib, name).restype = ctypes.c_int
        lib.cublasLtMatrixLayoutCreate.argtypes = [
            ctypes.POINTER(_VP),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_int64,
        ]
        lib.cublasLtMatmul.argtypes = [_VP] * 12 + [ctypes.POINTER(Algo), _VP, ctypes.c_size_t, _VP]
        self.handle = _VP()
        self._ok(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.types = (CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF)

    @staticmethod
    def _ok(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what}: cuBLAS status {status}")

    def problem(self, n: int, k: int, rows: int, col_major_w: bool) -> tuple:
        """(desc, A, B, C) for column-major D[n, rows] = op(W) x^T."""
        lib = self.lib
        desc = _VP()
        self._ok(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc")
        ta, tb = ctypes.c_int32(0 if col_major_w else 1), ctypes.c_int32(0)
        self._ok(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA, ctypes.byref(ta), 4), "transa")
        self._ok(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSB, ctypes.byref(tb), 4), "transb")
        layouts = []
        for r, c, ld in ((n, k, n) if col_major_w else (k, n, k), (k, rows, k), (n, rows, n)):
            lay = _VP()
            self._ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), CUDA_R_16BF, r, c, ld), "layout")
            layouts.append(lay)
        return (desc, *layouts)

    def heuristic(self, prob: tuple, count: int = 32) -> list[Algo]:
        lib = self.lib
        pref = _VP()
        self._ok(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws = ctypes.c_uint64(WORKSPACE)
        self._ok(
            lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
            "pref ws",
        )
        results = (HeuristicResult * count)()
        got = ctypes.c_int()
        desc, a, b, c = prob
        self._ok(
            lib.cublasLtMatmulAlgoGetHeuristic(
                self.handle, desc, a, b, c, c, pref, count, results, ctypes.byref(got)
            ),
            "heuristic",
        )
        return [results[i].algo for i in range(got.value) if results[i].state == 0]

    def cap_array(self, algo: Algo, attr: int) -> list[int]:
        written = ctypes.c_size_t()
        self.lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
        n = written.value // 4
        if n == 0:
            return []
        buf = (ctypes.c_uint32 * n)()
        self._ok(
            self.lib.cublasLtMatmulAlgoCapGetAttribute(
                ctypes.byref(algo), attr, buf, 4 * n, ctypes.byref(written)
            ),
            "cap",
        )
        return list(buf)

    def cap_int(self, algo: Algo, attr: int) -> int:
        v, written = ctypes.c_int32(), ctypes.c_size_t()
        self._ok(
            self.lib.cublasLtMatmulAlgoCapGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(v), 4, ctypes.byref(written)
            ),
            "cap",
        )
        return v.value

    def config(self, algo: Algo) -> dict:
        out = {}
        for name, attr, ctype in (
            ("id", 0, ctypes.c_int32),
            ("tile", CFG_TILE_ID, ctypes.c_uint32),
            ("splitk", CFG_SPLITK_NUM, ctypes.c_int32),
            ("reduction", CFG_REDUCTION_SCHEME, ctypes.c_uint32),
            ("stages", CFG_STAGES_ID, ctypes.c_uint32),
            ("cluster", CFG_CLUSTER_SHAPE_ID, ctypes.c_uint16),
        ):
            v, written = ctype(), ctypes.c_size_t()
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written)
            )
            out[name] = int(v.value)
        return out

    def enumerate(self, prob: tuple, limit: int, seconds: float) -> list[Algo]:
        """Every configuration with the cluster shape left to cuBLAS that Check accepts with the
        workspace we give (up to limit configurations or seconds of enumeration)."""
        lib = self.lib
        ids = (ctypes.c_int * 256)()
        got = ctypes.c_int()
        self._ok(lib.cublasLtMatmulAlgoGetIds(self.handle, *self.types, 256, ids, ctypes.byref(got)), "ids")
        desc, a, b, c = prob
        found: list[Algo] = []
        start = time.perf_counter()
        for algo_id in ids[: got.value]:
            base = Algo()
            if lib.cublasLtMatmulAlgoInit(self.handle, *self.types, algo_id, ctypes.byref(base)) != 0:
                continue
            tiles = self.cap_array(base, CAP_TILE_IDS) or [0]
            stages = self.cap_array(base, CAP_STAGES_IDS) or [0]
            splits = SPLITS if self.cap_int(base, CAP_SPLITK_SUPPORT) else (1,)
            red_mask = self.cap_int(base, CAP_REDUCTION_SCHEME_MASK)
            for tile, stage, split in itertools.product(tiles, stages, splits):
                for red in (0,) if split == 1 else tuple(r for r in REDUCTIONS if red_mask & r):
                    algo = self.variant(prob, base, tile=tile, stages=stage, splitk=split, reduction=red)
                    if algo is not None:
                        found.append(algo)
                    if len(found) >= limit or time.perf_counter() - start > seconds:
                        return found
        return found

    def variant(self, prob: tuple, base: Algo, **cfg: int) -> Algo | None:
        """base with the given config attributes set, or None when Check refuses it."""
        attrs = {
            "tile": (CFG_TILE_ID, ctypes.c_uint32),
            "stages": (CFG_STAGES_ID, ctypes.c_uint32),
            "splitk": (CFG_SPLITK_NUM, ctypes.c_int32),
            "reduction": (CFG_REDUCTION_SCHEME, ctypes.c_uint32),
            "cluster": (CFG_CLUSTER_SHAPE_ID, ctypes.c_uint16),
        }
        algo = Algo()
        ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
        for key, value in cfg.items():
            attr, ctype = attrs[key]
            v = ctype(value)
            self.lib.cublasLtMatmulAlgoConfigSetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(v), ctypes.sizeof(v)
            )
        desc, a, b, c = prob
        res = HeuristicResult()
        if (
            self.lib.cublasLtMatmulAlgoCheck(
                self.handle, desc, a, b, c, c, ctypes.byref(algo), ctypes.byref(res)
            )
            != 0
        ):
            return None
        return algo if res.workspaceSize <= WORKSPACE else None

    def matmul(
        self, prob: tuple, algo: Algo, w: int, x: int, y: int, accumulate: bool, ws: int, stream: int
    ) -> int:
        desc, a, b, c = prob
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(1.0 if accumulate else 0.0)
        return self.lib.cublasLtMatmul(
            self.handle,
            desc,
            ctypes.byref(alpha),
            _VP(w),
            a,
            _VP(x),
            b,
            ctypes.byref(beta),
            _VP(y),
            c,
            _VP(y),
            c,
            ctypes.byref(algo),
            _VP(ws),
            WORKSPACE,
            _VP(stream),
        )


def search_shape(
    lt: Lt,
    gemm: CublasGemm,
    stream: cupy.cuda.Stream,
    ws,
    name: str,
    n: int,
    k: int,
    accumulate: bool,
    rows: int,
    limit: int,
    seconds: float,
    top: int,
    rng,
) -> dict:
    col_major = n >= COLUMN_MAJOR_MIN_ASPECT * k  # as gemm_layout stores it in vt
    weights = rotating_weights(rng, n, k)
    copies = len(weights)
    x = rand_bf16(rng, (rows, k))
    y = cupy.zeros((rows, n), dtype=cupy.uint16)
    cupy.cuda.Device().synchronize()
    prob = lt.problem(n, k, rows, col_major)

    def lt_call(algo: Algo, out=y, acc: bool = accumulate):
        def call(i: int) -> None:
            w = weights[i % copies].data.ptr
            status = lt.matmul(prob, algo, w, x.data.ptr, out.data.ptr, acc, ws.data.ptr, stream.ptr)
            if status != 0:
                raise RuntimeError(f"cublasLtMatmul status {status}")

        return call

    def gemmex(i: int, out=y, acc: bool = accumulate) -> None:
        w = weights[i % copies].data.ptr
        gemm.linear(stream.ptr, x.data.ptr, k, w, out.data.ptr, rows, n, k, False, accumulate=acc,
                    w_col_major=col_major)

    t0 = time.perf_counter()
    configs = lt.enumerate(prob, limit, seconds)
    heur = lt.heuristic(prob)
    t_enum = time.perf_counter() - t0

    def score(algos: list[Algo]) -> list[tuple[float, Algo]]:
        out = []
        with stream:
            for algo in algos:
                try:
                    out.append((time_calls(stream, lt_call(algo), reps=8, replays=3), algo))
                except RuntimeError:
                    continue
        return out

    scored = sorted(score(heur + configs), key=lambda s: s[0])
    # then each of the leaders with every cluster shape
    more = []
    for _, algo in scored[:16]:
        for cluster in CLUSTERS:
            v = lt.variant(prob, algo, cluster=cluster)
            if v is not None:
                more.append(v)
    scored = sorted(scored + score(more), key=lambda s: s[0])
    # the reference output: gemmEx into a zeroed y (no accumulation) for the comparison below
    ref = cupy.zeros_like(y)
    with stream:
        gemmex(0, ref, False)
    stream.synchronize()
    t_gemmex = time_calls(stream, gemmex)
    best = []
    for t_e, algo in scored[:top]:
        t_g = time_calls(stream, lt_call(algo))
        out = cupy.zeros_like(y)
        with stream:
            lt_call(algo, out, False)(0)
        stream.synchronize()
        err = float(cupy.linalg.norm(from_bf16(out) - from_bf16(ref)) / cupy.linalg.norm(from_bf16(ref)))
        best.append({"screen_us": t_e * 1e6, "graph_us": t_g * 1e6, "err_vs_gemmex": err, **lt.config(algo)})
    heur_first = lt.config(heur[0]) if heur else None
    return {
        "shape": name,
        "n": n,
        "k": k,
        "rows": rows,
        "floor_us": 2 * n * k / HBM_BYTES_PER_S * 1e6,
        "gemmex_us": t_gemmex * 1e6,
        "configs": len(configs) + len(more),
        "timed": len(scored),
        "enumerate_s": t_enum,
        "heuristic_first": heur_first,
        "best": best,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b", choices=list(SHAPES))
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--shapes", default="qkv,o_proj,gate_up,down")
    ap.add_argument("--limit", type=int, default=20000, help="most configurations timed per shape")
    ap.add_argument("--seconds", type=float, default=20.0, help="most seconds of enumeration per shape")
    ap.add_argument("--top", type=int, default=6, help="configurations re-timed in a graph")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    lt = Lt()
    gemm = CublasGemm(load_libcublas(), cupy.empty((32 << 20,), dtype=cupy.uint8))
    ws = cupy.empty((WORKSPACE,), dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            n, k, acc = SHAPES[args.preset][name]
            r = search_shape(lt, gemm, stream, ws, name, n, k, acc, rows, args.limit, args.seconds, args.top,
                             rng)
            results.append(r)
            b = r["best"][0] if r["best"] else {}
            print(
                f"{name} rows={rows}: floor {r['floor_us']:.1f} us, gemmEx {r['gemmex_us']:.1f}, "
                f"best cuBLASLt {b.get('graph_us', float('nan')):.1f} ({r['configs']} configurations, "
                f"{r['timed']} timed, enumerated in {r['enumerate_s']:.1f} s); heuristic first "
                f"{r['heuristic_first']}",
                flush=True,
            )
            for c in r["best"]:
                print(
                    f"    graph {c['graph_us']:.1f} us screen {c['screen_us']:.1f} "
                    f"err {c['err_vs_gemmex']:.1e} "
                    f"id {c['id']} tile {c['tile']} stages {c['stages']} splitk {c['splitk']} "
                    f"reduction {c['reduction']} cluster {CLUSTERS.get(c['cluster'], c['cluster'])}",
                    flush=True,
                )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"preset": args.preset, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
