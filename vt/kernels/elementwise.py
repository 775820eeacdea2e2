"""Launchers of elementwise.cu: embedding gather, norms, the attention prologue (head norms, rope,
KV write), SiLU-mul, the decode inputs gathered from the last step, and the setup-time weight
scaling. Shapes and semantics are base.Backend's; numpy_ops is the reference."""

from __future__ import annotations

import cupy
import numpy as np

from vt.kernels.base import norm_rope_write_kv_unfused, prologue_fused
from vt.kernels.cuda_core import CudaCore, check_rows, is_fp8_cache, kv_cache_args, token_stride
from vt.kernels.quantized import PendingScales

# The kernels these launchers call (bias_add_k is gemm.py's, for a projection's bias).
KERNELS = {
    "elementwise.cu": (
        "gather_rows_k",
        "rms_norm_k",
        "head_rms_norm_k",
        "rope_k",
        "write_kv_k",
        "qk_norm_rope_write_kv_k",
        "qk_norm_rope_write_kv8_k",
        "round_q_e4m3_pow2_k",
        "silu_mul_k",
        "rms_scale_k",
        "scale_columns_k",
        "bias_add_k",
        "fill_from_last_k",
    ),
}
_i32 = np.int32
_f32 = np.float32


def unit_scale_args(scales: PendingScales | None) -> tuple[cupy.ndarray | int, cupy.ndarray | int]:
    """The prologue kernels' x_scale and w_scale pointers (null without pending scales)."""
    return (0, 0) if scales is None else (scales.x_scale, scales.w_scale)


class ElementwiseOps(CudaCore):
    def _token_grid(self, tokens: int, most_parts: int) -> tuple[int, int]:
        """Grid (parts, token blocks) of a kernel that splits each token's row into at most
        most_parts blocks: as few as keep about four blocks per SM in flight, so a long prompt
        runs one block per token (one reduction of its scale, not one per part) and a decode
        batch still fills the chip. Blocks stride over tokens beyond the grid's y limit."""
        parts = min(most_parts, max(1, -(-4 * self._num_sms // tokens)))
        return parts, min(tokens, 65535)

    def gather_rows(self, x: cupy.ndarray, idx: cupy.ndarray) -> cupy.ndarray:
        check_rows(x, "gather_rows x")
        n, width = idx.shape[0], x.shape[1]
        out = self._out((n, width), np.uint16)
        if n:
            self._launch("gather_rows_k", (n,), (128,), (idx, x, out, _i32(n), _i32(width), _i32(x.shape[0])))
        return out

    def embed(self, ids: cupy.ndarray, table: cupy.ndarray) -> cupy.ndarray:
        return self.gather_rows(table, ids)

    def rms_norm(
        self, x: cupy.ndarray, weight: cupy.ndarray, eps: float, residual: cupy.ndarray | None
    ) -> tuple[cupy.ndarray, cupy.ndarray]:
        check_rows(x, "rms_norm x")
        t, h = x.shape
        y = self._out((t, h), np.uint16)
        if residual is not None:
            check_rows(residual, "rms_norm residual")
            r = self._out((t, h), np.uint16)
        else:
            r = x
        if t:
            threads = min(1024, max(32, -(-h // 8 // 32) * 32))
            self._launch(
                "rms_norm_k",
                (t,),
                (threads,),
                (x, residual if residual is not None else 0, weight, y, r, _i32(h), _f32(eps)),
            )
        return y, r

    def head_rms_norm(self, x: cupy.ndarray, weight: cupy.ndarray, eps: float) -> cupy.ndarray:
        stride = token_stride(x, "head_rms_norm x")
        t, n, d = x.shape
        if d % 8:
            raise ValueError(f"head dim {d} must be a multiple of 8")
        y = self._out((t, n, d), np.uint16)
        if t:
            self._launch(
                "head_rms_norm_k",
                (-(-t * n // 4),),
                (128,),
                (x, _i32(stride), weight, y, _i32(t), _i32(n), _i32(d), _f32(eps)),
            )
        return y

    def fold_norm_weight(self, w: cupy.ndarray, norm: cupy.ndarray) -> None:
        check_rows(w, "fold_norm_weight w")
        rows, cols = w.shape
        if norm.shape != (cols,) or norm.dtype != np.uint16:
            raise ValueError(f"fold_norm_weight: norm {norm.dtype}{norm.shape} does not match w {w.shape}")
        chunks = rows * cols // 8
        if chunks:
            grid = (-(-chunks // 256),)
            self._launch("scale_columns_k", grid, (256,), (w, norm, np.int64(rows), _i32(cols)))
            self._settled(w)

    def rope(self, q: cupy.ndarray, k: cupy.ndarray, positions: cupy.ndarray, inv_freq: cupy.ndarray) -> None:
        qs, ks = token_stride(q, "rope q"), token_stride(k, "rope k")
        t, hq, d = q.shape
        if k.shape[0] != t or k.shape[2] != d or inv_freq.shape[0] != d // 2:
            raise ValueError(f"rope: shapes q {q.shape}, k {k.shape}, inv_freq {inv_freq.shape} disagree")
        if t:
            self._launch(
                "rope_k",
                (t,),
                (256,),
                (q, _i32(qs), k, _i32(ks), positions, inv_freq, _i32(hq), _i32(k.shape[1]), _i32(d)),
            )

    def write_kv(
        self,
        k: cupy.ndarray,
        v: cupy.ndarray,
        k_cache: cupy.ndarray,
        v_cache: cupy.ndarray,
        slot_mapping: cupy.ndarray,
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        kst, vst = token_stride(k, "write_kv k"), token_stride(v, "write_kv v")
        t, hk, d = k.shape
        nb, bs, hkc, dc = k_cache.shape
        if (hkc, dc) != (hk, d) or v_cache.shape != k_cache.shape or v.shape != k.shape:
            raise ValueError(f"write_kv: k {k.shape}, v {v.shape}, caches {k_cache.shape} disagree")
        if (hk * d) % 8:
            raise ValueError("write_kv: kv row must be a multiple of 8 elements")
        if t:
            self._launch(
                "write_kv_k",
                (t,),
                (128,),
                (k, _i32(kst), v, _i32(vst), k_cache, v_cache, slot_mapping, _i32(hk * d), np.int64(nb * bs),
                 *kv_cache_args(k_cache, kv_scales)),
            )

    def qk_norm_rope_write_kv(
        self,
        q: cupy.ndarray,
        k: cupy.ndarray,
        v: cupy.ndarray,
        q_norm: cupy.ndarray | None,
        k_norm: cupy.ndarray | None,
        eps: float,
        positions: cupy.ndarray,
        inv_freq: cupy.ndarray,
        k_cache: cupy.ndarray,
        v_cache: cupy.ndarray,
        slot_mapping: cupy.ndarray,
        rms_of: cupy.ndarray | None = None,
        bias: cupy.ndarray | None = None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        scales: PendingScales | None = None,
    ) -> None:
        t, hq, d = q.shape
        hk = k.shape[1]
        nb, bs, hkc, dc = k_cache.shape
        if rms_of is not None:
            check_rows(rms_of, "qk_norm_rope_write_kv rms_of")
            if rms_of.shape[0] != t:
                raise ValueError(f"qk_norm_rope_write_kv: rms_of has {rms_of.shape[0]} rows for {t} tokens")
        if bias is not None and (bias.shape != ((hq + 2 * hk) * d,) or bias.dtype != np.uint16):
            raise ValueError(f"qk_norm_rope_write_kv: bias {bias.dtype}{bias.shape} is not act[(Hq+2Hk)D]")
        width = (hq + 2 * hk) * d
        if scales is not None and (scales.x_scale.shape != (t,) or scales.w_scale.shape != (width,)):
            raise ValueError(f"qk_norm_rope_write_kv: scales {scales.x_scale.shape}, {scales.w_scale.shape} "
                             f"are not f32[{t}] and f32[{width}]")
        if not prologue_fused(d, q_norm, k_norm):
            self._prologue_unfused(q, k, v, q_norm, k_norm, eps, positions, inv_freq, k_cache, v_cache,
                                   slot_mapping, rms_of, bias, kv_scales, scales)
            return
        qs, ks, vs = (token_stride(x, "qk_norm_rope_write_kv") for x in (q, k, v))
        bad = k.shape != v.shape or k.shape[0] != t or k.shape[2] != d or (hkc, dc) != (hk, d)
        if bad or inv_freq.shape[0] != d // 2 or v_cache.shape != k_cache.shape:
            raise ValueError(
                f"qk_norm_rope_write_kv: q {q.shape}, k {k.shape}, v {v.shape}, caches {k_cache.shape}, "
                f"{v_cache.shape}, inv_freq {inv_freq.shape} disagree"
            )
        if t:
            lanes = 1 << (d // 8 - 1).bit_length()  # a row's lanes: the power of two >= d/8
            k_scale, v_scale, kv8 = kv_cache_args(k_cache, kv_scales)
            self._launch(
                "qk_norm_rope_write_kv8_k" if kv8 else "qk_norm_rope_write_kv_k",
                self._token_grid(t, -(-(hq + 2 * hk) * lanes // 256)),
                (256,),
                (q, _i32(qs), k, _i32(ks), v, _i32(vs), 0 if q_norm is None else q_norm,
                 0 if k_norm is None else k_norm, _f32(eps), positions, inv_freq, k_cache, v_cache,
                 slot_mapping, np.int64(nb * bs), _i32(t), _i32(hq), _i32(hk), _i32(d),
                 0 if rms_of is None else rms_of, _i32(0 if rms_of is None else rms_of.shape[1]),
                 0 if bias is None else bias, k_scale, v_scale, *unit_scale_args(scales)),
            )

    def _prologue_unfused(
        self,
        q: cupy.ndarray,
        k: cupy.ndarray,
        v: cupy.ndarray,
        q_norm: cupy.ndarray | None,
        k_norm: cupy.ndarray | None,
        eps: float,
        positions: cupy.ndarray,
        inv_freq: cupy.ndarray,
        k_cache: cupy.ndarray,
        v_cache: cupy.ndarray,
        slot_mapping: cupy.ndarray,
        rms_of: cupy.ndarray | None,
        bias: cupy.ndarray | None,
        kv_scales: tuple[float, float] = (1.0, 1.0),
        scales: PendingScales | None = None,
    ) -> None:
        """qk_norm_rope_write_kv as its three ops, for the shapes the one-warp-per-head kernel does
        not cover; the unit scales, the input-norm scale and the bias first, in place."""
        t, hq, d = q.shape
        hk = k.shape[1]
        width = 0 if rms_of is None else rms_of.shape[1]
        if (rms_of is not None or bias is not None or scales is not None) and t:
            xs, ws = unit_scale_args(scales)
            for x, lo in ((q, 0), (k, hq * d), (v, (hq + hk) * d)):
                n = x.shape[1] * d
                self._launch("rms_scale_k", (t,), (256,),
                             (x, _i32(token_stride(x, "qk_norm_rope_write_kv")), _i32(n),
                              0 if rms_of is None else rms_of, _i32(width), _f32(eps),
                              0 if bias is None else bias[lo : lo + n], xs,
                              0 if scales is None else ws[lo : lo + n]))
        norm_rope_write_kv_unfused(self, q, k, v, q_norm, k_norm, eps, positions, inv_freq, k_cache,
                                   v_cache, slot_mapping, kv_scales)
        if is_fp8_cache(k_cache) and t and hq:  # q as the fused kernel leaves it over an fp8 cache
            self._launch("round_q_e4m3_pow2_k", (t, hq), (32,),
                         (q, _i32(token_stride(q, "qk_norm_rope_write_kv")), _i32(d)))

    def silu_mul(self, x: cupy.ndarray, rms_of: cupy.ndarray | None = None, eps: float = 0.0) -> cupy.ndarray:
        check_rows(x, "silu_mul x")
        t, two_i = x.shape
        inter = two_i // 2
        if inter % 8:
            raise ValueError(f"silu_mul: half width {inter} must be a multiple of 8")
        if rms_of is not None:
            check_rows(rms_of, "silu_mul rms_of")
            if rms_of.shape[0] != t:
                raise ValueError(f"silu_mul: rms_of has {rms_of.shape[0]} rows for {t} tokens")
        out = self._out((t, inter), np.uint16)
        if t and inter:
            threads = 256  # a thread does every parts-th chunk of 8 outputs of its block's row
            self._launch("silu_mul_k", self._token_grid(t, -(-inter // 8 // threads)), (threads,),
                         (x, out, _i32(t), _i32(inter), 0 if rms_of is None else rms_of,
                          _i32(0 if rms_of is None else rms_of.shape[1]), _f32(eps)))
        return out

    def fill_from_last(
        self, input_ids: cupy.ndarray, src_rows: cupy.ndarray, last_tokens: cupy.ndarray
    ) -> None:
        n = src_rows.shape[0]
        if n:
            self._launch(
                "fill_from_last_k",
                (-(-n // 256),),
                (256,),
                (input_ids, src_rows, last_tokens, _i32(n), _i32(last_tokens.shape[0])),
            )
