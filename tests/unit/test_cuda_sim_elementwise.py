"""The element kernels every layer runs (elementwise.cu's SiLU-mul and the attention prologue),
run on the host simulator in tests/cuda_sim and matched against the numpy twin, over the grids
cuda_ops launches them with: one or several blocks a token's row, fewer token blocks than tokens
(blocks stride over tokens), rows whose chunks do not fill a thread's group of loads."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.cuda_sim import LAUNCH_ARGTYPES, SimUnavailable, build
from tests.cuda_sim import bf16_bits as _bits
from tests.cuda_sim import bf16_float as _float
from vt.kernels.numpy_fp8 import quantize_rows_pow2
from vt.kernels.numpy_ops import NumpyBackend

BF16_TOL = 1e-2
_P = ctypes.c_void_p
_I = ctypes.c_int
_LAUNCH = LAUNCH_ARGTYPES


@pytest.fixture(scope="module")
def lib():
    try:
        lib = build("elementwise.cu")
    except SimUnavailable as e:
        pytest.skip(str(e))
    lib.sim_silu_mul_k.argtypes = _LAUNCH + [_P, _P, _I, _I, _P, _I, ctypes.c_float]
    for fn in (lib.sim_qk_norm_rope_write_kv_k, lib.sim_qk_norm_rope_write_kv8_k):
        fn.argtypes = _LAUNCH + [_P, _I, _P, _I, _P, _I, _P, _P, ctypes.c_float, _P, _P, _P, _P, _P,
                                 ctypes.c_longlong, _I, _I, _I, _I, _P, _I, _P, ctypes.c_float,
                                 ctypes.c_float, _P, _P]
    lib.sim_round_q_e4m3_pow2_k.argtypes = _LAUNCH + [_P, _I, _I]
    lib.sim_write_kv_k.argtypes = _LAUNCH + [_P, _I, _P, _I, _P, _P, _P, _I, ctypes.c_longlong,
                                             ctypes.c_float, ctypes.c_float, _I]
    return lib


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def _ptr(a: np.ndarray | None, offset: int = 0) -> int | None:
    return None if a is None else a.ctypes.data + offset * a.itemsize


@pytest.mark.parametrize(
    ("tokens", "inter", "parts", "token_blocks", "threads"),
    [
        (3, 8 * 37, 1, 3, 32),  # a thread's chunks: 2 of a group of 4
        (5, 8 * 300, 1, 2, 32),  # 10 chunks a thread (3 groups, the last short), blocks stride over tokens
        (4, 8 * 100, 3, 4, 32),  # three blocks a row
        (2, 8 * 20, 2, 2, 64),  # threads past the row's chunks
    ],
)
@pytest.mark.parametrize("scaled", [False, True])
def test_silu_mul_matches_numpy(lib, tokens, inter, parts, token_blocks, threads, scaled):
    rng = np.random.default_rng(tokens * inter + parts)
    x = _bits(rng.standard_normal((tokens, 2 * inter)) * 3)
    r = _bits(rng.standard_normal((tokens, 96))) if scaled else None
    out = np.full((tokens, inter), 0xFFFF, np.uint16)
    rc = lib.sim_silu_mul_k(parts, token_blocks, 1, threads, 0, _ptr(x), _ptr(out), tokens, inter, _ptr(r),
                            0 if r is None else r.shape[1], 1e-6)
    assert rc == 0
    want = NumpyBackend().silu_mul(_float(x), rms_of=None if r is None else _float(r), eps=1e-6)
    assert _rel(_float(out), want) < BF16_TOL


def test_silu_mul_extremes(lib):
    """Gates far below and above the exponential's range give 0 and the gate (no NaN)."""
    g = np.array([-1e30, -200.0, -90.0, -1.0, 0.0, 1.0, 90.0, 1e30], np.float32)
    x = _bits(np.concatenate([g, np.ones(8, np.float32)])[None, :])
    out = np.zeros((1, 8), np.uint16)
    assert lib.sim_silu_mul_k(1, 1, 1, 32, 0, _ptr(x), _ptr(out), 1, 8, None, 0, 0.0) == 0
    got = _float(out)[0]
    assert np.isfinite(got).all()
    with np.errstate(over="ignore"):
        want = NumpyBackend().silu_mul(_float(x))[0]
    assert np.allclose(got, want, rtol=1e-2, atol=1e-6)


@pytest.mark.parametrize(("hq", "hk", "d", "parts", "token_blocks"), [(4, 2, 128, 1, 5), (4, 1, 64, 2, 2),
                                                                        (8, 2, 128, 2, 3)])
@pytest.mark.parametrize("prescale", [False, True])
def test_prologue_matches_numpy(lib, hq, hk, d, parts, token_blocks, prescale):
    rng = np.random.default_rng(hq * d + parts + prescale)
    t, nb, bs, eps = 5, 4, 4, 1e-6
    width = (hq + 2 * hk) * d
    qkv = _bits(rng.standard_normal((t, width)))
    q_norm, k_norm = _bits(1 + 0.1 * rng.standard_normal(d)), _bits(1 + 0.1 * rng.standard_normal(d))
    positions = rng.integers(0, 500, t).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    slots = np.array([3, 7, -1, 12, 0], np.int32)  # -1: a padding token, written nowhere
    rms_of = _bits(rng.standard_normal((t, 64))) if prescale else None
    bias = _bits(0.1 * rng.standard_normal(width)) if prescale else None
    k_cache = np.zeros((nb, bs, hk, d), np.uint16)
    v_cache = np.zeros_like(k_cache)

    ref = _float(qkv)
    q = ref[:, : hq * d].reshape(t, hq, d).copy()
    k = ref[:, hq * d : (hq + hk) * d].reshape(t, hk, d).copy()
    v = ref[:, (hq + hk) * d :].reshape(t, hk, d).copy()
    kc, vc = np.zeros((nb, bs, hk, d), np.float32), np.zeros((nb, bs, hk, d), np.float32)
    NumpyBackend().qk_norm_rope_write_kv(q, k, v, _float(q_norm), _float(k_norm), eps, positions, inv_freq,
                                         kc, vc, slots, rms_of=None if rms_of is None else _float(rms_of),
                                         bias=None if bias is None else _float(bias))

    rc = lib.sim_qk_norm_rope_write_kv_k(
        parts, token_blocks, 1, 256, 0, _ptr(qkv), width, _ptr(qkv, hq * d), width, _ptr(qkv, (hq + hk) * d),
        width, _ptr(q_norm), _ptr(k_norm), eps, _ptr(positions), _ptr(inv_freq), _ptr(k_cache), _ptr(v_cache),
        _ptr(slots), nb * bs, t, hq, hk, d, _ptr(rms_of), 0 if rms_of is None else rms_of.shape[1],
        _ptr(bias), 1.0, 1.0, None, None)
    assert rc == 0
    got = _float(qkv)
    assert _rel(got[:, : hq * d].reshape(t, hq, d), q) < BF16_TOL
    assert _rel(got[:, hq * d : (hq + hk) * d].reshape(t, hk, d), k) < BF16_TOL
    assert _rel(_float(k_cache), kc) < BF16_TOL
    assert _rel(_float(v_cache), vc) < BF16_TOL
    assert not _float(k_cache).reshape(nb * bs, hk, d)[[s for s in range(nb * bs) if s not in slots]].any()


@pytest.mark.parametrize(
    ("hq", "hk", "d", "parts"),
    [
        (32, 8, 128, 1),  # 8B's 48 rows: three passes of 16 in one part
        (28, 4, 128, 1),  # 36 rows: three passes, the last a quarter full
        (64, 16, 64, 1),  # 96 rows of 8 lanes: three passes of 32
        (64, 8, 128, 2),  # 80 rows: part 0 takes three passes, part 1 two
        (56, 8, 128, 2),  # 72 rows: three (the last half full) and two
    ],
)
@pytest.mark.parametrize("prescale", [False, True])
@pytest.mark.parametrize("kv8", [False, True])
def test_prologue_passes_match_one_pass_blocks(lib, hq, hk, d, parts, prescale, kv8):
    """A block that takes several passes over its token's rows (the later passes' rows loaded
    while earlier ones are computed) leaves bit for bit what blocks of one pass each leave (a grid
    of as many parts as passes: nothing loaded ahead), over tokens that blocks stride across."""
    rng = np.random.default_rng(hq * d + parts + 2 * prescale + kv8)
    t, token_blocks, nb, bs, eps = 5, 2, 4, 4, 1e-6
    rows, width = hq + 2 * hk, (hq + 2 * hk) * d
    qkv = _bits(rng.standard_normal((t, width)) * 4)
    q_norm, k_norm = _bits(1 + 0.1 * rng.standard_normal(d)), _bits(1 + 0.1 * rng.standard_normal(d))
    positions = rng.integers(0, 500, t).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    slots = np.array([3, 7, -1, 12, 0], np.int32)
    rms_of = _bits(rng.standard_normal((t, 64))) if prescale else None
    bias = _bits(0.1 * rng.standard_normal(width)) if prescale else None
    fn, dtype, kv_scales = ((lib.sim_qk_norm_rope_write_kv8_k, np.uint8, (0.05, 0.02)) if kv8
                            else (lib.sim_qk_norm_rope_write_kv_k, np.uint16, (1.0, 1.0)))
    groups = 256 // (1 << (d // 8 - 1).bit_length())  # rows a block takes a pass
    outs = []
    for grid_parts in (parts, -(-rows // groups)):
        x = qkv.copy()
        k_cache, v_cache = np.zeros((nb, bs, hk, d), dtype), np.zeros((nb, bs, hk, d), dtype)
        rc = fn(grid_parts, token_blocks, 1, 256, 0, _ptr(x), width, _ptr(x, hq * d), width,
                _ptr(x, (hq + hk) * d), width, _ptr(q_norm), _ptr(k_norm), eps, _ptr(positions),
                _ptr(inv_freq), _ptr(k_cache), _ptr(v_cache), _ptr(slots), nb * bs, t, hq, hk, d,
                _ptr(rms_of), 0 if rms_of is None else rms_of.shape[1], _ptr(bias), *kv_scales, None, None)
        assert rc == 0
        outs.append((x, k_cache, v_cache))
    (got, kc, vc), (want, kc_want, vc_want) = outs
    assert rows > 2 * groups * parts  # some part takes three passes
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kc, kc_want)
    np.testing.assert_array_equal(vc, vc_want)
    assert kc.any() and vc.any()
    if not kv8:  # and the one-pass blocks agree with numpy
        ref = _float(qkv)
        q = ref[:, : hq * d].reshape(t, hq, d).copy()
        k = ref[:, hq * d : (hq + hk) * d].reshape(t, hk, d).copy()
        v = ref[:, (hq + hk) * d :].reshape(t, hk, d).copy()
        kc_np, vc_np = np.zeros((nb, bs, hk, d), np.float32), np.zeros((nb, bs, hk, d), np.float32)
        NumpyBackend().qk_norm_rope_write_kv(q, k, v, _float(q_norm), _float(k_norm), eps, positions,
                                             inv_freq, kc_np, vc_np, slots,
                                             rms_of=None if rms_of is None else _float(rms_of),
                                             bias=None if bias is None else _float(bias))
        assert _rel(_float(want[:, : hq * d]).reshape(t, hq, d), q) < BF16_TOL
        assert _rel(_float(kc_want), kc_np) < BF16_TOL
        assert _rel(_float(vc_want), vc_np) < BF16_TOL


@pytest.mark.parametrize("kv8", [False, True])
@pytest.mark.parametrize(("hq", "hk", "d", "parts", "token_blocks"), [(4, 2, 128, 1, 5), (8, 2, 64, 2, 3)])
def test_prologue_gives_a_unit_scale_product_its_scales_first(lib, hq, hk, d, parts, token_blocks, kv8):
    """qkv of fp8 weights as unit-scale sums (fp8.linear_fp8_defer) with x_scale and w_scale: q, k,
    v and the cache are bit for bit the prologue's over bf16(sums * (x_scale[t] * w_scale[n])),
    the product rounded once, as the outer-vector GEMM's epilogue leaves it."""
    rng = np.random.default_rng(hq * d + parts + kv8)
    t, nb, bs, eps = 5, 4, 4, 1e-6
    width = (hq + 2 * hk) * d
    sums = _bits(rng.standard_normal((t, width)) * 3000)  # sums of e4m3 code products
    xs = rng.uniform(1e-3, 1e-1, t).astype(np.float32)
    # a column read from the wrong place shows
    ws = (rng.uniform(1e-4, 1e-2, width) * np.linspace(1, 4, width)).astype(np.float32)
    scaled = _bits(_float(sums) * (xs[:, None] * ws[None, :]))  # float32 products, rounded once
    q_norm, k_norm = _bits(1 + 0.1 * rng.standard_normal(d)), _bits(1 + 0.1 * rng.standard_normal(d))
    positions = rng.integers(0, 500, t).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    slots = np.array([3, 7, -1, 12, 0], np.int32)
    fn, dtype, kv_scales = ((lib.sim_qk_norm_rope_write_kv8_k, np.uint8, (0.05, 0.02)) if kv8
                            else (lib.sim_qk_norm_rope_write_kv_k, np.uint16, (1.0, 1.0)))
    outs = []
    for qkv, x_scale, w_scale in ((sums, xs, ws), (scaled, None, None)):
        k_cache, v_cache = np.zeros((nb, bs, hk, d), dtype), np.zeros((nb, bs, hk, d), dtype)
        rc = fn(parts, token_blocks, 1, 256, 0, _ptr(qkv), width, _ptr(qkv, hq * d), width,
                _ptr(qkv, (hq + hk) * d), width, _ptr(q_norm), _ptr(k_norm), eps, _ptr(positions),
                _ptr(inv_freq), _ptr(k_cache), _ptr(v_cache), _ptr(slots), nb * bs, t, hq, hk, d, None, 0,
                None, *kv_scales, _ptr(x_scale), _ptr(w_scale))
        assert rc == 0
        outs.append((qkv, k_cache, v_cache))
    (got, kc, vc), (want, kc_want, vc_want) = outs
    np.testing.assert_array_equal(got[:, : (hq + hk) * d], want[:, : (hq + hk) * d])
    np.testing.assert_array_equal(got[:, (hq + hk) * d :], scaled[:, (hq + hk) * d :])  # v, scaled
    np.testing.assert_array_equal(kc, kc_want)
    np.testing.assert_array_equal(vc, vc_want)
    assert vc.any()


def _codes(x: np.ndarray, scale: float) -> np.ndarray:
    """The e4m3 bytes numpy's fp8 KV cache stores for float32 x and a scale."""
    from vt.kernels.numpy_fp8 import to_e4m3

    return to_e4m3(np.asarray(x, np.float32) / np.float32(scale)).view(np.uint8)


@pytest.mark.parametrize(("hq", "hk", "d", "parts", "token_blocks"), [(4, 2, 128, 1, 5), (8, 2, 64, 2, 3)])
@pytest.mark.parametrize("prescale", [False, True])
def test_prologue_writes_fp8_codes(lib, hq, hk, d, parts, token_blocks, prescale):
    """Into an fp8 cache the prologue stores e4m3(k / k_scale) and e4m3(v / v_scale) of the bf16
    k and v it leaves (bit for bit the numpy twin's write_kv of those values), k is as with a
    bf16 cache, and each q head row is the bf16 cache's q rounded to e4m3 x 2^n (bit for bit
    numpy_fp8.quantize_rows_pow2), the query every attention kernel over the cache reads."""
    rng = np.random.default_rng(hq * d + parts + prescale + 7)
    t, nb, bs, eps, scales = 5, 4, 4, 1e-6, (0.004, 0.5)  # normed k reaches past 448 * 0.004
    width = (hq + 2 * hk) * d
    qkv = _bits(rng.standard_normal((t, width)) * 4)
    # q's norm weights span 2^-20..1 so that each q row reaches below e4m3's normal range, where
    # its codes depend on the row's amax (all its lanes), not on one lane's
    q_norm, k_norm = _bits(np.exp2(rng.uniform(-20, 0, d))), _bits(1 + 0.1 * rng.standard_normal(d))
    positions = rng.integers(0, 500, t).astype(np.int32)
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    slots = np.array([3, 7, -1, 12, 0], np.int32)
    rms_of = _bits(rng.standard_normal((t, 64))) if prescale else None
    bias = _bits(0.1 * rng.standard_normal(width)) if prescale else None
    k_cache = np.zeros((nb, bs, hk, d), np.uint8)
    v_cache = np.zeros_like(k_cache)
    plain = qkv.copy()
    rc = lib.sim_qk_norm_rope_write_kv8_k(
        parts, token_blocks, 1, 256, 0, _ptr(qkv), width, _ptr(qkv, hq * d), width, _ptr(qkv, (hq + hk) * d),
        width, _ptr(q_norm), _ptr(k_norm), eps, _ptr(positions), _ptr(inv_freq), _ptr(k_cache), _ptr(v_cache),
        _ptr(slots), nb * bs, t, hq, hk, d, _ptr(rms_of), 0 if rms_of is None else rms_of.shape[1],
        _ptr(bias), scales[0], scales[1], None, None)
    assert rc == 0
    got = _float(qkv)
    k_out = got[:, hq * d : (hq + hk) * d].reshape(t, hk, d)
    v_out = got[:, (hq + hk) * d :].reshape(t, hk, d)
    keep = slots >= 0
    assert (k_cache.reshape(nb * bs, hk, d)[slots[keep]] == _codes(k_out[keep], scales[0])).all()
    assert (v_cache.reshape(nb * bs, hk, d)[slots[keep]] == _codes(v_out[keep], scales[1])).all()
    assert np.isin(k_cache, (0x7e, 0xfe)).any()  # +-448: saturated codes
    others = [s for s in range(nb * bs) if s not in slots]
    assert not k_cache.reshape(nb * bs, hk, d)[others].any()
    # q and k are what the bf16 cache's launch leaves
    bf_cache, bf_v = np.zeros((nb, bs, hk, d), np.uint16), np.zeros((nb, bs, hk, d), np.uint16)
    rc = lib.sim_qk_norm_rope_write_kv_k(
        parts, token_blocks, 1, 256, 0, _ptr(plain), width, _ptr(plain, hq * d), width,
        _ptr(plain, (hq + hk) * d), width, _ptr(q_norm), _ptr(k_norm), eps, _ptr(positions), _ptr(inv_freq),
        _ptr(bf_cache), _ptr(bf_v), _ptr(slots), nb * bs, t, hq, hk, d, _ptr(rms_of),
        0 if rms_of is None else rms_of.shape[1], _ptr(bias), 1.0, 1.0, None, None)
    assert rc == 0 and (plain[:, hq * d :] == qkv[:, hq * d :]).all()
    q_plain = _float(plain)[:, : hq * d].reshape(t, hq, d)
    q_fp8 = got[:, : hq * d].reshape(t, hq, d)
    assert (q_fp8 == quantize_rows_pow2(q_plain)).all()
    assert (q_fp8 != q_plain).any()  # the rounding did something


def test_write_kv_writes_fp8_codes(lib):
    rng = np.random.default_rng(11)
    t, hk, d, nb, bs, scales = 4, 2, 64, 3, 4, (0.25, 0.01)
    k, v = _bits(rng.standard_normal((t, hk * d)) * 30), _bits(rng.standard_normal((t, hk * d)))
    k_cache, v_cache = np.zeros((nb, bs, hk, d), np.uint8), np.zeros((nb, bs, hk, d), np.uint8)
    slots = np.array([5, -1, 0, 11], np.int32)
    rc = lib.sim_write_kv_k(t, 1, 1, 128, 0, _ptr(k), hk * d, _ptr(v), hk * d, _ptr(k_cache), _ptr(v_cache),
                            _ptr(slots), hk * d, nb * bs, scales[0], scales[1], 1)
    assert rc == 0
    ops = NumpyBackend()
    kc, vc = ops.zeros((nb, bs, hk, d), "fp8"), ops.zeros((nb, bs, hk, d), "fp8")
    ops.write_kv(_float(k).reshape(t, hk, d), _float(v).reshape(t, hk, d), kc, vc, slots, kv_scales=scales)
    assert (k_cache == kc.view(np.uint8)).all() and (v_cache == vc.view(np.uint8)).all()


@pytest.mark.parametrize(("t", "hq", "d", "stride"), [(3, 4, 72, 576), (2, 3, 40, 120), (1, 2, 320, 640)])
def test_round_q_matches_numpy(lib, t, hq, d, stride):
    """The prologue's three-op path over an fp8 cache: each q head row (token-strided) rounded to
    e4m3 x 2^n in place, bit for bit numpy_fp8.quantize_rows_pow2; what lies past the heads stays."""
    rng = np.random.default_rng(t * d)
    # magnitudes over 2^-24..1 within a row (times a row scale): past e4m3's normal range below
    # the row's amax, where the codes depend on the row's n, not a lane's
    x = _bits(rng.standard_normal((t, stride)) * np.exp2(rng.uniform(-24, 0, (t, stride)))
              * rng.uniform(1e-3, 1e3, (t, 1)))
    x[0, d : 2 * d] = 0  # a zero row stays zero
    before = x.copy()
    rc = lib.sim_round_q_e4m3_pow2_k(t, hq, 1, 32, 0, _ptr(x), stride, d)
    assert rc == 0
    q = _float(before)[:, : hq * d].reshape(t, hq, d)
    assert (_float(x)[:, : hq * d].reshape(t, hq, d) == quantize_rows_pow2(q)).all()
    assert (x[:, hq * d :] == before[:, hq * d :]).all()
