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


@dataclass(frozen=True)
class PendingResidual:
    """A residual projection's unit-scale product not yet added to the residual stream: the norm
    that next reads the stream adds it first (residual[t, n] += product[t, n] * x_scale[t] *
    w_scale[n]), in its own launch (CUDA's fused norm; vt.kernels.fp8)."""
    product: Array   # bf16 [T, N], in the step's arena
    x_scale: Array   # f32 [T]
    w_scale: Array   # f32 [N]


@dataclass(frozen=True)
class PendingScales:
    """A projection's unit-scale product whose scales the kernel that reads it applies
    (y[t, n] * (x_scale[t] * w_scale[n])): qkv's, given them by the attention prologue
    (qk_norm_rope_write_kv's scales)."""
    x_scale: Array   # f32 [T]
    w_scale: Array   # f32 [N]


def gemm_rows(rows: int, group: int | None) -> int:
    """Rows an fp8 GEMM runs for `rows` tokens: cuBLASLt's block-scaled kernels take their
    activation scales group-major, each group's rows 16-byte aligned, so they need a multiple of 4
    (measured on an H100: 1, 2, 3, 7 and 33 rows are refused, 4, 8, 16 and 256 run); the CUDA
    backend pads to it (the pad rows' outputs are dropped)."""
    return rows if group is None else -(-rows // 4) * 4


# The decode GEMV's most tokens (gemv.cu; vt.kernels.gemm.GEMV_TOKENS_LIMIT) and the most rows whose
# residual projections (o_proj, down) run cuBLASLt's per-tensor fp8 kernel with unit scales, the
# per-token and per-channel scales applied afterwards as the product is added to the residual
# stream (vt.kernels.fp8). Measured on an H100 (bench/probes/fp8_gemm.py --variants, 8B shapes,
# 2026-12-06), us per GEMM, per-tensor / outer-vector: o_proj 8.8 / 13.5 and down 21.7 / 32.8 at 64
# rows, 10.1 / 13.5 and 25.8 / 33.5 at 256; qkv and gate_up gain less than the extra pass would cost.
GEMV_TOKENS = 16
UNIT_SCALE_MAX_ROWS = 256


def unit_scale_rows(rows: int, group: int | None) -> bool:
    """Whether a residual projection of `rows` per-token-scaled rows runs with unit scales and
    lands in a product buffer of its own (so the memory plan and the numpy ledger count one)."""
    return group is None and GEMV_TOKENS < rows <= UNIT_SCALE_MAX_ROWS


# Chunks of 8 values a thread of 256 that fp8.cu's held-row kernels are instantiated for
# (FP8_HELD_NORMS, FP8_HELD_SILU): the input norms and the attention output's quantization, SiLU-mul.
HELD_NORM_CHUNKS = (1, 2, 4)
HELD_SILU_CHUNKS = (2, 4, 6, 8)


def held_chunks(width: int, counts: tuple[int, ...]) -> int:
    """The chunk count of the held-row kernel that takes per-token rows of `width` values (the
    smallest of `counts` whose 256 threads x count x 8 values cover the row), 0 where none does."""
    need = -(-width // (256 * 8))
    return next((c for c in counts if c >= need), 0)
