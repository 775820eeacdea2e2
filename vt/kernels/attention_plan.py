"""Which attention kernel a batch runs and how its keys are split across blocks (no CuPy here,
so the rules are testable anywhere)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from vt.kernels.arena import ALIGN, aligned

TC_HEAD_DIMS = (64, 128)  # head dims with a tensor-core kernel (attention_tc.cu)
TC_STAGES = 3  # key tiles in flight per block in attention_tc.cu
# ... in its decode8 kernels reading an fp8 cache, whose blocks hold no bf16 tile (50 KB at 3)
DEC8_KV8_STAGES = 3
MAX_KEY_SPLITS = 64  # most key splits of one (row tile, kv head, sequence)
# Keys a tile, the unit a launch's key splits share out (cuda_common.cu's attn_block): of
# attention.cu's CUDA-core kernels (KT) and attention_tc.cu's (TC_KT), both defined from these
CUDA_CORE_KEY_TILE = 32
TC_KEY_TILE = 64
KV8_SUFFIX = "_kv8"  # an attention kernel's twin reading an fp8 (e4m3) KV cache


def tc_smem(d: int, stages: int, q_rows: int = 0, kv8: bool = False, direct: bool = False) -> int:
    """Dynamic shared memory of a tensor-core attention block: `stages` 64-key K and V tiles
    (rows padded by 8 elements) and their cache row offsets, then q_rows staged Q rows. kv8 (an
    fp8 cache): one such bf16 K and V tile, the MMAs' converted copy (none when `direct`: the
    decode8 kernel widens fragments in registers), and `stages` fp8 stages of 64 unpadded keys
    (attention_tc.cu's KvPipe). The decode8 kernel's closing merge (4 warps x 8 rows x d fp32)
    reuses the stages."""
    q = q_rows * (d + 8) * 2
    if kv8:
        tile = 0 if direct else 2 * 64 * (d + 8) * 2
        return max(tile + stages * (2 * 64 * d + 64 * 4) + q, 4 * 8 * (d + 2) * 4)
    return stages * (2 * 64 * (d + 8) * 2 + 64 * 4) + q


def wg_smem(nwg: int, stages: int, bufs: int = 1, v_direct: bool = False) -> int:
    """Dynamic shared memory of attention_wg.cu's block (head dim 128): the 1024-byte alignment
    pad, Q [2][64 nwg][128 B], per stage a swizzled K tile and V (swizzled like K with v_direct,
    else a padded staging tile and `bufs` transposed Vt), each warpgroup's `bufs` P, and the
    cache row offsets."""
    v_stage = 2 * 64 * 128 if v_direct else 64 * 136 * 2
    vt = 0 if v_direct else bufs * 128 * 128
    return (1024 + 2 * 64 * nwg * 128 + stages * (2 * 64 * 128 + v_stage) + vt + nwg * bufs * 64 * 128
            + stages * 64 * 4)


# wgr's fp8-cache body with Q K^T on the e4m3 tensor cores (attention_wg.cu), head dim 128.
QK8_KERNEL = "attention_wgq_d128_prefill_kv8"


def wgq_smem(stages: int = 3) -> int:
    """attention_wg.cu's wgq block (wgr's fp8-cache body with Q K^T in e4m3): the alignment pad, Q
    as codes [128 rows][128 B], one bf16 V tile [2][128 keys][128 B], per stage an fp8 K and V tile,
    the cache row offsets of 128 keys a stage, Q's 128 row scales and the 16-byte sink (150,544
    bytes with three stages)."""
    return 1024 + 128 * 128 + 2 * 128 * 128 + stages * 2 * 128 * 128 + stages * 128 * 4 + 128 * 4 + 16


def wgr_smem(stages: int = 3, kv8: bool = False) -> int:
    """Dynamic shared memory of attention_wg.cu's wgr block (head dim 128, 128 rows, 128-key
    tiles): the 1024-byte alignment pad, Q [2][128][128 B], per stage a swizzled K tile and a V
    tile stored like it ([2][128 keys][128 B] each), the cache row offsets of 128 keys a stage,
    and 16 bytes for the word the softmax's sums are stored to. Three stages come to 231,952
    bytes, within Hopper's 232,448 a block. kv8 (an fp8 cache): one such bf16 K and V tile, the
    products' converted copy, and per stage an fp8 K and V tile of 128 keys x 128 codes (199,184
    bytes with three stages)."""
    tiles = 2 * 2 * 128 * 128 + stages * 2 * 128 * 128 if kv8 else stages * 2 * 2 * 128 * 128
    return 1024 + 2 * 128 * 128 + tiles + stages * 128 * 4 + 16


class PrefillTiling(NamedTuple):
    """How prompts are tiled on tensor cores: the kernel (`{d}` the head dim), the head dims it
    has, rows of a block, its threads, and its dynamic shared memory for head dim d (the
    kernel's template arguments: tc_smem's or wg_smem's)."""

    kernel: str
    head_dims: tuple[int, ...]
    rows: int
    threads: int
    smem: Callable[[int], int]
    sm90_only: bool = False
    # shared memory of its fp8-KV-cache kernels (name + KV8_SUFFIX) for head dim d, or None where
    # it has none (wgmma's wg, wg3, wgp, wgv: an fp8 cache's prompts then run on the fallback tiling)
    kv8_smem: Callable[[int], int] | None = None
    # where it has none: the tiling whose fp8-KV-cache kernels its fp8 cache's prompts run on
    # (None: the fallback tiling's)
    kv8_tiling: str | None = None
    # its kernel loops over the launch's blocks as items (attention_wg.cu's ATTENTION_ITEMS_ENTRY):
    # a 1-D grid, the item space as two more arguments (launch_shape); persistent: one block an SM
    items: bool = False
    persistent: bool = False

    def kernels(self, kv8: bool = False) -> list[str]:
        """Its kernels' names, one per head dim (kv8: its fp8-KV-cache kernels', if any)."""
        if kv8:
            if self.kv8_smem is None:
                return []
            return [self.kernel.format(d=d) + KV8_SUFFIX for d in self.head_dims]
        return [self.kernel.format(d=d) for d in self.head_dims]


# r64: four warps of 16 rows (mma.sync; every GPU, head dims 64 and 128). w8: eight warps of 16
# rows, half the K/V traffic a row. m2: four warps of two 16-row m-tiles, half the K/V traffic and
# half the fragment loads a product, two blocks an SM. wg, wg3: two or three warpgroups of 64
# rows on wgmma (attention_wg.cu, sm_90 only), one block an SM; wgp: wg with each tile's P V
# running during the next tile's softmax; wgv: wgp reading V N-major where it lands, with no
# transpose. All are checked against numpy (tests/cuda_sim, tests/gpu) and timed on Hopper
# (bench/kernels/attn_tilings.py, bench/RESULTS.md): wgr (wgv with P kept in registers as wgmma's
# register A, 128-key tiles, K loaded two tiles ahead) is 1.7-2.3x r64, wgs (wgr in ping-pong)
# 1.07-1.13x wgr, and wgwp (wgs's consumers fed by a producer warpgroup, Q in registers, a
# persistent grid) 1.06-1.4x wgs and the default. A GPU without sm_90 (or a head
# dim they lack) runs r64. VT_PREFILL_TILING picks one for a benchmark. The shared memory
# follows each entry's template arguments in attention_tc.cu / attention_wg.cu (stages, staged Q
# rows, buffers, V read directly; wgr_smem for wgr's and wgs's own body).
PREFILL_TILINGS: dict[str, PrefillTiling] = {
    "r64": PrefillTiling("attention_tc_d{d}_prefill", TC_HEAD_DIMS, 64, 128, lambda d: tc_smem(d, TC_STAGES),
                         kv8_smem=lambda d: tc_smem(d, TC_STAGES, kv8=True)),
    "w8": PrefillTiling("attention_tc_d{d}_prefill_w8", TC_HEAD_DIMS, 128, 256,
                        lambda d: tc_smem(d, TC_STAGES), kv8_smem=lambda d: tc_smem(d, TC_STAGES, kv8=True)),
    "m2": PrefillTiling("attention_tc_d{d}_prefill_m2", TC_HEAD_DIMS, 128, 128, lambda d: tc_smem(d, 2, 128),
                        kv8_smem=lambda d: tc_smem(d, 2, 128, kv8=True)),
    "wg": PrefillTiling("attention_wg_d{d}_prefill", (128,), 128, 256, lambda d: wg_smem(2, 2), True),
    "wg3": PrefillTiling("attention_wg3_d{d}_prefill", (128,), 192, 384, lambda d: wg_smem(3, 2), True),
    "wgp": PrefillTiling("attention_wgp_d{d}_prefill", (128,), 128, 256, lambda d: wg_smem(2, 2, 2), True),
    "wgv": PrefillTiling("attention_wgv_d{d}_prefill", (128,), 128, 256,
                         lambda d: wg_smem(2, 3, 2, v_direct=True), True),
    "wgr": PrefillTiling("attention_wgr_d{d}_prefill", (128,), 128, 256, lambda d: wgr_smem(), True,
                         kv8_smem=lambda d: wgr_smem(kv8=True)),
    # wgs: wgr with its two warpgroups in ping-pong (named barriers instead of a block barrier a
    # tile; attention_wg.cu's PP notes): 1.07-1.13x wgr's rate on the H100 (bench/RESULTS.md).
    # An fp8 cache's prompts run on wgr's kernels.
    "wgs": PrefillTiling("attention_wgs_d{d}_prefill", (128,), 128, 256, lambda d: wgr_smem(), True,
                         kv8_tiling="wgr"),
    # wgw: wgs's two warpgroups fed by a third that makes every copy (a producer warpgroup, its
    # registers given to the other two; attention_wg.cu's notes above attention_wgw_body), a block
    # an item; wgwp: the same body with Q in registers on a persistent grid, a block an SM streaming
    # its items. wgwp is the default: on the H100 the fastest at 8B's heads on every case but a 2k
    # chunk at 32k keys (where wgw leads by 6%), and the 8B fp8 8000/64 row serves 1% faster on
    # either than on wgs (bench/RESULTS.md).
    "wgw": PrefillTiling("attention_wgw_d{d}_prefill", (128,), 128, 384, lambda d: wgr_smem(), True,
                         kv8_tiling="wgr", items=True),
    "wgwp": PrefillTiling("attention_wgwp_d{d}_prefill", (128,), 128, 384, lambda d: wgr_smem(), True,
                          kv8_tiling="wgr", items=True, persistent=True),
}
# The kernels that loop over items (their grid is 1-D): name -> whether on a persistent grid.
ITEM_KERNELS: dict[str, bool] = {
    t.kernel.format(d=d): t.persistent for t in PREFILL_TILINGS.values() if t.items for d in t.head_dims
}
DEFAULT_PREFILL_TILING = "wgwp"
# The tiling with a kernel for every tensor-core head dim on every GPU: a head dim (or a device)
# another tiling lacks runs on it, and benchmarks compare against it.
FALLBACK_PREFILL_TILING = "r64"


class AttnKernel(NamedTuple):
    """One attention launch's kernel and shape: grid x is row_tiles, blocks have `threads`."""

    name: str
    tensor_cores: bool
    row_tiles: int
    smem: int
    threads: int


TC_MAX_CACHE_ELEMS = 8 * 0xFFFFFFFF  # the tensor-core kernels address the cache in 32-bit 16-byte units


def attention_kernel(group: int, max_query_len: int, d: int, cache_elems: int = 0,
                     prefill: str = DEFAULT_PREFILL_TILING, kv8: bool = False,
                     qk8: bool = False) -> AttnKernel:
    """The kernel for sequences of up to max_query_len tokens, rows = tokens x GQA group per kv
    head. Head dims 64 and 128 run on tensor cores: 8-row transposed tiles when every sequence
    has at most 8 rows (decode with groups up to 8), 16-row tiles up to 16 rows, both with four
    warps sharing out the keys; the `prefill` tiling (PREFILL_TILINGS) otherwise. A K (or V)
    cache of cache_elems elements or more than TC_MAX_CACHE_ELEMS takes the CUDA cores.
    kv8: the cache holds e4m3 codes; the same choice among the kernels that read them (name +
    KV8_SUFFIX), a prompt tiling without such kernels taking its kv8_tiling's (wgs: wgr's) or else
    the fallback's. qk8 (with kv8): prompts that would run wgr's fp8 kernel run QK8_KERNEL, its
    body with Q K^T in e4m3 (each q row rounded to e4m3 x 2^n)."""
    rows = max_query_len * group
    suffix = KV8_SUFFIX if kv8 else ""
    if d in TC_HEAD_DIMS and cache_elems < TC_MAX_CACHE_ELEMS:
        if rows <= 8:
            smem = tc_smem(d, DEC8_KV8_STAGES if kv8 else TC_STAGES, kv8=kv8, direct=True)
            return AttnKernel(f"attention_tc_d{d}_decode8{suffix}", True, 1, smem, 128)
        if rows <= 16:
            smem = tc_smem(d, TC_STAGES, kv8=kv8)
            return AttnKernel(f"attention_tc_d{d}_decode{suffix}", True, 1, smem, 128)
        t = PREFILL_TILINGS[prefill]
        if kv8 and t.kv8_smem is None:
            t = PREFILL_TILINGS[t.kv8_tiling or FALLBACK_PREFILL_TILING]
        if d not in t.head_dims or (kv8 and t.kv8_smem is None):
            t = PREFILL_TILINGS[FALLBACK_PREFILL_TILING]
        if kv8 and qk8 and t is PREFILL_TILINGS["wgr"] and d == 128:
            return AttnKernel(QK8_KERNEL, True, -(-rows // t.rows), wgq_smem(), t.threads)
        smem = t.kv8_smem(d) if kv8 and t.kv8_smem is not None else t.smem(d)
        return AttnKernel(t.kernel.format(d=d) + suffix, True, -(-rows // t.rows), smem, t.threads)
    r = 1 if rows <= 4 else 2 if rows <= 8 else 4
    half = d // 2
    smem = 32 * half * 4 + 4 * r * half * 8 + 32 * (half + 1) * 4
    return AttnKernel(f"attention_r{r}{suffix}", False, -(-rows // (4 * r)), smem, 128)


def launch_shape(kernel: str, row_tiles: int, hk: int, zcount: int,
                 resident: int) -> tuple[tuple[int, int, int], tuple[int, ...]]:
    """The grid of a launch of `kernel` over (row tiles, kv heads, sequences x splits) and the int
    arguments after ATTN_TC_PARAMS: that grid and none, or for an item kernel (ITEM_KERNELS) a 1-D
    grid of a block an item, or of at most `resident` blocks (the chip's) on a persistent grid,
    and the item space (row_tiles, zcount)."""
    persistent = ITEM_KERNELS.get(kernel)
    if persistent is None:
        return (row_tiles, hk, zcount), ()
    items = row_tiles * hk * zcount
    return (min(items, resident) if persistent else items, 1, 1), (row_tiles, zcount)


def combine_key_tile(kernel: AttnKernel, max_query_len: int) -> int:
    """The key tile attention_combine_k recomputes `kernel`'s split chunking with, to merge only
    the splits that hold keys of a row's sequence; 0 = every split. Only where each sequence has
    one query row (decode: every row sees all its sequence's keys, so the chunking is the
    sequence length's alone) and on the decode kernels (CUDA-core ones, tensor-core decode and
    decode8); a prompt tiling serving decode rows (GQA groups over 16) keeps the full merge."""
    if max_query_len != 1:
        return 0
    if not kernel.tensor_cores:
        return CUDA_CORE_KEY_TILE
    return TC_KEY_TILE if kernel.name.startswith("attention_tc_d") and "_decode" in kernel.name else 0


def key_splits(blocks: int, resident: int, max_seq_len: int, max_splits: int = MAX_KEY_SPLITS) -> int:
    """Key splits per (row tile, kv head, sequence): blocks of equal work run in waves of
    `resident`, so a grid of 1.3 waves costs 2. Take the fewest splits whose grid fills its last
    wave to 90%, else the best filling one, keeping at least 256 keys per split and at most
    max_splits (what the partials' scratch holds for the launch)."""
    most = max(1, min(MAX_KEY_SPLITS, max_splits, -(-max_seq_len // 256)))
    if blocks >= 8 * resident:
        return 1
    best, best_fill = 1, 0.0
    for s in range(1, most + 1):
        waves = blocks * s / resident
        fill = waves / math.ceil(waves)
        if fill >= 0.9:
            return s
        if fill > best_fill + 1e-9:
            best, best_fill = s, fill
    return best


def attention_partial_bytes(splits: int, tokens: int, num_heads: int, head_dim: int) -> int:
    """Split-key partials of one attention launch: o f32[splits, T, Hq, D] and (m, l)
    f32[splits, T, Hq, 2], each aligned."""
    rows = splits * tokens * num_heads
    return aligned(rows * head_dim * 4) + aligned(rows * 2 * 4)


def max_splits_within(budget: int, tokens: int, num_heads: int, head_dim: int) -> int:
    """The most key splits whose partials fit budget bytes (1 needs none)."""
    per_split = tokens * num_heads * (head_dim + 2) * 4
    if per_split <= 0:
        return MAX_KEY_SPLITS
    return max(1, min(MAX_KEY_SPLITS, (budget - 2 * ALIGN) // per_split))
