"""One prompt-attention launch of a chosen tiling, a few times, for a profiler to attach to:

    ncu --kernel-name regex:attention_ --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        python3 -m bench.kernels.attn_ncu --tiling wgv --prompt 8192

`--tiling fa3` runs vLLM's FlashAttention-3 on the same case instead (the peer's bundle staged and
on PYTHONPATH, bench/kernels/attn_peer.py; CUTLASS launches it as `device_kernel`, which
`--kernel-name regex:device_kernel` picks).

Qwen3-8B's attention heads (32 q, 8 kv, head dim 128), one causal prompt over a paged cache with
shuffled blocks, built as bench/kernels/attn_tilings.py builds its cases. Prints the mean time of
the eager calls.
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiling", default="wgv")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    import cupy

    from bench.kernels.attn_tilings import causal_flops, paged_attention_call
    from vt.kernels.cuda_ops import CudaBackend

    hq, n = 32, args.prompt
    if args.tiling == "fa3":
        from bench.kernels.attn_peer import fa3_call
        from bench.kernels.attn_tilings import paged_case

        call = fa3_call(paged_case(np.random.default_rng(0), hq, [n], [n]), hq)
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            call()
        cupy.cuda.Device().synchronize()
    else:
        be = CudaBackend(workspace_bytes=1 << 30)
        be.use_prefill_tiling(args.tiling)
        call = paged_attention_call(be, np.random.default_rng(0), hq, [n], [n])
        cupy.cuda.Device().synchronize()  # inputs made on the default stream, before the slot's stream reads
        with be.slot(0):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                mark = be.arena_mark()
                call()
                be.arena_reset(mark)
            cupy.cuda.Device().synchronize()
    ms = (time.perf_counter() - t0) / args.calls * 1e3
    flops = causal_flops([n], [n], hq)
    print(f"{args.tiling} prompt {n}: {ms:.3f} ms a call (eager, with launch), "
          f"{flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
