// Prompt attention on Hopper's warpgroup MMA (wgmma, sm_90a): the contract of attention_tc.cu
// (ragged batch over the paged cache, rows = (token, GQA head) pairs of one kv head, causal,
// split partials in attention_combine_k's layout), head dim 128, for row tiles of 64 * NWG rows.
//
// Each warpgroup owns 64 rows. Per tile of 64 keys: S = Q K^T is one m64n64 wgmma chain (8
// k-steps over the head dim) with Q and K read from shared memory; the online softmax runs on
// the accumulators in registers (their layout is mma.m16n8's C fragments, so attention_parts.cu's
// softmax serves as is); P goes to shared memory as bf16 and O += P V is an m64n128 chain (4
// k-steps over the keys). Every operand is K-major with the 128-byte swizzle, the one layout
// wgmma.cu's descriptors describe: Q [rows][dims] and K [keys][dims] are stored so by their
// cp.async copies, P [rows][keys] by its stores, and V, which the cache holds [keys][dims], is
// copied to a staging tile and transposed through ldmatrix into Vt [dims][keys] once per tile for
// every warpgroup. K/V tiles arrive STAGES deep, their cache rows staged as 16-byte offsets
// (KvPipe's scheme) a tile before the copies. OVERLAP runs each tile's P V during the next
// tile's softmax (see the loop).
//
// Shared memory, from a 1024-aligned base: Q [2 halves of the head dim][ROWS][128 B]; per stage
// K [2][64][128 B] then V, as K (VDIRECT) or the staging tile [64][D + 8]; Vt [VT_BUFS][128][128 B];
// P [NWG][BUFS][64][128 B]; the cache row offsets [STAGES][64]. attention_plan.wg_smem computes
// the same total.

// The first 1024-byte-aligned address of `smem` (the 128-byte swizzle repeats every 1024 bytes)
// in the shared window, and gbase the generic pointer to it.
__device__ __forceinline__ unsigned smem_base_1024(unsigned char* smem, unsigned char*& gbase) {
    const unsigned raw = smem_u32(smem);
    const unsigned base = (raw + 1023u) & ~1023u;
    gbase = smem + (base - raw);
    return base;
}

// The cache row of key kpos of kv head kh (its block from the sequence's table row), in 16-byte
// units of `parts` a head row: the offset every prompt tiling stages for its copies.
__device__ __forceinline__ unsigned int cache_row16(const int* table, int kpos, int block_size, int hk, int kh,
                                                    int parts) {
    const size_t blk = (size_t)table[kpos / block_size];
    return (unsigned int)(((blk * block_size + kpos % block_size) * hk + kh) * parts);
}

// A thread's COPIES 16-byte pieces of a K or V tile: keys KSTEP apart (destinations 128 x KSTEP
// bytes apart), their staged offsets read first (read between the copies, whose asm clobbers
// memory, each would cost a shared-load round trip and ptxas pads every copy after one); pieces
// of keys at or past `valid` (this thread's count of real keys, times KSTEP) are zero-filled.
// src is the cache's address plus the piece's as an integer: one IMAD.WIDE a copy.
template <int COPIES, int KSTEP>
__device__ __forceinline__ void copy_key_pieces(unsigned dst, const unsigned int* offs, u64_t src, int valid) {
    unsigned int off[COPIES];
#pragma unroll
    for (int i = 0; i < COPIES; ++i) off[i] = offs[i * KSTEP];
#pragma unroll
    for (int i = 0; i < COPIES; ++i)
        cp_async16_u32(dst + i * KSTEP * 128, reinterpret_cast<const void*>(src + (u64_t)off[i] * 16),
                       i * KSTEP < valid ? 16 : 0);
}

#define WG_KT 64
#define WG_D 128
#define WG_SROW (WG_D + 8)                          // V staging row (bf16), ldmatrix conflict free
#define WG_K_BYTES (2 * WG_KT * 128)                // a K tile: two 64-dim halves of 64 rows

// The block's Q rows (row r of the block is (token q0 + (row0 + r) / group, head kh * group +
// (row0 + r) % group); rows past nrows are zero) into two swizzled 64-dim halves at q_s, by
// cp.async from every thread.
template <int ROWS, int NT>
__device__ __forceinline__ void copy_q_sw128(unsigned q_s, const bf16_t* __restrict__ q, int q_stride, int row0,
                                             int nrows, int group, int q0, int kh, int tid) {
    constexpr int PARTS = WG_D / 8;  // 16-byte pieces of a head row
    for (int e = tid; e < ROWS * PARTS; e += NT) {
        const int lr = e / PARTS, part = e % PARTS, r = row0 + lr;
        const bool ok = r < nrows;
        const bf16_t* src = ok ? q + (size_t)(q0 + r / group) * q_stride + (size_t)(kh * group + r % group) * WG_D + part * 8
                               : q;
        cp_async16_u32(sw128_at(q_s + (part / 8) * (ROWS * 128), lr, part % 8), src, ok ? 16 : 0);
    }
}

template <int NWG, int STAGES, bool OVERLAP, bool VDIRECT>
__device__ __forceinline__ void attention_wg_body(ATTN_TC_PARAMS) {
    constexpr int NT = 128 * NWG;
    constexpr int ROWS = 64 * NWG;
    constexpr int Q_BYTES = 2 * ROWS * 128;
    constexpr int PARTS = WG_D / 8;  // 16-byte pieces of a head row
    constexpr int BUFS = OVERLAP ? 2 : 1;  // P (and Vt) buffers: tile t's in buffer t % BUFS
    constexpr int VT_BUFS = VDIRECT ? 0 : BUFS;
    // VDIRECT: V is stored like K and read N-major by P V, with no staging and no transpose.
    constexpr int STAGE_BYTES = WG_K_BYTES + (VDIRECT ? WG_K_BYTES : WG_KT * WG_SROW * 2);
    // Tiles loaded ahead. VDIRECT's P V of tile t runs in step t + 1, so its stage is refilled one
    // step later than the others': three stages, one tile ahead.
    constexpr int AHEAD = VDIRECT ? 1 : STAGES - 1;
    static_assert(STAGE_BYTES % 1024 == 0, "stages keep the swizzle's 1024-byte alignment");
    static_assert(!VDIRECT || (OVERLAP && STAGES >= 3), "direct V needs the overlapped loop and three stages");
    extern __shared__ __align__(16) unsigned char smem[];

    ATTN_BLOCK_LOCALS(ROWS, WG_KT);
    const int tile0 = ab.tile0, tile1 = ab.tile1;
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int g = lane >> 2, c = lane & 3;

    // Addresses: u32 shared-window ones for wgmma and cp.async, generic ones for ldmatrix.
    unsigned char* gbase;
    const unsigned base = smem_base_1024(smem, gbase);
    const unsigned q_s = base;
    const unsigned stage0 = base + Q_BYTES;
    const unsigned vt_s = stage0 + STAGES * STAGE_BYTES;                  // [VT_BUFS][128][128 B]
    const unsigned p_s = vt_s + VT_BUFS * WG_D * 128 + wg * BUFS * 64 * 128;  // this warpgroup's [BUFS][64][128 B]
    unsigned int* off_s =
        reinterpret_cast<unsigned int*>(gbase + (vt_s - base) + VT_BUFS * WG_D * 128 + NWG * BUFS * 64 * 128);
    const int* table = block_tables + (size_t)b * max_blocks;
    constexpr unsigned NONE = 0xffffffffu;

    // This thread's rows (g and g + 8 of its warp's 16) and the warpgroup's last position.
    const int ra = row0 + wg * 64 + warp * 16 + g, rb = ra + 8;
    const int pos_a = ra < nrows ? ctx - qlen + ra / group : -1;
    const int pos_b = rb < nrows ? ctx - qlen + rb / group : -1;
    const int wlast = min(row0 + wg * 64 + 63, nrows - 1);
    const int wg_pos = wlast >= row0 + wg * 64 ? ctx - qlen + wlast / group : -1;

    // The cache row (in 16-byte units) of each key of `tile`, into its offset slot.
    auto fetch = [&](int tile) {
        if (tid < WG_KT && tile < tile1) {
            const int kpos = tile * WG_KT + tid;
            off_s[(tile % STAGES) * WG_KT + tid] =
                kpos < kv_end ? cache_row16(table, kpos, block_size, hk, kh, PARTS) : NONE;
        }
    };
    // K into its swizzled halves; V likewise (VDIRECT) or into the staging tile.
    auto load = [&](int tile) {
        const unsigned st = stage0 + (tile % STAGES) * STAGE_BYTES;
        bf16_t* vstage = reinterpret_cast<bf16_t*>(gbase + (st - base) + WG_K_BYTES);
        const unsigned int* offs = off_s + (tile % STAGES) * WG_KT;
        for (int e = tid; e < WG_KT * PARTS; e += NT) {
            const int key = e / PARTS, part = e % PARTS;
            const unsigned int off = offs[key];
            const bool ok = off != NONE;
            const size_t src = ok ? ((size_t)off + part) * 8 : 0;
            cp_async16_u32(sw128_at(st + (part / 8) * (WG_KT * 128), key, part % 8), k_cache + src, ok ? 16 : 0);
            if constexpr (VDIRECT)
                cp_async16_u32(sw128_at(st + WG_K_BYTES + (part / 8) * (WG_KT * 128), key, part % 8), v_cache + src,
                               ok ? 16 : 0);
            else
                cp_async16(vstage + key * WG_SROW + part * 8, v_cache + src, ok);
        }
    };

    for (int i = 0; i < STAGES; ++i) fetch(tile0 + i);
    grid_dependency_wait();  // q and this step's K/V come from the kernel before
    __syncthreads();
    // Q, zero rows past the sequence's, then the first STAGES - 1 tiles: group i holds tile i
    // (group 0 also Q).
    copy_q_sw128<ROWS, NT>(q_s, q, q_stride, row0, nrows, group, q0, kh, tid);
    for (int i = 0; i < AHEAD; ++i) {
        if (tile0 + i < tile1) load(tile0 + i);
        cp_async_commit();
    }

    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) { o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }
    float m_a = -VT_INF, m_b = -VT_INF, l_a = 0.f, l_b = 0.f;

    // O += P V of tile `vtile`, its P in buffer `buf`, as one chain of 4 k-steps of 16 keys: V from
    // its Vt buffer, or (VDIRECT) N-major from its stage.
    auto issue_pv = [&](int buf, int vtile) {
        const unsigned pb = p_s + buf * 64 * 128;
        if constexpr (VDIRECT) {
            const unsigned vb = stage0 + ((vtile % STAGES + STAGES) % STAGES) * STAGE_BYTES + WG_K_BYTES;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                WgmmaTB<128>::mma(&o[0][0], sw128_desc(pb + kk * 32), sw128_mn_desc(vb + kk * 2048, WG_KT * 128), 1);
        } else {
            const unsigned vb = vt_s + buf * WG_D * 128;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Wgmma<128>::mma(&o[0][0], sw128_desc(pb + kk * 32), sw128_desc(vb + kk * 32), 1);
        }
        wgmma_commit();
    };
    // V staging of `tile` [keys][dims] -> Vt [dims][keys] in buffer `buf`: each ldmatrix.trans
    // takes four 8 x 8 blocks.
    auto transpose_v = [&](int tile, int buf) {
        const unsigned st = stage0 + (tile % STAGES) * STAGE_BYTES;
        const unsigned vt = vt_s + buf * WG_D * 128;
        const bf16_t* vstage = reinterpret_cast<const bf16_t*>(gbase + (st - base) + WG_K_BYTES);
        for (int q4 = tid / 32; q4 < (WG_KT / 8) * (WG_D / 8) / 4; q4 += NT / 32) {
            const int blk = q4 * 4 + lane / 8;  // the block whose row this lane addresses
            const int kb = blk % (WG_KT / 8), db = blk / (WG_KT / 8);
            unsigned int r[4];
            ldsm_x4_t(r, vstage + (kb * 8 + lane % 8) * WG_SROW + db * 8);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int bi = q4 * 4 + i, kbi = bi % (WG_KT / 8), dbi = bi / (WG_KT / 8);
                // lane holds Vt[8 dbi + lane / 4][8 kbi + 2 (lane % 4) .. + 1]
                st_shared_u32(sw128_at(vt, dbi * 8 + lane / 4, kbi) + 4 * (lane % 4), r[i]);
            }
        }
    };
    // The tile has landed for every thread (and, before it, everything the threads wrote for
    // wgmma), and every warpgroup is done with what this step refills; then the refill.
    auto next_tile = [&](int tile) {
        cp_async_wait<AHEAD - 1>();
        fence_proxy_async();
        __syncthreads();
        const int next = tile + AHEAD;
        if (next < tile1) load(next);
        cp_async_commit();
        fetch(next + 1);  // its slot held the offsets of `tile`, copied steps ago
    };
    // S = Q K^T of `tile` over the head dim's 8 k-steps (two swizzled halves of 4), issued.
    auto issue_s = [&](int tile, float (&s)[8][4]) {
        const unsigned st = stage0 + (tile % STAGES) * STAGE_BYTES;
#pragma unroll
        for (int n = 0; n < 8; ++n) { s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f; }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const unsigned qa = q_s + (kk / 4) * (ROWS * 128) + wg * 64 * 128 + (kk % 4) * 32;
            const unsigned kb = st + (kk / 4) * (WG_KT * 128) + (kk % 4) * 32;
            Wgmma<64>::mma(&s[0][0], sw128_desc(qa), sw128_desc(kb), kk > 0);
        }
        wgmma_commit();
    };
    // P of this warpgroup [64 rows][64 keys] into buffer `buf`, K-major and swizzled: n-tile n
    // is chunk n.
    auto store_p = [&](const unsigned int (&pa)[8][2], int buf) {
        const unsigned pb = p_s + buf * 64 * 128;
        const int pr = warp * 16 + g;
#pragma unroll
        for (int n = 0; n < 8; ++n) {
            st_shared_u32(sw128_at(pb, pr, n) + 4 * c, pa[n][0]);
            st_shared_u32(sw128_at(pb, pr + 8, n) + 4 * c, pa[n][1]);
        }
    };

    if constexpr (OVERLAP) {
        // One barrier a tile. Step t issues S(t) and then P(t-1) V(t-1), transposes V(t) while
        // they run, takes S(t) through the softmax while P V still runs, and scales O once it
        // is done. Vt(t) and P(t) are read by step t + 1's product, after its barrier. Before the
        // first step a zero P (and a finite Vt) make the first P V add nothing, and tiles past a
        // warpgroup's last row are computed fully masked: no wgmma sits on a branch, which ptxas
        // would answer by serializing them all.
        // Zero `bytes` (a multiple of 4) of shared memory from addr, the block's threads together.
        auto zero = [&](unsigned addr, int bytes) {
            for (int e = tid; e < bytes / 4; e += NT) st_shared_u32(addr + e * 4, 0u);
        };
        zero(vt_s, (VT_BUFS * WG_D + NWG * BUFS * 64) * 128);  // every Vt and P buffer
        if constexpr (VDIRECT)  // the first P V reads the V of stage (tile0 - 1): loaded only later
            zero(stage0 + ((tile0 + STAGES - 1) % STAGES) * STAGE_BYTES + WG_K_BYTES, WG_K_BYTES);
        int buf = 0;  // this tile's Vt and P buffer
        for (int tile = tile0; tile < tile1; ++tile, buf ^= 1) {
            next_tile(tile);
            float s[8][4];
            issue_s(tile, s);
            issue_pv(buf ^ 1, tile - 1);
            if constexpr (!VDIRECT) transpose_v(tile, buf);
            wgmma_wait<1>();  // S has landed; the P V may still run
            Wgmma<64>::pin(&s[0][0]);
            unsigned int pa[8][2];
            const float2 corr = softmax_scores<8, true>(s, tile * WG_KT, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a,
                                                  l_b, pa);
            store_p(pa, buf);
            wgmma_wait<0>();
            Wgmma<128>::pin(&o[0][0]);
            rescale_m_tile<16>(o, corr);
            fence_proxy_async();  // this thread's Vt and P stores, for the next step's product
        }
        next_tile(tile1);  // the last Vt and P written by every thread
        wgmma_fence();
        issue_pv(buf ^ 1, tile1 - 1);  // the last tile's P V (a zero P when there was no tile)
        wgmma_wait<0>();
        Wgmma<128>::pin(&o[0][0]);
    } else {
        for (int tile = tile0; tile < tile1; ++tile) {
            next_tile(tile);
            transpose_v(tile, 0);
            fence_proxy_async();
            __syncthreads();
            const int kbase = tile * WG_KT;
            if (kbase > wg_pos) continue;  // every key of this tile is after the warpgroup's last row
            float s[8][4];
            issue_s(tile, s);
            wgmma_wait<0>();
            Wgmma<64>::pin(&s[0][0]);
            unsigned int pa[8][2];
            softmax_m_tile<8, 16>(s, kbase, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b, o, pa);
            store_p(pa, 0);
            fence_proxy_async();
            bar_sync(1 + wg, 128);
            wgmma_fence();
            issue_pv(0, tile);
            wgmma_wait<0>();
            Wgmma<128>::pin(&o[0][0]);
        }
    }
    cp_async_wait<0>();

    store_m_tile<WG_D>(o, m_a, m_b, quad_sum(l_a), quad_sum(l_b), ra, rb, c, nrows, group, q0, kh, hq, split,
                       total_tokens, num_splits, out, part_o, part_ml, v_scale);
}

#define ATTENTION_WG_ENTRY(NAME, NWG, STAGES, OVERLAP, VDIRECT)                                   \
    extern "C" __global__ void __launch_bounds__(128 * NWG) NAME(ATTN_TC_PARAMS) {                 \
        attention_wg_body<NWG, STAGES, OVERLAP, VDIRECT>(ATTN_TC_ARGS);                            \
    }

ATTENTION_WG_ENTRY(attention_wg_d128_prefill, 2, 2, false, false)
ATTENTION_WG_ENTRY(attention_wg3_d128_prefill, 3, 2, false, false)
ATTENTION_WG_ENTRY(attention_wgp_d128_prefill, 2, 2, true, false)
ATTENTION_WG_ENTRY(attention_wgv_d128_prefill, 2, 3, true, true)

// wgr: wgv's data flow with P kept in registers and 128-key tiles. Per tile of 128 keys, S = Q K^T
// is one m64n128 chain (8 k-steps over the head dim) per warpgroup; its accumulators, mma.m16n8's
// C fragments n-tile after n-tile, go through the softmax and are packed into bf16 pairs
// pa[16][2] (pa[n][0]: row g, keys 8n + 2c, +1; pa[n][1]: row g + 8), which are already wgmma's
// register A fragments of P: k-step kk (keys 16 kk ..) is {pa[2kk][0], pa[2kk][1],
// pa[2kk+1][0], pa[2kk+1][1]}, four consecutive words. O += P V is then an m64n128 chain of 8
// such k-steps with V read N-major where it lands: no P buffer, no shared-memory round trip.
// Step t issues S(t), then P(t-1) V(t-1) from pa; S(t)'s softmax runs while that product does,
// leaving P(t) as floats in S's registers, and only once the product is waited for are O
// rescaled and P(t) packed into pa, which the product read until then.
// K and V arrive on separate schedules: S(t) needs K(t) in step t, P V reads V(t) in step t + 1.
// Step t's copies (one cp.async group) are K(t + 2) and V(t + 1), into the stages last read by
// S(t - 1) and P(t - 2) V(t - 2), both retired before step t's barrier: three stages keep K two
// tiles ahead and V one, with one barrier a tile.
//
// Shared memory, from a 1024-aligned base: Q [2 halves of the head dim][128 rows][128 B] (32 KB),
// K [3][2][128 keys][128 B] (96 KB), V likewise (96 KB), the cache row offsets [3][128], a
// 16-byte sink: attention_plan.wgr_smem (231,952 bytes with the alignment pad, of the 232,448 an
// sm_90 block may have). A K or V half [128 keys][128 B] is K-major for S (n = key) and, for
// P V, the N-major B of 64 dims: 8 keys of 128 B an atom, the next 8 keys 1024 bytes on, the
// other 64 dims a half (16 KB, the leading offset) on; a k-step of 16 keys is 2048 bytes.
//
// KV8 (an fp8 cache of e4m3 codes, attention_tc.cu's KvPipe scheme): the same schedule lands the
// codes in fp8 stages ([3][128 keys][128 B] for K, then V, unswizzled) and step t, after its
// barrier, converts K(t) and V(t - 1) into the one bf16 K and V tile the products read (laid out
// as above), then fences them for the async proxy and meets a second barrier. The products of
// step t - 1 are retired by then, so one bf16 tile each suffices: Q, K, V (32 KB each), the fp8
// stages (96 KB), the offsets and the sink, attention_plan.wgr_smem(kv8=True). Scales as in
// attention_tc.cu: k_scale is in scale_log2, v_scale multiplies the output.

#define WGR_KT 128                 // keys a tile
#define WGR_HALF (WGR_KT * 128)    // a K or V tile's 64-dim half: [128 keys][128 B]
#define WGR_TILE (2 * WGR_HALF)    // a K or V tile, 32 KB
#define WGR_TILE8 (WGR_KT * WG_D)  // KV8: a K or V tile of e4m3 codes, 16 KB
#define WGR_STAGES 3

// KV8: the fp8 K or V tile at stage8 (generic pointer, [keys][128 codes]) into the swizzled bf16
// tile at tile16, as 2048 16-byte chunks (8 dims each) of which this thread converts 8: keys
// key0 + 16 i, the chunk's 8 codes one 8-byte load. The chunk's swizzled column depends on the
// key only through key0 % 8, so every address is a constant offset from the first.
template <int NT>
__device__ __forceinline__ void wgr_convert_tile(unsigned char* tile16, const unsigned char* stage8, int tid) {
    constexpr int CHUNKS = WG_D / 8;   // bf16 chunks of a key: 8 a 64-dim half
    constexpr int KSTEP = NT / CHUNKS;
    const int key0 = tid / CHUNKS, ch = tid % CHUNKS;
    const unsigned char* src = stage8 + key0 * WG_D + ch * 8;
    unsigned char* dst = tile16 + (ch / 8) * WGR_HALF + key0 * 128 + (((ch % 8) ^ (key0 & 7)) << 4);
#pragma unroll
    for (int i = 0; i < WGR_KT / KSTEP; ++i) {
        const uint2 w = *reinterpret_cast<const uint2*>(src + i * KSTEP * WG_D);
        const uint2 a = e4m3x4_to_bf16x4(w.x), b = e4m3x4_to_bf16x4(w.y);
        *reinterpret_cast<uint4*>(dst + i * KSTEP * 128) = make_uint4(a.x, a.y, b.x, b.y);
    }
}

// PP (wgs, bf16 only): the two warpgroups ping-pong instead of meeting at a block barrier every
// tile. Each warpgroup copies its own half of every K and V tile (keys 64 wg .. 64 wg + 63, their
// offsets fetched by its own threads) and hands it to the other through named barriers:
//   FULL[w][s] (ids 1 + 3 w + s): warpgroup w syncs on it before step t (s = t % 3) reads the
//     group copied at step t - 2; the other warpgroup arrives once its own half of that group
//     has landed (each thread waited for its group and fenced it for the async proxy), which it
//     checks in the middle of step t - 1, after its own refill: the leading warpgroup may then
//     start step t while the other still runs step t - 1's softmax.
//   EMPTY[w][p] (ids 7 + 2 w + p): before warpgroup w refills at step t the stages of K(t - 1)
//     and V(t - 2), the other must have retired S(t - 1) and P(t - 2) V(t - 2): it arrives at the
//     end of its step t - 1 (p = (t - 1) & 1; two ids, so an arrival for step t cannot land in
//     the phase of step t - 1 before warpgroup w has synced it).
//   SCHED[w] (ids 11 + w): FlashAttention-3's scheduler: warpgroup w syncs before issuing its
//     products, and arrives at the other's once they are issued, so the two issue in turn and
//     one's softmax runs while the other's products hold the tensor cores.
// A step issues its products first and refills after them (the refill waits for the other
// warpgroup's last step, which must not hold back this one's products). The lag between the two
// stays under a step: the FULL and EMPTY waits bound it.
#define WGS_FULL(w, s) (1 + 3 * (w) + (s))
#define WGS_EMPTY(w, p) (7 + 2 * (w) + (p))
#define WGS_SCHED(w) (11 + (w))

// QK8: the block's 128 Q rows (zero past nrows) as e4m3 codes into the swizzled tile at q8
// ([128 rows][128 B], 16-byte chunk c of row r at chunk c ^ (r % 8)), each row's scale 2^n into
// qsc: n is the smallest integer with amax <= 448 x 2^n, so the codes q / 2^n are exact wherever q
// itself is e4m3 x 2^m (m >= n always then). Two threads a row, 64 dims each.
__device__ __forceinline__ void wgq_load_q(unsigned char* q8, float* qsc, const bf16_t* __restrict__ q,
                                           int q_stride, int row0, int nrows, int group, int q0, int kh,
                                           int tid) {
    const int lr = tid >> 1, h = tid & 1, r = row0 + lr;
    const bool ok = r < nrows;
    const bf16_t* src = q + (size_t)(q0 + r / group) * q_stride + (size_t)(kh * group + r % group) * WG_D + h * 64;
    uint4 raw[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) raw[i] = ok ? *reinterpret_cast<const uint4*>(src + i * 8) : make_uint4(0u, 0u, 0u, 0u);
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const unsigned w[4] = {raw[i].x, raw[i].y, raw[i].z, raw[i].w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            amax = fmaxf(amax, fmaxf(fabsf(__uint_as_float(w[j] << 16)), fabsf(__uint_as_float(w[j] & 0xffff0000u))));
    }
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    const int n = e4m3_pow2_exponent(amax);
    const float inv = pow2f(-n);
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // chunk 4h + j: dims 16 j .. 16 j + 15 of this half
        unsigned w[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {  // four codes a word: raw[2 j + p / 2], words (p % 2) * 2, + 1
            const unsigned a = p % 2 ? raw[2 * j + p / 2].z : raw[2 * j + p / 2].x;
            const unsigned b = p % 2 ? raw[2 * j + p / 2].w : raw[2 * j + p / 2].y;
            w[p] = pack4_e4m3(__uint_as_float(a << 16) * inv, __uint_as_float(a & 0xffff0000u) * inv,
                              __uint_as_float(b << 16) * inv, __uint_as_float(b & 0xffff0000u) * inv);
        }
        const int ch = 4 * h + j;
        *reinterpret_cast<uint4*>(q8 + lr * 128 + ((ch ^ (lr & 7)) << 4)) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    if (h == 0) qsc[lr] = pow2f(n);
}

template <bool KV8, bool PP = false, bool QK8 = false>
__device__ __forceinline__ void attention_wgr_body(ATTN_TC_PARAMS) {
    static_assert(!(KV8 && PP), "the ping-pong body reads a bf16 cache");
    static_assert(!QK8 || KV8, "Q K^T in e4m3 reads an fp8 cache");
    constexpr int NT = 256, ROWS = 128, KT = WGR_KT, STAGES = WGR_STAGES;
    constexpr int Q_BYTES = (QK8 ? 1 : 2) * ROWS * 128;  // QK8: a row of 128 codes, one swizzled row
    constexpr int PARTS = KV8 ? WG_D / 16 : WG_D / 8;  // 16-byte pieces of a cached head row
    constexpr int COPIES = KT * PARTS / NT;    // a thread's 16-byte copies of one K (or V) tile: 8 (KV8 4)
    constexpr int STAGE_BYTES = KV8 ? WGR_TILE8 : WGR_TILE;  // a K (or V) stage
    extern __shared__ __align__(16) unsigned char smem[];

    ATTN_BLOCK_LOCALS(ROWS, KT);
    // A split past the keys has tile1 < tile0: no tiles, and its one P V reads the zeroed stage.
    const int tile0 = ab.tile0, tile1 = max(ab.tile1, ab.tile0);
    const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
    const int g = lane >> 2, c = lane & 3;

    unsigned char* gbase;
    const unsigned base = smem_base_1024(smem, gbase);
    const unsigned q_s = base;
    // The tiles the products read: K stage s at k_s + s * WGR_TILE, V likewise (KV8: one each)
    const unsigned k_s = base + Q_BYTES;
    const unsigned v_s = k_s + (QK8 ? 0 : KV8 ? 1 : STAGES) * WGR_TILE;  // QK8: S reads the fp8 K stage
    // Where the copies land: those stages, or (KV8) the fp8 K stages, then V's
    const unsigned kc_s = KV8 ? v_s + WGR_TILE : k_s;
    const unsigned vc_s = KV8 ? kc_s + STAGES * WGR_TILE8 : v_s;
    const unsigned off_at = vc_s + STAGES * STAGE_BYTES;
    unsigned int* off_s = reinterpret_cast<unsigned int*>(gbase + (off_at - base));
    // QK8: each Q row's scale 2^n (its codes are q / 2^n), then the sink
    const unsigned qsc_at = off_at + STAGES * KT * 4;
    const unsigned sink = qsc_at + (QK8 ? ROWS * 4 : 0);  // a word never read
    const int* table = block_tables + (size_t)b * max_blocks;

    const int ra = row0 + wg * 64 + warp * 16 + g, rb = ra + 8;
    const int pos_a = ra < nrows ? ctx - qlen + ra / group : -1;
    const int pos_b = rb < nrows ? ctx - qlen + rb / group : -1;

    // The cache row (in 16-byte units) of each key of `tile`, into its offset slot (warpgroup 0,
    // a key a thread; PP: the first 64 threads of each warpgroup, its own half of the keys); 0, a
    // valid address the copies read nothing from, for keys past kv_end.
    auto fetch = [&](int tile) {
        const int fk = PP ? wg * (KT / 2) + tid % 128 : tid;
        if ((PP ? tid % 128 < KT / 2 : tid < KT) && tile < tile1) {
            const int kpos = tile * KT + fk;
            off_s[(tile % STAGES) * KT + fk] = kpos < kv_end ? cache_row16(table, kpos, block_size, hk, kh, PARTS) : 0u;
        }
    };
    // One K or V tile into its stage of `slots`: this thread's piece `part` of keys key0 + 16 i.
    // Rows 16 apart keep the swizzle's chunk, so the destinations are 2048 bytes apart; keys
    // past kv_end are zero-filled. A copy is an offset load, one wide multiply-add and the
    // cp.async: the copies are most of a step's instructions outside the softmax.
    // KV8: pieces of 16 codes into the unswizzled fp8 stage (rows of 128 codes), keys key0 + 32 i.
    // PP: a warpgroup's 128 threads copy its 64 keys, 8 keys apart (the same 8 copies a thread).
    constexpr int CT = PP ? 128 : NT;      // the threads that copy one tile
    constexpr int KSTEP = CT / PARTS;      // keys between one thread's copies
    const int ctid = PP ? tid % 128 : tid;
    const int key0 = (PP ? wg * (KT / 2) : 0) + ctid / PARTS, part = ctid % PARTS;
    const unsigned dst0 = KV8 ? key0 * WG_D + part * 16
                              : (part / 8) * WGR_HALF + key0 * 128 + (((part % 8) ^ (key0 & 7)) << 4);
    // QK8: K's fp8 stage is the wgmma's B as it lands: 128-byte rows swizzled (a thread's keys are
    // 32 apart, so its chunk's swizzle is the same for all of them); V's stays plain for widening.
    const unsigned dst0k = QK8 ? key0 * 128 + ((part ^ (key0 & 7)) << 4) : dst0;
    auto copy_tile = [&](int tile, unsigned slots, const bf16_t* cache, unsigned d0) {
        const unsigned dst = slots + (tile % STAGES) * STAGE_BYTES + d0;
        const unsigned int* offs = off_s + (tile % STAGES) * KT + key0;
        copy_key_pieces<COPIES, KSTEP>(dst, offs, reinterpret_cast<u64_t>(cache) + part * 16,
                                       kv_end - tile * KT - key0);
    };

    for (int i = 0; i < STAGES; ++i) fetch(tile0 + i);
    grid_dependency_wait();  // q and this step's K/V come from the kernel before
    __syncthreads();
    // Q (zero rows past the sequence's) and K(tile0); then K(tile0 + 1) and V(tile0): the groups
    // steps tile0 - 2 and tile0 - 1 would have issued.
    if constexpr (QK8) {
        wgq_load_q(gbase + (q_s - base), reinterpret_cast<float*>(gbase + (qsc_at - base)), q, q_stride, row0,
                   nrows, group, q0, kh, tid);
    } else {
        copy_q_sw128<ROWS, NT>(q_s, q, q_stride, row0, nrows, group, q0, kh, tid);
    }
    if (tile0 < tile1) copy_tile(tile0, kc_s, k_cache, dst0k);
    cp_async_commit();
    if (tile0 + 1 < tile1) copy_tile(tile0 + 1, kc_s, k_cache, dst0k);
    if (tile0 < tile1) copy_tile(tile0, vc_s, v_cache, dst0);
    cp_async_commit();
    // The first step's P V multiplies a zero P by the V stage of tile0 - 1, which no copy fills
    // before step tile0 + 1: zero it, so that the product is 0 and not 0 * stale NaN (KV8: its
    // fp8 stage, which step tile0 converts; code 0 is 0).
    {
        const unsigned vz = vc_s + ((tile0 + STAGES - 1) % STAGES) * STAGE_BYTES;
        for (int e = tid; e < STAGE_BYTES / 4; e += NT) st_shared_u32(vz + e * 4, 0u);
    }

    float o[16][4];
#pragma unroll
    for (int n = 0; n < 16; ++n) { o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }
    float m_a = -VT_INF, m_b = -VT_INF, l_a = 0.f, l_b = 0.f;
    unsigned int pa[16][2];  // the P whose product is pending: the last tile's
#pragma unroll
    for (int n = 0; n < 16; ++n) { pa[n][0] = 0u; pa[n][1] = 0u; }

    // Tile t's K and the V of t - 1 have landed for every thread (the group issued two steps
    // ago), the zeroed V too, and every warpgroup has retired the products that read what this
    // step refills; then the refill: K(t + 2), V(t + 1). (The step's fetch, of tile t + 3's
    // offsets into the slot tile t's held, comes after its products are issued: the block
    // table's load then waits behind them, not before them.)
    // KV8: then K(t) (a real tile) and V(t - 1) into the bf16 tiles, published by a second
    // barrier; the fp8 stages refilled here were converted a step ago.
    auto next_tile = [&](int tile) {
        cp_async_wait<1>();
        fence_proxy_async();
        __syncthreads();
        if (tile + 2 < tile1) copy_tile(tile + 2, kc_s, k_cache, dst0k);
        if (tile + 1 < tile1) copy_tile(tile + 1, vc_s, v_cache, dst0);
        cp_async_commit();
        if constexpr (KV8) {
            if (!QK8 && tile < tile1)
                wgr_convert_tile<NT>(gbase + (k_s - base), gbase + (kc_s - base) + (tile % STAGES) * WGR_TILE8, tid);
            wgr_convert_tile<NT>(gbase + (v_s - base),
                                 gbase + (vc_s - base) + ((tile + STAGES - 1) % STAGES) * WGR_TILE8, tid);
            fence_proxy_async();  // the converted tiles, for the products
            __syncthreads();
        }
    };
    // S = Q K^T of `tile`, this warpgroup's 64 rows x 128 keys, issued.
    auto issue_s = [&](int tile, float (&s)[16][4]) {
        const unsigned kt = KV8 ? k_s : k_s + (tile % STAGES) * WGR_TILE;
#pragma unroll
        for (int n = 0; n < 16; ++n) { s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f; }
        wgmma_fence();  // also orders the last step's writes of o and pa before the products below
        if constexpr (QK8) {  // codes times codes: 4 k-steps of 32 over the fp8 K stage
            const unsigned k8 = kc_s + (tile % STAGES) * WGR_TILE8;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                WgmmaE4M3<128>::mma(&s[0][0], sw128_desc(q_s + wg * 64 * 128 + kk * 32), sw128_desc(k8 + kk * 32),
                                    kk > 0);
        } else {
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                const unsigned qa = q_s + (kk / 4) * (ROWS * 128) + wg * 64 * 128 + (kk % 4) * 32;
                Wgmma<128>::mma(&s[0][0], sw128_desc(qa), sw128_desc(kt + (kk / 4) * WGR_HALF + (kk % 4) * 32),
                                kk > 0);
            }
        }
        wgmma_commit();
    };
    // O += P V of `vtile` (P in pa), issued: k-step kk takes pa[2kk], pa[2kk + 1] and V's keys
    // 16 kk .. 16 kk + 15.
    auto issue_pv = [&](int vtile) {
        const unsigned vt = KV8 ? v_s : v_s + ((vtile % STAGES + STAGES) % STAGES) * WGR_TILE;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
            WgmmaRATB<128>::mma(&o[0][0], &pa[2 * kk][0], sw128_mn_desc(vt + kk * 2048, WGR_HALF), 1);
        wgmma_commit();
    };

    if constexpr (PP) {
        const int other = 1 - wg;
        // This thread's copies of the group committed before the newest have landed: fenced for
        // the products and announced to the other warpgroup, for the step that reads them.
        auto announce = [&](int step) {
            cp_async_wait<1>();
            fence_proxy_async();
            bar_arrive(WGS_FULL(other, step % STAGES), NT);
        };
        announce(tile0);  // Q and K(tile0), and the zeroed V stage
        if (wg == 1) bar_arrive(WGS_SCHED(0), NT);  // warpgroup 0 issues first
        for (int tile = tile0; tile < tile1; ++tile) {
            bar_sync(WGS_FULL(wg, tile % STAGES), NT);  // both halves of K(t) and V(t - 1)
            float s[16][4];
            bar_sync(WGS_SCHED(wg), NT);
            issue_s(tile, s);
            issue_pv(tile - 1);
            bar_arrive(WGS_SCHED(other), NT);
            // The refill: K(t + 2) and V(t + 1) into the stages of K(t - 1) and V(t - 2), once the
            // other warpgroup has retired the products that read them (its step t - 1).
            if (tile > tile0) bar_sync(WGS_EMPTY(wg, (tile - 1) & 1), NT);
            if (tile + 2 < tile1) copy_tile(tile + 2, kc_s, k_cache, dst0k);
            if (tile + 1 < tile1) copy_tile(tile + 1, vc_s, v_cache, dst0);
            cp_async_commit();
            fetch(tile + 3);  // its slot's offsets, tile t's, were last read by V(t)'s copies a step ago
            // K(t + 1) and V(t) (last step's group): announced now, not at the next step's start,
            // so that the other warpgroup may start that step while this one runs its softmax.
            announce(tile + 1);
            wgmma_wait<1>();
            Wgmma<128>::pin(&s[0][0]);
            const float2 corr =
                softmax_weights<16, true>(s, tile * KT, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b);
            st_shared_u32(sink, __float_as_uint(l_a + l_b));
            wgmma_wait<0>();
            Wgmma<128>::pin(&o[0][0]);
            bar_arrive(WGS_EMPTY(other, tile & 1), NT);  // S(t) and P(t - 1) V(t - 1) are retired
            rescale_m_tile<16>(o, corr);
#pragma unroll
            for (int n = 0; n < 16; ++n) { pa[n][0] = pack2_rn(s[n][0], s[n][1]); pa[n][1] = pack2_rn(s[n][2], s[n][3]); }
        }
        bar_sync(WGS_FULL(wg, tile1 % STAGES), NT);  // the last V, both halves
        bar_sync(WGS_SCHED(wg), NT);
        wgmma_fence();
        issue_pv(tile1 - 1);
        bar_arrive(WGS_SCHED(other), NT);
        wgmma_wait<0>();
        Wgmma<128>::pin(&o[0][0]);
        cp_async_wait<0>();
        store_m_tile<WG_D>(o, m_a, m_b, quad_sum(l_a), quad_sum(l_b), ra, rb, c, nrows, group, q0, kh, hq, split,
                           total_tokens, num_splits, out, part_o, part_ml, v_scale);
    } else {
        // QK8: the rows' scales, read once the first step's barrier has published them
        float qs_a = 1.f, qs_b = 1.f;
        // As wgv's loop: no wgmma on a branch (ptxas would serialize them all), so the first P V
        // multiplies a zero P, and tiles past a warpgroup's last row are computed fully masked.
        for (int tile = tile0; tile < tile1; ++tile) {
            next_tile(tile);
            if constexpr (QK8) {
                if (tile == tile0) {
                    const float* qsc = reinterpret_cast<const float*>(gbase + (qsc_at - base));
                    qs_a = qsc[wg * 64 + warp * 16 + g];
                    qs_b = qsc[wg * 64 + warp * 16 + g + 8];
                }
            }
            float s[16][4];
            issue_s(tile, s);
            issue_pv(tile - 1);
            fetch(tile + 3);  // its slot's offsets, tile t's, were last read by V(t)'s copies a step ago
            wgmma_wait<1>();  // S has landed; the P V may still run, reading pa
            Wgmma<128>::pin(&s[0][0]);
            if constexpr (QK8) {  // the codes' products times each row's 2^n
#pragma unroll
                for (int n = 0; n < 16; ++n) { s[n][0] *= qs_a; s[n][1] *= qs_a; s[n][2] *= qs_b; s[n][3] *= qs_b; }
            }
            const float2 corr = softmax_weights<16, true>(s, tile * KT, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b);
            // ptxas moves a wait up past arithmetic but not past a shared-memory store: storing
            // the row sums, which need every exponential of the tile, keeps the softmax before it.
            st_shared_u32(sink, __float_as_uint(l_a + l_b));
            wgmma_wait<0>();
            Wgmma<128>::pin(&o[0][0]);
            rescale_m_tile<16>(o, corr);
            // P into the registers the product has finished reading: n-tile n's rows g and g + 8
#pragma unroll
            for (int n = 0; n < 16; ++n) { pa[n][0] = pack2_rn(s[n][0], s[n][1]); pa[n][1] = pack2_rn(s[n][2], s[n][3]); }
        }
        next_tile(tile1);  // the last V landed for every thread (nothing is copied any more)
        wgmma_fence();
        issue_pv(tile1 - 1);
        wgmma_wait<0>();
        Wgmma<128>::pin(&o[0][0]);
        cp_async_wait<0>();

        store_m_tile<WG_D>(o, m_a, m_b, quad_sum(l_a), quad_sum(l_b), ra, rb, c, nrows, group, q0, kh, hq, split,
                           total_tokens, num_splits, out, part_o, part_ml, v_scale);
    }
}

// wgw: wgs's consumers with the copies taken off them, over a list of blocks. A third warpgroup
// (warpgroup 0, the producer) fetches the cache rows of every key and issues every cp.async (Q, K
// and V); the two consumer warpgroups (1 and 2, 64 rows each) only multiply and run the softmax, in
// wgs's ping-pong. The producer gives registers back (setmaxnreg) for the consumers.
//
// A launch covers items (attn_item: row tile, kv head, sequence x split; longest first), dealt
// to the blocks a round at a time (round_item): one each on a full grid, or several on a
// persistent grid of one block an SM, where the producer streams the next item's Q and first keys
// while the consumers finish the last one. The block's work is one sequence of steps g = 0, 1, ...: an item of n key tiles is n
// steps (S of its tile j, P V of tile j - 1; at j = 0 a zero P over the V stage the step before
// filled, or the zeroed one) and a final step (P V of its last tile, then its output). Step g reads
// K stage g % 3 and V stage (g - 1) % 3; the producer's iteration g, once both consumers have
// retired step g - 3 (EMPTY[g % 3]: K stage g % 3 and V stage (g - 1) % 3 are then free), copies
// step g's K and V as one group (at an item's first step also its Q, once both consumers have
// retired the last S of the item before: QFREE), fetches step g + 1's key offsets, then waits for
// the group of step g - 1 and announces it to each consumer (FULL[w][(g - 1) % 3]).
// Each barrier id's phases stay apart: the producer's arrival for step g + 3 on FULL[w][s] follows
// its wait for step g + 1's EMPTY (so w has synced step g), a consumer's arrival for step g + 3 on
// EMPTY[s] follows FULL of step g + 3, announced after the producer's wait for step g, and QFREE
// likewise a whole item apart. The producer syncs every step's EMPTY and every item's QFREE once,
// so no arrival is left over at the end.
#define WGW_FULL(w, s) (1 + 3 * (w) + (s))
#define WGW_EMPTY(s) (7 + (s))
#define WGW_SCHED(w) (10 + (w))
#define WGW_PRODUCER 12
#define WGW_QFREE 13
#define WGW_PRODUCER_REGS 56
#define WGW_CONSUMER_REGS 224  // 128 x 56 + 256 x 224 = 64,512 of an SM's 65,536

// QREG: each consumer holds its Q rows in registers for the item (S's A from registers, 32 more a
// thread), read from the Q buffer at the item's first step; the buffer is free from then on
// (QFREE), so the producer may load the next item's Q a whole item early instead of at the last S.
template <bool QREG>
__device__ __forceinline__ void attention_wgw_body(ATTN_TC_PARAMS, int row_tiles, int zcount) {
    constexpr int ROWS = 128, KT = WGR_KT, STAGES = WGR_STAGES;
    constexpr int PARTS = WG_D / 8;            // 16-byte pieces of a cached head row
    constexpr int COPIES = KT * PARTS / 128;   // a producer thread's copies of one K (or V) tile: 16
    constexpr int KSTEP = 128 / PARTS;         // keys between them: 8
    extern __shared__ __align__(16) unsigned char smem[];

    const int items = row_tiles * hk * zcount;
    auto item = [&](int i) {
        return attn_item(query_start_loc, seq_lens, hq, hk, num_splits, ROWS, KT, row_tiles, zcount, i);
    };
    // Round r gives this block item r * G + k (r even) or r * G + G - 1 - k (r odd), G blocks, k its
    // index: the descending list dealt out in a snake, so that the blocks' sums of key tiles stay
    // level (dealt in the same direction every round, the first blocks would get the longest
    // item of every round). This block's next round from r on with an item that has rows (a
    // sequence shorter than the launch's longest has none in its top row tiles), or -1.
    const int G = gridDim.x, k = blockIdx.x;
    auto round_item = [&](int r) { return r * G + (r % 2 ? G - 1 - k : k); };
    auto next_round = [&](int r) {
        for (; r * G < items; ++r) {
            const int i = round_item(r);
            if (i < items) {
                const AttnBlock a = item(i);
                if (a.row0 < a.nrows) return r;
            }
        }
        return -1;
    };
    const int tid = threadIdx.x, wg = tid / 128;

    unsigned char* gbase;
    const unsigned base = smem_base_1024(smem, gbase);
    const unsigned q_s = base;                              // Q [2][128 rows][128 B]
    const unsigned k_s = base + 2 * ROWS * 128;             // K stages
    const unsigned v_s = k_s + STAGES * WGR_TILE;           // V stages
    const unsigned off_at = v_s + STAGES * WGR_TILE;
    unsigned int* off_s = reinterpret_cast<unsigned int*>(gbase + (off_at - base));
    const unsigned sink = off_at + STAGES * KT * 4;

    if (wg == 0) {  // the producer
        warpgroup_regs_dec<WGW_PRODUCER_REGS>();
        const int p = tid;
        // The cache row (in 16-byte units) of key p of a's `tile` into offset slot `slot`; 0 past kv_end.
        auto fetch = [&](const AttnBlock& a, int tile, int slot) {
            const int kpos = tile * KT + p;
            off_s[slot * KT + p] = kpos < a.kv_end ? cache_row16(block_tables + (size_t)a.b * max_blocks, kpos,
                                                                 block_size, hk, a.kh, PARTS)
                                                   : 0u;
        };
        // Piece `part` of keys key0 + 8 i: keys 8 apart keep the swizzle's chunk, 1024 bytes apart.
        const int key0 = p / PARTS, part = p % PARTS;
        const unsigned dst0 = (part / 8) * WGR_HALF + key0 * 128 + (((part % 8) ^ (key0 & 7)) << 4);
        auto copy_tile = [&](const AttnBlock& a, int tile, int slot, unsigned stage, const bf16_t* cache) {
            const unsigned dst = stage + dst0;
            const unsigned int* offs = off_s + slot * KT + key0;
            copy_key_pieces<COPIES, KSTEP>(dst, offs, reinterpret_cast<u64_t>(cache) + part * 16,
                                           a.kv_end - tile * KT - key0);
        };
        auto announce = [&](int step) {
            fence_proxy_async();
            bar_arrive(WGW_FULL(0, step % STAGES), 256);
            bar_arrive(WGW_FULL(1, step % STAGES), 256);
        };
        int r = next_round(0);
        if (r < 0) return;  // the consumers find none either
        AttnBlock a = item(round_item(r));
        int j = 0;
        if (a.tile0 < a.tile1) fetch(a, a.tile0, 0);
        // The V stage an item's first step reads with a zero P (0 x stale NaN is NaN): step 0's,
        // and on a block running several items any stage (one that no step has filled yet, after
        // an item of one tile or of none).
        {
            const int first = G < items ? 0 : STAGES - 1;
            for (int e = p; e < (STAGES - first) * WGR_TILE / 4; e += 128)
                st_shared_u32(v_s + first * WGR_TILE + e * 4, 0u);
        }
        grid_dependency_wait();  // q and this step's K/V come from the kernel before
        bar_sync(WGW_PRODUCER, 128);
        int g = 0;
        for (;; ++g) {
            const int n = max(a.tile1, a.tile0) - a.tile0;
            if (g >= STAGES) bar_sync(WGW_EMPTY(g % STAGES), 384);
            bool announced = false;
            if (j == 0) {
                if (g > 0) {  // the item before: its final step's group, then Q free
                    cp_async_wait<0>();
                    announce(g - 1);
                    announced = true;
                    bar_sync(WGW_QFREE, 384);
                }
                copy_q_sw128<ROWS, 128>(q_s, q, q_stride, a.row0, a.nrows, a.group, a.q0, a.kh, p);
            }
            if (j < n) copy_tile(a, a.tile0 + j, g % STAGES, k_s + (g % STAGES) * WGR_TILE, k_cache);
            if (j > 0)
                copy_tile(a, a.tile0 + j - 1, (g + STAGES - 1) % STAGES, v_s + ((g + STAGES - 1) % STAGES) * WGR_TILE,
                          v_cache);
            cp_async_commit();
            // step g + 1: this item's next, or the next item's first
            const bool last = j == n;
            if (last) {
                r = next_round(r + 1);
                if (r >= 0) {
                    a = item(round_item(r));
                    j = 0;
                }
            } else {
                ++j;
            }
            if (r >= 0 && j < max(a.tile1, a.tile0) - a.tile0) fetch(a, a.tile0 + j, (g + 1) % STAGES);
            if (g > 0 && !announced) {
                cp_async_wait<1>();
                announce(g - 1);
            }
            bar_sync(WGW_PRODUCER, 128);  // step g + 1's offsets, for every producer thread
            if (last && r < 0) break;
        }
        cp_async_wait<0>();
        announce(g);
        // the phases the loop left: EMPTY of the last three steps, QFREE of the last item
        for (int s = max(g - STAGES + 1, 0); s <= g; ++s) bar_sync(WGW_EMPTY(s % STAGES), 384);
        bar_sync(WGW_QFREE, 384);
        return;
    }

    warpgroup_regs_inc<WGW_CONSUMER_REGS>();
    const int w = wg - 1, other = 1 - w, warp = (tid % 128) / 32, lane = tid % 32;
    const int gq = lane >> 2, c = lane & 3;
    grid_dependency_wait();  // the kernel before is done with what this writes

    unsigned int qf[QREG ? 8 : 1][4];  // QREG: k-step kk's A fragment (rows 16 warp + g, + 8)
    // QREG: this thread's Q fragments from the swizzled buffer, k-step kk one ldmatrix.x4 (matrix
    // i: rows + 8 (i % 2), the k-step's 16-byte chunk i / 2; lanes 8 i .. 8 i + 7 address it).
    auto load_q = [&]() {
        const int i = lane / 8, row = w * 64 + warp * 16 + lane % 8 + 8 * (i % 2);
#pragma unroll
        for (int kk = 0; kk < (QREG ? 8 : 0); ++kk) {
            const int ch = (kk % 4) * 2 + i / 2;
            ldsm_x4(qf[kk], gbase + (kk / 4) * (ROWS * 128) + row * 128 + ((ch ^ (row & 7)) << 4));
        }
    };
    auto issue_s = [&](int step, float (&s)[16][4]) {
        const unsigned kt = k_s + (step % STAGES) * WGR_TILE;
#pragma unroll
        for (int n = 0; n < 16; ++n) { s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f; }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const u64_t kd = sw128_desc(kt + (kk / 4) * WGR_HALF + (kk % 4) * 32);
            if constexpr (QREG) {
                WgmmaRA<128>::mma(&s[0][0], qf[kk], kd, kk > 0);
            } else {
                const unsigned qa = q_s + (kk / 4) * (ROWS * 128) + w * 64 * 128 + (kk % 4) * 32;
                Wgmma<128>::mma(&s[0][0], sw128_desc(qa), kd, kk > 0);
            }
        }
        wgmma_commit();
    };
    float o[16][4];
    unsigned int pa[16][2];  // the P whose product is pending: the last tile's
    auto issue_pv = [&](int step) {
        const unsigned vt = v_s + ((step + STAGES - 1) % STAGES) * WGR_TILE;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
            WgmmaRATB<128>::mma(&o[0][0], &pa[2 * kk][0], sw128_mn_desc(vt + kk * 2048, WGR_HALF), 1);
        wgmma_commit();
    };

    if (w == 1) bar_arrive(WGW_SCHED(0), 256);  // consumer 0 issues first
    int g = 0;
    for (int r = next_round(0); r >= 0; r = next_round(r + 1)) {
        const AttnBlock a = item(round_item(r));
        const int n = max(a.tile1, a.tile0) - a.tile0;
        const int ra = a.row0 + w * 64 + warp * 16 + gq, rb = ra + 8;
        const int pos_a = ra < a.nrows ? a.ctx - a.qlen + ra / a.group : -1;
        const int pos_b = rb < a.nrows ? a.ctx - a.qlen + rb / a.group : -1;
#pragma unroll
        for (int t = 0; t < 16; ++t) {
            o[t][0] = 0.f; o[t][1] = 0.f; o[t][2] = 0.f; o[t][3] = 0.f;
            pa[t][0] = 0u; pa[t][1] = 0u;
        }
        float m_a = -VT_INF, m_b = -VT_INF, l_a = 0.f, l_b = 0.f;
        for (int j = 0; j < n; ++j, ++g) {
            bar_sync(WGW_FULL(w, g % STAGES), 256);  // K of tile j, V of tile j - 1 (Q with the first)
            if (QREG && j == 0) {
                load_q();
                bar_arrive(WGW_QFREE, 384);  // read: the producer may load the next item's Q
            }
            float s[16][4];
            bar_sync(WGW_SCHED(w), 256);
            issue_s(g, s);
            issue_pv(g);
            bar_arrive(WGW_SCHED(other), 256);
            wgmma_wait<1>();
            Wgmma<128>::pin(&s[0][0]);
            const float2 corr =
                softmax_weights<16, true>(s, (a.tile0 + j) * KT, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b);
            // ptxas keeps a wait after an earlier shared store: the softmax stays before the wait
            st_shared_u32(sink, __float_as_uint(l_a + l_b));
            wgmma_wait<0>();
            Wgmma<128>::pin(&o[0][0]);
            if (!QREG && j == n - 1) bar_arrive(WGW_QFREE, 384);  // the item's last S: Q may be replaced
            bar_arrive(WGW_EMPTY(g % STAGES), 384);
            rescale_m_tile<16>(o, corr);
#pragma unroll
            for (int t = 0; t < 16; ++t) { pa[t][0] = pack2_rn(s[t][0], s[t][1]); pa[t][1] = pack2_rn(s[t][2], s[t][3]); }
        }
        bar_sync(WGW_FULL(w, g % STAGES), 256);  // the item's last V
        bar_sync(WGW_SCHED(w), 256);
        wgmma_fence();
        issue_pv(g);
        bar_arrive(WGW_SCHED(other), 256);
        wgmma_wait<0>();
        Wgmma<128>::pin(&o[0][0]);
        if (n == 0) bar_arrive(WGW_QFREE, 384);
        bar_arrive(WGW_EMPTY(g % STAGES), 384);
        ++g;
        store_m_tile<WG_D>(o, m_a, m_b, quad_sum(l_a), quad_sum(l_b), ra, rb, c, a.nrows, a.group, a.q0, a.kh, hq,
                           a.split, total_tokens, num_splits, out, part_o, part_ml, v_scale);
    }
}

#define ATTENTION_WGR_ENTRY(NAME, KV8, PP)                                                        \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(ATTN_TC_PARAMS) {                   \
        attention_wgr_body<KV8, PP>(ATTN_TC_ARGS);                                                \
    }
#define ATTENTION_WGQ_ENTRY(NAME)                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(ATTN_TC_PARAMS) {                   \
        attention_wgr_body<true, false, true>(ATTN_TC_ARGS);                                      \
    }

ATTENTION_WGR_ENTRY(attention_wgr_d128_prefill, false, false)
// wgs: wgr's products and data flow, its warpgroups in ping-pong (the PP notes above).
ATTENTION_WGR_ENTRY(attention_wgs_d128_prefill, false, true)
// wgw: wgs's consumers fed by a producer warpgroup (the notes above attention_wgw_body).
// ATTN_TC_PARAMS, then the launch's items: row tiles and sequences x splits (attention_plan.launch_shape)
#define ATTENTION_ITEMS_ENTRY(NAME, QREG)                                                         \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(ATTN_TC_PARAMS, int row_tiles, int zcount) { \
        attention_wgw_body<QREG>(ATTN_TC_ARGS, row_tiles, zcount);                                \
    }
ATTENTION_ITEMS_ENTRY(attention_wgw_d128_prefill, false)
// the same body with Q in registers, launched on a persistent grid (attention_plan: wgwp)
ATTENTION_ITEMS_ENTRY(attention_wgwp_d128_prefill, true)
// fp8 KV cache (e4m3 codes): the same tiles, each converted to bf16 in shared memory.
ATTENTION_WGR_ENTRY(attention_wgr_d128_prefill_kv8, true, false)
// fp8 KV cache with Q K^T in e4m3 (q quantized per row to e4m3 x 2^n as it loads).
ATTENTION_WGQ_ENTRY(attention_wgq_d128_prefill_kv8)
