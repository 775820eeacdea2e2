"""Per-kernel times of the CUDA backend against their bytes-moved floors (Qwen3-8B decode shapes).

Each op runs N times inside one captured CUDA graph (outputs reuse one arena region), so launch
gaps stay out of the numbers; the median over several replays is reported. Floor = the bytes the
op must read and write once, over the measured device-to-device copy bandwidth.

    python3 -m bench.kernels.kernel_bench [--batch 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import cupy
import numpy as np

from bench.graph_timing import median_per_call
from vt.kernels.cuda_ops import CudaBackend

REPS_IN_GRAPH = 20
REPLAYS = 7


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read + written per second of a large device-to-device copy."""
    a = cupy.empty(nbytes, dtype=np.uint8)
    b = cupy.empty_like(a)
    a.fill(1)
    for _ in range(2):
        b[...] = a
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(5):
        start.record()
        b[...] = a
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def act(*shape: int, scale: float = 1.0) -> cupy.ndarray:
    """Random bf16 bits drawn on the device (a 150k x 4096 host draw costs seconds), truncated."""
    f = cupy.random.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    out = (f.view(np.uint32) >> 16).astype(np.uint16)
    cupy.cuda.Device().synchronize()
    return out


def time_op(be: CudaBackend, fn) -> float:
    """Median seconds of one fn() call, from graph replays of REPS_IN_GRAPH calls."""

    def body():
        for _ in range(REPS_IN_GRAPH):
            mark = be.arena_mark()
            fn()
            be.arena_reset(mark)

    with be.slot(0):
        fn()  # warm: first-use costs stay out of the capture
    cupy.cuda.Device().synchronize()
    graph = be.capture(0, body)
    return median_per_call(be._slots[0].stream, graph.replay, REPS_IN_GRAPH, REPLAYS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    be = CudaBackend(workspace_bytes=1 << 30)
    rng = np.random.default_rng(0)
    bw = copy_bandwidth()
    B, H, Hq, Hk, D, INTER, V = args.batch, 4096, 32, 8, 128, 12288, 151936
    ctx, bs = args.ctx, 16

    def i32(a):
        return be.from_host(np.asarray(a, np.int32), "i32")

    x = act(B, H)
    res = act(B, H)
    norm_w = act(H)
    w_qkv, w_o = act((Hq + 2 * Hk) * D, H, scale=0.02), act(H, Hq * D, scale=0.02)
    w_gu, w_dn = act(2 * INTER, H, scale=0.02), act(H, INTER, scale=0.02)
    lm = act(V, H, scale=0.02)
    qkv = act(B, (Hq + 2 * Hk) * D)
    q = qkv[:, : Hq * D].reshape(B, Hq, D)
    k = qkv[:, Hq * D : (Hq + Hk) * D].reshape(B, Hk, D)
    v = qkv[:, (Hq + Hk) * D :].reshape(B, Hk, D)
    gu = act(B, 2 * INTER)
    hmid = act(B, INTER)
    inv_freq = be.from_host((1.0 / 1e6 ** (np.arange(0, D, 2) / D)).astype(np.float32), "f32")
    pos = i32(rng.integers(0, ctx, B))
    blocks_per = -(-ctx // bs)
    nblk = B * blocks_per + 1
    kc, vc = act(nblk, bs, Hk, D), act(nblk, bs, Hk, D)
    table = i32(rng.permutation(nblk)[: B * blocks_per].reshape(B, blocks_per))
    slots = i32(rng.permutation(nblk * bs)[:B])
    qsl, seq_lens = i32(np.arange(B + 1)), i32(np.full(B, ctx))
    logits = be.from_host((rng.standard_normal((B, V)) * 3).astype(np.float32), "f32")
    ids = i32(rng.integers(0, V, B))
    temp = be.from_host(np.full(B, 0.8, np.float32), "f32")
    greedy_t = be.from_host(np.zeros(B, np.float32), "f32")
    top_k = i32(np.full(B, 50))
    no_k = i32(np.zeros(B))
    top_p = be.from_host(np.full(B, 0.9, np.float32), "f32")
    one_p = be.from_host(np.ones(B, np.float32), "f32")
    zero_p = be.from_host(np.zeros(B, np.float32), "f32")
    seeds = be.from_host(np.arange(B, dtype=np.int64), "i64")
    offs = i32(np.zeros(B))
    # long-context decode: few sequences, split keys
    lb, lctx = 4, 16384
    lblocks = lctx // bs
    lkc, lvc = act(lb * lblocks, bs, Hk, D), act(lb * lblocks, bs, Hk, D)
    lq = act(lb, Hq, D)
    ltable = i32(rng.permutation(lb * lblocks).reshape(lb, lblocks))
    lqsl, lseq = i32(np.arange(lb + 1)), i32(np.full(lb, lctx))
    # prefill: one 2048-token sequence
    pt = 2048
    pkc, pvc = act(pt // bs, bs, Hk, D), act(pt // bs, bs, Hk, D)
    pq = act(pt, Hq, D)
    ptable = i32(np.arange(pt // bs)[None, :])
    pqsl, pseq = i32([0, pt]), i32([pt])

    a2 = 2  # bytes per bf16
    kv_bytes = B * ctx * Hk * D * a2 * 2
    cases = [
        ("rms_norm+residual", lambda: be.rms_norm(x, norm_w, 1e-6, res), (4 * B * H + H) * a2),
        ("linear qkv", lambda: be.linear(x, w_qkv, None), w_qkv.nbytes + (B * H + B * w_qkv.shape[0]) * a2),
        ("linear_residual o_proj", lambda: be.linear_residual(x, w_o, res), w_o.nbytes + 3 * B * H * a2),
        ("linear gate_up", lambda: be.linear(x, w_gu, None), w_gu.nbytes + (B * H + B * 2 * INTER) * a2),
        ("linear_residual down", lambda: be.linear_residual(hmid, w_dn, res),
         w_dn.nbytes + (B * INTER + 2 * B * H) * a2),
        ("head_rms_norm q", lambda: be.head_rms_norm(q, norm_w[:D], 1e-6), 2 * B * Hq * D * a2),
        ("rope q,k", lambda: be.rope(q, k, pos, inv_freq), 2 * B * (Hq + Hk) * D * a2),
        ("write_kv", lambda: be.write_kv(k, v, kc, vc, slots), 4 * B * Hk * D * a2),
        (
            "qk_norm_rope_write_kv (fused, input norm scale)",
            lambda: be.qk_norm_rope_write_kv(q, k, v, norm_w[:D], norm_w[:D], 1e-6, pos, inv_freq,
                                             kc, vc, slots, rms_of=x),
            (2 * B * (Hq + 2 * Hk) * D + 2 * B * Hk * D + B * H) * a2,
        ),
        (
            f"attention decode B={B} ctx={ctx}",
            lambda: be.attention(q, kc, vc, qsl, seq_lens, table, D**-0.5, 1, ctx),
            kv_bytes + 2 * B * Hq * D * a2,
        ),
        (
            f"attention decode B={lb} ctx={lctx}",
            lambda: be.attention(lq, lkc, lvc, lqsl, lseq, ltable, D**-0.5, 1, lctx),
            lkc.nbytes + lvc.nbytes,
        ),
        ("silu_mul (post-attention norm scale)", lambda: be.silu_mul(gu, rms_of=x, eps=1e-6),
         (3 * B * INTER + B * H) * a2),
        ("logits (lm_head, f32 out)", lambda: be.logits(x, lm), lm.nbytes + B * H * a2 + B * V * 4),
        ("sample greedy", lambda: be.sample(logits, greedy_t, no_k, one_p, zero_p, seeds, offs), B * V * 4),
        ("sample T=0.8 plain", lambda: be.sample(logits, temp, no_k, one_p, zero_p, seeds, offs), B * V * 4),
        (
            "sample top_k=50 top_p=0.9",
            lambda: be.sample(logits, temp, top_k, top_p, zero_p, seeds, offs),
            B * V * 4,
        ),
        ("log_softmax_topk k=5", lambda: be.log_softmax_topk(logits, ids, 5), B * V * 4),
        ("embed", lambda: be.embed(ids, lm), 2 * B * H * a2),
    ]
    rows = []
    for name, fn, nbytes in cases:
        t = time_op(be, fn)
        floor = nbytes / bw
        rows.append({"op": name, "us": t * 1e6, "floor_us": floor * 1e6, "ratio": t / floor, "bytes": nbytes})
    t = time_op(be, lambda: be.attention(pq, pkc, pvc, pqsl, pseq, ptable, D**-0.5, pt, pt))
    flops = 4 * Hq * D * pt * pt / 2  # causal: half of QK^T and PV
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s (read + write)")
    print(f"{'op':38s} {'us':>9s} {'floor us':>9s} {'x floor':>8s}")
    for r in rows:
        print(f"{r['op']:38s} {r['us']:9.1f} {r['floor_us']:9.1f} {r['ratio']:8.2f}")
    print(
        f"attention prefill T={pt}: {t * 1e6:.1f} us, {flops / t / 1e12:.1f} TFLOP/s"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows, "prefill_us": t * 1e6}, f, indent=1)


if __name__ == "__main__":
    main()
