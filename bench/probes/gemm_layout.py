"""A projection's weight row-major against column-major, from decode sizes to prefill chunks.

    python3 -m bench.probes.gemm_layout [--preset 8b] [--rows 64,256,2048,8192] [--shapes gate_up,qkv]

`gemm_layout` stores a wide weight (gate_up) column-major because cuBLAS streamed it a few
percent faster at decode sizes; a prefill chunk is compute-bound and may prefer the other
layout. Each cell is gemmEx as vt calls it (CublasGemm.linear), 36 calls a captured graph,
weights rotating through copies so they come from HBM; TFLOP/s over the GEMM's FLOPs.
"""

from __future__ import annotations

import argparse
import json

import cupy
import numpy as np

from bench.probes.gemm_decode import SHAPES, rand_bf16, rotating_weights, time_calls
from vt.kernels.cublas_capture import CublasGemm, load_libcublas

CALLS = 36


def time_layout(gemm: CublasGemm, stream: cupy.cuda.Stream, n: int, k: int, rows: int, accumulate: bool,
                col_major: bool, rng) -> float:
    weights = rotating_weights(rng, n, k)
    copies = len(weights)
    if col_major:
        weights = [cupy.asfortranarray(w) for w in weights]
    x = rand_bf16(rng, (rows, k))
    y = cupy.zeros((rows, n), dtype=cupy.uint16)
    cupy.cuda.Device().synchronize()

    def call(i: int) -> None:
        gemm.linear(stream.ptr, x.data.ptr, k, weights[i % copies].data.ptr, y.data.ptr, rows, n, k, False,
                    accumulate=accumulate, w_col_major=col_major)

    return time_calls(stream, call, reps=CALLS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b", choices=list(SHAPES))
    ap.add_argument("--rows", default="64,256,2048,8192")
    ap.add_argument("--shapes", default="gate_up,qkv")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    gemm = CublasGemm(load_libcublas(), cupy.empty((32 << 20,), dtype=cupy.uint8))
    stream = cupy.cuda.Stream(non_blocking=True)
    rows_out = []
    print("| shape | rows | row-major us | TFLOP/s | column-major us | TFLOP/s | column / row |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in args.shapes.split(","):
        n, k, acc = SHAPES[args.preset][name]
        for rows in (int(r) for r in args.rows.split(",")):
            flops = 2.0 * rows * n * k
            t_row = time_layout(gemm, stream, n, k, rows, acc, False, rng)
            t_col = time_layout(gemm, stream, n, k, rows, acc, True, rng)
            rows_out.append({"shape": name, "rows": rows, "row_us": t_row * 1e6, "col_us": t_col * 1e6})
            print(f"| {name} | {rows} | {t_row * 1e6:.1f} | {flops / t_row / 1e12:.0f} | {t_col * 1e6:.1f} | "
                  f"{flops / t_col / 1e12:.0f} | {t_col / t_row:.3f} |", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows_out, f, indent=1)


if __name__ == "__main__":
    main()
