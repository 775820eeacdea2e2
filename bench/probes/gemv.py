"""The decode GEMVs (vt/kernels/gemv.cu) against the cuBLAS / cuBLASLt paths they replace, through
the backend itself, at the projections of one model and 1-16 token rows.

    python3 -m bench.probes.gemv [--preset 8b] [--rows 1,2,4,8,16] [--json out.json]
    python3 -m bench.probes.gemv --sweep 4x1,8x1,8x2 [--rows 1,8]

For each shape, bf16 and fp8 (per-channel scales, as `--quantization fp8` makes them): REPS calls
in one captured graph, the weight rotating through copies so every call reads it from HBM, median
of REPLAYS replays; the backend's gemv_max_tokens switches between the two paths. Each line: us a
call on either path, and the GEMV's weight bytes a second as a share of the card's copy bandwidth
(measured here with a device-to-device copy).
--sweep UxB,... recompiles gemv.cu with GEMV_UNROLL_BF16 = GEMV_UNROLL_FP8 = U and GEMV_MIN_BLOCKS =
GEMV_MIN_BLOCKS_FP8_8 = B
for each pair and times each build's GEMV (cuBLAS once, beside the first).
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import cupy
import numpy as np

from bench.graph_timing import median_per_call
from bench.probes.gemm_decode import SHAPES
from vt.kernels import numpy_fp8 as f8

REPS, REPLAYS = 36, 7
COPY_BYTES = 512 << 20  # weight copies in rotation: together well past the 50-60 MB L2


def copy_bandwidth() -> float:
    a = cupy.empty(1 << 30, dtype=np.uint8)
    b = cupy.empty_like(a)
    cupy.cuda.Device().synchronize()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        b[...] = a
        cupy.cuda.Device().synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * a.nbytes / best


def copy_weight(w):
    """A bf16 weight array, or an Fp8Weight with its codes copied (the scales are tiny)."""
    return cupy.copy(w) if isinstance(w, cupy.ndarray) else type(w)(cupy.copy(w.q), w.scale, w.block)


@functools.cache
def build(unroll: int, min_blocks: int):
    from vt.kernels.sources import translation_unit

    return cupy.RawModule(code=translation_unit("gemv.cu"), options=(
        "-std=c++17", f"-DGEMV_UNROLL_BF16={unroll}", f"-DGEMV_UNROLL_FP8={unroll}",
        f"-DGEMV_MIN_BLOCKS={min_blocks}", f"-DGEMV_MIN_BLOCKS_FP8_8={min_blocks}"))


def use_build(cb, unroll: int, min_blocks: int) -> None:
    """gemv.cu compiled with other constants, its kernels put in place of the backend's."""
    from vt.kernels.gemm import KERNELS

    module = build(unroll, min_blocks)
    for name in KERNELS["gemv.cu"]:
        cb._kernels[name] = module.get_function(name)


def time_graph(cb, fn) -> float:
    """Seconds a call: fn() makes REPS calls, captured once, replayed REPLAYS times."""
    graph = cb.capture(0, fn)
    return median_per_call(cb._slots[0].stream, graph.replay, REPS, REPLAYS)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--json")
    ap.add_argument("--sweep", default="", help="GEMV_UNROLL x GEMV_MIN_BLOCKS builds, e.g. 4x1,8x1")
    args = ap.parse_args()
    from vt.kernels.cuda_ops import CudaBackend

    cb = CudaBackend(workspace_bytes=256 << 20)
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; us a call (share of copy bandwidth)")
    rng = np.random.default_rng(0)
    builds = [tuple(int(v) for v in b.split("x")) for b in args.sweep.split(",") if b] or [None]
    results = []
    for name, (n, k, accumulate) in SHAPES[args.preset].items():
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        bf = cb.gemm_layout(cb.from_host(w, "act"))
        q = cb.upload_fp8(*f8.quantize_weight_channel(w))
        for dtype, one, nbytes in (("bf16", bf, 2 * n * k), ("fp8", q, n * k)):
            copies = [one] + [copy_weight(one) for _ in range(COPY_BYTES // nbytes)]
            for rows in (int(r) for r in args.rows.split(",")):
                x = cb.from_host(rng.standard_normal((rows, k)).astype(np.float32), "act")
                res = cb.from_host(np.zeros((rows, n), np.float32), "act")

                def calls(copies=copies, x=x, res=res, dtype=dtype, accumulate=accumulate):
                    xa = cb.quantize_fp8(x, None) if dtype == "fp8" else x
                    for i in range(REPS):
                        wi = copies[i % len(copies)]
                        if dtype == "fp8":
                            cb.linear_fp8_residual(xa, wi, res) if accumulate else cb.linear_fp8(xa, wi, None)
                        else:
                            cb.linear_residual(xa, wi, res) if accumulate else cb.linear(xa, wi, None)

                row = {"shape": name, "dtype": dtype, "rows": rows}
                cb.gemv_max_tokens = 0
                row["blas"] = time_graph(cb, calls) * 1e6
                cb.gemv_max_tokens = 16
                line = f"{name:8s} {dtype:4s} rows {rows:2d}: cuBLAS {row['blas']:6.1f}"
                for build in builds:
                    if build:
                        use_build(cb, *build)
                    key = "gemv" if not build else f"gemv_u{build[0]}b{build[1]}"
                    row[key] = time_graph(cb, calls) * 1e6
                    line += f"  {key} {row[key]:6.1f} ({nbytes / (row[key] / 1e6) / bandwidth:.0%})"
                results.append(row)
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bandwidth, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
