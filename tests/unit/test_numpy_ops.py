"""Direct checks of the numpy backend's model ops against plain dense references."""

from __future__ import annotations

import numpy as np
import pytest

from vt.kernels import get_backend
from vt.kernels.numpy_ops import NumpyBackend

ops = NumpyBackend()
rng = np.random.default_rng(0)


def dense_causal_attention(q, k, v, scale):
    """q [L, Hq, D] at the last L positions of k, v [S, Hk, D]; fp64 reference."""
    length, hq, _ = q.shape
    ctx, hk, _ = k.shape
    out = np.zeros(q.shape)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hk)].astype(np.float64), v[:, h // (hq // hk)].astype(np.float64)
        for j in range(length):
            pos = ctx - length + j
            s = q[j, h].astype(np.float64) @ kh[: pos + 1].T * scale
            p = np.exp(s - s.max())
            out[j, h] = (p / p.sum()) @ vh[: pos + 1]
    return out


def paged(k_dense, block_ids, bs, nb):
    """Scatter dense per-sequence K into a paged cache at the given blocks."""
    cache = np.zeros((nb, bs) + k_dense[0].shape[1:], np.float32)
    for seq, blocks in zip(k_dense, block_ids, strict=True):
        for p in range(seq.shape[0]):
            cache[blocks[p // bs], p % bs] = seq[p]
    return cache


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (6, 1)])
def test_attention_matches_dense_causal_softmax_on_ragged_paged_batch(hq, hk):
    d, bs, nb = 8, 4, 16
    ctxs, qlens = [7, 1, 12], [7, 1, 3]  # prefill, a one-token prompt, a decode-ish chunk
    ks = [rng.standard_normal((c, hk, d)).astype(np.float32) for c in ctxs]
    vs = [rng.standard_normal((c, hk, d)).astype(np.float32) for c in ctxs]
    qs = [rng.standard_normal((n, hq, d)).astype(np.float32) for n in qlens]
    perm = rng.permutation(nb)
    block_ids, i = [], 0
    for c in ctxs:
        n = -(-c // bs)
        block_ids.append(perm[i : i + n].tolist())
        i += n
    table = np.zeros((3, 4), np.int32)
    for b, ids in enumerate(block_ids):
        table[b, : len(ids)] = ids
    qsl = np.array([0, *np.cumsum(qlens)], np.int32)
    out = ops.attention(np.concatenate(qs), paged(ks, block_ids, bs, nb), paged(vs, block_ids, bs, nb),
                        qsl, np.array(ctxs, np.int32), table, d ** -0.5, max(qlens), max(ctxs))
    assert out.shape == (sum(qlens), hq, d) and out.dtype == np.float32
    for b in range(3):
        ref = dense_causal_attention(qs[b], ks[b], vs[b], d ** -0.5)
        np.testing.assert_allclose(out[qsl[b] : qsl[b + 1]], ref, rtol=1e-5, atol=1e-5)


def test_attention_ignores_cache_beyond_seq_len():
    d, bs = 4, 4
    k = rng.standard_normal((2, bs, 1, d)).astype(np.float32)
    v = rng.standard_normal((2, bs, 1, d)).astype(np.float32)
    q = rng.standard_normal((1, 1, d)).astype(np.float32)
    args = (np.array([0, 1], np.int32), np.array([3], np.int32), np.array([[1, 0]], np.int32), 0.5, 1, 3)
    a = ops.attention(q, k, v, *args)
    k[1, 3], v[1, 3], k[0], v[0] = 100.0, 100.0, 100.0, 100.0  # slot 3 of block 1 and all of block 0
    np.testing.assert_array_equal(ops.attention(q, k, v, *args), a)


def test_attention_into_out_with_decodes_first():
    """out: rows of no sequence (padding after the last) keep their values; decode_seqs is a
    promise about the batch that is checked, not trusted."""
    d, bs = 4, 4
    k = rng.standard_normal((4, bs, 1, d)).astype(np.float32)
    v = rng.standard_normal((4, bs, 1, d)).astype(np.float32)
    q = rng.standard_normal((6, 2, d)).astype(np.float32)  # rows 0, 1: decodes; 2-4: a prompt; 5: pad
    qsl, lens = np.array([0, 1, 2, 5], np.int32), np.array([5, 2, 3], np.int32)
    table = np.array([[0, 1], [2, 0], [3, 0]], np.int32)
    want = ops.attention(q, k, v, qsl, lens, table, 0.5, 3, 5)
    out = np.full((6, 2, d), 9.0, np.float32)
    got = ops.attention(q, k, v, qsl, lens, table, 0.5, 3, 5, out=out, decode_seqs=2)
    assert got is out
    np.testing.assert_array_equal(out[:5], want[:5])
    assert (out[5] == 9.0).all()
    with pytest.raises(ValueError, match="one query row"):
        ops.attention(q, k, v, qsl, lens, table, 0.5, 3, 5, decode_seqs=3)
    with pytest.raises(ValueError, match="out must be"):
        ops.attention(q, k, v, qsl, lens, table, 0.5, 3, 5, out=out[:5])


def test_rope_rotates_halves_and_preserves_relative_dot_products():
    d = 8
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    q = rng.standard_normal((3, 2, d)).astype(np.float32)
    k = rng.standard_normal((3, 1, d)).astype(np.float32)
    pos = np.array([0, 5, 9], np.int32)
    q2, k2 = q.copy(), k.copy()
    ops.rope(q2, k2, pos, inv_freq)
    np.testing.assert_array_equal(q2[0], q[0])  # position 0: identity
    ang = 5 * inv_freq
    x1, x2 = q[1, 0, : d // 2], q[1, 0, d // 2 :]
    expect = np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)])
    np.testing.assert_allclose(q2[1, 0], expect, rtol=1e-5, atol=1e-6)
    # Same relative offset at different absolute positions: the same q.k score.
    def score(qpos: int, kpos: int) -> float:
        qq, kk = q[:1].copy(), k[:1].copy()
        ops.rope(qq, np.zeros((1, 1, d), np.float32), np.array([qpos], np.int32), inv_freq)
        ops.rope(np.zeros((1, 1, d), np.float32), kk, np.array([kpos], np.int32), inv_freq)
        return float(qq[0, 0] @ kk[0, 0])

    assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-4)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-2)


def test_rms_norm_with_and_without_residual():
    x = rng.standard_normal((3, 16)).astype(np.float32)
    res = rng.standard_normal((3, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    y, r = ops.rms_norm(x, w, 1e-6, None)
    np.testing.assert_array_equal(r, x)
    np.testing.assert_allclose(y, x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-5)
    y, r = ops.rms_norm(x, w, 1e-6, res)
    np.testing.assert_allclose(r, x + res, rtol=1e-6)
    np.testing.assert_allclose(y, r / np.sqrt((r**2).mean(-1, keepdims=True) + 1e-6) * w, rtol=1e-5)
    heads = ops.head_rms_norm(x.reshape(3, 2, 8), w[:8], 1e-6)
    xh = x.reshape(3, 2, 8)
    np.testing.assert_allclose(heads, xh / np.sqrt((xh**2).mean(-1, keepdims=True) + 1e-6) * w[:8], rtol=1e-5)


def test_write_kv_skips_negative_slots():
    kc, vc = ops.zeros((3, 2, 1, 2), "act"), ops.zeros((3, 2, 1, 2), "act")
    k = np.arange(1, 9, dtype=np.float32).reshape(4, 1, 2)
    ops.write_kv(k, -k, kc, vc, np.array([5, -1, 0, -1], np.int32))
    expect = np.zeros((6, 1, 2), np.float32)
    expect[5], expect[0] = k[0], k[2]
    np.testing.assert_array_equal(kc.reshape(6, 1, 2), expect)
    np.testing.assert_array_equal(vc.reshape(6, 1, 2), -expect)
    with pytest.raises(IndexError, match="slot 6"):
        ops.write_kv(k[:1], k[:1], kc, vc, np.array([6], np.int32))


def test_linear_silu_mul_embed_gather_logits_fill_from_last():
    x = rng.standard_normal((2, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    np.testing.assert_allclose(ops.linear(x, w, b), x @ w.T + b, rtol=1e-6)
    g = np.array([[0.0, 1.0, 2.0, 3.0]], np.float32)
    np.testing.assert_allclose(ops.silu_mul(g), [[0.0 * 2.0, 1 / (1 + np.exp(-1.0)) * 3.0]], rtol=1e-6)
    table = np.arange(12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(ops.embed(np.array([3, 0], np.int32), table), table[[3, 0]])
    np.testing.assert_array_equal(ops.gather_rows(table, np.array([2], np.int32)), table[[2]])
    assert ops.logits(x, w).dtype == np.float32
    ids = np.array([9, 9, 9], np.int32)
    ops.fill_from_last(ids, np.array([-1, 1, 0], np.int32), np.array([40, 41], np.int32))
    assert ids.tolist() == [9, 41, 40]


def test_upload_upcasts_bf16_and_plumbing_is_trivial():
    import ml_dtypes

    host = np.array([1.5, -2.25, 3.0], dtype=ml_dtypes.bfloat16)
    dev = ops.upload(host)
    assert dev.dtype == np.float32 and dev.tolist() == [1.5, -2.25, 3.0]
    assert ops.from_host(np.array([1, 2]), "i32").dtype == np.int32
    with pytest.raises(ValueError, match="dtype"):
        ops.zeros((1,), "bf17")
    calls = []
    graph = ops.capture(0, lambda: calls.append(1))
    assert calls == []
    graph.replay()
    graph.replay()
    assert calls == [1, 1]
    parts = ops.capture_parts(0, (lambda: calls.append(2), lambda: calls.append(3)))
    assert calls == [1, 1] and len(parts) == 2
    parts[1].replay()
    parts[0].replay()
    assert calls == [1, 1, 3, 2]
    assert ops.num_slots() == 3 and ops.done(1)
    with ops.slot(1):
        ops.after(1, 0)
        ops.record(1)
    ops.wait(1)
    with pytest.raises(ValueError, match="slot 3"):
        ops.slot(3)


def test_get_backend_names():
    assert get_backend("cpu").name == "numpy"
    assert get_backend("numpy").name == "numpy"
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend("tpu")


def test_sampling_methods_reach_the_numpy_sampler():
    pytest.importorskip("vt.kernels.numpy_sampling")
    logits = np.array([[0.1, 2.0, -1.0], [3.0, 0.0, 3.0]], np.float32)
    b = len(logits)
    greedy = ops.sample(logits.copy(), np.zeros(b, np.float32), np.zeros(b, np.int32), np.ones(b, np.float32),
                        np.zeros(b, np.float32), np.zeros(b, np.int64), np.zeros(b, np.int32))
    assert np.asarray(greedy).tolist() == [1, 0]  # ties go to the lowest id
    banned = logits.copy()
    ops.ban_tokens(banned, np.array([[1], [-1]], np.int32))
    assert banned[0, 1] == -np.inf and banned[1].tolist() == logits[1].tolist()
    last, counts = np.zeros(2, np.int32), np.zeros((2, 3), np.int32)
    ops.record_sampled(last, counts, np.array([1, -1], np.int32), np.array([2, 0], np.int32))
    assert last.tolist() == [0, 2] and counts.tolist() == [[0, 0, 0], [0, 0, 1]]


def test_folded_norms_equal_norm_then_projection():
    """The layer's norm folding: a norm weight folded into the projection, the row scale applied
    by the op after it (prologue with bias, silu_mul), and the residual add inside the output
    projection give what the plain norm -> projection -> op sequence gives."""
    t, h, hq, hk, d, inter, eps = 5, 32, 4, 2, 8, 24, 1e-6
    r = rng.standard_normal((t, h)).astype(np.float32) * rng.uniform(0.1, 20, (t, 1)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, h).astype(np.float32)
    w_qkv = rng.standard_normal(((hq + 2 * hk) * d, h)).astype(np.float32)
    bias = rng.standard_normal((hq + 2 * hk) * d).astype(np.float32)
    w_gu = rng.standard_normal((2 * inter, h)).astype(np.float32)
    pos = np.arange(t, dtype=np.int32) * 7
    inv_freq = (1.0 / (1e4 ** (np.arange(0, d, 2, dtype=np.float32) / d))).astype(np.float32)
    qn, kn = rng.uniform(0.5, 1.5, d).astype(np.float32), rng.uniform(0.5, 1.5, d).astype(np.float32)

    def prologue(qkv, **kw):
        kc, vc = ops.zeros((2, 4, hk, d), "act"), ops.zeros((2, 4, hk, d), "act")
        q, k, v = (qkv[:, : hq * d].reshape(t, hq, d), qkv[:, hq * d : (hq + hk) * d].reshape(t, hk, d),
                   qkv[:, (hq + hk) * d :].reshape(t, hk, d))
        slots = np.arange(t, dtype=np.int32)
        ops.qk_norm_rope_write_kv(q, k, v, qn, kn, eps, pos, inv_freq, kc, vc, slots, **kw)
        return qkv, kc, vc

    normed, _ = ops.rms_norm(r, norm, eps, None)
    want = prologue(ops.linear(normed, w_qkv, bias))
    folded = w_qkv.copy()
    ops.fold_norm_weight(folded, norm)
    got = prologue(ops.linear(r, folded, None), rms_of=r, bias=bias)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert np.abs(want[2]).max() > 0.1  # the v rows reached the cache

    gu_folded = w_gu.copy()
    ops.fold_norm_weight(gu_folded, norm)
    np.testing.assert_allclose(ops.silu_mul(ops.linear(r, gu_folded, None), rms_of=r, eps=eps),
                               ops.silu_mul(ops.linear(normed, w_gu, None)), rtol=1e-4, atol=1e-5)

    x = rng.standard_normal((t, 2 * inter)).astype(np.float32)
    w_o = rng.standard_normal((h, 2 * inter)).astype(np.float32)
    acc = r.copy()
    ops.linear_residual(x, w_o, acc)
    np.testing.assert_allclose(acc, r + x @ w_o.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.linear_residual(x, w_o, acc[:, :8])
    with pytest.raises(ValueError, match="fold_norm_weight"):
        ops.fold_norm_weight(folded, norm[:8])


def test_a_row_alone_gets_the_products_it_gets_in_a_batch():
    """A token decoded alone and the same token in a prompt step must see the same products (the
    CPU tests' same-tokens-after-preemption promise): linear, the residual projection, logits and
    the fp8 scaled GEMM give row 0 bit for bit the same alone as among 9 rows."""
    from vt.kernels import numpy_fp8

    r = np.random.default_rng(5)
    x = r.standard_normal((9, 1024)).astype(np.float32)
    w = r.standard_normal((768, 1024)).astype(np.float32)
    assert (ops.linear(x[:1], w, None) == ops.linear(x, w, None)[:1]).all()
    assert (ops.logits(x[:1], w) == ops.logits(x, w)[:1]).all()
    res_one, res_all = np.ones((1, 768), np.float32), np.ones((9, 768), np.float32)
    ops.linear_residual(x[:1], w, res_one)
    ops.linear_residual(x, w, res_all)
    assert (res_one == res_all[:1]).all()
    wq, ws = numpy_fp8.quantize_weight_channel(w)
    xq, xs = numpy_fp8.quantize(x)
    one = numpy_fp8.scaled_gemm(xq[:1], xs[:1], wq, ws)
    assert (one == numpy_fp8.scaled_gemm(xq, xs, wq, ws)[:1]).all()
