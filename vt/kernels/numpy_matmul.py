"""The numpy backend's one matrix product: float32, and each output row the same whatever rows
share the call.

BLAS runs a one-row product as a gemv, whose sums run in another order than gemm's (a last-bit
difference; gemm's rows do not depend on how many there are). A token decoded alone and the same
token recomputed in a prompt after preemption would then differ in the last bit, and a later
rounding (fp8 activations, an fp8 cache, a sampled tie) can turn that into another token. The CPU
tests promise the same tokens in every step shape, so a single row goes through gemm as two."""

from __future__ import annotations

import numpy as np


def matmul_rows(x: np.ndarray, w_t: np.ndarray) -> np.ndarray:
    """x[T, K] @ w_t[K, N] with rows independent of T (T = 1 runs as gemm's first of two rows)."""
    if x.ndim == 2 and x.shape[0] == 1:
        return (np.concatenate([x, x]) @ w_t)[:1]
    return x @ w_t
