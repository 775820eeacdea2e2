"""Cascade attention's launches (the order and arguments of AttentionOps._cascade) on the host
simulator: attention_cascade_prep_k, the prompt kernel over every decode's queries as one group,
the decode kernel over each decode's own blocks, attention_cascade_combine_k; against the numpy
twin's plain attention. The prompt kernel then sees a GQA group of B x G rows of one token, and the
decode kernel a block table read from a column offset at the table's own stride: shapes no other
test gives them."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.cuda_sim import (
    _LAUNCH_ARGTYPES,
    _TC_ARGTYPES,
    SIM_RESIDENT,
    SimAttention,
    SimUnavailable,
    build_kernels,
)
from tests.cuda_sim import bf16_bits as _bits
from tests.cuda_sim import bf16_float as _float
from tests.unit.cascade_batches import shared_prefix_batch
from vt.kernels.attention_plan import attention_kernel, launch_shape
from vt.kernels.cascade_plan import cascade_scratch
from vt.kernels.numpy_fp8 import to_e4m3
from vt.kernels.numpy_ops import NumpyBackend

BF16_TOL = 1e-2
_P, _I = ctypes.c_void_p, ctypes.c_int
_KERNELS = {
    "attention_cascade_prep_k": (
        "const bf16_t* q, int q_stride, const int* seq_lens, int num_seqs, int hq, int hk, int d, "
        "int prefix_len, bf16_t* q_perm, int* ints",
        "q, q_stride, seq_lens, num_seqs, hq, hk, d, prefix_len, q_perm, ints",
        [_P, _I, _P, _I, _I, _I, _I, _I, _P, _P]),
    "attention_cascade_combine_k": (
        "const float* part_o, const float* part_ml, int prefix_splits, int suffix_splits, int num_seqs, "
        "int hq, int hk, int d, bf16_t* out",
        "part_o, part_ml, prefix_splits, suffix_splits, num_seqs, hq, hk, d, out",
        [_P, _P, _I, _I, _I, _I, _I, _I, _P]),
}


@pytest.fixture(scope="module")
def sim():
    try:
        return SimAttention(), build_kernels("attention.cu", _KERNELS)
    except SimUnavailable as e:
        pytest.skip(str(e))


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def _attn(att: SimAttention, kernel: str, grid, threads: int, smem: int, q, q_stride: int, kc, vc, qsl, lens,
          table, max_blocks: int, out, part_o, part_ml, tokens: int, hq: int, hk: int, d: int, bs: int,
          scale_log2: float, splits: int, v_scale: float) -> None:
    """One attention kernel launched on the simulator with pointers as given (tables at an offset)."""
    scalar = kernel.startswith("attention_r")
    lib = att.scalar if scalar else att.wg if kernel.startswith("attention_wg") else att.tc
    lib.sim_set_timing(1, 1, ctypes.c_uint(0))
    fn = getattr(lib, f"sim_{kernel}")
    grid, items = launch_shape(kernel, *grid, SIM_RESIDENT)  # a kernel over items: as cuda_ops launches it
    fn.argtypes = _LAUNCH_ARGTYPES + _TC_ARGTYPES[:14] + [_I] * scalar + _TC_ARGTYPES[14:] + [_I] * len(items)
    head = (d,) if scalar else ()
    rc = fn(*grid, threads, smem, q, q_stride, _ptr(kc), _ptr(vc), qsl, lens, table, max_blocks, _ptr(out),
            part_o, part_ml, tokens, hq, hk, *head, bs, scale_log2, splits, v_scale, *items)
    assert rc == 0, f"{kernel}: launch failed ({rc})"


def _cascade_on_sim(sim, q, kc, vc, lens, table, shared: int, scale: float, sp: int, ss: int, tiling: str,
                    kv_scales=None) -> np.ndarray:
    """What AttentionOps._cascade launches, in its order, with sp and ss key splits."""
    att, lib = sim
    b, hq, d = q.shape
    _, bs, hk, _ = kc.shape
    group, kv8 = hq // hk, kv_scales is not None
    rows, prefix_len = b * hq, shared * bs
    lay = cascade_scratch(sp, ss, b, hq, d)
    scratch = np.zeros(lay.end, np.uint8)
    base = scratch.ctypes.data
    out = np.zeros((b, hq, d), np.uint16)
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    scale_log2 = scale * np.log2(np.e) * k_scale
    rc = lib.sim_attention_cascade_prep_k(b, 1, 1, 128, 0, _ptr(q), hq * d, _ptr(lens), b, hq, hk, d,
                                          prefix_len, base + lay.q_perm, base + lay.ints)
    assert rc == 0
    ints = base + lay.ints
    stride = table.shape[1]
    qsl = np.arange(b + 1, dtype=np.int32)
    pre = attention_kernel(b * group, 1, d, prefill=tiling, kv8=kv8)
    suf = attention_kernel(group, 1, d, prefill=tiling, kv8=kv8)
    o_split, ml_split = rows * d * 4, rows * 2 * 4
    _attn(att, pre.name, (pre.row_tiles, hk, sp), pre.threads, pre.smem, base + lay.q_perm, rows * d, kc, vc,
          ints + 4 * b, ints + 4 * (b + 2), _ptr(table), stride, out, base + lay.part_o, base + lay.part_ml,
          1, rows, hk, d, bs, scale_log2, sp, v_scale)
    _attn(att, suf.name, (suf.row_tiles, hk, b * ss), suf.threads, suf.smem, _ptr(q), hq * d, kc, vc,
          _ptr(qsl), ints, _ptr(table) + 4 * shared, stride, out, base + lay.part_o + sp * o_split,
          base + lay.part_ml + sp * ml_split, b, hq, hk, d, bs, scale_log2, ss, v_scale)
    rc = lib.sim_attention_cascade_combine_k(rows, 1, 1, 64, 0, base + lay.part_o, base + lay.part_ml, sp, ss,
                                             b, hq, hk, d, _ptr(out))
    assert rc == 0
    assert (scratch[lay.ints: lay.ints + 4 * (b + 3)].view(np.int32)
            == np.concatenate([lens - prefix_len, [0, 1, prefix_len]])).all()
    return out


def _case(rng, b: int, hq: int, hk: int, d: int, bs: int, shared: int, max_own: int):
    """shared_prefix_batch with q and the caches as bf16 bits."""
    q, kc, vc, lens, table = shared_prefix_batch(rng, b, hq, hk, d, bs, shared, max_own)
    return _bits(q), _bits(kc), _bits(vc), lens, table


@pytest.mark.parametrize("b,hq,hk,d,shared,sp,ss,tiling", [
    (36, 8, 2, 128, 20, 2, 2, "wgr"),   # 144 prefix rows a kv head: two 128-row tiles, three key tiles
    (36, 8, 2, 128, 20, 3, 2, "wgs"),   # the same on the ping-pong tiling
    (36, 8, 2, 128, 20, 3, 2, "wgw"),   # and with its producer warpgroup
    (36, 8, 2, 128, 20, 3, 2, "wgwp"),  # and on a persistent grid
    (9, 32, 8, 128, 9, 3, 2, "wgr"),    # Qwen3-8B's heads, a split past the suffix keys
    (12, 8, 4, 64, 6, 2, 3, "r64"),     # head dim 64 on the fallback tiling
    (5, 4, 4, 128, 3, 2, 2, "wgr"),     # no GQA: 20 prefix rows
])
def test_cascade_launches_match_plain_attention(sim, b, hq, hk, d, shared, sp, ss, tiling):
    rng = np.random.default_rng(b * 100 + hq)
    bs = 16
    q, kc, vc, lens, table = _case(rng, b, hq, hk, d, bs, shared, 70)
    scale = d ** -0.5
    out = _float(_cascade_on_sim(sim, q, kc, vc, lens, table, shared, scale, sp, ss, tiling))
    qsl = np.arange(b + 1, dtype=np.int32)
    nb, top = NumpyBackend(), int(lens.max())
    ref = nb.attention(_float(q), _float(kc), _float(vc), qsl, lens, table, scale, 1, top)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < BF16_TOL, err
    # and the cascade is not plain attention by accident: a wrong prefix shows
    wrong = nb.attention(_float(q), _float(kc), _float(vc)[::-1].copy(), qsl, lens, table, scale, 1, top)
    assert np.linalg.norm(out - wrong) / np.linalg.norm(wrong) > 0.1


def test_cascade_launches_on_an_fp8_cache(sim):
    rng = np.random.default_rng(21)
    b, hq, hk, d, bs, shared = 20, 8, 2, 128, 16, 17
    q, kc, vc, lens, table = _case(rng, b, hq, hk, d, bs, shared, 50)
    kc, vc = (to_e4m3(_float(c) * 40) for c in (kc, vc))
    scales = (0.025, 0.04)
    scale = d ** -0.5
    out = _float(_cascade_on_sim(sim, q, kc.view(np.uint8), vc.view(np.uint8), lens, table, shared, scale,
                                 2, 2, "wgr", kv_scales=scales))
    ref = NumpyBackend().attention(_float(q), kc, vc, np.arange(b + 1, dtype=np.int32), lens, table, scale, 1,
                                   int(lens.max()), kv_scales=scales)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < BF16_TOL
