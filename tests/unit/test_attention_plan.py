"""The launch rules of the CUDA attention: which kernel a batch gets, and key splits that fill
the chip's last wave of blocks."""

from __future__ import annotations

import math

import pytest

from vt.kernels.attention_plan import (
    CUDA_CORE_KEY_TILE,
    PREFILL_TILINGS,
    TC_KEY_TILE,
    TC_MAX_CACHE_ELEMS,
    attention_kernel,
    combine_key_tile,
    key_splits,
    launch_shape,
    tc_smem,
)
from vt.kernels.sources import translation_unit


def test_item_kernels_get_a_1d_grid_and_the_item_space_others_their_3d_grid():
    wgs = attention_kernel(4, 1000, 128, prefill="wgs")  # 4000 rows: 32 row tiles
    assert launch_shape(wgs.name, wgs.row_tiles, 8, 6, 132) == ((32, 8, 6), ())
    wgw = attention_kernel(4, 1000, 128, prefill="wgw")
    assert (wgw.name, wgw.threads) == ("attention_wgw_d128_prefill", 384)
    assert launch_shape(wgw.name, wgw.row_tiles, 8, 6, 132) == ((32 * 8 * 6, 1, 1), (32, 6))  # one an item
    wgwp = attention_kernel(4, 1000, 128, prefill="wgwp")
    assert launch_shape(wgwp.name, wgwp.row_tiles, 8, 6, 132) == ((132, 1, 1), (32, 6))  # a block an SM
    assert launch_shape(wgwp.name, 1, 8, 2, 132) == ((16, 1, 1), (1, 2))  # never more blocks than items
    # an fp8 cache's prompts run wgr's kernel (3-D grid) on both
    assert launch_shape(attention_kernel(4, 1000, 128, prefill="wgwp", kv8=True).name, 32, 8, 6, 132)[1] == ()


def test_decode_rows_take_the_key_sharing_kernels_and_long_spans_the_prefill_one():
    assert attention_kernel(4, 1, 128)[:3] == ("attention_tc_d128_decode8", True, 1)
    assert attention_kernel(8, 1, 64)[:3] == ("attention_tc_d64_decode8", True, 1)  # 8 rows
    assert attention_kernel(2, 4, 128)[:3] == ("attention_tc_d128_decode8", True, 1)  # 4 tokens x 2
    assert attention_kernel(16, 1, 128)[:3] == ("attention_tc_d128_decode", True, 1)  # 16 rows
    assert attention_kernel(4, 4, 128)[:3] == ("attention_tc_d128_decode", True, 1)  # 16 rows
    assert attention_kernel(4, 5, 128)[:3] == ("attention_wgwp_d128_prefill", True, 1)  # 20 rows: default
    assert attention_kernel(4, 5, 128, prefill="wgs")[:3] == ("attention_wgs_d128_prefill", True, 1)
    assert attention_kernel(4, 5, 128, prefill="wgr")[:3] == ("attention_wgr_d128_prefill", True, 1)
    assert attention_kernel(4, 5, 128, prefill="r64")[:3] == ("attention_tc_d128_prefill", True, 1)
    # wgs has no fp8-cache kernel: an fp8 cache's prompts take wgr's, decodes stay on theirs
    wgs_kv8 = attention_kernel(4, 5, 128, prefill="wgs", kv8=True)
    assert wgs_kv8[:3] == ("attention_wgr_d128_prefill_kv8", True, 1)
    assert attention_kernel(4, 1, 128, kv8=True)[0] == "attention_tc_d128_decode8_kv8"
    # wgs and wgr have head dim 128 only: 64 runs on the fallback, r64, with an fp8 cache too
    assert attention_kernel(2, 1000, 64)[:3] == ("attention_tc_d64_prefill", True, 32)
    assert attention_kernel(2, 1000, 64, kv8=True)[0] == "attention_tc_d64_prefill_kv8"
    k = attention_kernel(8, 3, 256)  # no tensor-core kernel for 256
    assert (k.name, k.tensor_cores) == ("attention_r4", False)
    # a cache past the tensor-core kernels' 32-bit offsets (16-byte units) takes the CUDA cores
    assert attention_kernel(4, 1, 128, TC_MAX_CACHE_ELEMS - 8)[0] == "attention_tc_d128_decode8"
    assert attention_kernel(4, 1, 128, TC_MAX_CACHE_ELEMS)[:2] == ("attention_r1", False)


def test_the_combine_gets_the_decode_kernels_key_tile():
    """A launch of one query row a sequence on a decode kernel: its key tile (the constants the
    kernel files are built with), so the combine repeats its chunking; prompts, and decode rows on a
    prompt tiling (GQA groups over 16), merge every split (0)."""
    assert (CUDA_CORE_KEY_TILE, TC_KEY_TILE) == (32, 64)
    assert f"#define KT {CUDA_CORE_KEY_TILE}\n" in translation_unit("attention.cu")
    assert f"#define TC_KT {TC_KEY_TILE}\n" in translation_unit("attention_tc.cu")
    for group, d, kv8, name in [
        (4, 128, False, "attention_tc_d128_decode8"),
        (4, 128, True, "attention_tc_d128_decode8_kv8"),
        (16, 64, False, "attention_tc_d64_decode"),
        (16, 64, True, "attention_tc_d64_decode_kv8"),
    ]:
        k = attention_kernel(group, 1, d, kv8=kv8)
        assert k.name == name
        assert combine_key_tile(k, 1) == TC_KEY_TILE
        assert combine_key_tile(k, 2) == 0  # a row tile of several tokens: they see different keys
    for group, d, cache, name in [(8, 256, 0, "attention_r2"), (4, 128, TC_MAX_CACHE_ELEMS, "attention_r1")]:
        k = attention_kernel(group, 1, d, cache)
        assert k.name == name
        assert combine_key_tile(k, 1) == CUDA_CORE_KEY_TILE
        assert combine_key_tile(k, 3) == 0
    wide = attention_kernel(32, 1, 128)  # 32 rows a kv head: the prompt tiling
    assert not wide.name.startswith("attention_tc_d128_decode") and combine_key_tile(wide, 1) == 0
    assert combine_key_tile(attention_kernel(4, 300, 128), 300) == 0


def test_prefill_tilings_size_their_blocks():
    """A 128-row tiling halves the row tiles; each launch's threads and shared memory are the
    tiling's (m2 adds its staged Q rows to two K/V stages)."""
    r64 = attention_kernel(4, 1000, 128, prefill="r64")
    w8 = attention_kernel(4, 1000, 128, prefill="w8")
    m2 = attention_kernel(4, 1000, 128, prefill="m2")
    assert (r64.name, r64.row_tiles, r64.threads) == ("attention_tc_d128_prefill", 63, 128)
    assert (w8.name, w8.row_tiles, w8.threads, w8.smem) == ("attention_tc_d128_prefill_w8", 32, 256, r64.smem)
    assert (m2.name, m2.row_tiles, m2.threads) == ("attention_tc_d128_prefill_m2", 32, 128)
    assert m2.smem == tc_smem(128, 2) + 128 * 136 * 2
    wg = attention_kernel(4, 1000, 128, prefill="wg")
    assert (wg.name, wg.row_tiles, wg.threads) == ("attention_wg_d128_prefill", 32, 256)
    wgp = attention_kernel(4, 1000, 128, prefill="wgp")
    assert wgp.smem == wg.smem + 128 * 128 + 2 * 64 * 128  # a second Vt and a second P per warpgroup
    wgv = attention_kernel(4, 1000, 128, prefill="wgv")  # V as K: no staging, no Vt; a third stage
    k_tile, v_staging, vt = 64 * 256, 64 * 136 * 2, 128 * 128
    assert wgv.smem == wgp.smem - 2 * v_staging - 2 * vt + 2 * k_tile + (2 * k_tile + 64 * 4)
    # wgr: 128-key tiles (K and V 32 KB each a stage), three stages, no P buffers: just within the
    # 232,448 bytes (227 KB) an sm_90 block may opt into
    wgr = attention_kernel(4, 1000, 128, prefill="wgr")
    assert (wgr.name, wgr.row_tiles, wgr.threads) == ("attention_wgr_d128_prefill", 32, 256)
    assert wgr.smem == 1024 + 128 * 256 + 3 * (2 * 128 * 256 + 128 * 4) + 16 == 231952
    assert wgr.smem <= 227 * 1024
    # no wgmma kernel for head dim 64: the fallback tiling
    assert attention_kernel(4, 1000, 64, prefill="wg").name == "attention_tc_d64_prefill"
    # decode rows keep their kernels whatever the prefill tiling
    for t in PREFILL_TILINGS:
        assert attention_kernel(4, 1, 128, prefill=t).name == "attention_tc_d128_decode8"
    # two m2 blocks fit an SM's shared memory (228 KB, 1 KB reserved a block)
    assert 2 * (m2.smem + 1024) <= 228 * 1024


@pytest.mark.parametrize("blocks", [8, 256, 512, 1024, 2048, 3000])
def test_splits_fill_the_last_wave_or_do_their_best(blocks):
    resident = 396
    s = key_splits(blocks, resident, 40960)
    waves = blocks * s / resident
    fill = waves / math.ceil(waves)
    better = [t for t in range(1, s) if (w := blocks * t / resident) / math.ceil(w) >= 0.9]
    assert not better  # no fewer splits already fill the last wave
    assert fill >= 0.9 or s == 64


def test_splits_keep_256_keys_each_and_leave_full_grids_alone():
    assert key_splits(8, 396, 512) == 2  # at most ceil(512 / 256) splits
    assert key_splits(8, 396, 100) == 1
    assert key_splits(8 * 396, 396, 40960) == 1
    assert key_splits(512, 396, 40960) == 3  # 1.29 waves -> 3.88 waves
