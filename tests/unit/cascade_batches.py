"""Decode batches whose rows share their first blocks: the cascade tests' inputs, on the host
simulator (tests/unit/test_cuda_sim_cascade.py) and on the device (tests/gpu/test_cascade_cuda.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values exactly representable in bf16."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def shared_prefix_batch(rng: np.random.Generator, b: int, hq: int, hk: int, d: int, bs: int, shared: int,
                        max_own: int) -> tuple[np.ndarray, ...]:
    """(q [b, hq, d], k_cache, v_cache, seq_lens, block_tables): b decodes sharing `shared` blocks
    (anywhere in the cache), then 1..max_own keys of their own; q and the caches bf16 values as
    float32; table padding holds an out-of-range block id that no launch may read."""
    own = rng.integers(1, max_own + 1, b)
    need = [-(-int(n) // bs) for n in own]
    nblk = shared + sum(need) + 2
    pool = list(rng.permutation(nblk))
    prefix = [pool.pop() for _ in range(shared)]
    table = np.full((b, shared + max(need) + 1), 10**6, np.int32)
    for i, n in enumerate(need):
        table[i, :shared] = prefix
        table[i, shared: shared + n] = [pool.pop() for _ in range(n)]
    lens = (shared * bs + own).astype(np.int32)
    q = bf16(rng.standard_normal((b, hq, d)))
    kc = bf16(rng.standard_normal((nblk, bs, hk, d)))
    vc = bf16(rng.standard_normal((nblk, bs, hk, d)))
    return q, kc, vc, lens, table
