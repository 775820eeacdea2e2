"""Decode-size projections: the stream-K wgmma probe (bench/probes/streamk_gemm.cu, not used by vt)
against cuBLAS, same operands, same run.

    python3 -m bench.probes.gemm_decode [--preset 8b] [--rows 1,16,64,128] [--json out.json]

Every shape is checked first: the kernel's output against an fp32 product of the same bf16
operands (relative norm error, beside cuBLAS' own), with accumulation into a residual, with
padded token rows and a strided x, and bit for bit against a second launch, a graph replay and
a launch as a programmatic dependent.
Then both are timed: REPS calls in one captured graph, the weight rotating through copies so
every call reads it from HBM, median over replays. Floor = weight bytes / 4.25 TB/s.
"""

from __future__ import annotations

import argparse
import json

import cupy
import numpy as np

from bench.graph_timing import median_per_call
from bench.probes.streamk_gemm import StreamKGemm
from vt.kernels.cublas_capture import CublasGemm, load_libcublas
from vt.kernels.dependent_launch import DependentLauncher

HBM_BYTES_PER_S = 4.25e12
REPS = 36
REPLAYS = 7
COPY_BYTES = 512 << 20  # weight copies in rotation: together well past the 60 MB L2

# name: (n, k, accumulate into a residual as the model does)
SHAPES = {
    "8b": {"qkv": (6144, 4096, False), "o_proj": (4096, 4096, True), "gate_up": (24576, 4096, False),
           "down": (4096, 12288, True)},
    "0.6b": {"qkv": (4096, 1024, False), "o_proj": (1024, 2048, True), "gate_up": (6144, 1024, False),
             "down": (1024, 3072, True)},
}

# checked, not timed: 150 tiles of four units over 132 CTAs (runs of 4-5 units), so whole tiles
# beside tiles split in two
CHECK_ONLY = {"whole_and_split": (19200, 256, False)}


def to_bf16(a: cupy.ndarray) -> cupy.ndarray:
    u = cupy.ascontiguousarray(a, dtype=cupy.float32).view(cupy.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(cupy.uint16)


def rand_bf16(rng, shape: tuple[int, ...], scale: float = 1.0) -> cupy.ndarray:
    return to_bf16(cupy.asarray(rng.standard_normal(shape) * scale, dtype=cupy.float32))


def from_bf16(a: cupy.ndarray) -> cupy.ndarray:
    return (a.astype(cupy.uint32) << 16).view(cupy.float32)


def rel(a: cupy.ndarray, b: cupy.ndarray) -> float:
    return float(cupy.linalg.norm(a - b) / cupy.linalg.norm(b))


def check(sk: StreamKGemm, ws, gemm: CublasGemm, dep: DependentLauncher, n: int, k: int, rows: int,
          rng) -> dict:
    """Errors and repeatability of one shape; raises on a failure."""
    stream = cupy.cuda.Stream(non_blocking=True)
    ld = k + 64  # a strided x: rows further apart than k
    xs = rand_bf16(rng, (rows, ld))
    x = xs[:, :k]
    w = rand_bf16(rng, (n, k), 1 / np.sqrt(k))
    res = rand_bf16(rng, (rows, n), 0.5)
    ref = from_bf16(cupy.ascontiguousarray(x)) @ from_bf16(w).T
    y, y2, y3, yc = (cupy.full((rows, n), 0xFFFF, dtype=cupy.uint16) for _ in range(4))
    acc = res.copy()
    cupy.cuda.Device().synchronize()  # the buffers were filled on the default stream
    with stream:
        sk.launch(ws, x, ld, w, y, rows, n, k, False)
        sk.launch(ws, x, ld, w, acc, rows, n, k, True)
        sk.launch(ws, x, ld, w, y2, rows, n, k, False)
        sk.launch(ws, x, ld, w, y3, rows, n, k, False, dependent=dep)
        gemm.linear(stream.ptr, x.data.ptr, ld, w.data.ptr, yc.data.ptr, rows, n, k, False)
        stream.begin_capture()
        sk.launch(ws, x, ld, w, y2, rows, n, k, False)
        graph = stream.end_capture()
        y2.fill(0)
        graph.launch(stream)
        graph.launch(stream)
    stream.synchronize()
    out = {"err": rel(from_bf16(y), ref), "err_cublas": rel(from_bf16(yc), ref),
           "err_accumulate": rel(from_bf16(acc) - from_bf16(res), ref), "err_replay": rel(from_bf16(y2), ref)}
    stale = int(cupy.count_nonzero(ws[1]))
    bad = {key: v for key, v in out.items() if not v < 1e-2}
    same = bool((y == y2).all()) and bool((y == y3).all())
    if bad or stale or not same:
        raise AssertionError(f"n={n} k={k} rows={rows}: errors {out}, counters left nonzero {stale}, "
                             f"replay and dependent launch equal {same}")
    return out


def time_calls(stream: cupy.cuda.Stream, call, reps: int = REPS, replays: int = REPLAYS) -> float:
    """Median seconds per call(i) over graph replays of reps calls. A call that raises does so
    before the capture (on the warm-up call) or ends the capture on its way out."""
    with stream:
        call(0)
        stream.synchronize()
        stream.begin_capture()
        try:
            for i in range(reps):
                call(i)
        finally:
            graph = stream.end_capture()
    return median_per_call(stream, lambda: graph.launch(stream), reps, replays)


def rotating_weights(rng, n: int, k: int) -> list[cupy.ndarray]:
    """Copies of a random w[n, k], enough that a graph of calls cycling through them reads each
    from HBM, not from L2."""
    copies = max(2, -(-COPY_BYTES // (2 * n * k)))
    return [rand_bf16(rng, (n, k), 1 / np.sqrt(k)) for _ in range(copies)]


def time_shape(sk: StreamKGemm, ws, gemm: CublasGemm, dep: DependentLauncher, stream: cupy.cuda.Stream,
               n: int, k: int, rows: int, accumulate: bool, rng) -> dict:
    """Microseconds per call of cuBLAS and the stream-K kernel, weights read from HBM."""
    weights = rotating_weights(rng, n, k)
    copies = len(weights)
    x = rand_bf16(rng, (rows, k))
    y = cupy.zeros((rows, n), dtype=cupy.uint16)
    cupy.cuda.Device().synchronize()  # made on the default stream, which `stream` does not wait for
    t_cublas = time_calls(stream, lambda i: gemm.linear(
        stream.ptr, x.data.ptr, k, weights[i % copies].data.ptr, y.data.ptr, rows, n, k, False,
        accumulate=accumulate))
    t_sk = time_calls(stream, lambda i: sk.launch(ws, x, k, weights[i % copies], y, rows, n, k, accumulate))
    t_dep = time_calls(stream, lambda i: sk.launch(ws, x, k, weights[i % copies], y, rows, n, k, accumulate,
                                                   dependent=dep))
    floor = 2 * n * k / HBM_BYTES_PER_S
    return {"floor_us": floor * 1e6, "cublas_us": t_cublas * 1e6, "streamk_us": t_sk * 1e6,
            "streamk_dependent_us": t_dep * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b", choices=list(SHAPES))
    ap.add_argument("--rows", default="1,16,64,128")
    ap.add_argument("--check-rows", default="1,13,64,100,128", help="row counts checked before timing")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    sk = StreamKGemm()
    ws = sk.new_workspace()
    gemm = CublasGemm(load_libcublas(), cupy.empty((32 << 20,), dtype=cupy.uint8))
    dep = DependentLauncher.open()
    shapes = SHAPES[args.preset]
    failures = 0
    for name, (n, k, _) in {**shapes, **CHECK_ONLY}.items():
        for rows in (int(r) for r in args.check_rows.split(",")):
            try:
                e = check(sk, ws, gemm, dep, n, k, rows, rng)
            except AssertionError as exc:  # report, and time the rest all the same
                print(f"FAILED check {name} rows={rows}: {exc}")
                failures += 1
                ws[1].fill(0)
                continue
            print(f"check {name} rows={rows}: err {e['err']:.2e} (cuBLAS {e['err_cublas']:.2e}), "
                  f"accumulate {e['err_accumulate']:.2e}")
    stream = cupy.cuda.Stream(non_blocking=True)
    results = []
    print("| shape | rows | floor us | cuBLAS us | stream-K us | stream-K dependent us | best / cuBLAS | "
          "best x floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, (n, k, accumulate) in shapes.items():
        for rows in (int(r) for r in args.rows.split(",")):
            row = time_shape(sk, ws, gemm, dep, stream, n, k, rows, accumulate, rng)
            results.append({"shape": name, "n": n, "k": k, "rows": rows, **row})
            floor, t_cublas, t_sk, t_dep = (row[c] for c in ("floor_us", "cublas_us", "streamk_us",
                                                             "streamk_dependent_us"))
            best = min(t_sk, t_dep)
            print(f"| {name} | {rows} | {floor:.1f} | {t_cublas:.1f} | {t_sk:.1f} | {t_dep:.1f} | "
                  f"{best / t_cublas:.2f} | {best / floor:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "results": results}, f, indent=1)
    if failures:
        raise SystemExit(f"{failures} checks failed")


if __name__ == "__main__":
    main()
