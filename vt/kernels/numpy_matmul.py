"""The numpy backend's one matrix product: float32 operands, each output row the same whatever
rows share the call.

BLAS does not promise that: OpenBLAS picks its kernels and its sum order by the shape (a one-row
product runs as a gemv, and on some CPUs the rows of a gemm depend on how many there are). A token
decoded alone and the same token recomputed in a prompt after preemption would then differ in
the last bit, and a later rounding (fp8 activations, an fp8 cache, a sampled tie) can turn that
into another token. The CPU tests promise the same tokens in every step shape, so the product
runs in float64 and is rounded once to float32: two float64 sums of 53-bit products differ by far
less than a float32 step, so the rounded rows agree unless a sum lies within ~2^-29 of a rounding
boundary."""

from __future__ import annotations

import numpy as np


def matmul_rows(x: np.ndarray, w_t: np.ndarray) -> np.ndarray:
    """x[T, K] @ w_t[K, N] -> float32[T, N], its rows independent of T (float64 sums, rounded once)."""
    return (np.asarray(x, np.float64) @ np.asarray(w_t, np.float64)).astype(np.float32)
