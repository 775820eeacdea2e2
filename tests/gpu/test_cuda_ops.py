"""CudaBackend against the float32 NumpyBackend on fresh random inputs (bf16 tolerances), plus the
async plumbing: slots, arenas, events and CUDA graph capture with replay."""

from __future__ import annotations

import zlib

import ml_dtypes
import numpy as np
import pytest

from tests.gpu.launches import record_launches
from vt.kernels import numpy_sampling
from vt.kernels.attention_plan import FALLBACK_PREFILL_TILING, KV8_SUFFIX, PREFILL_TILINGS, QK8_KERNEL
from vt.kernels.numpy_fp8 import to_e4m3
from vt.kernels.numpy_ops import NumpyBackend

pytestmark = pytest.mark.gpu

BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def cb():
    from vt.kernels.cuda_ops import CudaBackend

    return CudaBackend(workspace_bytes=256 << 20)


@pytest.fixture(scope="module")
def nb():
    return NumpyBackend()


@pytest.fixture
def rng(request):
    # crc32, not hash(): str hashes change from run to run, and a failure must reproduce
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


@pytest.fixture(scope="module")
def shared_cases():
    """Inputs and numpy references made once per case and checked by every tiling that runs it:
    the reference of a 2k prompt takes numpy ~15 s, and eight tilings run each case."""
    return {}


def _shared_case(cache: dict, make, *key):
    """make(rng) -> (inputs, reference) for `key`, from a seed of the key alone (the tiling is not
    part of it, so each tiling sees the same batch), made at its first use."""
    key = tuple(tuple(k) if isinstance(k, list) else k for k in key)
    if key not in cache:
        cache[key] = make(np.random.default_rng(zlib.crc32(repr(key).encode())))
    return cache[key]


def bf16(x: np.ndarray) -> np.ndarray:
    """float32 values exactly representable in bf16 (what both backends then see)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def poison(cb, i: int = 0) -> None:
    """Fill slot i's arena with 0xFF bytes: NaN in bf16 and f32, -1 in i32."""
    import cupy

    cb._slots[i].arena.buf.fill(255)
    cupy.cuda.Device().synchronize()  # the fill ran on the default stream, the slots do not wait for it


def act(cb, x: np.ndarray):
    return cb.from_host(bf16(x), "act")


# ---- memory ----------------------------------------------------------------------------------


def test_upload_accepts_float_dtypes_and_rounds_like_ml_dtypes(cb, rng):
    x = rng.standard_normal((7, 24)).astype(np.float32)
    want = bf16(x)
    for host in (
        x,
        x.astype(np.float16),
        x.astype(ml_dtypes.bfloat16),
        x.astype(ml_dtypes.bfloat16).view(np.uint16),
    ):
        got = cb.to_host(cb.upload(host))
        np.testing.assert_array_equal(
            got, bf16(host.astype(np.float32)) if host.dtype == np.float16 else want
        )
    assert cb.to_host(cb.zeros((3, 8), "act")).dtype == np.float32
    np.testing.assert_array_equal(cb.to_host(cb.from_host(np.arange(5), "i32")), np.arange(5))
    with pytest.raises(ValueError):
        cb.zeros((2,), "f64")


def test_pinned_copies_round_trip_on_a_slot_stream(cb, rng):
    src = cb.pinned_empty((10,), np.int32)
    src[:] = rng.integers(0, 1000, 10)
    dev = cb.zeros((16,), "i32")
    back = cb.pinned_empty((16,), np.int32)
    back[:] = -7
    with cb.slot(1):
        cb.copy_h2d(dev, src)
        cb.copy_d2h(back, dev)
        cb.record(1)
    cb.wait(1)
    assert cb.done(1)
    np.testing.assert_array_equal(back[:10], src)
    np.testing.assert_array_equal(back[10:], 0)


# ---- model ops -------------------------------------------------------------------------------


def test_embed_and_gather_rows(cb, nb, rng):
    table = bf16(rng.standard_normal((50, 64)))
    ids = rng.integers(0, 50, 33).astype(np.int32)
    poison(cb)
    with cb.slot(0):
        out = cb.embed(cb.from_host(ids, "i32"), cb.from_host(table, "act"))
        rows = cb.gather_rows(out, cb.from_host(np.array([3, 0, 32], np.int32), "i32"))
        got, got_rows = cb.to_host(out), cb.to_host(rows)
    np.testing.assert_array_equal(got, nb.embed(ids, table))
    np.testing.assert_array_equal(got_rows, got[[3, 0, 32]])


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(cb, nb, rng, with_residual):
    t, h = 37, 1024
    x, res, w = (
        bf16(rng.standard_normal((t, h))),
        bf16(rng.standard_normal((t, h))),
        bf16(rng.random(h) + 0.5),
    )
    poison(cb)
    with cb.slot(0):
        y, r = cb.rms_norm(act(cb, x), act(cb, w), 1e-6, act(cb, res) if with_residual else None)
        y, r = cb.to_host(y), cb.to_host(r)
    ry, rr = nb.rms_norm(x, w, 1e-6, res if with_residual else None)
    assert rel_err(y, ry) < BF16_TOL
    assert rel_err(r, rr) < BF16_TOL


def test_head_rms_norm_on_a_strided_view(cb, nb, rng):
    t, hq, hk, d = 9, 4, 2, 128
    qkv = bf16(rng.standard_normal((t, (hq + 2 * hk) * d)))
    w = bf16(rng.random(d) + 0.5)
    dev = act(cb, qkv)
    k_view = dev[:, hq * d : (hq + hk) * d].reshape(t, hk, d)
    got = cb.to_host(cb.head_rms_norm(k_view, act(cb, w), 1e-6))
    ref = nb.head_rms_norm(qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d), w, 1e-6)
    assert rel_err(got, ref) < BF16_TOL


def test_linear_with_bias_and_logits(cb, nb, rng):
    t, k, n = 45, 512, 776
    x, w, b = (
        bf16(rng.standard_normal((t, k))),
        bf16(rng.standard_normal((n, k)) * 0.05),
        bf16(rng.standard_normal(n)),
    )
    poison(cb)
    with cb.slot(0):
        y = cb.to_host(cb.linear(act(cb, x), act(cb, w), act(cb, b)))
        y0 = cb.to_host(cb.linear(act(cb, x), act(cb, w), None))
        lg = cb.logits(act(cb, x), act(cb, w))
        assert lg.dtype == np.float32
        lg = cb.to_host(lg)
    assert rel_err(y, nb.linear(x, w, b)) < BF16_TOL
    assert rel_err(y0, nb.linear(x, w, None)) < BF16_TOL
    # f32 output of the same bf16 operands: only accumulation order differs from float32 numpy
    assert rel_err(lg, nb.logits(x, w)) < 1e-4


def test_linear_residual_adds_into_the_residual_and_fold_norm_weight(cb, nb, rng):
    """The residual add inside the projection (one rounding of GEMM + residual) and a norm
    weight folded into a projection's columns, both against numpy."""
    t, k, n = 37, 768, 512
    x, w, res = bf16(rng.standard_normal((t, k))), bf16(rng.standard_normal((n, k)) * 0.05), \
        bf16(rng.standard_normal((t, n)) * 4)
    poison(cb)
    with cb.slot(0):
        r = act(cb, res)
        cb.linear_residual(act(cb, x), act(cb, w), r)
        got = cb.to_host(r)
    ref = res.copy()
    nb.linear_residual(x, w, ref)
    assert rel_err(got, ref) < BF16_TOL
    assert rel_err(got - res, ref - res) < BF16_TOL  # the GEMM part itself, not just the residual
    with pytest.raises(ValueError, match="residual"):
        cb.linear_residual(act(cb, x), act(cb, w), act(cb, res[:, :256]))
    norm = bf16(rng.uniform(0.2, 2.0, k))
    wd = act(cb, w)
    cb.fold_norm_weight(wd, act(cb, norm))
    folded = w.copy()
    nb.fold_norm_weight(folded, norm)
    np.testing.assert_array_equal(cb.to_host(wd), bf16(folded))  # one product, rounded once


@pytest.mark.parametrize("t", [1, 2, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("n,k", [(776, 512), (512, 96), (3072, 512)])
def test_decode_rows_run_the_gemv_and_match_numpy(cb, nb, rng, t, n, k, monkeypatch):
    """Steps of up to 16 tokens (both GEMV kernels) take gemv.cu for row-major weights (strided
    rows, a bias, the residual add); a column-major weight and 17 rows stay on cuBLAS. Both against
    numpy."""
    monkeypatch.setattr(cb, "gemv_max_tokens", 16)
    x = bf16(rng.standard_normal((t, k + 32)))
    w, b = bf16(rng.standard_normal((n, k)) / np.sqrt(k)), bf16(rng.standard_normal(n))
    res = bf16(rng.standard_normal((t, n)))  # as large as the product: its rounding does not hide it
    poison(cb)
    laid = cb.gemm_layout(act(cb, w))
    xd = act(cb, x)[:, 32:]  # rows 16-byte aligned, on a stride wider than k
    assert cb._bf16_gemv_fits(xd, laid) == (t <= 16 and laid.flags.c_contiguous)
    with cb.slot(0):
        y = cb.to_host(cb.linear(xd, laid, act(cb, b)))
        r = act(cb, res)
        cb.linear_residual(xd, laid, r)
        got = cb.to_host(r)
    assert rel_err(y, nb.linear(x[:, 32:], w, b)) < BF16_TOL
    ref = res.copy()
    nb.linear_residual(x[:, 32:], w, ref)
    assert rel_err(got - res, ref - res) < BF16_TOL


@pytest.mark.parametrize("n,k", [(3072, 512), (512, 768)])
def test_gemm_layout_keeps_linear_and_linear_residual(cb, nb, rng, n, k):
    """A wide weight comes back column-major, others as they were; linear and linear_residual
    read either order to the same product as numpy."""
    from vt.kernels.gemm import COLUMN_MAJOR_MIN_ASPECT as aspect

    t = 33
    x, w, res = bf16(rng.standard_normal((t, k))), bf16(rng.standard_normal((n, k)) * 0.05), \
        bf16(rng.standard_normal((t, n)) * 4)
    wd = act(cb, w)
    laid = cb.gemm_layout(wd)
    assert (laid is wd) == (n < aspect * k)
    assert laid.flags.f_contiguous == (n >= aspect * k)
    np.testing.assert_array_equal(cb.to_host(laid), w)
    with cb.slot(0):
        y = cb.to_host(cb.linear(act(cb, x), laid, None))
        r = act(cb, res)
        cb.linear_residual(act(cb, x), laid, r)
        got = cb.to_host(r)
    assert rel_err(y, nb.linear(x, w, None)) < BF16_TOL
    ref = res.copy()
    nb.linear_residual(x, w, ref)
    assert rel_err(got - res, ref - res) < BF16_TOL


def test_linear_matches_cupy_gemmex_and_strided_rows(cb, rng):
    import cupy
    from cupy_backends.cuda.libs import cublas

    t, k, n = 64, 256, 384
    x, w = bf16(rng.standard_normal((t, 2 * k))), bf16(rng.standard_normal((n, k)))
    xd, wd = act(cb, x), act(cb, w)
    x_view = xd[:, k:]  # row stride 2k: passed to cuBLAS as lda
    got = cb.to_host(cb.linear(x_view, wd, None))
    ref_dev = cupy.empty((t, n), dtype=np.uint16)
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    xc = cupy.ascontiguousarray(x_view)
    cublas.gemmEx(
        cupy.cuda.device.get_cublas_handle(),
        1,
        0,
        n,
        t,
        k,
        one.ctypes.data,
        wd.data.ptr,
        14,
        k,
        xc.data.ptr,
        14,
        k,
        zero.ctypes.data,
        ref_dev.data.ptr,
        14,
        n,
        68,
        -1,
    )
    ref = cb.to_host(ref_dev)
    assert rel_err(got, ref) < 1e-3
    assert rel_err(got, x[:, k:] @ w.T) < BF16_TOL


def test_rope_in_place_on_strided_views(cb, nb, rng):
    t, hq, hk, d = 11, 4, 2, 64
    qkv = bf16(rng.standard_normal((t, (hq + 2 * hk) * d)))
    pos = rng.integers(0, 4000, t).astype(np.int32)
    inv_freq = (1.0 / (10000.0 ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    dev = act(cb, qkv)
    q = dev[:, : hq * d].reshape(t, hq, d)
    k = dev[:, hq * d : (hq + hk) * d].reshape(t, hk, d)
    cb.rope(q, k, cb.from_host(pos, "i32"), cb.from_host(inv_freq, "f32"))
    got = cb.to_host(dev)
    ref = qkv.copy()
    rq = ref[:, : hq * d].reshape(t, hq, d).copy()
    rk = ref[:, hq * d : (hq + hk) * d].reshape(t, hk, d).copy()
    nb.rope(rq, rk, pos, inv_freq)
    assert rel_err(got[:, : hq * d], rq.reshape(t, -1)) < BF16_TOL
    assert rel_err(got[:, hq * d : (hq + hk) * d], rk.reshape(t, -1)) < BF16_TOL
    np.testing.assert_array_equal(got[:, (hq + hk) * d :], qkv[:, (hq + hk) * d :])  # v untouched


def test_write_kv_skips_negative_slots(cb, nb, rng):
    t, hk, d, nblk, bs = 13, 2, 64, 6, 4
    k, v = bf16(rng.standard_normal((t, hk, d))), bf16(rng.standard_normal((t, hk, d)))
    slots = rng.permutation(nblk * bs)[:t].astype(np.int32)
    slots[[2, 7]] = -1
    kc0, vc0 = bf16(rng.standard_normal((nblk, bs, hk, d))), bf16(rng.standard_normal((nblk, bs, hk, d)))
    kc, vc = act(cb, kc0), act(cb, vc0)
    cb.write_kv(act(cb, k), act(cb, v), kc, vc, cb.from_host(slots, "i32"))
    rk, rv = kc0.copy(), vc0.copy()
    nb.write_kv(k, v, rk, rv, slots)
    np.testing.assert_array_equal(cb.to_host(kc), rk)
    np.testing.assert_array_equal(cb.to_host(vc), rv)


def _prologue_case(rng, d, t=9, hq=8, hk=2, nblk=4, bs=4) -> dict:
    """Random inputs of the attention prologue: qkv rows, positions, frequencies, cache slots
    (one padding slot), head-norm weights, a cache to start from, and q/k/v views of a buffer."""
    slots = rng.permutation(nblk * bs)[:t].astype(np.int32)
    slots[3] = -1

    def views(buf):
        return (buf[:, : hq * d].reshape(t, hq, d), buf[:, hq * d : (hq + hk) * d].reshape(t, hk, d),
                buf[:, (hq + hk) * d :].reshape(t, hk, d))

    return dict(
        t=t, hq=hq, hk=hk, d=d, nblk=nblk, bs=bs, slots=slots, views=views,
        qkv=bf16(rng.standard_normal((t, (hq + 2 * hk) * d)) * 3),
        pos=rng.integers(0, 4000, t).astype(np.int32),
        inv_freq=(1.0 / (1e6 ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32),
        qw=bf16(rng.uniform(0.5, 1.5, d)), kw=bf16(rng.uniform(0.5, 1.5, d)),
        cache0=bf16(rng.standard_normal((nblk, bs, hk, d))),
    )


@pytest.mark.parametrize("with_norm,d,shape", [
    (True, 128, {}), (False, 64, {}), (True, 256, {}), (True, 96, {}), (True, 32, {}),
    # a token's rows split over three blocks; 700 tokens at one block each, three rows a group
    (True, 128, dict(hq=32, hk=8)), (True, 128, dict(t=700, hq=32, hk=8, nblk=200)),
])
def test_fused_prologue_equals_norm_rope_write_kv(cb, nb, rng, with_norm, d, shape):
    """One launch for head norms, rope and the cache write: bit for bit the three CUDA ops, and
    within bf16 of numpy; padding slots (-1) leave the cache alone."""
    c = _prologue_case(rng, d, **shape)
    qkv, pos, inv_freq, slots, cache0, views = c["qkv"], c["pos"], c["inv_freq"], c["slots"], c["cache0"], \
        c["views"]
    dev_pos, dev_slots = cb.from_host(pos, "i32"), cb.from_host(slots, "i32")
    dev_freq = cb.from_host(inv_freq, "f32")
    norms = (act(cb, c["qw"]), act(cb, c["kw"])) if with_norm else (None, None)
    fused, kc, vc = act(cb, qkv), act(cb, cache0), act(cb, cache0)
    cb.qk_norm_rope_write_kv(*views(fused), *norms, 1e-6, dev_pos, dev_freq, kc, vc, dev_slots)
    three, kc3, vc3 = act(cb, qkv), act(cb, cache0), act(cb, cache0)
    q3, k3, v3 = views(three)
    if with_norm:
        q3[...] = cb.head_rms_norm(q3, norms[0], 1e-6)
        k3[...] = cb.head_rms_norm(k3, norms[1], 1e-6)
    cb.rope(q3, k3, dev_pos, dev_freq)
    cb.write_kv(k3, v3, kc3, vc3, dev_slots)
    for a, b in ((fused, three), (kc, kc3), (vc, vc3)):
        np.testing.assert_array_equal(cb.to_host(a), cb.to_host(b))
    ref, rkc, rvc = qkv.copy(), cache0.copy(), cache0.copy()
    nb.qk_norm_rope_write_kv(*views(ref), *((c["qw"], c["kw"]) if with_norm else (None, None)), 1e-6, pos,
                             inv_freq, rkc, rvc, slots)
    assert rel_err(cb.to_host(fused), ref) < BF16_TOL
    assert rel_err(cb.to_host(kc), rkc) < BF16_TOL
    np.testing.assert_array_equal(cb.to_host(vc), rvc)


@pytest.mark.parametrize("with_norm,d,with_bias", [(True, 128, False), (False, 64, True), (True, 72, True)])
def test_prologue_scales_by_the_folded_input_norm(cb, nb, rng, with_norm, d, with_bias):
    """rms_of (and bias): q, k, v rows scaled by their token's rsqrt(mean square) and biased
    before the head norms, the scaled v in the cache and in v; d=72 takes the three-op path."""
    c = _prologue_case(rng, d)
    t, hq, hk, slots, cache0, views = c["t"], c["hq"], c["hk"], c["slots"], c["cache0"], c["views"]
    qkv, width, cells = c["qkv"], (hq + 2 * hk) * d, c["nblk"] * c["bs"]
    r = bf16(rng.standard_normal((t, 320)) * rng.uniform(0.1, 30, (t, 1)))
    bias = bf16(rng.standard_normal(width)) if with_bias else None
    fused, kc, vc = act(cb, qkv), act(cb, cache0), act(cb, cache0)
    norms = (act(cb, c["qw"]), act(cb, c["kw"])) if with_norm else (None, None)
    cb.qk_norm_rope_write_kv(*views(fused), *norms, 1e-6, cb.from_host(c["pos"], "i32"),
                             cb.from_host(c["inv_freq"], "f32"), kc, vc, cb.from_host(slots, "i32"),
                             rms_of=act(cb, r), bias=None if bias is None else act(cb, bias))
    ref, rkc, rvc = qkv.copy(), cache0.copy(), cache0.copy()
    nb.qk_norm_rope_write_kv(*views(ref), *((c["qw"], c["kw"]) if with_norm else (None, None)), 1e-6,
                             c["pos"], c["inv_freq"], rkc, rvc, slots, rms_of=r, bias=bias)
    got = cb.to_host(fused)
    for part in (slice(0, hq * d), slice(hq * d, (hq + hk) * d), slice((hq + hk) * d, width)):
        assert rel_err(got[:, part], ref[:, part]) < BF16_TOL
    assert rel_err(cb.to_host(kc), rkc) < BF16_TOL
    assert rel_err(cb.to_host(vc), rvc) < BF16_TOL
    untouched = np.setdiff1d(np.arange(cells), slots[slots >= 0])
    np.testing.assert_array_equal(cb.to_host(vc).reshape(cells, hk, d)[untouched],
                                  cache0.reshape(cells, hk, d)[untouched])


def _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, bs, extra_blocks=3):
    """Random q and caches with each sequence's blocks drawn from a shuffled pool; table padding
    holds an out-of-range block id that attention must never read."""
    need = [-(-c // bs) for c in ctx_lens]
    nblk = sum(need) + extra_blocks
    pool = list(rng.permutation(nblk))
    width = max(need) + 1
    table = np.full((len(q_lens), width), 10**6, np.int32)
    for b, n in enumerate(need):
        table[b, :n] = [pool.pop() for _ in range(n)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = bf16(rng.standard_normal((int(qsl[-1]), hq, d)))
    kc = bf16(rng.standard_normal((nblk, bs, hk, d)))
    vc = bf16(rng.standard_normal((nblk, bs, hk, d)))
    return q, kc, vc, qsl, np.asarray(ctx_lens, np.int32), table


@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hk,d",
    [
        ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2, 128),  # prefill, decode, chunked prefill, decode
        ([1] * 6, [3000, 17, 1, 513, 64, 2048], 16, 8, 128),  # decode with split keys
        ([1, 1], [5000, 4100], 32, 8, 128),  # tiny batch, long contexts: many splits
        ([70, 33], [70, 100], 4, 4, 64),  # no GQA, head dim 64, multi-tile prefill
        ([3, 2], [20, 9], 8, 1, 256),  # head dim 256, MQA
        ([300, 1, 129], [300, 700, 1000], 32, 8, 128),  # many row and key tiles, chunked prefill
        ([4, 1, 2], [30, 100, 70], 16, 4, 128),  # short query spans through the 16-row decode tiles
        ([1] * 3, [64, 65, 128], 16, 8, 64),  # key counts on and just past tile edges, head dim 64
        ([1] * 5, [1, 15, 16, 17, 2500], 64, 8, 128),  # group 8 fills the 8-row transposed tiles
        ([3, 4, 1, 2], [40, 130, 77, 2], 4, 2, 128),  # several tokens per 8-row tile, causal inside
        ([1, 1, 1], [100, 1, 300], 4, 4, 64),  # no GQA: one row per transposed tile
        ([1] * 2, [9000, 33], 8, 1, 128),  # MQA, group 8, long context: split keys
    ],
)
def test_attention_ragged_paged(cb, nb, rng, q_lens, ctx_lens, hq, hk, d):
    bs = 16
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, bs)
    scale = d**-0.5
    args = (qsl, seq_lens, table, scale, max(q_lens), max(ctx_lens))
    ref = nb.attention(q, kc, vc, *args)
    poison(cb)
    with cb.slot(0):
        dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
        out = cb.attention(act(cb, q), act(cb, kc), act(cb, vc), *dev, scale, max(q_lens), max(ctx_lens))
        got = cb.to_host(out)
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (16, 1, 64), (16, 2, 256)])  # decode8, decode, r2
def test_decode_sized_for_a_long_context_over_short_ones(cb, nb, rng, hq, hk, d):
    """A decode launch sized for 16384 keys (a decode graph's max_model_len) over short contexts:
    many key splits, most past every key of a row, which the combine then skips
    (attention_plan.combine_key_tile; tests/cuda_sim checks it bit for bit against every split)."""
    q_lens, ctx_lens = [1] * 5, [1, 64, 65, 384, 2600]
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, 16)
    scale = d**-0.5
    ref = nb.attention(q, kc, vc, qsl, seq_lens, table, scale, 1, max(ctx_lens))
    poison(cb)
    with cb.slot(0):
        dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
        out = cb.attention(act(cb, q), act(cb, kc), act(cb, vc), *dev, scale, 1, 16384)
        got = cb.to_host(out)
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("tiling", sorted(PREFILL_TILINGS))
@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hk,d",
    [
        ([300, 1, 129], [300, 700, 1000], 32, 8, 128),  # chunked prefill beside a decode
        ([2048], [2048], 32, 8, 128),  # one long prompt: many row tiles, causal
        ([70, 33], [70, 100], 4, 4, 64),  # head dim 64, no GQA
        ([37, 5], [900, 5], 16, 2, 64),  # group 8, a chunk deep in its context
        ([64, 200], [3000, 200], 32, 8, 128),  # few blocks: split keys and their combine
    ],
)
def test_attention_prefill_tilings(cb, nb, shared_cases, tiling, q_lens, ctx_lens, hq, hk, d):
    """Every prefill tiling (attention_plan.PREFILL_TILINGS) against numpy; tests/cuda_sim
    checks the same kernels on the host, this on the device."""
    scale = d**-0.5

    def make(rng):
        batch = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, 16)
        return batch, nb.attention(*batch, scale, max(q_lens), max(ctx_lens))

    batch, ref = _shared_case(shared_cases, make, "bf16", q_lens, ctx_lens, hq, hk, d)
    q, kc, vc, qsl, seq_lens, table = batch
    before = cb.prefill_tiling
    cb.use_prefill_tiling(tiling)
    try:
        poison(cb)
        with cb.slot(0):
            dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
            out = cb.attention(act(cb, q), act(cb, kc), act(cb, vc), *dev, scale, max(q_lens), max(ctx_lens))
            got = cb.to_host(out)
    finally:
        cb.use_prefill_tiling(before)
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize("q_lens,ctx_lens", [
    ([1, 1, 1, 20], [3000, 50, 700, 4000]),  # both launches split keys; the combine of the
    ([1, 1, 7, 300], [17, 900, 7, 300]),     # second must leave the decodes' rows alone
])
def test_attention_with_decodes_first_into_out(cb, nb, rng, q_lens, ctx_lens):
    """decode_seqs: decodes on decode tiles, the rest in a second launch, into a given out whose
    rows of no sequence (padding after the last one) keep what they held."""
    hq, hk, d, bs, pad = 32, 8, 128, 16, 3
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, bs)
    t = q.shape[0]
    q = np.concatenate([q, bf16(rng.standard_normal((pad, hq, d)))])
    scale = d**-0.5
    ndec = sum(1 for n in q_lens if n == 1)
    args = (qsl, seq_lens, table, scale, max(q_lens), max(ctx_lens))
    ref = nb.attention(q, kc, vc, *args, decode_seqs=ndec)
    marker = bf16(np.full((t + pad, hq, d), 7.0))
    with cb.slot(0):
        dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
        out = act(cb, marker)
        cb.attention(act(cb, q), act(cb, kc), act(cb, vc), *dev, scale, max(q_lens), max(ctx_lens),
                     out=out, decode_seqs=ndec)
        got = cb.to_host(out)
    assert rel_err(got[:t], ref[:t]) < BF16_TOL
    assert (got[t:] == 7.0).all()
    with pytest.raises(ValueError, match="one query row"):
        nb.attention(q, kc, vc, *args, decode_seqs=ndec + 1)


@pytest.mark.parametrize("hq,hk,d", [(32, 8, 128), (16, 8, 64), (8, 1, 128)])
def test_attention_started_during_the_prologue_reads_what_it_wrote(cb, nb, rng, hq, hk, d):
    """follows_kv_write: attention launched as a dependent of qk_norm_rope_write_kv, eager and
    replayed from a graph, uses that op's q and new K/V (the new key in the first, second or a
    later key tile, split keys): bit for bit the plain launch, within bf16 of numpy."""
    bs, eps = 16, 1e-6
    ctx = [1, 2, 64, 65, 129, 3000, 17, 700]
    t, width = len(ctx), (hq + 2 * hk) * d
    _, kc0, vc0, qsl, seq_lens, table = _paged_batch(rng, [1] * t, ctx, hq, hk, d, bs)
    pos = (seq_lens - 1).astype(np.int32)
    slots = (table[np.arange(t), pos // bs] * bs + pos % bs).astype(np.int32)
    qkv = bf16(rng.standard_normal((t, width)) * 3)
    r = bf16(rng.standard_normal((t, 256)) * rng.uniform(0.1, 30, (t, 1)))
    inv_freq = (1.0 / (1e6 ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    qw, kw = bf16(rng.uniform(0.5, 1.5, d)), bf16(rng.uniform(0.5, 1.5, d))

    def views(buf):
        return (buf[:, : hq * d].reshape(t, hq, d), buf[:, hq * d : (hq + hk) * d].reshape(t, hk, d),
                buf[:, (hq + hk) * d :].reshape(t, hk, d))

    ref_qkv, rkc, rvc = qkv.copy(), kc0.copy(), vc0.copy()
    nb.qk_norm_rope_write_kv(*views(ref_qkv), qw, kw, eps, pos, inv_freq, rkc, rvc, slots, rms_of=r)
    ref = nb.attention(views(ref_qkv)[0], rkc, rvc, qsl, seq_lens, table, d**-0.5, 1, max(ctx))

    dev_qkv, kc, vc = act(cb, qkv), act(cb, kc0), act(cb, vc0)
    pristine = [act(cb, a) for a in (qkv, kc0, vc0)]
    consts = [cb.from_host(a, k) for a, k in ((pos, "i32"), (inv_freq, "f32"), (slots, "i32"))]
    dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
    weights = (act(cb, qw), act(cb, kw), act(cb, r))
    result = {}

    def step(follows: bool) -> None:
        q, k, v = views(dev_qkv)
        cb.qk_norm_rope_write_kv(q, k, v, weights[0], weights[1], eps, consts[0], consts[1], kc, vc,
                                 consts[2], rms_of=weights[2])
        result["out"] = cb.attention(q, kc, vc, *dev, d**-0.5, 1, max(ctx), follows_kv_write=follows)

    def reset() -> None:
        for a, b in zip((dev_qkv, kc, vc), pristine, strict=True):
            a[...] = b

    outs = {}
    for follows in (False, True):
        with cb.slot(0):
            reset()
            step(follows)
            outs[follows] = cb.to_host(result["out"])
    np.testing.assert_array_equal(outs[True], outs[False])
    assert rel_err(outs[True], ref) < BF16_TOL
    graph = cb.capture(0, lambda: step(True))
    for _ in range(5):
        with cb.slot(0):
            reset()
            graph.replay()
            got = cb.to_host(result["out"])
        np.testing.assert_array_equal(got, outs[False])


def test_attention_on_a_strided_q_view(cb, nb, rng):
    hq, hk, d, bs = 4, 2, 64, 8
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, [6, 1], [6, 30], hq, hk, d, bs)
    t = q.shape[0]
    wide = np.concatenate([q.reshape(t, -1), bf16(rng.standard_normal((t, 2 * hk * d)))], axis=1)
    q_view = act(cb, wide)[:, : hq * d].reshape(t, hq, d)
    dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
    got = cb.to_host(cb.attention(q_view, act(cb, kc), act(cb, vc), *dev, 0.125, 6, 30))
    assert rel_err(got, nb.attention(q, kc, vc, qsl, seq_lens, table, 0.125, 6, 30)) < BF16_TOL


@pytest.mark.parametrize("inter,t", [(384, 19), (3072, 19), (12288, 19), (3072, 600)])
def test_silu_mul(cb, nb, rng, inter, t):
    """A row split over several blocks (few tokens) and one block a row (a prompt's worth)."""
    x = bf16(rng.standard_normal((t, 2 * inter)) * 3)
    r = bf16(rng.standard_normal((t, 1024)) * rng.uniform(0.1, 30, (t, 1)))
    poison(cb)
    with cb.slot(0):
        got = cb.to_host(cb.silu_mul(act(cb, x)))
        scaled = cb.to_host(cb.silu_mul(act(cb, x), rms_of=act(cb, r), eps=1e-6))
    assert rel_err(got, nb.silu_mul(x)) < BF16_TOL
    assert rel_err(scaled, nb.silu_mul(x, rms_of=r, eps=1e-6)) < BF16_TOL


def test_fill_from_last_and_record_sampled(cb, nb, rng):
    ids = rng.integers(0, 100, 12).astype(np.int32)
    src = np.full(12, -1, np.int32)
    src[[1, 4, 9]] = [2, 0, 5]
    last = rng.integers(0, 100, 8).astype(np.int32)
    dev_ids = cb.from_host(ids, "i32")
    cb.fill_from_last(dev_ids, cb.from_host(src, "i32"), cb.from_host(last, "i32"))
    want = ids.copy()
    nb.fill_from_last(want, src, last)
    np.testing.assert_array_equal(cb.to_host(dev_ids), want)

    counts = rng.integers(0, 3, (8, 50)).astype(np.int32)
    rows = np.array([3, -1, 0, 7], np.int32)
    sampled = np.array([10, 11, 49, 0], np.int32)
    d_last, d_counts = cb.from_host(last, "i32"), cb.from_host(counts, "i32")
    cb.record_sampled(d_last, d_counts, cb.from_host(rows, "i32"), cb.from_host(sampled, "i32"))
    r_last, r_counts = last.copy(), counts.copy()
    nb.record_sampled(r_last, r_counts, rows, sampled)
    np.testing.assert_array_equal(cb.to_host(d_last), r_last)
    np.testing.assert_array_equal(cb.to_host(d_counts), r_counts)


# ---- sampling --------------------------------------------------------------------------------


def test_penalize_and_ban_match_exactly(cb, nb, rng):
    b, v, r = 5, 3000, 8
    logits = (rng.standard_normal((b, v)) * 4).astype(np.float32)
    counts = (rng.random((r, v)) < 0.05) * rng.integers(1, 4, (r, v))
    counts = counts.astype(np.int32)
    mask = (rng.random((r, v)) < 0.05).astype(np.uint8)
    rows = np.array([2, -1, 7, 0, 5], np.int32)
    pres = rng.random(b).astype(np.float32)
    freq = rng.random(b).astype(np.float32)
    rep = np.array([1.3, 1.5, 1.0, 0.8, 1.1], np.float32)
    ban = np.array([[1, -1], [2, 3], [-1, -1], [0, 2999], [5, 5]], np.int32)
    d = cb.from_host(logits, "f32")
    cb.penalize(
        d,
        *(
            cb.from_host(a, t)
            for a, t in (
                (rows, "i32"),
                (counts, "i32"),
                (mask, "u8"),
                (pres, "f32"),
                (freq, "f32"),
                (rep, "f32"),
            )
        ),
    )
    cb.ban_tokens(d, cb.from_host(ban, "i32"))
    ref = logits.copy()
    nb.penalize(ref, rows, counts, mask, pres, freq, rep)
    nb.ban_tokens(ref, ban)
    np.testing.assert_array_equal(cb.to_host(d), ref)


@pytest.mark.parametrize("v", [1000, 151936])
def test_apply_token_bitmask_matches_numpy(cb, nb, rng, v):
    """Structured outputs' mask: random bits (all-set and all-clear rows too), rows in any order
    with -1 skipped, a vocabulary that is not a multiple of 32; then sampling the masked logits
    picks only allowed tokens, as numpy does."""
    b, words = 7, -(-v // 32)
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, size=(5, words), dtype=np.int64).astype(np.int32)
    bitmask[1] = -1
    bitmask[3] = 0
    bitmask[3, 2] = 1 << 5  # one allowed token: 69
    rows = np.array([6, 0, -1, 2, 4], np.int32)
    d = cb.from_host(logits, "f32")
    cb.apply_token_bitmask(d, cb.from_host(bitmask, "i32"), cb.from_host(rows, "i32"))
    ref = logits.copy()
    nb.apply_token_bitmask(ref, bitmask, rows)
    np.testing.assert_array_equal(cb.to_host(d), ref)
    host = _rows(b, 1.0, 0, 1.0, 0.0, rng)
    got = _sample_cuda(cb, ref, host)
    np.testing.assert_array_equal(got, numpy_sampling.sample(ref, *host))
    assert got[2] == 69


@pytest.mark.parametrize("v", [1000, 151936])
def test_bias_logits_matches_numpy(cb, nb, rng, v):
    """logit_bias and allowed_token_ids: biased rows and exclusive rows (one with a single
    allowed token), a row skipped (-1), ids at both ends of the vocabulary; sampling the result
    then picks only allowed tokens, as numpy does."""
    b, cap = 6, 64
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    tokens = np.zeros((5, cap), np.int32)
    biases = np.zeros((5, cap), np.float32)
    lines = [np.sort(rng.choice(v, 40, replace=False)), np.array([0, 7, v - 1]), np.array([v - 1]),
             np.sort(rng.choice(v, cap, replace=False)), np.array([3])]
    for r, ids in enumerate(lines):
        tokens[r, : len(ids)] = ids
        biases[r, : len(ids)] = rng.uniform(-100, 100, len(ids))
    sel = np.array([[4, 0, 40, 0], [1, 1, 3, 1], [-1, 2, 1, 1], [2, 2, 1, 1], [0, 3, cap, 0], [5, 4, 1, 1]],
                   np.int32)
    d = cb.from_host(logits, "f32")
    cb.bias_logits(d, cb.from_host(sel, "i32"), cb.from_host(tokens, "i32"), cb.from_host(biases, "f32"))
    ref = logits.copy()
    nb.bias_logits(ref, sel, tokens, biases)
    np.testing.assert_allclose(cb.to_host(d), ref, rtol=1e-6, atol=1e-5)
    host = _rows(b, 1.0, 0, 1.0, 0.0, rng)
    got = _sample_cuda(cb, ref, host)
    np.testing.assert_array_equal(got, numpy_sampling.sample(ref, *host))
    assert got[2] == v - 1 and got[5] == 3 and got[1] in (0, 7, v - 1)


def test_log_softmax_topk(cb, nb, rng):
    b, v, k = 6, 5000, 7
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[2, [10, 20]] = logits[2].max() + 1  # an exact tie at the top: lower id first
    ids = rng.integers(0, v, b).astype(np.int32)
    poison(cb)
    with cb.slot(0):
        chosen, top_ids, top_lp = (
            cb.to_host(a)
            for a in cb.log_softmax_topk(cb.from_host(logits, "f32"), cb.from_host(ids, "i32"), k)
        )
    r_chosen, r_ids, r_lp = nb.log_softmax_topk(logits, ids, k)
    np.testing.assert_allclose(chosen, r_chosen, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(top_ids, r_ids)
    np.testing.assert_allclose(top_lp, r_lp, rtol=1e-5, atol=1e-4)
    with cb.slot(0):
        _, none_ids, _ = cb.log_softmax_topk(cb.from_host(logits, "f32"), cb.from_host(ids, "i32"), 0)
        assert none_ids.shape == (b, 0)


def _sampler_inputs(cb, rng, b, v, temperature, top_k, top_p, min_p):
    seeds = rng.integers(-(2**63), 2**63 - 1, b, dtype=np.int64)
    offsets = rng.integers(0, 500, b).astype(np.int32)
    host = (
        np.full(b, temperature, np.float32),
        np.full(b, top_k, np.int32),
        np.full(b, top_p, np.float32),
        np.full(b, min_p, np.float32),
        seeds,
        offsets,
    )
    kinds = ("f32", "i32", "f32", "f32", "i64", "i32")
    return host, tuple(cb.from_host(a, t) for a, t in zip(host, kinds))


def test_sample_greedy_with_clear_margin(cb, rng):
    b, v = 16, 32000
    logits = rng.standard_normal((b, v)).astype(np.float32)
    top = rng.integers(0, v, b)
    logits[np.arange(b), top] = logits.max(axis=1) + 2.0
    host, dev = _sampler_inputs(cb, rng, b, v, 0.0, 0, 1.0, 0.0)
    poison(cb)
    with cb.slot(0):
        got = cb.to_host(cb.sample(cb.from_host(logits, "f32"), *dev))
    np.testing.assert_array_equal(got, top)
    np.testing.assert_array_equal(got, numpy_sampling.sample(logits, *host))


def test_gumbel_noise_is_the_numpy_noise(cb, rng):
    # With equal logits the choice is the argmax of the noise alone, over every token id.
    b, v = 64, 4096
    logits = np.zeros((b, v), np.float32)
    host, dev = _sampler_inputs(cb, rng, b, v, 1.0, 0, 1.0, 0.0)
    got = cb.to_host(cb.sample(cb.from_host(logits, "f32"), *dev))
    want = np.argmax(numpy_sampling.gumbel_noise(host[4], host[5], v), axis=1)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "temperature,top_k,top_p,min_p",
    [(1.0, 0, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.3, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.8, 200, 0.8, 0.02)],
)
def test_seeded_sampling_matches_numpy(cb, rng, temperature, top_k, top_p, min_p):
    b, v = 48, 20000
    logits = (rng.standard_normal((b, v)) * 2.5).astype(np.float32)
    host, dev = _sampler_inputs(cb, rng, b, v, temperature, top_k, top_p, min_p)
    poison(cb)
    with cb.slot(0):
        got = cb.to_host(cb.sample(cb.from_host(logits, "f32"), *dev))
    want = numpy_sampling.sample(logits, *host)
    np.testing.assert_array_equal(got, want)


def test_sampling_respects_bans_and_top_k_one(cb, rng):
    b, v = 8, 1000
    logits = rng.standard_normal((b, v)).astype(np.float32)
    best = np.argmax(logits, axis=1)
    host, dev = _sampler_inputs(cb, rng, b, v, 1.0, 1, 1.0, 0.0)
    got = cb.to_host(cb.sample(cb.from_host(logits, "f32"), *dev))
    np.testing.assert_array_equal(got, best)  # top_k = 1 leaves only the max
    d = cb.from_host(logits, "f32")
    cb.ban_tokens(d, cb.from_host(best[:, None].astype(np.int32), "i32"))
    host, dev = _sampler_inputs(cb, rng, b, v, 1.0, 1, 1.0, 0.0)
    got = cb.to_host(cb.sample(d, *dev))
    assert not np.any(got == best)


def _rows(b, temperature, top_k, top_p, min_p, rng):
    """Per-row sampler parameters (scalars broadcast) with random seeds and offsets."""
    full = lambda x, dt: np.broadcast_to(np.asarray(x, dt), (b,)).copy()
    return (full(temperature, np.float32), full(top_k, np.int32), full(top_p, np.float32),
            full(min_p, np.float32), rng.integers(-(2**63), 2**63 - 1, b, dtype=np.int64),
            rng.integers(0, 500, b).astype(np.int32))


def _sample_cuda(cb, logits, host):
    kinds = ("f32", "i32", "f32", "f32", "i64", "i32")
    dev = tuple(cb.from_host(a, t) for a, t in zip(host, kinds))
    poison(cb)
    with cb.slot(0):
        return cb.to_host(cb.sample(cb.from_host(logits, "f32"), *dev))


def test_sampling_mixed_rows_full_vocab(cb, rng):
    """Every path in one batch at the real vocab size: greedy and plain rows split over blocks,
    filtered rows from their candidates, each row as numpy picks it."""
    v = 151936
    params = [  # temperature, top_k, top_p, min_p
        (0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.0), (1.0, 50, 1.0, 0.0),
        (0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.05), (0.6, 20, 0.8, 0.1), (1.2, 1000, 0.95, 0.0),
        (0.9, 1, 1.0, 0.0), (1.0, 0, 0.5, 0.02), (0.0, 50, 0.9, 0.0), (1.5, 300, 1.0, 0.0),
    ]
    b = len(params)
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    peaked = rng.integers(0, v, (b, 30))
    logits[np.arange(b)[:, None], peaked] += rng.uniform(8, 20, (b, 30)).astype(np.float32)  # LLM-like heads
    host = list(_rows(b, 1.0, 0, 1.0, 0.0, rng))
    for j, (t, k, p, m) in enumerate(params):
        host[0][j], host[1][j], host[2][j], host[3][j] = t, k, p, m
    got = _sample_cuda(cb, logits, host)
    np.testing.assert_array_equal(got, numpy_sampling.sample(logits, *host))


@pytest.mark.parametrize("v,top_k,temperature", [(151936, 50, 1.0), (151936, 5, 3.0), (20000, 200, 0.7),
                                                 (151936, 200, 1.0), (3000, 40, 1.0)])
def test_sampling_top_k_ties_at_the_boundary(cb, rng, v, top_k, temperature):
    """Logits on a coarse grid tie in groups; every token tied with the k-th value is kept."""
    b = 8
    step = 1.0 if top_k == 200 else 0.25
    logits = (np.round(rng.standard_normal((b, v)) * 2.5 / step) * step).astype(np.float32)
    host = _rows(b, temperature, top_k, 1.0, 0.0, rng)
    np.testing.assert_array_equal(_sample_cuda(cb, logits, host), numpy_sampling.sample(logits, *host))
    host = _rows(b, temperature, top_k, 1.0, 0.05, rng)
    np.testing.assert_array_equal(_sample_cuda(cb, logits, host), numpy_sampling.sample(logits, *host))


def test_sampling_top_k_ties_made_by_the_temperature(cb, rng):
    """Neighbouring raw logits that divide to one float: with the k-th value on such a pair, the
    raw value just below the k-th largest is kept too."""
    b, v, n = 6, 151936, 64
    logits = rng.standard_normal((b, v)).astype(np.float32)
    base = np.float32(15.0)  # top of its binade: after / t the float spacing is coarser than the run's
    run = base + np.arange(n, dtype=np.float32) * np.spacing(base)
    for r in range(b):
        logits[r, rng.permutation(v)[:n]] = run
    for t in (3.0, 1.3, 0.7):
        scaled = np.sort(run / np.float32(t))[::-1]
        ties = np.nonzero(scaled[:-1] == scaled[1:])[0]  # scaled[j] == scaled[j + 1]
        assert ties.size
        for k in (int(ties[0]) + 1, int(ties[ties.size // 2]) + 1, 10):
            host = _rows(b, t, k, 1.0, 0.0, rng)
            want = numpy_sampling.sample(logits, *host)
            np.testing.assert_array_equal(_sample_cuda(cb, logits, host), want)


@pytest.mark.parametrize("top_k", [0, 50])
def test_sampling_top_p_extremes(cb, rng, top_k):
    b, v = 16, 151936
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[np.arange(b), rng.integers(0, v, b)] += 6  # a clear top token
    for top_p in (1e-6, 1.0, 0.999, 0.3):
        host = _rows(b, 0.9, top_k, top_p, 0.0, rng)
        got = _sample_cuda(cb, logits, host)
        np.testing.assert_array_equal(got, numpy_sampling.sample(logits, *host))
        if top_p == 1e-6:
            np.testing.assert_array_equal(got, np.argmax(logits, axis=1))


def _pick_if_determined(scaled, noise, top_p, delta):
    """argmax of scaled + noise over the float64 nucleus, or None where moving top_p by +-delta
    changes the answer (a boundary float32 sums may round either way)."""
    e = np.exp(scaled.astype(np.float64) - scaled.max())
    order = np.argsort(-e, kind="stable")
    before = np.concatenate(([0.0], np.cumsum(e[order])[:-1])) / e.sum()
    picks = set()
    for p in (top_p - delta, top_p + delta):
        keep = np.zeros(scaled.shape[0], bool)
        keep[order[before < p]] = True
        picks.add(int(np.argmax(np.where(keep, scaled + noise, -np.inf))))
    return picks.pop() if len(picks) == 1 else None


def test_sampling_wide_nucleus_and_large_top_k_take_the_full_path(cb, rng):
    """A nucleus of thousands of tokens (flat logits) and top_k above the candidate buffer."""
    b, v = 16, 20000
    logits = (rng.standard_normal((b, v)) * 0.3).astype(np.float32)
    host = _rows(b, 1.0, 0, 0.97, 0.0, rng)
    got = _sample_cuda(cb, logits, host)
    noise = numpy_sampling.gumbel_noise(host[4], host[5], v)
    decided = 0
    for r in range(b):
        want = _pick_if_determined(logits[r], noise[r], 0.97, 2e-3)
        if want is not None:
            decided += 1
            assert got[r] == want, r
    assert decided >= b // 2
    logits = (rng.standard_normal((b, v)) * 2.5).astype(np.float32)
    for k, p in ((5000, 1.0), (3000, 0.9), (1025, 1.0)):
        host = _rows(b, 0.8, k, p, 0.0, rng)
        np.testing.assert_array_equal(_sample_cuda(cb, logits, host), numpy_sampling.sample(logits, *host))


def test_top_p_keeps_a_whole_tie_group(cb, rng):
    """Equal logits: the nucleus ends inside one group of equal values and the sampler keeps the
    whole group (numpy would cut it by id), so the pick is the noise argmax over all tokens."""
    b, v = 8, 20000
    logits = np.zeros((b, v), np.float32)
    for top_k, top_p in ((0, 0.5), (10, 1.0), (100, 0.3)):
        host = _rows(b, 1.0, top_k, top_p, 0.0, rng)
        want = np.argmax(numpy_sampling.gumbel_noise(host[4], host[5], v), axis=1)
        np.testing.assert_array_equal(_sample_cuda(cb, logits, host), want)


def test_sampling_minus_inf_rows_and_bans(cb, rng):
    b, v = 10, 151936
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    logits[0] = -np.inf  # nothing allowed: -1, as numpy (the engine ends that request alone)
    logits[1, :] = -np.inf
    logits[1, 777] = 1.0  # one allowed token
    logits[2, rng.random(v) < 0.9] = -np.inf  # mostly banned
    logits[3, :v - 30] = -np.inf  # fewer allowed tokens than top_k
    logits[4, np.argsort(logits[4])[-40:]] = -np.inf  # the head banned
    for t, k, p, m in ((1.0, 0, 1.0, 0.0), (0.8, 50, 0.9, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1),
                       (0.0, 0, 1.0, 0.0), (0.7, 100, 1.0, 0.05)):
        host = _rows(b, t, k, p, m, rng)
        got = _sample_cuda(cb, logits, host)
        np.testing.assert_array_equal(got, numpy_sampling.sample(logits, *host))
        assert got[1] == 777 and got[0] == -1


@pytest.mark.parametrize("temperature", [1e-5, 2e-5, 9.99e-6, 0.05])
def test_sampling_temperatures_near_zero(cb, rng, temperature):
    b, v = 12, 151936
    logits = (rng.standard_normal((b, v)) * 3).astype(np.float32)
    for k, p, m in ((0, 1.0, 0.0), (50, 0.9, 0.0), (0, 0.9, 0.0), (0, 1.0, 0.1)):
        host = _rows(b, temperature, k, p, m, rng)
        np.testing.assert_array_equal(_sample_cuda(cb, logits, host), numpy_sampling.sample(logits, *host))


def test_gumbel_noise_is_the_numpy_noise_with_split_rows(cb, rng):
    # Few rows of the full vocab: each row is split over several blocks and combined.
    b, v = 3, 151936
    logits = np.zeros((b, v), np.float32)
    host = _rows(b, 1.0, 0, 1.0, 0.0, rng)
    want = np.argmax(numpy_sampling.gumbel_noise(host[4], host[5], v), axis=1)
    np.testing.assert_array_equal(_sample_cuda(cb, logits, host), want)
    host = _rows(b, 0.0, 0, 1.0, 0.0, rng)
    logits[:, [5, 100000, 151935]] = 1.0  # greedy ties across blocks: the lowest id
    np.testing.assert_array_equal(_sample_cuda(cb, logits, host), [5, 5, 5])


@pytest.mark.parametrize("v,k", [(151936, 5), (151936, 20), (5000, 1500), (3000, 3000), (20000, 1024)])
def test_log_softmax_topk_ties_infs_and_large_k(cb, nb, rng, v, k):
    b = 6
    logits = (np.round(rng.standard_normal((b, v)) * 8) / 4).astype(np.float32)  # ties everywhere
    logits[1, rng.random(v) < 0.5] = -np.inf
    logits[2, :] = -np.inf
    logits[2, :3] = [0.5, 0.5, -1.0]  # fewer finite values than k
    logits[3, [7, 70, 700]] = logits[3].max() + 2  # a tie at the top
    ids = rng.integers(0, v, b).astype(np.int32)
    ids[3] = 7
    poison(cb)
    with cb.slot(0):
        outs = cb.log_softmax_topk(cb.from_host(logits, "f32"), cb.from_host(ids, "i32"), k)
        chosen, top_ids, top_lp = (cb.to_host(a) for a in outs)
    r_chosen, r_ids, r_lp = nb.log_softmax_topk(logits, ids, k)
    np.testing.assert_array_equal(top_ids, r_ids)  # -inf after every finite value, ties by id
    np.testing.assert_allclose(top_lp, r_lp, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(chosen, r_chosen, rtol=1e-5, atol=1e-4)
    assert chosen[3] == top_lp[3, 0] and top_ids[3, 0] == 7  # one lse for both outputs
    np.testing.assert_array_equal(top_ids[2, :2], [0, 1])


# ---- slots, arenas, graphs -------------------------------------------------------------------


def test_arena_bounds_and_marks():
    from vt.kernels.cuda_ops import CudaBackend

    small = CudaBackend(workspace_bytes=1 << 20)
    x = small.from_host(bf16(np.ones((8, 1024))), "act")
    w = small.from_host(bf16(np.ones(1024)), "act")
    with small.slot(0):
        mark = small.arena_mark()
        small.rms_norm(x, w, 1e-6, None)
        assert small.arena_mark() >= mark + 8 * 1024 * 2
        small.arena_reset(mark)
        assert small.arena_mark() == mark
        with pytest.raises(MemoryError):
            small.silu_mul(small.from_host(bf16(np.ones((1024, 2048))), "act"))
    with pytest.raises(ValueError):  # the first slot past the backend's last
        small.slot(small.num_slots()).__enter__()


def test_two_slots_order_with_after(cb, rng):
    x = act(cb, rng.standard_normal((256, 1024)))
    w = act(cb, rng.standard_normal((1024, 1024)) * 0.03)
    with cb.slot(0):
        y0 = cb.linear(x, w, None)
        for _ in range(20):  # keep slot 0 busy so an unordered read on slot 1 would see stale data
            y0 = cb.linear(y0, w, None)
    cb.after(1, 0)
    with cb.slot(1):
        y1 = cb.linear(y0, w, None)
        cb.record(1)
    cb.wait(1)
    ref = cb.to_host(y0)
    want = ref.astype(ml_dtypes.bfloat16).astype(np.float32) @ cb.to_host(w).T
    assert rel_err(cb.to_host(y1), want) < BF16_TOL


def test_captured_step_replays_with_new_inputs_equal_to_eager(cb, rng):
    v, h, inter, t = 300, 256, 512, 8
    table = act(cb, rng.standard_normal((v, h)))
    norm_w = act(cb, rng.random(h) + 0.5)
    w_up = act(cb, rng.standard_normal((2 * inter, h)) * 0.05)
    w_down = act(cb, rng.standard_normal((h, inter)) * 0.05)
    bias = act(cb, rng.standard_normal(h))
    lm = act(cb, rng.standard_normal((v, h)) * 0.05)
    ids = cb.zeros((t,), "i32")
    pinned = cb.pinned_empty((t,), np.int32)
    out_host = cb.pinned_empty((t,), np.int32)
    sampler = [
        cb.from_host(a, k)
        for a, k in (
            (np.zeros(t), "f32"),
            (np.zeros(t), "i32"),
            (np.ones(t), "f32"),
            (np.zeros(t), "f32"),
            (np.arange(t), "i64"),
            (np.zeros(t), "i32"),
        )
    ]
    result = {}

    def step():
        x = cb.embed(ids, table)
        y, r = cb.rms_norm(x, norm_w, 1e-6, None)
        hmid = cb.silu_mul(cb.linear(y, w_up, None))
        z = cb.linear(hmid, w_down, bias)
        y2, _ = cb.rms_norm(z, norm_w, 1e-6, r)
        lg = cb.logits(y2, lm)
        result["ids"] = cb.sample(lg, *sampler)
        result["logits"] = lg

    def eager(new_ids):
        pinned[:] = new_ids
        with cb.slot(1):
            cb.copy_h2d(ids, pinned)
            step()
            cb.record(1)
        cb.wait(1)
        return cb.to_host(result["logits"]), cb.to_host(result["ids"])

    warm = rng.integers(0, v, t).astype(np.int32)
    eager(warm)
    graph = cb.capture(0, step)
    captured_logits, captured_ids = result["logits"], result["ids"]
    for _ in range(3):
        new = rng.integers(0, v, t).astype(np.int32)
        want_logits, want_ids = eager(new)
        pinned[:] = new
        poison(cb, 0)
        with cb.slot(0):
            cb.copy_h2d(ids, pinned)
            graph.replay()
            cb.copy_d2h(out_host, captured_ids)
            cb.record(0)
        cb.wait(0)
        got_logits = cb.to_host(captured_logits)
        np.testing.assert_array_equal(got_logits, want_logits)  # same kernels, same cuBLAS path
        np.testing.assert_array_equal(out_host, want_ids)


def test_two_part_capture_takes_a_mask_between_its_parts(cb, rng):
    """capture_parts: a step captured as a forward part and a sampler part, with the token
    bitmask applied uncaptured between the replays (as guided decode steps run), samples what
    the eager step with the same mask samples, and only allowed tokens."""
    v, h, t = 300, 256, 8
    words = -(-v // 32)
    table = act(cb, rng.standard_normal((v, h)))
    norm_w = act(cb, rng.random(h) + 0.5)
    lm = act(cb, rng.standard_normal((v, h)) * 0.05)
    ids = cb.zeros((t,), "i32")
    mask = cb.zeros((t, words), "i32")
    rows = cb.from_host(np.arange(t), "i32")
    pinned = cb.pinned_empty((t,), np.int32)
    mask_host = cb.pinned_empty((t, words), np.int32)
    out_host = cb.pinned_empty((t,), np.int32)
    fields = ((np.zeros(t), "f32"), (np.zeros(t), "i32"), (np.ones(t), "f32"), (np.zeros(t), "f32"),
              (np.arange(t), "i64"), (np.zeros(t), "i32"))
    greedy = [cb.from_host(a, k) for a, k in fields]  # temperature 0: argmax of the allowed tokens
    result = {}

    def forward():
        y, _ = cb.rms_norm(cb.embed(ids, table), norm_w, 1e-6, None)
        result["logits"] = cb.logits(y, lm)

    def sample():
        result["ids"] = cb.sample(result["logits"], *greedy)

    parts = cb.capture_parts(0, (forward, sample))
    assert len(parts) == 2
    captured = dict(result)

    def step(slot, new_ids, bits, replay):
        pinned[:] = new_ids
        mask_host[:] = bits
        with cb.slot(slot):
            cb.copy_h2d(ids, pinned)
            if replay:
                parts[0].replay()
            else:
                forward()
            cb.copy_h2d(mask, mask_host)
            cb.apply_token_bitmask((captured if replay else result)["logits"], mask, rows)
            if replay:
                parts[1].replay()
            else:
                sample()
            cb.copy_d2h(out_host, (captured if replay else result)["ids"])
            cb.record(slot)
        cb.wait(slot)
        return out_host.copy()

    for _ in range(3):
        new = rng.integers(0, v, t).astype(np.int32)
        bits = rng.integers(-(2**31), 2**31, (t, words), dtype=np.int64).astype(np.int32)
        want = step(1, new, bits, replay=False)
        poison(cb, 0)
        got = step(0, new, bits, replay=True)
        np.testing.assert_array_equal(got, want)
        allowed = (bits.view(np.uint32)[np.arange(t), got // 32] >> (got % 32).astype(np.uint32)) & 1
        assert allowed.all()


# ---- an fp8 (e4m3) KV cache (--kv-cache-dtype fp8): the KV write's codes bit for bit against the
# numpy twin, attention (scalar, tensor-core decode, every prompt tiling, split keys) within bf16
# tolerances.
FP8_SCALES = (0.025, 0.04)


def _codes_on(cb, codes: np.ndarray):
    """An e4m3 cache on the device as its bytes (what zeros(..., "fp8") allocates)."""
    return cb.from_host(codes.view(np.uint8), "u8")


def test_write_kv_stores_the_twins_codes(cb, nb, rng):
    t, hk, d, blocks, bs = 9, 4, 128, 6, 16
    k, v = bf16(rng.standard_normal((t, hk, d)) * 30), bf16(rng.standard_normal((t, hk, d)))
    slots = np.array([3, -1, 40, 0, 95, 17, -5, 64, 2], np.int32)
    kc, vc = nb.zeros((blocks, bs, hk, d), "fp8"), nb.zeros((blocks, bs, hk, d), "fp8")
    nb.write_kv(k, v, kc, vc, slots, kv_scales=(0.05, 0.01))
    dk, dv = cb.zeros((blocks, bs, hk, d), "fp8"), cb.zeros((blocks, bs, hk, d), "fp8")
    with cb.slot(0):
        cb.write_kv(act(cb, k), act(cb, v), dk, dv, cb.from_host(slots, "i32"), kv_scales=(0.05, 0.01))
    assert (cb.to_host(dk) == kc.view(np.uint8)).all() and (cb.to_host(dv) == vc.view(np.uint8)).all()


@pytest.mark.parametrize("d,with_norm", [(128, True), (64, False), (128, False), (72, True)])
def test_fused_prologue_quantizes_what_it_writes(cb, nb, rng, d, with_norm):
    """The fused prologue into an fp8 cache stores e4m3(k / k_scale), e4m3(v / v_scale) of the
    bf16 k and v it leaves in place, and leaves q as into a bf16 cache with each head row rounded
    to e4m3 x 2^n (numpy_fp8.quantize_rows_pow2, bit for bit). Head dim 72: the three-op path."""
    from vt.kernels.numpy_fp8 import quantize_rows_pow2

    t, hq, hk, blocks, bs = 7, 8, 2, 4, 16
    q, k, v = (bf16(rng.standard_normal((t, h, d)) * 3) for h in (hq, hk, hk))
    norms = [bf16(1 + 0.1 * rng.standard_normal(d)) for _ in range(2)] if with_norm else [None, None]
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    pos = rng.integers(0, 2000, t).astype(np.int32)
    slots = np.array([5, 0, -1, 63, 20, 21, 2], np.int32)
    dq, dk, dv = act(cb, q), act(cb, k), act(cb, v)
    kc, vc = cb.zeros((blocks, bs, hk, d), "fp8"), cb.zeros((blocks, bs, hk, d), "fp8")
    with cb.slot(0):
        cb.qk_norm_rope_write_kv(dq, dk, dv, *(None if n is None else act(cb, n) for n in norms), 1e-6,
                                 cb.from_host(pos, "i32"), cb.from_host(inv_freq, "f32"), kc, vc,
                                 cb.from_host(slots, "i32"), kv_scales=(0.01, 0.05))
        k_out, v_out, q_out = cb.to_host(dk), cb.to_host(dv), cb.to_host(dq)
        plain, dev_norms = act(cb, q), [None if n is None else act(cb, n) for n in norms]
        cb.qk_norm_rope_write_kv(plain, act(cb, k), act(cb, v), *dev_norms, 1e-6, cb.from_host(pos, "i32"),
                                 cb.from_host(inv_freq, "f32"), cb.zeros(kc.shape, "act"),
                                 cb.zeros(vc.shape, "act"), cb.from_host(slots, "i32"))
        q_plain = cb.to_host(plain)
    want_k, want_v = nb.zeros(kc.shape, "fp8"), nb.zeros(vc.shape, "fp8")
    nb.write_kv(k_out, v_out, want_k, want_v, slots, kv_scales=(0.01, 0.05))
    assert (cb.to_host(kc) == want_k.view(np.uint8)).all()
    assert (cb.to_host(vc) == want_v.view(np.uint8)).all()
    assert (q_out == quantize_rows_pow2(q_plain)).all() and (q_out != q_plain).any()


def _attend_fp8(cb, q, kc, vc, qsl, seq_lens, table, scale, max_q, max_ctx) -> np.ndarray:
    """CUDA attention over fp8 caches (the codes of kc, vc) at FP8_SCALES, from a poisoned arena."""
    poison(cb)
    with cb.slot(0):
        dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
        out = cb.attention(act(cb, q), _codes_on(cb, kc), _codes_on(cb, vc), *dev, scale, max_q, max_ctx,
                           kv_scales=FP8_SCALES)
        return cb.to_host(out)


def _fp8_batch(rng, q_lens, ctx_lens, hq, hk, d):
    """A paged batch over an fp8 cache, q rounded as the prologue leaves it there (e4m3 x 2^n)."""
    from vt.kernels.numpy_fp8 import quantize_rows_pow2

    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, 16)
    return quantize_rows_pow2(q), to_e4m3(kc * 40), to_e4m3(vc * 40), qsl, seq_lens, table


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk", [
    ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2),  # prompt, decode, chunk
    ([300, 40], [2300, 40], 32, 8),  # Qwen3-8B's heads over many key tiles, split keys likely
    ([1200], [1200], 32, 8),  # one long prompt (the numpy reference holds every score)
])
def test_fp8_qk_prompt_kernel_matches_numpy_on_rounded_queries(cb, nb, q_lens, ctx_lens, hq, hk, monkeypatch):
    """Prompts over an fp8 cache on attention_wgq (Q K^T on the e4m3 tensor cores, each q row
    rounded to e4m3 x 2^n as it loads, a no-op on the prologue's rounded rows): the numpy twin's
    attention of the rounded queries, from raw bf16 queries too."""
    from vt.kernels.numpy_fp8 import quantize_rows_pow2

    if QK8_KERNEL not in cb._kernels and cb._compile_sm90a():
        pytest.skip("no sm_90a kernels on this GPU")
    monkeypatch.setattr(cb, "kv8_qk8", True)
    launched = record_launches(cb, monkeypatch)
    rng = np.random.default_rng(sum(ctx_lens))
    q, kc, vc, qsl, seq_lens, table = _fp8_batch(rng, q_lens, ctx_lens, hq, hk, 128)
    q = bf16(q * rng.uniform(0.01, 50, (q.shape[0], hq, 1)))
    ref = nb.attention(quantize_rows_pow2(q), kc, vc, qsl, seq_lens, table, 128**-0.5, max(q_lens),
                       max(ctx_lens), kv_scales=FP8_SCALES)
    got = _attend_fp8(cb, q, kc, vc, qsl, seq_lens, table, 128**-0.5, max(q_lens), max(ctx_lens))
    assert QK8_KERNEL in launched, launched
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hk,d",
    [
        ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2, 128),  # prefill, decode, chunked prefill
        ([1] * 6, [3000, 17, 1, 513, 64, 2048], 16, 8, 128),  # decode with split keys
        ([1] * 5, [1, 15, 16, 17, 2500], 64, 8, 128),  # group 8: the transposed decode tiles
        ([4, 1, 2], [30, 100, 70], 16, 4, 128),  # 16-row decode tiles
        ([70, 33], [70, 100], 4, 4, 64),  # head dim 64
        ([3, 2], [20, 9], 8, 1, 256),  # head dim 256: the CUDA-core kernels
        ([1, 1, 1], [40, 700, 33], 8, 4, 96),  # head dim 96 decode
        ([300, 1, 129], [300, 700, 1000], 32, 8, 128),  # many row and key tiles
    ],
)
def test_attention_reads_fp8_codes_times_scale(cb, nb, rng, q_lens, ctx_lens, hq, hk, d):
    q, kc, vc, qsl, seq_lens, table = _fp8_batch(rng, q_lens, ctx_lens, hq, hk, d)
    scale = d**-0.5
    args = (qsl, seq_lens, table, scale, max(q_lens), max(ctx_lens))
    ref = nb.attention(q, kc, vc, *args, kv_scales=FP8_SCALES)
    got = _attend_fp8(cb, q, kc, vc, qsl, seq_lens, table, scale, max(q_lens), max(ctx_lens))
    assert rel_err(got, ref) < BF16_TOL


@pytest.mark.parametrize(("q_len", "hk", "d", "tiling"), [
    (1, 2, 128, "wgr"),  # decode: the transposed tiles
    (20, 2, 128, "wgr"),  # a prompt on the default tiling (wgr's fp8 kernel on sm_90)
    (20, 4, 64, FALLBACK_PREFILL_TILING),  # a prompt on mma.sync tiles
    (1, 1, 256, "wgr"),  # head dim 256: the CUDA-core kernel
])
def test_every_e4m3_code_reads_back_exactly(cb, rng, q_len, hk, d, tiling):
    """A prompt's first token sees one key, so its output is that key's V row: each of the 254
    finite codes over the V row's heads and dims comes back as its e4m3 value (subnormals too:
    the device's bf16 FMA of the conversion must not flush them)."""
    codes = np.arange(hk * d) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes: the cache never holds them
    q, _, _, qsl, seq_lens, table = _paged_batch(rng, [q_len], [q_len], hk, hk, d, 16)
    vc = np.zeros((int(table[table < 10**6].max()) + 1, 16, hk, d), np.uint8)  # every block the rows read
    vc[table[0, 0], 0] = codes.reshape(hk, d)
    kc = np.zeros_like(vc)
    previous = cb.prefill_tiling
    try:
        cb.use_prefill_tiling(tiling, strict=False)
        with cb.slot(0):
            dev = [cb.from_host(a, "i32") for a in (qsl, seq_lens, table)]
            out = cb.to_host(cb.attention(act(cb, q), cb.from_host(kc, "u8"), cb.from_host(vc, "u8"), *dev,
                                          d**-0.5, q_len, q_len, kv_scales=(1.0, 1.0)))
    finally:
        cb.use_prefill_tiling(previous)
    want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(hk, d)
    np.testing.assert_array_equal(np.asarray(out, np.float32)[0], want)


@pytest.mark.parametrize("tiling", sorted(PREFILL_TILINGS))
@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk,d", [
    ([2048], [2048], 32, 8, 128),  # one long prompt
    ([64, 200], [3000, 200], 32, 8, 128),  # split keys
    ([300, 1, 129], [300, 700, 1000], 32, 8, 128),  # chunked prefill beside a decode, partial tiles
    ([37, 5], [900, 5], 16, 2, 64),  # head dim 64, group 8
])
def test_fp8_prompt_attention_on_every_tiling(cb, nb, shared_cases, tiling, q_lens, ctx_lens, hq, hk, d,
                                              monkeypatch):
    """Every requested tiling serves an fp8 cache: its own _kv8 kernels (wgr's on sm_90: the e4m3
    Q K^T one at head dim 128), those of the tiling it names (wgs: wgr's), or (the other wgmma
    tilings', a head dim it lacks) the fallback's."""
    scale = d**-0.5

    def make(rng):
        batch = _fp8_batch(rng, q_lens, ctx_lens, hq, hk, d)
        return batch, nb.attention(*batch, scale, max(q_lens), max(ctx_lens), kv_scales=FP8_SCALES)

    batch, ref = _shared_case(shared_cases, make, "fp8", q_lens, ctx_lens, hq, hk, d)
    q, kc, vc, qsl, seq_lens, table = batch
    launched = record_launches(cb, monkeypatch)
    previous = cb.prefill_tiling
    try:
        cb.use_prefill_tiling(tiling, strict=False)
        t = PREFILL_TILINGS[cb.prefill_tiling]  # the fallback where sm_90a kernels do not build
        if t.kv8_smem is None:
            t = PREFILL_TILINGS[t.kv8_tiling or FALLBACK_PREFILL_TILING]
        if t.kv8_smem is None or d not in t.head_dims:
            t = PREFILL_TILINGS[FALLBACK_PREFILL_TILING]
        expected = t.kernel.format(d=d) + KV8_SUFFIX
        if cb.kv8_qk8 and t is PREFILL_TILINGS["wgr"] and d == 128:
            expected = QK8_KERNEL  # wgr's body with Q K^T in e4m3
        got = _attend_fp8(cb, q, kc, vc, qsl, seq_lens, table, scale, max(q_lens), max(ctx_lens))
    finally:
        cb.use_prefill_tiling(previous)
    assert expected in launched, launched
    assert rel_err(got, ref) < BF16_TOL

