"""Where a prompt attention tiling goes wrong on the device, in one short run: cases from one
64-row tile upwards, each compared with numpy, and for a failing case the error by row tile,
by warpgroup-sized row block and by 8-dim column block (S or softmax errors spread over every
column; a P V error shows in some column blocks only; a pipeline error grows with the key tile).

    python3 -m bench.kernels.attn_debug --tiling wg [--tiling wgp ...]

The same cases run on the host simulator with `python3 -m pytest tests/unit/test_cuda_sim_attention.py`.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from vt.kernels.attention_plan import PREFILL_TILINGS, attention_kernel
from vt.kernels.numpy_ops import NumpyBackend

# (label, q_lens, ctx_lens, hq, hk, block_size): from the simplest upwards
CASES = [
    ("one tile, one head", [64], [64], 1, 1, 64),
    ("two key tiles", [128], [128], 1, 1, 64),
    ("two row tiles, GQA 4", [96], [96], 4, 1, 64),
    ("paged, block 16", [200], [200], 4, 1, 16),
    ("chunk deep in context", [70], [300], 8, 2, 16),
    ("ragged batch", [5, 1, 130, 1], [5, 40, 600, 7], 32, 8, 16),
]


def bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def batch(rng: np.random.Generator, q_lens, ctx_lens, hq, hk, bs, d=128):
    need = [-(-c // bs) for c in ctx_lens]
    pool = list(rng.permutation(sum(need) + 2))
    table = np.zeros((len(q_lens), max(need)), np.int32)
    for b, n in enumerate(need):
        table[b, :n] = [pool.pop() for _ in range(n)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = bf16(rng.standard_normal((int(qsl[-1]), hq, d)))
    kc = bf16(rng.standard_normal((sum(need) + 2, bs, hk, d)))
    vc = bf16(rng.standard_normal((sum(need) + 2, bs, hk, d)))
    return q, kc, vc, qsl, np.asarray(ctx_lens, np.int32), table


def error_map(got: np.ndarray, ref: np.ndarray, hq: int, hk: int, rows_per_tile: int) -> str:
    """Max abs error by (kv head, row tile), by 64-row block and by 8-dim column block."""
    t, _, d = ref.shape
    group = hq // hk
    err = np.abs(got - ref)  # [T, Hq, D]
    lines = []
    for kh in range(hk):
        rows = err[:, kh * group:(kh + 1) * group].reshape(t * group, d)  # row = token * group + g
        tiles = [rows[i:i + rows_per_tile].max() for i in range(0, len(rows), rows_per_tile)]
        blocks = [rows[i:i + 64].max() for i in range(0, len(rows), 64)]
        lines.append(f"  kv head {kh}: row tiles {np.round(tiles, 3).tolist()}; "
                     f"64-row blocks {np.round(blocks, 3).tolist()}")
    cols = err.reshape(-1, d // 8, 8).max(axis=(0, 2))
    lines.append(f"  8-dim column blocks: {np.round(cols, 3).tolist()}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiling", action="append", default=None, choices=sorted(PREFILL_TILINGS))
    args = ap.parse_args()
    import cupy

    from vt.kernels.cuda_ops import CudaBackend

    be = CudaBackend(workspace_bytes=256 << 20)
    nb = NumpyBackend()
    rng = np.random.default_rng(0)
    for tiling in args.tiling or ["wg"]:
        be.use_prefill_tiling(tiling)
        print(f"== {tiling}")
        for label, q_lens, ctx_lens, hq, hk, bs in CASES:
            q, kc, vc, qsl, seq_lens, table = batch(rng, q_lens, ctx_lens, hq, hk, bs)
            scale = 128**-0.5
            ref = nb.attention(q, kc, vc, qsl, seq_lens, table, scale, max(q_lens), max(ctx_lens))
            with be.slot(0):
                acts = [be.from_host(a, "act") for a in (q, kc, vc)]
                ints = [be.from_host(a, "i32") for a in (qsl, seq_lens, table)]
                out = be.attention(*acts, *ints, scale, max(q_lens), max(ctx_lens))
                got = cupy.asnumpy(out).view(ml_dtypes.bfloat16).astype(np.float32)
            rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            kernel = attention_kernel(hq // hk, max(q_lens), 128, prefill=tiling).name
            verdict = "ok" if rel < 1e-2 and np.isfinite(got).all() else "WRONG"
            print(f"{label:24s} {kernel:30s} rel err {rel:.2e} {verdict}")
            if verdict != "ok":
                print(error_map(got, ref, hq, hk, PREFILL_TILINGS[tiling].rows))
        be.use_prefill_tiling("r64")


if __name__ == "__main__":
    main()
