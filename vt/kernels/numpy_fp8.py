"""FP8 (e4m3) semantics in numpy: the reference every fp8 CUDA op is checked against.

Formats (the ones real FP8 checkpoints use):
- activations: quantized per token (one fp32 scale a row) or per token and 128 columns (a scale
  per row and group, for block-scaled weights), dynamically, from the values themselves;
- weights: per output channel (a scale a row: compressed-tensors "channel", and vt's own
  `--quantization fp8` of a bf16 checkpoint; a per-tensor checkpoint scale is that scale on every
  row) or per 128x128 block (Qwen3 / DeepSeek "fp8" with weight_block_size [128, 128]).

Quantizing a group g of values x: amax = max(|x|, AMAX_FLOOR), scale = amax / 448,
q = e4m3(x * (448 / amax)) rounded to nearest even and saturated to +-448; x ~ q * scale.
Every step is one IEEE float32 operation, so the CUDA kernels reproduce these bits exactly on
the same inputs. The floor keeps an all-zero group finite (its values quantize to zero).
A scaled GEMM is the float32 product of the dequantized operands, accumulated in float32.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from vt.kernels.numpy_matmul import matmul_rows
from vt.kernels.quantized import (
    Fp8Activation,
    Fp8Weight,
    PendingResidual,
    PendingScales,
    gemm_rows,
    unit_scale_rows,
)

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E4M3_MAX = np.float32(448.0)
AMAX_FLOOR = np.float32(1e-12)
BLOCK = 128  # the block and group width of block-scaled formats


def num_groups(k: int, group: int | None) -> int:
    """Scales a row of k values has: 1 per row, or ceil(k / group)."""
    return 1 if group is None else -(-k // group)


def _group_view(x: np.ndarray, group: int | None) -> tuple[np.ndarray, int]:
    """x f32[T, K] as f32[T, G, g] (zero-padded to whole groups) and the padded width."""
    t, k = x.shape
    g = k if group is None else group
    groups = num_groups(k, group)
    if groups * g != k:
        padded = np.zeros((t, groups * g), dtype=np.float32)
        padded[:, :k] = x
        x = padded
    return x.reshape(t, groups, g), groups * g


def to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> e4m3, nearest even, saturating finite values to +-448 (NaN stays NaN)."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.isnan(x), x, np.clip(x, -E4M3_MAX, E4M3_MAX)).astype(E4M3)


def quantize(x: np.ndarray, group: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """x f32[T, K] -> (q e4m3[T, K], scale f32[T, G]) with G = num_groups(K, group)."""
    x = np.asarray(x, dtype=np.float32)
    t, k = x.shape
    blocks, width = _group_view(x, group)
    amax = np.maximum(np.abs(blocks).max(axis=2), AMAX_FLOOR).astype(np.float32)
    inv = (E4M3_MAX / amax).astype(np.float32)
    q = to_e4m3(blocks * inv[:, :, None]).reshape(t, width)[:, :k]
    return np.ascontiguousarray(q), (amax / E4M3_MAX).astype(np.float32)


def dequantize(q: np.ndarray, scale: np.ndarray, group: int | None = None) -> np.ndarray:
    """Activations: q e4m3[T, K] with scale f32[T, G] -> f32[T, K]."""
    k = q.shape[1]
    per_column = scale if group is None else np.repeat(scale, group, axis=1)[:, :k]
    return (q.astype(np.float32) * per_column.astype(np.float32)).astype(np.float32)


def quantize_weight_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A weight f32[N, K] -> (q e4m3[N, K], scale f32[N]): one scale per output channel."""
    q, scale = quantize(w, None)
    return q, scale[:, 0]


def quantize_weight_block(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A weight f32[N, K] -> (q e4m3[N, K], scale f32[ceil(N/128), ceil(K/128)]) per 128x128 block."""
    w = np.asarray(w, dtype=np.float32)
    n, k = w.shape
    nb, kb = num_groups(n, BLOCK), num_groups(k, BLOCK)
    padded = np.zeros((nb * BLOCK, kb * BLOCK), dtype=np.float32)
    padded[:n, :k] = w
    blocks = padded.reshape(nb, BLOCK, kb, BLOCK)
    amax = np.maximum(np.abs(blocks).max(axis=(1, 3)), AMAX_FLOOR).astype(np.float32)
    inv = (E4M3_MAX / amax).astype(np.float32)
    q = to_e4m3(blocks * inv[:, None, :, None]).reshape(nb * BLOCK, kb * BLOCK)[:n, :k]
    return np.ascontiguousarray(q), (amax / E4M3_MAX).astype(np.float32)


def dequantize_weight(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """q e4m3[N, K] with a channel scale f32[N] or a block scale f32[ceil(N/128), ceil(K/128)]."""
    n, k = q.shape
    scale = np.asarray(scale, dtype=np.float32)
    if scale.ndim == 1:
        per_element = scale[:, None]
    else:
        per_element = np.repeat(np.repeat(scale, BLOCK, axis=0), BLOCK, axis=1)[:n, :k]
    return (q.astype(np.float32) * per_element).astype(np.float32)


def scaled_gemm(xq: np.ndarray, x_scale: np.ndarray, wq: np.ndarray, w_scale: np.ndarray) -> np.ndarray:
    """y f32[T, N] = dequantize(x) @ dequantize_weight(w).T with float32 accumulation. A block-scaled
    weight pairs with activations grouped by 128 columns, a channel-scaled one with per-token
    activations."""
    group = BLOCK if np.asarray(w_scale).ndim == 2 else None
    if x_scale.shape != (xq.shape[0], num_groups(xq.shape[1], group)):
        raise ValueError(f"scaled_gemm: activation scales {x_scale.shape} do not match the weight's "
                         f"{'block' if group else 'channel'} scales")
    return matmul_rows(dequantize(xq, x_scale, group), dequantize_weight(wq, w_scale).T)


def rms_norm_quantize(x: np.ndarray, weight: np.ndarray, eps: float,
                      group: int | None) -> tuple[np.ndarray, np.ndarray]:
    """quantize(x * rsqrt(mean(x ** 2) + eps) * weight) per row: the input norm of a projection
    whose activations are fp8, in one op (stats and the normalized row in float32)."""
    x = np.asarray(x, dtype=np.float32)
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    h = x / np.sqrt(var + np.float32(eps)) * np.asarray(weight, dtype=np.float32)
    return quantize(h, group)


def silu_mul_quantize(x: np.ndarray, group: int | None) -> tuple[np.ndarray, np.ndarray]:
    """quantize(silu(x[:, :I]) * x[:, I:]) per row, the product in float32."""
    x = np.asarray(x, dtype=np.float32)
    inter = x.shape[1] // 2
    gate, up = x[:, :inter], x[:, inter:]
    return quantize(gate / (np.float32(1.0) + np.exp(-gate)) * up, group)


class NumpyFp8Ops:
    """The fp8 ops of the numpy backend (mixed into NumpyBackend; `_took` enters each output in
    the open slot's arena ledger at its CUDA size). Activations are Fp8Activation with numpy's
    scale layout [T, G]; CUDA keeps block scales group-major, which only its own GEMM reads."""

    def _took(self, shape: tuple[int, ...], dtype: str) -> None:  # provided by NumpyBackend
        raise NotImplementedError

    def _took_activation(self, rows: int, k: int, group: int | None) -> None:
        padded = gemm_rows(rows, group)  # as CUDA pads them for its block-scaled GEMMs
        self._took((padded, k), "fp8")
        self._took((padded * num_groups(k, group),), "f32")

    def upload_fp8(self, q: np.ndarray, scale: np.ndarray) -> Fp8Weight:
        q = np.array(q, dtype=E4M3, copy=True, order="C")
        scale = np.array(scale, dtype=np.float32, copy=True, order="C")
        return Fp8Weight(q, scale, block=scale.ndim == 2)

    def quantize_weight(self, w: np.ndarray) -> Fp8Weight:
        q, scale = quantize_weight_channel(w)
        return Fp8Weight(q, scale, block=False)

    def quantize_fp8(self, x: np.ndarray, group: int | None) -> Fp8Activation:
        t, k = x.shape
        self._took_activation(t, k, group)
        return Fp8Activation(*quantize(x, group), group, t)

    def rms_norm_quant(self, x: np.ndarray, weight: np.ndarray, eps: float,
                       group: int | None, pending: PendingResidual | None = None) -> Fp8Activation:
        _no_pending(pending)
        t, k = x.shape
        self._took_activation(t, k, group)
        return Fp8Activation(*rms_norm_quantize(x, weight, eps, group), group, t)

    def silu_mul_quant(self, x: np.ndarray, group: int | None) -> Fp8Activation:
        t, k2 = x.shape
        self._took_activation(t, k2 // 2, group)
        return Fp8Activation(*silu_mul_quantize(x, group), group, t)

    def linear_fp8(self, x: Fp8Activation, w: Fp8Weight, bias: np.ndarray | None) -> np.ndarray:
        self._took((gemm_rows(x.rows, x.group), w.q.shape[0]), "act")
        y = scaled_gemm(x.q, x.scale, w.q, w.scale)
        return y if bias is None else y + bias

    def linear_fp8_defer(self, x: Fp8Activation, w: Fp8Weight) -> tuple[np.ndarray, PendingScales | None]:
        """x @ w^T with its scales applied (CUDA may leave them to the consumer; the twin never does)."""
        return self.linear_fp8(x, w, None), None

    def mlp_act_fp8(self, r: np.ndarray, weight: np.ndarray, eps: float, group: int | None,
                    w: Fp8Weight, pending: PendingResidual | None = None) -> Fp8Activation:
        """down_proj's input: SiLU-mul of the normed gate_up projection, quantized (CUDA gives a
        17-256-row step's unit-scale sums their scales inside SiLU-mul, with the same buffers)."""
        x = self.rms_norm_quant(r, weight, eps, group, pending)
        return self.silu_mul_quant(self.linear_fp8(x, w, None), group)

    def add_pending(self, residual: np.ndarray, pending: PendingResidual) -> None:
        """residual += product * (x_scale[t] * w_scale[n]) (the twin never defers a product, but
        adds one as CUDA does)."""
        x_scale, w_scale = np.asarray(pending.x_scale, np.float32), np.asarray(pending.w_scale, np.float32)
        residual += np.asarray(pending.product, np.float32) * (x_scale[:, None] * w_scale[None, :])

    def linear_fp8_residual(self, x: Fp8Activation, w: Fp8Weight, residual: np.ndarray,
                            defer: bool = False) -> PendingResidual | None:
        """residual += x @ w^T, added at once (CUDA may hand a deferred product to the next norm,
        which adds it with the same arithmetic, so the twin never defers)."""
        # CUDA's padded GEMM, and its unit-scale one, land in a buffer first
        if gemm_rows(x.rows, x.group) != x.rows or unit_scale_rows(x.rows, x.group):
            self._took((gemm_rows(x.rows, x.group), w.q.shape[0]), "act")
        if residual.shape != (x.q.shape[0], w.q.shape[0]):
            raise ValueError(f"linear_fp8_residual: residual {residual.shape} is not "
                             f"{(x.q.shape[0], w.q.shape[0])}")
        residual += scaled_gemm(x.q, x.scale, w.q, w.scale)
        return None


def _no_pending(pending: PendingResidual | None) -> None:
    if pending is not None:  # the twin's residual projections add at once and never return one
        raise ValueError("the numpy backend takes no pending residual product")


def quantize_rows_pow2(x: np.ndarray) -> np.ndarray:
    """Each row (last axis) rounded to e4m3 x 2^n, n the smallest integer with max |row| <= 448 x
    2^n (clamped to +-100), as float32: a power-of-two scale keeps e4m3's three mantissa bits, so
    the values are exact in bf16, and rounding them again gives the same values."""
    x = np.asarray(x, np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True).astype(np.float32)
    bits = amax.view(np.uint32)
    e = ((bits >> 23) & 255).astype(np.int32) - 127
    n = np.where(amax > 0, e - 8 + ((bits & 0x7FFFFF) > 0x600000), 0).clip(-100, 100)
    codes = (x * np.ldexp(np.float32(1), -n).astype(np.float32)).clip(-E4M3_MAX, E4M3_MAX).astype(E4M3)
    return codes.astype(np.float32) * np.ldexp(np.float32(1), n).astype(np.float32)
