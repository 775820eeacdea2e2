"""One prompt-attention launch of a chosen tiling, a few times, for a profiler to attach to:

    ncu --kernel-name regex:attention_ --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        python3 bench/attn_ncu.py --tiling wgv --prompt 8192

Qwen3-8B's attention heads (32 q, 8 kv, head dim 128), one causal prompt over a paged cache with
shuffled blocks, as bench/attn_tilings.py builds it. Prints the mean time of the eager calls.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiling", default="wgv")
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=3)
    args = ap.parse_args()
    import cupy
    from kernel_bench import act

    from vt.kernels.cuda_ops import CudaBackend

    be = CudaBackend(workspace_bytes=1 << 30)
    be.use_prefill_tiling(args.tiling)
    bs, d, hq, hk, n = 16, 128, 32, 8, args.prompt
    blocks = -(-n // bs)
    kc, vc, q = act(blocks, bs, hk, d), act(blocks, bs, hk, d), act(n, hq, d)
    table = np.random.default_rng(0).permutation(blocks).astype(np.int32)[None, :]
    dev = [cupy.asarray(np.asarray(a, np.int32)) for a in ([0, n], [n], table)]
    cupy.cuda.Device().synchronize()
    with be.slot(0):
        t0 = time.perf_counter()
        for _ in range(args.calls):
            mark = be.arena_mark()
            be.attention(q, kc, vc, *dev, d**-0.5, n, n)
            be.arena_reset(mark)
        cupy.cuda.Device().synchronize()
    ms = (time.perf_counter() - t0) / args.calls * 1e3
    flops = 4.0 * hq * d * (n * (n + 1) // 2)
    print(f"{args.tiling} prompt {n}: {ms:.3f} ms a call (eager, with launch), "
          f"{flops / ms / 1e9:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
