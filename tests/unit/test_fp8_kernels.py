"""FP8 semantics (vt.kernels.numpy_fp8) and the fp8.cu kernels on the host simulator against them.

The numpy twin is the definition: e4m3 rounding as ml_dtypes does it, saturated, with scales
amax / 448 per row or per row and 128 columns. quantize_rows_k must reproduce its bits exactly on
the same bf16 input; the fused norm and SiLU-mul kernels compute their row in a different order
(rsqrt, the fast exponential), so their codes may differ by a rounding step where a value lands
between two codes.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_sim import SimUnavailable, build_kernels
from tests.cuda_sim import bf16_bits as _bits
from vt.kernels import numpy_fp8 as f8

_P, _I, _F, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_longlong
_KERNELS = {
    "quantize_rows_k": ("const bf16_t* x, long long ld, unsigned char* q, float* scale, int k, int group, "
                        "int scale_ld", "x, ld, q, scale, k, group, scale_ld", [_P, _LL, _P, _P, _I, _I, _I]),
    "rms_norm_quant_k": ("const bf16_t* x, const bf16_t* w, float eps, unsigned char* q, float* scale, "
                         "int k, int group, int scale_ld", "x, w, eps, q, scale, k, group, scale_ld",
                         [_P, _P, _F, _P, _P, _I, _I, _I]),
    "silu_mul_quant_k": ("const bf16_t* x, unsigned char* q, float* scale, int inter, int group, "
                         "int scale_ld",
                         "x, q, scale, inter, group, scale_ld", [_P, _P, _P, _I, _I, _I]),
    "silu_mul_quant_scaled_k": ("const bf16_t* y, const float* xs, const float* ws, unsigned char* q, "
                                "float* scale, int inter", "y, xs, ws, q, scale, inter",
                                [_P, _P, _P, _P, _P, _I]),
    "add_scaled_rows_k": ("bf16_t* r, const bf16_t* y, const float* xs, const float* ws, int n, "
                          "long long chunks", "r, y, xs, ws, n, chunks", [_P, _P, _P, _P, _I, _LL]),
    "add_scaled_rms_norm_quant_k": ("bf16_t* r, const bf16_t* y, const float* xs, const float* ws, "
                                    "const bf16_t* w, float eps, unsigned char* q, float* scale, int k",
                                    "r, y, xs, ws, w, eps, q, scale, k",
                                    [_P, _P, _P, _P, _P, _F, _P, _P, _I]),
}
_NORM_CHUNKS, _SILU_CHUNKS = (1, 2, 4), (2, 4, 6, 8)  # fp8.py's HELD_NORM_CHUNKS, HELD_SILU_CHUNKS
for _c in _NORM_CHUNKS:
    _KERNELS[f"rms_norm_quant_held{_c}_k"] = (
        "const bf16_t* x, const bf16_t* w, float eps, unsigned char* q, float* scale, int k",
        "x, w, eps, q, scale, k", [_P, _P, _F, _P, _P, _I])
    _KERNELS[f"add_scaled_rms_norm_quant_held{_c}_k"] = _KERNELS["add_scaled_rms_norm_quant_k"]
    _KERNELS[f"quantize_rows_held{_c}_k"] = (
        "const bf16_t* x, long long ld, unsigned char* q, float* scale, int k", "x, ld, q, scale, k",
        [_P, _LL, _P, _P, _I])
for _c in _SILU_CHUNKS:
    _KERNELS[f"silu_mul_quant_held{_c}_k"] = ("const bf16_t* x, unsigned char* q, float* scale, int inter",
                                              "x, q, scale, inter", [_P, _P, _P, _I])
    _KERNELS[f"silu_mul_quant_scaled_held{_c}_k"] = _KERNELS["silu_mul_quant_scaled_k"]


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bf16, as float32 (what a bf16 tensor holds)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


# ---- the numpy definition -----------------------------------------------------------------------

def test_quantize_round_trip_is_within_half_an_e4m3_step_of_each_row():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((17, 300)).astype(np.float32) * np.float32(7)
    q, scale = f8.quantize(x)
    assert q.dtype == f8.E4M3 and scale.shape == (17, 1)
    back = f8.dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal codes; a row's largest value
    # maps to 448 exactly
    err = np.abs(back - x) / np.abs(x).max(axis=1, keepdims=True)
    assert err.max() <= 2.0 ** -4
    np.testing.assert_array_equal(np.abs(q.astype(np.float32)).max(axis=1), 448.0)


def test_group_scales_follow_each_block_of_128_and_a_short_last_group():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    x[:, 128:256] *= 1000  # one loud group must not flatten the others
    q, scale = f8.quantize(x, 128)
    assert scale.shape == (3, 3)
    loud, quiet = np.abs(x[:, 128:256]).max(1), np.abs(x[:, :128]).max(1)
    np.testing.assert_allclose(scale[:, 1] / scale[:, 0], loud / quiet, rtol=1e-6)
    back = f8.dequantize(q, scale, 128)
    assert (np.abs(back - x)[:, :128] <= np.abs(x[:, :128]).max(1, keepdims=True) / 16).all()


def test_zero_rows_stay_zero_with_a_finite_scale_and_overflow_saturates():
    x = np.zeros((2, 16), np.float32)
    x[1, 3] = np.float32(np.finfo(np.float32).max)
    q, scale = f8.quantize(x)
    assert np.isfinite(scale).all() and not q[0].astype(np.float32).any()
    assert q[1, 3].astype(np.float32) == 448.0
    np.testing.assert_array_equal(f8.to_e4m3(np.array([1e9, -1e9, 0.0], np.float32)).astype(np.float32),
                                  [448.0, -448.0, 0.0])


def test_scaled_gemm_is_the_product_of_the_dequantized_operands():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 256)).astype(np.float32)
    w = rng.standard_normal((64, 256)).astype(np.float32) / 16
    xq, xs = f8.quantize(x)
    wq, ws = f8.quantize_weight_channel(w)
    y = f8.scaled_gemm(xq, xs, wq, ws)
    want = f8.dequantize(xq, xs) @ f8.dequantize_weight(wq, ws).T
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    rel = np.linalg.norm(y - x @ w.T) / np.linalg.norm(x @ w.T)
    assert rel < 0.05  # two e4m3 roundings: a few percent of the product


def test_block_scaled_gemm_pairs_128x128_weight_blocks_with_128_wide_activation_groups():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 300)).astype(np.float32)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    w[:128, :128] *= 100  # blocks keep their own scale
    wq, ws = f8.quantize_weight_block(w)
    assert ws.shape == (2, 3)
    xq, xs = f8.quantize(x, 128)
    y = f8.scaled_gemm(xq, xs, wq, ws)
    want = f8.dequantize(xq, xs, 128).astype(np.float64) @ f8.dequantize_weight(wq, ws).T.astype(np.float64)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="block"):
        f8.scaled_gemm(*f8.quantize(x), wq, ws)


# ---- fp8.cu on the host simulator ----------------------------------------------------------------

@pytest.fixture(scope="module")
def lib():
    try:
        return build_kernels("fp8.cu", _KERNELS)
    except SimUnavailable as e:
        pytest.skip(str(e))


def _outputs(rows: int, k: int, group: int | None) -> tuple[np.ndarray, np.ndarray, int]:
    groups = f8.num_groups(k, group)
    return np.full((rows, k), 0x55, np.uint8), np.full(rows * groups, np.nan, np.float32), groups


def _scales(scale: np.ndarray, rows: int, groups: int, group: int | None) -> np.ndarray:
    """The kernel's scales as numpy's [rows, groups]: group-major (scale[g * rows + r]) for groups."""
    return scale.reshape(rows, 1) if group is None else scale.reshape(groups, rows).T


def _codes_agree(got: np.ndarray, want: np.ndarray) -> None:
    """Codes equal, or one rounding step apart where the kernel's float differs in its last bits."""
    g, w = got.astype(np.int32), want.view(np.uint8).astype(np.int32)
    assert np.abs(g - w).max() <= 1 and (g != w).mean() < 0.01


# quantize_rows reads a per-token row twice (amax, then codes) at every width.
@pytest.mark.parametrize(("rows", "k", "group"), [(3, 64, None), (5, 4096 + 8, None), (3, 16384, None),
                                                   (3, 16384 + 64, None), (4, 384, 128), (2, 128 * 33, 128)])
def test_quantize_rows_kernel_is_bit_exact(lib, rows, k, group):
    rng = np.random.default_rng(rows * k)
    x = _bf16(rng.standard_normal((rows, k)) * rng.uniform(0.001, 1000, (rows, 1)))
    x[0, :] = 0.0  # a zero row
    x[-1, 1] = _bf16(np.float32(3e38))  # saturation, and a subnormal neighbour row range
    x[-1, 2] = _bf16(np.float32(1e-30))
    ld = k + 16  # a strided input, as the attention output's rows may be
    xs = np.zeros((rows, ld), np.float32)
    xs[:, :k] = x
    xb = _bits(xs)
    q, scale, groups = _outputs(rows, k, group)
    rc = lib.sim_quantize_rows_k(rows, 1, 1, 256, 0, xb.ctypes.data, ld, q.ctypes.data, scale.ctypes.data, k,
                                 group or 0, rows)
    assert rc == 0
    want_q, want_s = f8.quantize(x, group)
    np.testing.assert_array_equal(q, want_q.view(np.uint8))
    np.testing.assert_array_equal(_scales(scale, rows, groups, group), want_s)


@pytest.mark.parametrize(("rows", "k", "group"), [(3, 256, None), (2, 4096, None), (2, 16384 + 64, None),
                                                   (2, 1024, 128)])
def test_rms_norm_quant_kernel_matches_numpy(lib, rows, k, group):
    rng = np.random.default_rng(k)
    x = _bf16(rng.standard_normal((rows, k)) * 4)
    w = _bf16(rng.uniform(0.2, 2.0, k))
    q, scale, groups = _outputs(rows, k, group)
    xb, wb = _bits(x), _bits(w)  # kept alive across the call
    rc = lib.sim_rms_norm_quant_k(rows, 1, 1, 256, 0, xb.ctypes.data, wb.ctypes.data, 1e-6,
                                  q.ctypes.data, scale.ctypes.data, k, group or 0, rows)
    assert rc == 0
    want_q, want_s = f8.rms_norm_quantize(x, w, 1e-6, group)
    np.testing.assert_allclose(_scales(scale, rows, groups, group), want_s, rtol=1e-5)
    _codes_agree(q, want_q)


# SiLU-mul holds rows of up to 16384 in registers between amax and quantization; 16384 + 64 takes
# the two-read path.
@pytest.mark.parametrize(("rows", "inter", "group"), [(3, 8 * 50, None), (2, 12288, None),
                                                      (3, 16384 + 64, None), (2, 384, 128)])
def test_silu_mul_quant_kernel_matches_numpy(lib, rows, inter, group):
    rng = np.random.default_rng(inter)
    x = _bf16(rng.standard_normal((rows, 2 * inter)) * 3)
    q, scale, groups = _outputs(rows, inter, group)
    xb = _bits(x)
    rc = lib.sim_silu_mul_quant_k(rows, 1, 1, 256, 0, xb.ctypes.data, q.ctypes.data, scale.ctypes.data,
                                  inter, group or 0, rows)
    assert rc == 0
    want_q, want_s = f8.silu_mul_quantize(x, group)
    np.testing.assert_allclose(_scales(scale, rows, groups, group), want_s, rtol=1e-5)
    _codes_agree(q, want_q)


# gate_up of a 17-256-row step with unit scales (fp8.mlp_act_fp8): SiLU-mul gives the sums their
# token's and channel's scales as it reads them, then quantizes per token (held rows up to 16384).
@pytest.mark.parametrize(("rows", "inter"), [(3, 8 * 50), (17, 12288), (2, 16384 + 64)])
def test_silu_mul_quant_scaled_kernel_scales_the_unit_product(lib, rows, inter):
    rng = np.random.default_rng(rows + inter)
    y = _bf16(rng.standard_normal((rows, 2 * inter)) * 2000)  # sums of e4m3 code products
    xs = rng.uniform(1e-3, 1e-1, rows).astype(np.float32)
    ws = (rng.uniform(1e-4, 1e-2, 2 * inter) * np.linspace(1, 3, 2 * inter)).astype(np.float32)
    q, scale, _ = _outputs(rows, inter, None)
    yb = _bits(y)
    rc = lib.sim_silu_mul_quant_scaled_k(rows, 1, 1, 256, 0, yb.ctypes.data, xs.ctypes.data, ws.ctypes.data,
                                         q.ctypes.data, scale.ctypes.data, inter)
    assert rc == 0
    want_q, want_s = f8.silu_mul_quantize(y * (xs[:, None] * ws[None, :]), None)
    np.testing.assert_allclose(scale[:rows], want_s[:, 0], rtol=1e-5)
    _codes_agree(q, want_q)


# The unit-scale fp8 GEMM's epilogue (fp8.py, quantized.unit_scale_rows): each value of the product y
# times its token's and its channel's scale, added to the residual row by one fused multiply-add and
# rounded once to bf16. The reference does the multiply-add in float64 (exact for the product of two
# floats) and rounds to float32, then bf16.
@pytest.mark.parametrize(("rows", "n"), [(1, 8), (17, 4096), (3, 200)])
def test_add_scaled_rows_kernel_applies_both_scales_after_the_product(lib, rows, n):
    rng = np.random.default_rng(rows * n)
    r = _bf16(rng.standard_normal((rows, n)) * 3)
    y = _bf16(rng.standard_normal((rows, n)) * 2000)  # a product of e4m3 codes: hundreds to thousands
    xs = rng.uniform(1e-3, 1e-1, rows).astype(np.float32)
    ws = rng.uniform(1e-4, 1e-2, n).astype(np.float32)
    rb, yb = _bits(r), _bits(y)
    chunks = rows * n // 8
    rc = lib.sim_add_scaled_rows_k(-(-chunks // 256), 1, 1, 256, 0, rb.ctypes.data, yb.ctypes.data,
                                   xs.ctypes.data, ws.ctypes.data, n, chunks)
    assert rc == 0
    scale = (xs[:, None] * ws[None, :]).astype(np.float32)  # float32 product, as the kernel's
    want = _bf16((y.astype(np.float64) * scale.astype(np.float64) + r.astype(np.float64)).astype(np.float32))
    got = rb.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got, want)


# o_proj's unit-scale product added by the post-attention norm (fp8.py's fp8_fold_add): the residual
# rows and the codes are the same bits as add_scaled_rows_k then rms_norm_quant_k.
@pytest.mark.parametrize(("rows", "k"), [(1, 64), (17, 4096), (3, 200 * 8)])
def test_add_scaled_rms_norm_quant_is_the_add_then_the_norm(lib, rows, k):
    rng = np.random.default_rng(rows + k)
    r = _bf16(rng.standard_normal((rows, k)) * 3)
    y = _bf16(rng.standard_normal((rows, k)) * 2000)
    xs = rng.uniform(1e-3, 1e-1, rows).astype(np.float32)
    ws = rng.uniform(1e-4, 1e-2, k).astype(np.float32)
    w = _bf16(rng.uniform(0.2, 2.0, k))
    r_two, r_one, yb, wb = _bits(r), _bits(r), _bits(y), _bits(w)
    q_two, s_two, _ = _outputs(rows, k, None)
    q_one, s_one, _ = _outputs(rows, k, None)
    chunks = rows * k // 8
    assert lib.sim_add_scaled_rows_k(-(-chunks // 256), 1, 1, 256, 0, r_two.ctypes.data, yb.ctypes.data,
                                     xs.ctypes.data, ws.ctypes.data, k, chunks) == 0
    assert lib.sim_rms_norm_quant_k(rows, 1, 1, 256, 0, r_two.ctypes.data, wb.ctypes.data, 1e-6,
                                    q_two.ctypes.data, s_two.ctypes.data, k, 0, rows) == 0
    assert lib.sim_add_scaled_rms_norm_quant_k(rows, 1, 1, 256, 0, r_one.ctypes.data, yb.ctypes.data,
                                               xs.ctypes.data, ws.ctypes.data, wb.ctypes.data, 1e-6,
                                               q_one.ctypes.data, s_one.ctypes.data, k) == 0
    np.testing.assert_array_equal(r_one, r_two)
    np.testing.assert_array_equal(q_one, q_two)
    np.testing.assert_array_equal(s_one, s_two)
    assert not np.array_equal(r_one, _bits(r))  # the product was added


# ---- the held-row kernels: the generic kernels' bits from one read of the row --------------------

def _p(a: np.ndarray) -> int:
    return a.ctypes.data


def _held_counts(width: int, counts: tuple[int, ...]) -> list[int]:
    """Every instantiated chunk count whose kernel takes rows of `width` (fp8.held_chunks picks the
    smallest; the larger ones must give the same bits with chunks past the row idle)."""
    return [c for c in counts if c * 256 * 8 >= width]


@pytest.mark.parametrize("k", [64, 8 * 50, 2048, 2048 + 8, 4096, 4096 + 64, 8192])
def test_held_norm_and_quantize_kernels_give_the_generic_kernels_bits(lib, k):
    rows = 3
    rng = np.random.default_rng(k + 7)
    x = _bf16(rng.standard_normal((rows, k)) * rng.uniform(0.01, 100, (rows, 1)))
    x[0, :] = 0.0  # a zero row: the amax floor
    x[-1, 3] = _bf16(np.float32(3e38))  # saturation
    w = _bf16(rng.uniform(0.2, 2.0, k))
    y = _bf16(rng.standard_normal((rows, k)) * 2000)
    xs = rng.uniform(1e-3, 1e-1, rows).astype(np.float32)
    ws = rng.uniform(1e-4, 1e-2, k).astype(np.float32)
    xb, wb, yb = _bits(x), _bits(w), _bits(y)
    ld = k + 16
    strided = np.zeros((rows, ld), np.uint16)
    strided[:, :k] = xb
    grid = (rows, 1, 1, 256, 0)

    def norm(name, *tail):
        q, s, _ = _outputs(rows, k, None)
        assert getattr(lib, name)(*grid, _p(xb), _p(wb), 1e-6, _p(q), _p(s), k, *tail) == 0
        return q, s

    def quantize(name, *tail):
        q, s, _ = _outputs(rows, k, None)
        assert getattr(lib, name)(*grid, _p(strided), ld, _p(q), _p(s), k, *tail) == 0
        return q, s

    def add_norm(name):
        r, (q, s, _) = xb.copy(), _outputs(rows, k, None)
        assert getattr(lib, name)(*grid, _p(r), _p(yb), _p(xs), _p(ws), _p(wb), 1e-6, _p(q), _p(s), k) == 0
        return r, q, s

    want_norm = norm("sim_rms_norm_quant_k", 0, rows)
    want_quantize = quantize("sim_quantize_rows_k", 0, rows)
    want_add_norm = add_norm("sim_add_scaled_rms_norm_quant_k")
    counts = _held_counts(k, _NORM_CHUNKS)
    assert counts, "no held kernel takes this width"
    for c in counts:
        for got, want in [(norm(f"sim_rms_norm_quant_held{c}_k"), want_norm),
                          (quantize(f"sim_quantize_rows_held{c}_k"), want_quantize),
                          (add_norm(f"sim_add_scaled_rms_norm_quant_held{c}_k"), want_add_norm)]:
            for g, w_ in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w_)
    np.testing.assert_array_equal(want_quantize[0], f8.quantize(x, None)[0].view(np.uint8))


@pytest.mark.parametrize("inter", [8 * 50, 4096, 4096 + 8, 8192, 12288, 12288 + 64, 16384])
def test_held_silu_mul_kernels_give_the_generic_kernels_bits(lib, inter):
    rows = 2
    rng = np.random.default_rng(inter)
    x = _bf16(rng.standard_normal((rows, 2 * inter)) * 3)
    x[0, :] = 0.0
    y = _bf16(rng.standard_normal((rows, 2 * inter)) * 2000)
    xs = rng.uniform(1e-3, 1e-1, rows).astype(np.float32)
    ws = (rng.uniform(1e-4, 1e-2, 2 * inter) * np.linspace(1, 3, 2 * inter)).astype(np.float32)
    xb, yb = _bits(x), _bits(y)
    grid = (rows, 1, 1, 256, 0)

    def silu(name, *tail):
        q, s, _ = _outputs(rows, inter, None)
        assert getattr(lib, name)(*grid, _p(xb), _p(q), _p(s), inter, *tail) == 0
        return q, s

    def scaled(name):
        q, s, _ = _outputs(rows, inter, None)
        assert getattr(lib, name)(*grid, _p(yb), _p(xs), _p(ws), _p(q), _p(s), inter) == 0
        return q, s

    want_silu, want_scaled = silu("sim_silu_mul_quant_k", 0, rows), scaled("sim_silu_mul_quant_scaled_k")
    for c in _held_counts(inter, _SILU_CHUNKS):
        for got, want in [(silu(f"sim_silu_mul_quant_held{c}_k"), want_silu),
                          (scaled(f"sim_silu_mul_quant_scaled_held{c}_k"), want_scaled)]:
            for g, w_ in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w_)
    assert np.all(want_silu[0][0] == 0) and not np.all(want_silu[0][1] == 0)


def test_held_chunks_picks_the_smallest_kernel_that_holds_the_row():
    from vt.kernels.quantized import HELD_NORM_CHUNKS, HELD_SILU_CHUNKS, held_chunks

    assert (HELD_NORM_CHUNKS, HELD_SILU_CHUNKS) == (_NORM_CHUNKS, _SILU_CHUNKS)
    norms = [held_chunks(w, HELD_NORM_CHUNKS) for w in (8, 2048, 2056, 4096, 6144, 8192, 8200)]
    assert norms == [1, 1, 2, 2, 4, 4, 0]
    silus = [held_chunks(w, HELD_SILU_CHUNKS) for w in (400, 9728, 12288, 14336, 16384, 16392)]
    assert silus == [2, 6, 6, 8, 8, 0]
