"""Decode attention's fixed cost per launch against a copy of the same bytes.

    python3 -m bench.probes.attn_waves

Times the 8-row decode attention (8 kv heads, head dim 128, group 4) at 1, 2 and 4 full waves
of blocks (B = 33, 66, 132 on 132 SMs at two blocks an SM) and contexts of 256-2048 keys, and
a device copy moving the same number of bytes, each as 20 calls in one captured graph. A
least-squares fit t = fixed + bytes / rate per batch separates the per-launch cost from the
streaming rate.
"""

from __future__ import annotations

import cupy
import numpy as np

from bench.kernels.kernel_bench import act, time_op
from vt.kernels.cuda_ops import CudaBackend


def main() -> None:
    be = CudaBackend(workspace_bytes=1 << 30)
    rng = np.random.default_rng(0)
    Hq, Hk, D, bs = 32, 8, 128, 16

    def i32(a):
        return be.from_host(np.asarray(a, np.int32), "i32")

    print("| B | ctx | KV MB | floor us | attention us | x floor | copy us |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    fits = {}
    for B in (33, 66, 132):
        pts = []
        for ctx in (256, 512, 1024, 2048):
            q = act(B, Hq, D)
            blocks_per = -(-ctx // bs)
            nblk = B * blocks_per + 1
            kc, vc = act(nblk, bs, Hk, D), act(nblk, bs, Hk, D)
            table = i32(rng.permutation(nblk)[: B * blocks_per].reshape(B, blocks_per))
            qsl, seq_lens = i32(np.arange(B + 1)), i32(np.full(B, ctx))
            kv_bytes = 2 * B * ctx * Hk * D * 2
            args = (q, kc, vc, qsl, seq_lens, table, D**-0.5, 1, ctx)
            t_att = time_op(be, lambda a=args: be.attention(*a))
            src = cupy.empty(kv_bytes // 2, dtype=np.uint8)
            dst = cupy.empty_like(src)
            t_copy = time_op(be, lambda d=dst, s=src: cupy.copyto(d, s))
            floor = kv_bytes / 4.25e12
            pts.append((kv_bytes, t_att, t_copy))
            print(f"| {B} | {ctx} | {kv_bytes / 1e6:.1f} | {floor * 1e6:.1f} | {t_att * 1e6:.1f} | "
                  f"{t_att / floor:.2f} | {t_copy * 1e6:.1f} |", flush=True)
        x = np.array([p[0] for p in pts], dtype=np.float64)
        for i, name in ((1, "attention"), (2, "copy")):
            y = np.array([p[i] for p in pts])
            slope, fixed = np.polyfit(x, y, 1)
            fits[(B, name)] = (fixed * 1e6, 1 / slope / 1e12)
    for (B, name), (fixed, rate) in fits.items():
        print(f"B={B} {name}: fixed {fixed:.1f} us, streaming {rate:.2f} TB/s")


if __name__ == "__main__":
    main()
