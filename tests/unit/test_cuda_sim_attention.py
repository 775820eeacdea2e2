"""The tensor-core attention kernels (attention_tc.cu and attention_wg.cu, the sources NVRTC
compiles) run on the host simulator in tests/cuda_sim and match the numpy twin: every tiling the
plan picks, ragged and paged batches, GQA groups, split keys. Asynchronous copies and wgmma
products land at their waits unless a test says otherwise, so a missing wait fails. On a GPU,
tests/gpu/test_cuda_ops.py runs the same kernels for real; here CI checks their indexing,
fragment layouts and waits without one."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_sim import SimAttention, SimUnavailable
from tests.cuda_sim import bf16_bits as _bits
from tests.cuda_sim import bf16_float as _float
from vt.kernels.attention_plan import (
    DEFAULT_PREFILL_TILING,
    FALLBACK_PREFILL_TILING,
    PREFILL_TILINGS,
    attention_kernel,
    combine_key_tile,
)
from vt.kernels.numpy_fp8 import to_e4m3
from vt.kernels.numpy_ops import NumpyBackend

BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def sim():
    try:
        return SimAttention()
    except SimUnavailable as e:
        pytest.skip(str(e))


def _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, bs):
    """bf16 q and caches (as bits), each sequence's blocks drawn from a shuffled pool; table
    padding holds an out-of-range block id that attention must never read."""
    need = [-(-c // bs) for c in ctx_lens]
    nblk = sum(need) + 2
    pool = list(rng.permutation(nblk))
    table = np.full((len(q_lens), max(need) + 1), 10**6, np.int32)
    for b, n in enumerate(need):
        table[b, :n] = [pool.pop() for _ in range(n)]
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = _bits(rng.standard_normal((int(qsl[-1]), hq, d)))
    kc = _bits(rng.standard_normal((nblk, bs, hk, d)))
    vc = _bits(rng.standard_normal((nblk, bs, hk, d)))
    return q, kc, vc, qsl, np.asarray(ctx_lens, np.int32), table


def _rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _check(sim, rng, q_lens, ctx_lens, hq, hk, d, splits=1, tiling=DEFAULT_PREFILL_TILING, bs=16, late=True,
           order=0, kv_scales=None):
    """kv_scales: an fp8 cache (e4m3 codes spanning the format's range) read with these scales."""
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, bs)
    scale = d**-0.5
    if kv_scales is not None:
        kc, vc = (to_e4m3(_float(c) * 40) for c in (kc, vc))
        ref = NumpyBackend().attention(_float(q), kc, vc, qsl, seq_lens, table, scale, max(q_lens),
                                       max(ctx_lens), kv_scales=kv_scales)
        kc, vc = kc.view(np.uint8), vc.view(np.uint8)
    else:
        ref = NumpyBackend().attention(_float(q), _float(kc), _float(vc), qsl, seq_lens, table, scale,
                                       max(q_lens), max(ctx_lens))
    plan = attention_kernel(hq // hk, max(q_lens), d, prefill=tiling, kv8=kv_scales is not None)
    grid = (plan.row_tiles, hk, len(q_lens) * splits)
    out = sim.launch(plan.name, grid, plan.threads, plan.smem, q, kc, vc, qsl, seq_lens, table, scale, splits,
                     late=late, order=order, kv_scales=kv_scales or (1.0, 1.0),
                     key_tile=combine_key_tile(plan, max(q_lens)))
    assert _rel_err(_float(out), ref) < BF16_TOL, plan.name
    return plan.name


@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hk,d,kernel",
    [
        ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2, 128, "prefill"),  # prefill, decode, chunked prefill
        ([70, 33], [70, 100], 4, 4, 64, "prefill"),  # no GQA, head dim 64, multi-tile prefill
        ([150, 1, 40], [150, 200, 230], 8, 2, 128, "prefill"),  # several row and key tiles
        ([4, 1, 2], [30, 100, 70], 16, 4, 128, "decode"),  # short spans through 16-row tiles
        ([1, 1, 1], [64, 65, 130], 16, 1, 64, "decode"),  # group 16, key counts on and past tile edges
        ([1] * 4, [1, 15, 17, 150], 64, 8, 128, "decode8"),  # group 8 fills the transposed tiles
        ([3, 4, 1, 2], [40, 130, 77, 2], 4, 2, 128, "decode8"),  # several tokens a tile, causal
    ],
)
def test_tensor_core_attention_matches_numpy(sim, q_lens, ctx_lens, hq, hk, d, kernel):
    rng = np.random.default_rng(len(q_lens) * 1000 + sum(ctx_lens))
    name = _check(sim, rng, q_lens, ctx_lens, hq, hk, d)
    assert name.endswith("_" + kernel)  # the plan picked the tiling this case is meant for


@pytest.mark.parametrize("tiling", sorted(PREFILL_TILINGS))
@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hk,d",
    [
        ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2, 128),  # prefill, decode, chunked prefill
        ([70, 33], [70, 100], 4, 4, 64),  # no GQA, head dim 64, one 128-row tile per sequence
        ([150, 1, 40], [150, 200, 230], 8, 2, 128),  # several row and key tiles, chunked prefill
        ([37], [300], 16, 2, 64),  # group 8: a tile's rows span 16 positions, keys past tile edges
        ([200], [200], 4, 1, 128),  # a warp's m-tiles at different causal limits in every tile
    ],
)
@pytest.mark.parametrize("late", [True, False], ids=["late", "early"])
def test_every_prefill_tiling_matches_numpy(sim, tiling, q_lens, ctx_lens, hq, hk, d, late):
    """late: copies and wgmma products land at their waits (a missing wait reads stale data);
    early: at issue (a stage refilled while another warp still reads it shows)."""
    rng = np.random.default_rng(sum(ctx_lens) + hq)
    name = _check(sim, rng, q_lens, ctx_lens, hq, hk, d, tiling=tiling, late=late)
    t = PREFILL_TILINGS[tiling if d in PREFILL_TILINGS[tiling].head_dims else FALLBACK_PREFILL_TILING]
    assert name == t.kernel.format(d=d)


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk", [
    ([300], [300], 32, 8),  # Qwen3-8B's heads: 10 row tiles a kv head, warpgroups at different limits
    ([64, 200], [600, 200], 8, 2),  # a chunk deep in its context beside a whole prompt
    ([33, 1, 90], [97, 5, 90], 16, 2),  # group 8, a decode row among prompts, partial tiles
])
@pytest.mark.parametrize("tiling", ["wg", "wg3", "wgp", "wgv", "wgr", "wgs", "wgw", "wgwp"])
@pytest.mark.parametrize("order", [0, 1, 2, 3], ids=["round-robin", "low-first", "high-first", "random"])
def test_wgmma_prefill_on_qwen3_shapes(sim, tiling, q_lens, ctx_lens, hq, hk, order):
    """attention_wg.cu (wgmma, warpgroups of 64 rows) on more shapes than the shared cases, with
    threads switched in four orders: its warpgroups share Vt and meet only at barriers, and an
    order that lets one run ahead shows a barrier missing between them."""
    name = _check(sim, np.random.default_rng(5), q_lens, ctx_lens, hq, hk, 128, tiling=tiling, order=order)
    assert name == PREFILL_TILINGS[tiling].kernel.format(d=128)


@pytest.mark.parametrize("tiling", ["wg", "wg3", "wgp", "wgv", "wgr", "wgs", "wgw", "wgwp"])
@pytest.mark.parametrize("late,order", [(True, 0), (False, 0), (False, 1), (False, 2)],
                         ids=["late", "early", "early-low-first", "early-high-first"])
def test_wgmma_prefill_over_many_key_tiles(sim, tiling, late, order):
    """Chunks deep in their contexts, so that every stage of the K/V pipeline is refilled
    several times (seven 128-key tiles, fourteen of 64): a stage refilled while a product still
    reads it shows when copies land at issue, one read before its copy landed when they land
    late. The shared cases above have at most three 128-key tiles, too few for wgr's stages."""
    _check(sim, np.random.default_rng(17), [40, 3], [900, 700], 8, 2, 128, tiling=tiling, late=late,
           order=order)


@pytest.mark.parametrize("tiling", sorted(PREFILL_TILINGS))
@pytest.mark.parametrize("order", [1, 2], ids=["low-first", "high-first"])
def test_prefill_tilings_with_one_warp_running_ahead(sim, tiling, order):
    """Threads switched so that the lowest (or highest) warps run ahead as far as the barriers
    let them: a barrier missing between warps of the K/V pipeline shows here."""
    _check(sim, np.random.default_rng(13), [150, 1, 40], [150, 200, 230], 8, 2, 128, tiling=tiling,
           order=order)


@pytest.mark.parametrize("tiling", sorted(PREFILL_TILINGS))
def test_prefill_tilings_with_split_keys(sim, tiling):
    _check(sim, np.random.default_rng(11), [60, 9], [260, 140], 8, 2, 128, splits=3, tiling=tiling)


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk,d,splits", [
    ([1, 1], [300, 200], 8, 2, 128, 3),  # decode tiles, uneven key slices
    ([40, 1], [250, 90], 8, 2, 64, 2),  # prefill tiles with split keys, a split past the keys
])
def test_split_keys_combine_to_the_same_attention(sim, q_lens, ctx_lens, hq, hk, d, splits):
    _check(sim, np.random.default_rng(7), q_lens, ctx_lens, hq, hk, d, splits=splits)


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk,d,splits", [
    ([3, 2], [20, 9], 8, 1, 256, 1),  # head dim 256, MQA: attention_r4
    ([1, 1, 1], [40, 70, 33], 8, 4, 96, 1),  # decode rows, head dim 96: attention_r1
    ([1, 1], [300, 130], 16, 2, 256, 3),  # group 8 decode (attention_r2) with split keys
    ([37], [90], 4, 2, 80, 2),  # a chunk deep in its context, head dim 80
])
def test_cuda_core_attention_matches_numpy(sim, q_lens, ctx_lens, hq, hk, d, splits):
    """Head dims without a tensor-core kernel run attention.cu's CUDA-core kernels."""
    name = _check(sim, np.random.default_rng(d + hq), q_lens, ctx_lens, hq, hk, d, splits=splits)
    assert name.startswith("attention_r")


# ---- the decode combine: only the splits that hold keys ------------------------------------------
COMBINE_SPLITS = 40  # what key_splits gives a batch-1 decode graph sized for a long context


def _active_splits(seq_len: int, key_tile: int, splits: int) -> int:
    """The splits a decode row's keys land in: attn_block's chunking (cuda_common.cu's key_chunks),
    split s taking tiles [s * chunk, (s + 1) * chunk) of the ntiles."""
    ntiles = -(-seq_len // key_tile)
    chunk = -(-ntiles // splits)
    return -(-ntiles // chunk) if chunk else 0


def _decode_partials(sim, q_lens, ctx_lens, hq, hk, d, kv8, seed):
    """A decode launch over COMBINE_SPLITS splits on the host simulator: the plan, the batch's
    query_start_loc and seq_lens, the split partials and the all-splits merge (checked against
    numpy)."""
    rng = np.random.default_rng(seed)
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, d, 16)
    scale, kv_scales = d**-0.5, KV8_SCALES if kv8 else (1.0, 1.0)
    if kv8:
        kc, vc = (to_e4m3(_float(c) * 40) for c in (kc, vc))
        ref = NumpyBackend().attention(_float(q), kc, vc, qsl, seq_lens, table, scale, 1, max(ctx_lens),
                                       kv_scales=kv_scales)
        kc, vc = kc.view(np.uint8), vc.view(np.uint8)
    else:
        ref = NumpyBackend().attention(_float(q), _float(kc), _float(vc), qsl, seq_lens, table, scale, 1,
                                       max(ctx_lens))
    plan = attention_kernel(hq // hk, 1, d, kv8=kv8)
    grid = (plan.row_tiles, hk, len(q_lens) * COMBINE_SPLITS)
    out, part_o, part_ml = sim.partials(plan.name, grid, plan.threads, plan.smem, q, kc, vc, qsl, seq_lens,
                                        table, scale, COMBINE_SPLITS, kv_scales=kv_scales)
    full = sim.combine(part_o, part_ml, qsl, seq_lens, out.copy())
    assert _rel_err(_float(full), ref) < BF16_TOL, plan.name
    return plan, qsl, seq_lens, part_o, part_ml, full


def _poison(part_o, part_ml, splits: slice, token: int) -> None:
    """Partials a merge must not read: a finite m (an m of -inf or NaN weighs nothing) over NaN o."""
    part_o[splits, token] = np.nan
    part_ml[splits, token] = (0.0, 1.0)


@pytest.mark.parametrize("hq,hk,d,kv8,kernel", [
    (8, 2, 128, False, "attention_tc_d128_decode8"),
    (16, 1, 64, False, "attention_tc_d64_decode"),
    (8, 2, 128, True, "attention_tc_d128_decode8_kv8"),
    (16, 1, 64, True, "attention_tc_d64_decode_kv8"),
    (8, 4, 96, False, "attention_r1"),
    (16, 2, 256, True, "attention_r2_kv8"),
])
def test_decode_combine_reads_only_the_splits_holding_keys(sim, hq, hk, d, kv8, kernel):
    """A decode launch split for a long context over short, varied ones: the combine told the
    kernel's key tile merges only the splits that hold each row's keys, bit for bit the merge of
    every split. The others carry m = -inf, and are poisoned before the combine runs: reading
    one shows. Told a wrong tile (4x or a quarter), it reads the wrong splits and differs."""
    plan = attention_kernel(hq // hk, 1, d, kv8=kv8)
    assert plan.name == kernel
    kt = combine_key_tile(plan, 1)
    # one key; one tile (one split); a tile and a key; partial tiles; 384 keys (at 64 a tile);
    # one tile a split (every split); a tile more (two tiles a split, 21 splits)
    ctx = [1, kt, kt + 1, 3 * kt + 17, 6 * kt, COMBINE_SPLITS * kt, COMBINE_SPLITS * kt + 1]
    plan, qsl, seq_lens, part_o, part_ml, full = _decode_partials(sim, [1] * len(ctx), ctx, hq, hk, d, kv8,
                                                                  d + hq + kv8)
    active = [_active_splits(c, kt, COMBINE_SPLITS) for c in ctx]
    assert active == [1, 1, 2, 4, 6, 40, 21]
    for b, n in enumerate(active):  # the kernel's chunking is the one mirrored here
        m = part_ml[:, b, :, 0]
        assert np.isfinite(m[:n]).all() and (m[n:] == -np.inf).all(), b
        _poison(part_o, part_ml, slice(n, None), b)
    got = sim.combine(part_o, part_ml, qsl, seq_lens, np.zeros_like(full), key_tile=kt)
    np.testing.assert_array_equal(got, full)
    for wrong in (4 * kt, kt // 4):
        told = sim.combine(part_o, part_ml, qsl, seq_lens, np.zeros_like(full), key_tile=wrong)
        assert not np.array_equal(told, full), wrong


def test_decode_combine_after_a_sequence_without_a_token_reads_every_split(sim):
    """A row's sequence is its token's index only while every sequence before has one token:
    after an empty one (token 1 is sequence 2's, of 2600 keys in 21 splits; sequence 1 has 700
    keys in 11), the combine merges every split and still gives the all-splits bits. The splits
    past sequence 0's keys are poisoned: its row still reads only its own."""
    q_lens, ctx = [1, 0, 1, 1], [1, 700, 2600, 65]
    plan, qsl, seq_lens, part_o, part_ml, full = _decode_partials(sim, q_lens, ctx, 8, 2, 128, False, 41)
    kt = combine_key_tile(plan, 1)
    _poison(part_o, part_ml, slice(1, None), 0)
    got = sim.combine(part_o, part_ml, qsl, seq_lens, np.zeros_like(full), key_tile=kt)
    np.testing.assert_array_equal(got, full)


def test_the_simulator_sees_a_wrong_fragment_layout(sim):
    """A kernel run through a simulator that got ldmatrix or mma wrong would still 'pass' against
    a lenient check; this one reads V through the decode8 kernel's transposed path and must fail
    when the output is compared against attention with V's rows shuffled."""
    rng = np.random.default_rng(3)
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, [1, 1], [40, 70], 8, 2, 64, 16)
    scale = 64**-0.5
    plan = attention_kernel(4, 1, 64)
    out = _float(sim.launch(plan.name, (plan.row_tiles, 2, 2), plan.threads, plan.smem, q, kc, vc, qsl,
                            seq_lens, table, scale, 1))
    nb = NumpyBackend()
    ref = nb.attention(_float(q), _float(kc), _float(vc), qsl, seq_lens, table, scale, 1, 70)
    wrong = nb.attention(_float(q), _float(kc), _float(vc)[:, ::-1], qsl, seq_lens, table, scale, 1, 70)
    assert _rel_err(out, ref) < BF16_TOL
    assert _rel_err(out, wrong) > 0.1


@pytest.mark.parametrize("tiling", ["r64", "m2", "wgp", "wgv", "wgr"])
def test_a_plan_short_of_shared_memory_fails_the_launch(sim, tiling):
    """The simulator guards the bytes after a launch's shared memory, so the sizes
    attention_plan computes by hand (tc_smem, wg_smem, wgr_smem) are checked against what the kernels
    write: the plan passes above, and 4 KB less fails."""
    q, kc, vc, qsl, seq_lens, table = _paged_batch(np.random.default_rng(1), [150], [150], 8, 2, 128, 16)
    plan = attention_kernel(4, 150, 128, prefill=tiling)
    with pytest.raises(ValueError, match="wrote past"):
        sim.launch(plan.name, (plan.row_tiles, 2, 1), plan.threads, plan.smem - 4096, q, kc, vc, qsl,
                   seq_lens, table, 128**-0.5, 1)


# ---- an fp8 (e4m3) KV cache: the _kv8 kernels ----------------------------------------------------
KV8_SCALES = (0.025, 0.04)  # keys and values of about unit size from codes spanning e4m3's range


@pytest.mark.parametrize(
    "q_lens,ctx_lens,hq,hk,d,kernel",
    [
        ([1] * 4, [1, 15, 17, 150], 64, 8, 128, "decode8"),  # group 8 decode: the transposed tiles
        ([3, 4, 1, 2], [40, 130, 77, 2], 4, 2, 128, "decode8"),  # several tokens a tile, causal
        ([1, 1], [700, 333], 32, 8, 128, "decode8"),  # 8B's decode: every stage refilled, twice
        ([4, 1], [500, 261], 16, 4, 64, "decode"),  # 16-row tiles over many key tiles, head dim 64
        ([1, 1, 1], [64, 65, 130], 16, 1, 64, "decode"),  # group 16, keys on and past tile edges
        ([4, 1, 2], [30, 100, 70], 16, 4, 128, "decode"),  # 16-row tiles
        ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2, 128, "wgr_d128_prefill_kv8"),  # prompt, decode, chunk
        ([70, 33], [70, 100], 4, 4, 64, "tc_d64_prefill_kv8"),  # head dim 64, multi-tile prompt: r64
    ],
)
@pytest.mark.parametrize("late", [True, False], ids=["late", "early"])
def test_fp8_kv_tensor_core_attention_matches_numpy(sim, q_lens, ctx_lens, hq, hk, d, kernel, late):
    """The _kv8 kernels read e4m3 codes as code * scale, the numpy twin's fp8 cache: the codes
    widen to bf16 exactly, so the bf16 cache's tolerance holds. Prompts run the default tiling's
    fp8 kernel (wgr's) at head dim 128, the fallback's at 64."""
    rng = np.random.default_rng(len(q_lens) * 100 + sum(ctx_lens))
    name = _check(sim, rng, q_lens, ctx_lens, hq, hk, d, late=late, kv_scales=KV8_SCALES)
    assert name.endswith("_" + kernel + ("" if kernel.endswith("_kv8") else "_kv8")), name


@pytest.mark.parametrize("tiling", sorted(t for t, p in PREFILL_TILINGS.items() if p.kv8_smem is not None))
@pytest.mark.parametrize("order", [0, 1, 2], ids=["round-robin", "low-first", "high-first"])
def test_fp8_kv_prefill_tilings_match_numpy(sim, tiling, order):
    """Every tiling with fp8 kernels, over many key tiles (each fp8 stage refilled several times)
    with warps switched so one runs ahead: a missing barrier around the conversion shows."""
    name = _check(sim, np.random.default_rng(19), [150, 1, 40], [400, 200, 230], 8, 2, 128, tiling=tiling,
                  order=order, kv_scales=KV8_SCALES)
    assert name == PREFILL_TILINGS[tiling].kernel.format(d=128) + "_kv8"


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk,d,splits", [
    ([1, 1], [300, 200], 8, 2, 128, 3),  # decode tiles, uneven key slices: v_scale on the partials
    ([40, 1], [250, 90], 8, 2, 64, 2),  # prompt tiles with split keys
    ([1, 1, 1], [40, 70, 33], 8, 4, 96, 1),  # head dim 96: attention_r1_kv8
    ([3, 2], [20, 9], 8, 1, 256, 1),  # head dim 256, MQA: attention_r4_kv8
    ([1, 1], [300, 130], 16, 2, 256, 3),  # attention_r2_kv8 with split keys
])
def test_fp8_kv_split_keys_and_cuda_cores_match_numpy(sim, q_lens, ctx_lens, hq, hk, d, splits):
    name = _check(sim, np.random.default_rng(d + splits), q_lens, ctx_lens, hq, hk, d, splits=splits,
                  kv_scales=KV8_SCALES)
    assert name.endswith("_kv8")


@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk,splits", [
    ([60, 9], [260, 140], 8, 2, 3),  # split keys: v_scale on the partials
    ([40, 1], [250, 90], 8, 2, 2),  # a split past the keys: no tile, one zero P V
    ([33, 1, 90], [97, 5, 90], 16, 2, 1),  # group 8, a decode row among prompts, partial tiles
    ([300], [300], 32, 8, 1),  # Qwen3-8B's heads: warpgroups at different causal limits
])
def test_fp8_kv_wgr_matches_numpy(sim, q_lens, ctx_lens, hq, hk, splits):
    """wgr's fp8 kernel (the default prompt tiling on sm_90) on the shapes the other prompt cases
    use: its fp8 stages converted into the swizzled bf16 tiles the wgmma products read."""
    name = _check(sim, np.random.default_rng(23 + splits), q_lens, ctx_lens, hq, hk, 128, splits=splits,
                  tiling="wgr", kv_scales=KV8_SCALES)
    assert name == "attention_wgr_d128_prefill_kv8"


@pytest.mark.parametrize("late,order", [(True, 0), (False, 0), (False, 1), (False, 2)],
                         ids=["late", "early", "early-low-first", "early-high-first"])
def test_fp8_kv_wgr_over_many_key_tiles(sim, late, order):
    """Seven 128-key tiles, so that every fp8 stage is refilled and every bf16 tile converted
    several times: a conversion before its copy landed shows when copies land late, a stage
    refilled or a tile overwritten while still read when they land at issue or one warp runs
    ahead."""
    _check(sim, np.random.default_rng(29), [40, 3], [900, 700], 8, 2, 128, tiling="wgr", late=late,
           order=order, kv_scales=KV8_SCALES)


def test_fp8_kv_wgr_plan_short_of_shared_memory_fails_the_launch(sim):
    """attention_plan.wgr_smem(kv8=True) is what the fp8 kernel writes: 4 KB less fails."""
    q, kc, vc, qsl, seq_lens, table = _paged_batch(np.random.default_rng(1), [150], [150], 8, 2, 128, 16)
    kc, vc = (to_e4m3(_float(c) * 40).view(np.uint8) for c in (kc, vc))
    plan = attention_kernel(4, 150, 128, prefill="wgr", kv8=True)
    assert plan.name == "attention_wgr_d128_prefill_kv8"
    sim.launch(plan.name, (plan.row_tiles, 2, 1), plan.threads, plan.smem, q, kc, vc, qsl, seq_lens, table,
               128**-0.5, 1, kv_scales=KV8_SCALES)
    with pytest.raises(ValueError, match="wrote past"):
        sim.launch(plan.name, (plan.row_tiles, 2, 1), plan.threads, plan.smem - 4096, q, kc, vc, qsl,
                   seq_lens, table, 128**-0.5, 1, kv_scales=KV8_SCALES)


@pytest.mark.parametrize(("q_len", "hk", "d", "tiling"), [
    (1, 2, 128, DEFAULT_PREFILL_TILING),  # decode: the transposed tiles
    (20, 2, 128, DEFAULT_PREFILL_TILING),  # a prompt on the default tiling (wgr's fp8 kernel)
    (20, 4, 64, FALLBACK_PREFILL_TILING),  # a prompt on mma.sync tiles
    (1, 1, 256, DEFAULT_PREFILL_TILING),  # head dim 256: the CUDA-core kernel
])
def test_every_e4m3_code_reads_back_exactly(sim, q_len, hk, d, tiling):
    """A prompt's first token sees one key, so its output is that key's V row times v_scale: each
    of the 254 finite codes, laid over the V row's heads and dims, must come back as its e4m3 value
    (bf16 holds every one), subnormals included."""
    codes = np.arange(hk * d) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes: the cache never holds them
    rng = np.random.default_rng(d + q_len)
    q, _, _, qsl, seq_lens, table = _paged_batch(rng, [q_len], [q_len], hk, hk, d, 16)
    kc = np.zeros((table.max(initial=0, where=table < 10**6) + 1, 16, hk, d), np.uint8)
    vc = kc.copy()
    vc[table[0, 0], 0] = codes.reshape(hk, d)  # key 0
    plan = attention_kernel(1, q_len, d, prefill=tiling, kv8=True)
    out = sim.launch(plan.name, (plan.row_tiles, hk, 1), plan.threads, plan.smem, q, kc, vc, qsl, seq_lens,
                     table, d**-0.5, 1, kv_scales=(1.0, 1.0))
    want = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(hk, d)
    np.testing.assert_array_equal(_float(out)[0], want)


# ---- wgq: Q K^T in e4m3 over an fp8 cache (each q row e4m3 x 2^n) -------------------------------

@pytest.mark.parametrize("q_lens,ctx_lens,hq,hk,splits", [
    ([5, 1, 17, 1], [5, 40, 60, 7], 8, 2, 1),  # prompt, decode, chunk
    ([60, 9], [260, 140], 8, 2, 3),  # split keys
    ([33, 1, 90], [97, 5, 90], 16, 2, 1),  # group 8, partial tiles
    ([300], [300], 32, 8, 1),  # Qwen3-8B's heads: warpgroups at different causal limits
])
@pytest.mark.parametrize("late,order", [(True, 0), (False, 0), (False, 2)],
                         ids=["late", "early", "high-first"])
def test_fp8_qk_prompt_kernel_matches_numpy_on_rounded_queries(sim, q_lens, ctx_lens, hq, hk, splits, late,
                                                                order):
    """attention_wgq_d128_prefill_kv8 rounds each q row to e4m3 x 2^n as it loads Q and multiplies
    codes by the fp8 K stage's codes on the e4m3 tensor cores: on queries the numpy twin has
    rounded the same way (quantize_rows_pow2) it is the twin's attention; on raw bf16 queries too,
    since it rounds them as the twin does."""
    from vt.kernels.attention_plan import wgq_smem
    from vt.kernels.numpy_fp8 import quantize_rows_pow2

    rng = np.random.default_rng(31 + splits + hq)
    q, kc, vc, qsl, seq_lens, table = _paged_batch(rng, q_lens, ctx_lens, hq, hk, 128, 16)
    q = _bits(_float(q) * rng.uniform(0.01, 50, (q.shape[0], hq, 1)))  # rows of every size
    kc, vc = (to_e4m3(_float(c) * 40) for c in (kc, vc))
    rounded = quantize_rows_pow2(_float(q))
    ref = NumpyBackend().attention(rounded, kc, vc, qsl, seq_lens, table, 128**-0.5, max(q_lens),
                                   max(ctx_lens), kv_scales=KV8_SCALES)
    kc, vc = kc.view(np.uint8), vc.view(np.uint8)
    rows = max(q_lens) * (hq // hk)
    grid = (-(-rows // 128), hk, len(q_lens) * splits)
    for queries in (_bits(rounded), q):
        out = sim.launch("attention_wgq_d128_prefill_kv8", grid, 256, wgq_smem(), queries, kc, vc, qsl,
                         seq_lens, table, 128**-0.5, splits, late=late, order=order, kv_scales=KV8_SCALES)
        assert _rel_err(_float(out), ref) < BF16_TOL


def test_pow2_rounding_of_query_rows_is_idempotent_and_within_an_e4m3_step():
    from vt.kernels.numpy_fp8 import quantize_rows_pow2

    rng = np.random.default_rng(7)
    x = (rng.standard_normal((50, 128)) * rng.uniform(1e-3, 1e3, (50, 1))).astype(np.float32)
    x[3] = 0.0
    once = quantize_rows_pow2(x)
    np.testing.assert_array_equal(quantize_rows_pow2(once), once)
    np.testing.assert_array_equal(_float(_bits(once)), once)  # exact in bf16
    amax = np.abs(x).max(axis=1, keepdims=True)
    assert (np.abs(once - x) <= amax / 16 + 1e-30).all() and not once[3].any()


def test_fp8_qk_prompts_take_the_e4m3_kernel_only_where_wgr_would_run():
    """qk8 changes only the prompts that wgr's fp8 kernel (the default tiling's) would run."""
    from vt.kernels.attention_plan import QK8_KERNEL

    assert attention_kernel(4, 300, 128, kv8=True, qk8=True).name == QK8_KERNEL
    assert attention_kernel(4, 300, 128, kv8=True).name == "attention_wgr_d128_prefill_kv8"
    assert attention_kernel(4, 300, 128, kv8=False, qk8=True).name != QK8_KERNEL  # a bf16 cache
    assert attention_kernel(4, 1, 128, kv8=True, qk8=True).name.endswith("decode8_kv8")  # decode
    assert attention_kernel(4, 300, 64, kv8=True, qk8=True).name != QK8_KERNEL  # head dim 64
    assert attention_kernel(4, 300, 128, kv8=True, qk8=True, prefill="r64").name != QK8_KERNEL
