"""Prefill attention on each tensor-core tiling (attention_plan.PREFILL_TILINGS), side by side:
time, TFLOP/s, and the output's relative difference from the fallback tiling's (r64, proven on
the H200).

Shapes are Qwen3-8B's and Qwen3-0.6B's attention (head dim 128, 8 kv heads, 32 or 16 q heads):
one prompt alone (2k, 8k), a 2048-token chunk at the end of an 8k and of a 32k context (chunked
prefill), and four 1k prompts in one step. Each launch is timed as kernel_bench times ops (graph replays).

    python3 -m bench.kernels.attn_tilings [--json out.json] [--best FILE] [--tiling wgv --tiling wgr ...]

--tiling (repeatable) times only those tilings (and always the fallback, the baseline).
--kv-cache-dtype fp8 reads an fp8 cache (random e4m3 codes of magnitude up to 30, scales 0.1):
the `_kv8` kernels, where a tiling without them runs the fallback's.

--best writes the tiling to serve with: the one with the best geometric-mean speed-up over the
8B cases among those whose output stays within 2% of the fallback's (r64, proven) on every case.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vt.kernels.attention_plan import FALLBACK_PREFILL_TILING, PREFILL_TILINGS

if TYPE_CHECKING:
    from collections.abc import Callable

    import cupy

    from vt.kernels.cuda_ops import CudaBackend

BS = 16
D = 128


def causal_flops(q_lens: list[int], ctx_lens: list[int], hq: int) -> float:
    """QK^T and PV over the keys each query row sees (itself and everything before it)."""
    total = 0
    for q, c in zip(q_lens, ctx_lens):
        first = c - q + 1  # keys seen by the chunk's first row
        total += q * first + q * (q - 1) // 2
    return 4.0 * hq * D * total


def host_f32(a: cupy.ndarray) -> np.ndarray:
    """bf16 bits on the device as float32 on the host."""
    import cupy

    return (cupy.asnumpy(a).astype(np.uint32) << 16).view(np.float32)


def rel_diff(got: np.ndarray, ref: np.ndarray) -> float:
    """How far one attention output is from another: |got - ref| / |ref|."""
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def fp8_codes(*shape: int) -> cupy.ndarray:
    """Random e4m3 codes, exponent fields 0-11 (magnitudes up to 30) and either sign."""
    import cupy

    mag = cupy.random.randint(0, 0x60, shape, dtype=np.int32)
    return (mag | (cupy.random.randint(0, 2, shape, dtype=np.int32) << 7)).astype(np.uint8)


@dataclass
class PagedCase:
    """Sequences (q_lens[i] new tokens at the end of ctx_lens[i]) over a paged cache of 16-key
    blocks [block][key][kv head][dim], shuffled: q [tokens][hq][dim], K and V, the block table, the
    query start offsets and the context lengths, on the device."""
    q: cupy.ndarray
    k_cache: cupy.ndarray
    v_cache: cupy.ndarray
    query_start_loc: cupy.ndarray
    seq_lens: cupy.ndarray
    block_table: cupy.ndarray
    q_lens: list[int]
    ctx_lens: list[int]


def paged_case(rng: np.random.Generator, hq: int, q_lens: list[int], ctx_lens: list[int],
               kv8: bool = False) -> PagedCase:
    """Random bf16 q, K and V (kv8: e4m3 codes, and q rounded as over an fp8 cache), 8 kv heads."""
    import cupy

    from bench.kernels.kernel_bench import act

    hk = 8
    blocks = [-(-c // BS) for c in ctx_lens]
    make = fp8_codes if kv8 else act
    kc, vc = make(sum(blocks), BS, hk, D), make(sum(blocks), BS, hk, D)
    q = act(sum(q_lens), hq, D)
    if kv8:  # the query the prologue leaves over an fp8 cache: each row e4m3 x 2^n
        from vt.kernels.cuda_core import bf16_bits
        from vt.kernels.numpy_fp8 import quantize_rows_pow2

        q = cupy.asarray(bf16_bits(quantize_rows_pow2(host_f32(q))))
    table = np.zeros((len(q_lens), max(blocks)), np.int32)
    perm = rng.permutation(sum(blocks))
    at = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[at:at + n]
        at += n
    qsl = np.concatenate([[0], np.cumsum(q_lens)])
    dev = [cupy.asarray(np.asarray(a, np.int32)) for a in (qsl, ctx_lens, table)]
    return PagedCase(q, kc, vc, *dev, list(q_lens), list(ctx_lens))


def case_call(be: CudaBackend, c: PagedCase, kv8: bool = False) -> Callable[[], cupy.ndarray]:
    """Case c's attention on be as a step calls it (kv8: scales 0.1): one-row sequences ahead of the
    longer ones are the step's decodes (decode_seqs), which run on the decode kernel, the rest in
    one prompt launch; a case that puts its decodes after a prompt runs all of them in that one."""
    scales = (0.1, 0.1) if kv8 else (1.0, 1.0)
    max_q, max_k = max(c.q_lens), max(c.ctx_lens)
    decodes = next((i for i, n in enumerate(c.q_lens) if n != 1), len(c.q_lens)) if max_q > 1 else 0

    def call() -> cupy.ndarray:
        return be.attention(c.q, c.k_cache, c.v_cache, c.query_start_loc, c.seq_lens, c.block_table, D**-0.5,
                            max_q, max_k, kv_scales=scales, decode_seqs=decodes)

    return call


def paged_attention_call(be: CudaBackend, rng: np.random.Generator, hq: int, q_lens: list[int],
                         ctx_lens: list[int], kv8: bool = False) -> Callable[[], cupy.ndarray]:
    """One attention launch of a new paged_case."""
    return case_call(be, paged_case(rng, hq, q_lens, ctx_lens, kv8), kv8)


def run_case(be: CudaBackend, rng: np.random.Generator, hq: int, label: str, q_lens: list[int],
             ctx_lens: list[int], tilings: list[str] | None = None, kv8: bool = False) -> list[dict]:
    from bench.kernels.kernel_bench import time_op

    call = paged_attention_call(be, rng, hq, q_lens, ctx_lens, kv8)
    flops = causal_flops(q_lens, ctx_lens, hq)
    rows: list[dict] = []
    order = [FALLBACK_PREFILL_TILING,
             *(t for t in PREFILL_TILINGS if t != FALLBACK_PREFILL_TILING and (not tilings or t in tilings))]
    for tiling in order:
        try:
            be.use_prefill_tiling(tiling)
        except ValueError as e:  # a tiling this device has no kernels for
            print(f"{tiling}: skipped ({str(e).splitlines()[0]})")
            continue
        t = time_op(be, call)
        with be.slot(0):
            got = host_f32(call()).astype(np.float64)
        if not rows:
            base_t, base_out = t, got
        diff = rel_diff(got, base_out)
        rows.append({"hq": hq, "case": label, "tiling": tiling, "us": t * 1e6, "tflops": flops / t / 1e12,
                     "speedup": base_t / t, "rel_diff": diff})
    be.use_prefill_tiling(FALLBACK_PREFILL_TILING)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--best", default=None, help="write the fastest tiling that agrees with the default")
    ap.add_argument("--tiling", action="append", default=None, choices=sorted(PREFILL_TILINGS),
                    help="time only these (and the fallback); every tiling when not given")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    args = ap.parse_args()
    from vt.kernels.cuda_ops import CudaBackend

    be = CudaBackend(workspace_bytes=1 << 30)
    rng = np.random.default_rng(0)
    cases = [("2k alone", [2048], [2048]), ("8k alone", [8192], [8192]),
             ("2k chunk at 8k", [2048], [8192]), ("2k chunk at 32k", [2048], [32768]),
             ("4 x 1k", [1024] * 4, [1024] * 4)]
    rows = []
    print(f"{'heads':>6s} {'case':16s} {'tiling':7s} {'us':>9s} {'TFLOP/s':>8s} {'vs default':>10s} "
          f"{'rel diff':>9s}")
    for hq in (32, 16):
        for label, q_lens, ctx_lens in cases:
            kv8 = args.kv_cache_dtype == "fp8"
            for row in run_case(be, rng, hq, label, q_lens, ctx_lens, args.tiling, kv8):
                rows.append(row)
                print(f"{hq:6d} {label:16s} {row['tiling']:7s} {row['us']:9.1f} {row['tflops']:8.1f} "
                      f"{row['speedup']:9.2f}x {row['rel_diff']:9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    best = best_tiling(rows)
    print(f"best tiling (8B heads, agreeing with {FALLBACK_PREFILL_TILING} within 2%): {best}")
    if args.best:
        with open(args.best, "w") as f:
            f.write(best + "\n")


def best_tiling(rows: list[dict], hq: int = 32, tol: float = 0.02) -> str:
    """The tiling with the best geometric-mean speed-up over the cases at hq heads, among those
    whose output agrees with the default's on every case."""
    scores: dict[str, float] = {}
    for tiling in {r["tiling"] for r in rows}:
        mine = [r for r in rows if r["tiling"] == tiling]
        if any(r["rel_diff"] > tol or not math.isfinite(r["rel_diff"]) for r in mine):
            continue
        at = [r["speedup"] for r in mine if r["hq"] == hq]
        scores[tiling] = math.exp(sum(math.log(x) for x in at) / len(at)) if at else 0.0
    if not scores:
        return FALLBACK_PREFILL_TILING
    return max(scores, key=lambda t: (scores[t], t == FALLBACK_PREFILL_TILING))


if __name__ == "__main__":
    main()
