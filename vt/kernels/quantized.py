"""Quantized operands as they cross the backend interface (both backends; the model holds them).

An fp8 weight and an fp8 activation are each an e4m3 array and its fp32 scales (formats in
vt.kernels.numpy_fp8). The scale layout inside an activation is the backend's own business:
only that backend's GEMM reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Array = Any


@dataclass(frozen=True)
class Fp8Weight:
    q: Array        # e4m3 [N, K] (numpy: ml_dtypes.float8_e4m3fn; CUDA: uint8 bits)
    scale: Array    # f32 [N] per output channel, or f32 [ceil(N/128), ceil(K/128)] per 128x128 block
                    # (CUDA: each row of k-blocks padded to a multiple of 4, as cuBLASLt reads them)
    block: bool

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def group(self) -> int | None:
        """The activation grouping this weight's GEMM needs: 128 columns for block scales, else
        one scale per token."""
        return 128 if self.block else None


@dataclass(frozen=True)
class Fp8Activation:
    q: Array               # e4m3 [T, K] (CUDA: [gemm_rows(T, group), K], rows past T unused)
    scale: Array           # f32 per token, or per token and 128 columns (layout: the backend's)
    group: int | None      # None: one scale a token; 128: one a token and 128 columns
    rows: int              # T, the tokens it holds


def gemm_rows(rows: int, group: int | None) -> int:
    """Rows an fp8 GEMM runs for `rows` tokens: cuBLASLt's block-scaled kernels take their
    activation scales group-major, each group's rows 16-byte aligned, so they need a multiple of 4
    (measured on an H100: 1, 2, 3, 7 and 33 rows are refused, 4, 8, 16 and 256 run); the CUDA
    backend pads to it (the pad rows' outputs are dropped)."""
    return rows if group is None else -(-rows // 4) * 4
