"""gemv.cu (the decode GEMVs: 1-16 tokens against a bf16 or fp8 weight, on mma.sync) run on the host
simulator in tests/cuda_sim and matched against the numpy twins: the bf16 product in f32 and
numpy_fp8.scaled_gemm. The shapes reach every path a launch can take: one chunk (most warps idle),
rows past a block of 16, warps whose last round of chunks is short, the second token tile part
filled, block scales over a short last 128-row block, the residual add, a bias, strided inputs."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_sim import SimUnavailable, build_kernels
from tests.cuda_sim import bf16_bits as _bits
from vt.kernels import numpy_fp8 as f8

_P, _I = ctypes.c_void_p, ctypes.c_int
_FP8 = ("const unsigned char* xq, const float* xs, int xs_ld, const unsigned char* wq, const float* ws, "
        "int ws_ld, bf16_t* y, int ldy, int tokens, int n, int k, int block, int accumulate",
        "xq, xs, xs_ld, wq, ws, ws_ld, y, ldy, tokens, n, k, block, accumulate",
        [_P, _P, _I, _P, _P, _I, _P, _I, _I, _I, _I, _I, _I])
_BF16 = ("const bf16_t* x, int ldx, const bf16_t* w, const bf16_t* bias, bf16_t* y, int ldy, int tokens, "
         "int n, int k, int accumulate", "x, ldx, w, bias, y, ldy, tokens, n, k, accumulate",
         [_P, _I, _P, _P, _P, _I, _I, _I, _I, _I])
_KERNELS = {"gemv_fp8_8_k": _FP8, "gemv_fp8_16_k": _FP8, "gemv_bf16_8_k": _BF16, "gemv_bf16_16_k": _BF16}


@pytest.fixture(scope="module")
def lib():
    try:
        return build_kernels("gemv.cu", _KERNELS)
    except SimUnavailable as e:
        pytest.skip(str(e))


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def _launch(lib, kernel: str, tokens: int, n: int, *args) -> None:
    name = f"sim_{kernel}_{8 if tokens <= 8 else 16}_k"
    assert getattr(lib, name)(-(-n // 16), 1, 1, 256, 0, *args) == 0


def _output(rng, tokens: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """y on a wider row stride than n, filled with values the kernel must add to or leave."""
    ldy = n + 24
    base = _bf16(rng.standard_normal((tokens, ldy)))
    return base, _bits(base), ldy


def _check(y: np.ndarray, base: np.ndarray, want: np.ndarray, n: int, accumulate: bool) -> None:
    got = y.view(ml_dtypes.bfloat16).astype(np.float32)
    expect = want + base[:, :n] if accumulate else want
    np.testing.assert_allclose(got[:, :n], expect, rtol=1e-2, atol=1e-2 * np.abs(expect).max())
    np.testing.assert_array_equal(got[:, n:], base[:, n:])  # nothing past the weight's rows


SHAPES = [(1, 16, 64), (3, 40, 64 * 37), (8, 32, 512), (13, 48, 256 * 5), (5, 136, 128 * 9), (16, 16, 384)]


@pytest.mark.parametrize(("tokens", "n", "k"), SHAPES)
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_fp8_gemv_matches_the_scaled_gemm(lib, tokens, n, k, block, accumulate):
    if block and k % 128:
        k *= 2
    rng = np.random.default_rng(tokens * n + k)
    x = _bf16(rng.standard_normal((tokens, k)) * rng.uniform(0.1, 10, (tokens, 1)))
    w = _bf16(rng.standard_normal((n, k)) * rng.uniform(0.01, 1, (n, 1)))
    xq, xs = f8.quantize(x, 128 if block else None)
    wq, ws = f8.quantize_weight_block(w) if block else f8.quantize_weight_channel(w)
    want = f8.scaled_gemm(xq, xs, wq, ws)
    # CUDA's layouts: block activation scales group-major over 4-padded rows, each row of block
    # weight scales padded to a multiple of 4
    if block:
        pad_rows = -(-tokens // 4) * 4
        xs_c = np.zeros((xs.shape[1], pad_rows), np.float32)
        xs_c[:, :tokens] = xs.T
        ws_c = np.zeros((ws.shape[0], -(-ws.shape[1] // 4) * 4), np.float32)
        ws_c[:, : ws.shape[1]] = ws
        xs_ld, ws_ld = pad_rows, ws_c.shape[1]
    else:
        xs_c, ws_c, xs_ld, ws_ld = np.ascontiguousarray(xs[:, 0]), ws, 0, 0
    base, y, ldy = _output(rng, tokens, n)
    xq_b, wq_b = xq.view(np.uint8), wq.view(np.uint8)
    _launch(lib, "gemv_fp8", tokens, n, xq_b.ctypes.data, xs_c.ctypes.data, xs_ld, wq_b.ctypes.data,
            ws_c.ctypes.data, ws_ld, y.ctypes.data, ldy, tokens, n, k, int(block), int(accumulate))
    _check(y, base, want, n, accumulate)


@pytest.mark.parametrize(("tokens", "n", "k"), [(1, 16, 32), *SHAPES])
@pytest.mark.parametrize(("accumulate", "bias"), [(False, False), (False, True), (True, False)])
def test_bf16_gemv_matches_the_f32_product(lib, tokens, n, k, accumulate, bias):
    rng = np.random.default_rng(tokens * n + k + 1)
    ldx = k + 8  # a strided input (16-byte aligned rows), as a fused projection's slice is
    x = _bf16(rng.standard_normal((tokens, ldx)))
    w = _bf16(rng.standard_normal((n, k)) * 0.05)
    b = _bf16(rng.standard_normal(n)) if bias else None
    want = x[:, :k] @ w.T + (b if bias else 0.0)
    base, y, ldy = _output(rng, tokens, n)
    xb, wb = _bits(x), _bits(w)
    bb = _bits(b) if bias else None
    _launch(lib, "gemv_bf16", tokens, n, xb.ctypes.data, ldx, wb.ctypes.data,
            None if bb is None else bb.ctypes.data, y.ctypes.data, ldy, tokens, n, k, int(accumulate))
    _check(y, base, want, n, accumulate)
