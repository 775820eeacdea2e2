// Paged causal attention on tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate) for head
// dims 64 and 128: the same ragged-batch contract as attention.cu, which keeps the other sizes.
//
// Grid: x = tiles of 16 * RW query rows, y = kv head, z = sequence * num_splits. Rows are
// (token j, GQA head g) pairs, row = j * G + g, so one kv head's K/V tile serves its whole group.
// A block has 4 warps = RW row warps x KW key warps. Prefill (RW 4, KW 1): each warp owns 16 rows
// and every key. Decode (RW 1, KW 4): one 16-row tile (G valid rows) and each warp a quarter of
// every key tile, merged through shared memory at the end, so all four warps stream keys.
// Key tiles of 64 arrive by cp.async, TC_STAGES of them in flight per block: the next tiles load
// while the current one is multiplied, which is what keeps decode near the HBM rate.
// Scores live in the log2 domain (scale * log2 e) with an online softmax in fp32; P is rounded
// to bf16 for the P.V product. Split partials (o, m, l) use attention_combine_k's layout.

// TC_STAGES (key tiles in flight per block) is defined by cuda_ops from attention_plan.TC_STAGES,
// which also sizes the shared memory; DEC8_KV8_STAGES likewise for the decode8 kernels reading fp8.
// TC_KT (keys a tile) likewise from attention_plan.TC_KEY_TILE, which the launcher also hands
// attention_combine_k for its chunking.
static_assert(TC_KT == 64, "the tiles' warp shares and shared memory (tc_smem) are laid out for 64 keys");

// The K/V tiles of one (sequence, kv head, key split) through shared memory, TC_KT keys a tile
// and STAGES tiles in flight. The cache rows of each tile are staged in shared memory as 32-bit
// offsets in 16-byte units (slot tile % STAGES) a tile before their copies are issued, so that
// issuing never waits on a block-table read and a copy is a shared load, an add and the cp.async.
// Every step commits one copy group, empty or not, so "all but the newest STAGES - 2 groups
// done" always means "the current tile has landed".
// KV8 (an fp8 cache of e4m3 codes): the copies land in fp8 stages ([STAGES][K|V][TC_KT][D]
// bytes) and advance() converts the current one into the single bf16 tile the MMAs read (the
// codes widen to bf16 exactly; the scales are applied outside: k_scale in scale_log2, v_scale on
// the output), with a second barrier before the MMAs. Half the bytes a key cross HBM and L2.
// DIRECT (KV8, the decode8 body): no bf16 tile; the MMAs' fragments are widened in registers
// straight from the fp8 stages, whose 16-byte pieces sit at swizzled places in a row (k_piece,
// v_piece) so that the readers' 16-byte loads meet no bank twice.
template <int D, int STAGES, int NT = 128, bool KV8 = false, bool DIRECT = false>
struct KvPipe {
    static_assert(!DIRECT || KV8, "only an fp8 cache is read without a converted tile");
    static constexpr int SROW = D + 8;      // smem row stride (bf16): 16-byte pad, ldmatrix conflict free
    static constexpr int PARTS = KV8 ? D / 16 : D / 8;  // 16-byte pieces of one key's cached head row
    static constexpr int TPP = NT / PARTS;  // keys per copy pass of the block's NT threads
    static constexpr unsigned int NONE = 0xffffffffu;
    bf16_t* kv_s;                           // [STAGES][K|V][TC_KT][SROW]; KV8: [K|V][TC_KT][SROW], fp8 stages
    unsigned int* off_s;                    // [STAGES][TC_KT]
    const bf16_t* k_cache;
    const bf16_t* v_cache;
    const int* table;                       // this sequence's block-table row
    int block_size, hk, kh, kv_end, tile0, tile1;

    static constexpr size_t TILE_BYTES = (size_t)2 * TC_KT * SROW * sizeof(bf16_t);  // one K and V tile
    static constexpr size_t STAGE8_BYTES = (size_t)2 * TC_KT * D;                      // one fp8 stage
    static constexpr size_t TILE16_BYTES = KV8 && DIRECT ? 0 : TILE_BYTES;  // KV8: the converted tile
    static constexpr size_t KV_BYTES = KV8 ? TILE16_BYTES + STAGES * STAGE8_BYTES : STAGES * TILE_BYTES;
    static constexpr size_t BYTES = KV_BYTES + (size_t)STAGES * TC_KT * sizeof(unsigned int);
    static_assert(NT >= TC_KT && TC_KT % TPP == 0, "a copy pass covers whole keys of the tile");
    __device__ const bf16_t* k_tile(int tile) const {
        if constexpr (KV8) return kv_s;  // the converted tile
        return kv_s + (size_t)((tile - tile0) % STAGES) * 2 * TC_KT * SROW;  // its V tile follows
    }
    __device__ unsigned char* stage8(int tile) const {  // KV8: the fp8 copies of `tile`, K then V
        return reinterpret_cast<unsigned char*>(kv_s) + TILE16_BYTES + (size_t)((tile - tile0) % STAGES) * STAGE8_BYTES;
    }
    // DIRECT: where piece p (16 codes) of K row `row` of a stage sits. The decode8 reader's lanes
    // 4r..4r+3 take row r's pieces c (+ 4): odd rows swap halves so two rows fill the 32 banks.
    static __device__ __forceinline__ int k_piece(int row, int p) { return p ^ ((row & 1) * (D / 32)); }
    // ... and of V row `row`: lane (g, c) reads piece g's share of rows 2c, 2c + 1, 2c + 8, 2c + 9,
    // so rows 0, 2, 4, 6 of one load are spread over the banks by (row / 2) % 4.
    static __device__ __forceinline__ int v_piece(int row, int p) {
        return p ^ ((((row >> 1) & 3) * 2) & (D / 16 - 1));
    }

    __device__ void fetch(int tile) const {
        if (threadIdx.x < TC_KT && tile < tile1) {
            const int kpos = tile * TC_KT + threadIdx.x;
            unsigned int off = NONE;
            if (kpos < kv_end) {
                const size_t blk = (size_t)table[kpos / block_size];
                off = (unsigned int)(((blk * block_size + kpos % block_size) * hk + kh) * PARTS);
            }
            off_s[(tile % STAGES) * TC_KT + threadIdx.x] = off;
        }
    }
    __device__ void load(int tile) const {
        const unsigned int* offs = off_s + (tile % STAGES) * TC_KT;
        const int part = threadIdx.x % PARTS, tok0 = threadIdx.x / PARTS;
        // In bytes: offsets count 16-byte pieces of the cache either way; a staged row is SROW
        // bf16 (padded) or D codes.
        constexpr int ROW_BYTES = KV8 ? D : SROW * (int)sizeof(bf16_t);
        unsigned char* ks = KV8 ? stage8(tile) : reinterpret_cast<unsigned char*>(const_cast<bf16_t*>(k_tile(tile)));
        unsigned char* vs = ks + TC_KT * ROW_BYTES;
        const unsigned char* kc = reinterpret_cast<const unsigned char*>(k_cache);
        const unsigned char* vc = reinterpret_cast<const unsigned char*>(v_cache);
#pragma unroll
        for (int i = 0; i < TC_KT / TPP; ++i) {
            const int tok = tok0 + i * TPP;
            const unsigned int off = offs[tok];
            const bool ok = off != NONE;
            const size_t src = ok ? ((size_t)off + part) * 16 : 0;
            const int kp = DIRECT ? k_piece(tok, part) : part, vp = DIRECT ? v_piece(tok, part) : part;
            cp_async16(ks + tok * ROW_BYTES + kp * 16, kc + src, ok);
            cp_async16(vs + tok * ROW_BYTES + vp * 16, vc + src, ok);
        }
    }
    // KV8: 16 codes of stage row `row` (K keys, then V keys), piece `part`, into the bf16 tile.
    __device__ void convert_piece(const unsigned char* src, int row, int part) const {
        const uint4 w = *reinterpret_cast<const uint4*>(src + (size_t)row * D + part * 16);
        const uint2 a = e4m3x4_to_bf16x4(w.x), b = e4m3x4_to_bf16x4(w.y);
        const uint2 c = e4m3x4_to_bf16x4(w.z), d = e4m3x4_to_bf16x4(w.w);
        uint4* dst = reinterpret_cast<uint4*>(kv_s + (size_t)row * SROW + part * 16);
        dst[0] = make_uint4(a.x, a.y, b.x, b.y);
        dst[1] = make_uint4(c.x, c.y, d.x, d.y);
    }
    // KV8: the landed fp8 stage of `tile` into the bf16 tile, 16 codes a thread a pass (keys
    // past kv_end were zero-filled, and code 0 is 0).
    __device__ void convert(int tile) const {
        const unsigned char* src = stage8(tile);
        static_assert(2 * TC_KT * (D / 16) % NT == 0, "every thread converts the same number of pieces");
#pragma unroll 1
        for (int i = 0; i < 2 * TC_KT * (D / 16) / NT; ++i) {
            const int e = threadIdx.x + i * NT;
            convert_piece(src, e / (D / 16), e % (D / 16));
        }
    }
    // KV8, decode: one warp converts only the 16 keys of the tile it reads (K and V rows key0 ..
    // key0 + 15), 16 codes a lane a pass as in convert(), so no second block barrier is needed.
    __device__ void convert_keys(int tile, int key0) const {
        constexpr int PIECES = D / 16;  // 16-code pieces of a cached row
        static_assert(2 * 16 * PIECES % 32 == 0, "every lane converts the same number of pieces");
        const unsigned char* src = stage8(tile);
        const int lane = threadIdx.x & 31;
#pragma unroll 1
        for (int i = 0; i < 2 * 16 * PIECES / 32; ++i) {
            const int e = lane + 32 * i;
            const int r = e / PIECES;  // the slice's 16 K rows, then its 16 V rows
            convert_piece(src, (r < 16 ? 0 : TC_KT) + key0 + (r & 15), e % PIECES);
        }
    }
    // The first STAGES - 1 tiles go out before the caller's Q reads, so their latencies overlap.
    // Launched as a dependent of the kernel that writes Q and the new tokens' K/V, the block
    // reads the block table and the tiles before `fresh_tile` (keys older than this step) while
    // that kernel still runs, and waits for it before anything it writes.
    __device__ void start(int fresh_tile) const {
        for (int i = 0; i < STAGES; ++i) fetch(tile0 + i);
        __syncthreads();
        int i = 0;
        for (; i < STAGES - 1 && tile0 + i < fresh_tile; ++i) {
            if (tile0 + i < tile1) load(tile0 + i);
            cp_async_commit();
        }
        grid_dependency_wait();
        for (; i < STAGES - 1; ++i) {
            if (tile0 + i < tile1) load(tile0 + i);
            cp_async_commit();
        }
    }
    // Wait for `tile`, then refill the stage the previous step consumed. KV8: convert the tile
    // (every warp is past the last tile's products at the first barrier) and publish it; with
    // own_key0 >= 0 (the 16-row decode body, whose warps each read 16 keys of a tile) each warp
    // converts its own keys and only waits for its own lanes. DIRECT converts nothing here.
    __device__ void advance(int tile, int own_key0 = -1) const {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // this tile landed for every thread; the stage refilled below is free
        if constexpr (KV8 && !DIRECT) {
            if (own_key0 >= 0) convert_keys(tile, own_key0);
            else convert(tile);
        }
        const int next = tile + STAGES - 1;
        if (next < tile1) load(next);
        cp_async_commit();
        fetch(next + 1);  // its slot held the offsets of `tile`, issued steps ago
        if constexpr (KV8 && !DIRECT) {
            if (own_key0 >= 0) __syncwarp();  // the warp's converted keys are whole before its products
            else __syncthreads();             // the converted tile is whole before the products
        }
    }
    __device__ void finish() const {
        cp_async_wait<0>();
        __syncthreads();  // every warp is done with the stages before the caller reuses them
    }
};

// The end of a block whose KW warps each streamed a share of the keys for the same ROWS rows:
// each left (m, l) per row in red_ml [KW][ROWS][2] and its unnormalised o in red_o [KW][ROWS][D].
// Merge them and write the rows out (one split) or as split partials.
template <int D, int KW, int ROWS>
__device__ __forceinline__ void merge_key_warps(const float* red_o, const float* red_ml, int row0, int nrows,
                                                int group, int q0, int kh, int hq, int split, int total_tokens,
                                                int num_splits, bf16_t* out, float* part_o, float* part_ml,
                                                float v_scale) {
    for (int e = threadIdx.x; e < ROWS * (D / 2); e += blockDim.x) {
        const int lr = e / (D / 2), p = e % (D / 2), r = row0 + lr;
        if (r >= nrows) continue;
        float mm = -VT_INF;
#pragma unroll
        for (int w = 0; w < KW; ++w) mm = fmaxf(mm, red_ml[(w * ROWS + lr) * 2]);
        float ll = 0.f, x0 = 0.f, x1 = 0.f;
        if (mm > -VT_INF) {
#pragma unroll
            for (int w = 0; w < KW; ++w) {
                const float mw = red_ml[(w * ROWS + lr) * 2];
                if (mw == -VT_INF) continue;
                const float wt = exp2f(mw - mm);
                ll += wt * red_ml[(w * ROWS + lr) * 2 + 1];
                x0 += wt * red_o[(w * ROWS + lr) * D + 2 * p];
                x1 += wt * red_o[(w * ROWS + lr) * D + 2 * p + 1];
            }
        }
        const int t = q0 + r / group, h = kh * group + r % group;
        if (num_splits == 1) {
            const float inv = ll > 0.f ? v_scale / ll : 0.f;
            reinterpret_cast<unsigned int*>(out + ((size_t)t * hq + h) * D)[p] = pack2(x0 * inv, x1 * inv);
        } else {
            const size_t prow = ((size_t)split * total_tokens + t) * hq + h;
            reinterpret_cast<float2*>(part_o + prow * D)[p] = make_float2(x0 * v_scale, x1 * v_scale);
            if (p == 0) { part_ml[prow * 2] = mm; part_ml[prow * 2 + 1] = ll; }
        }
    }
}

template <int D, int RW, int KW, int STAGES, bool KV8 = false>
__device__ __forceinline__ void attention_tc_body(
    ATTN_TC_PARAMS) {
    using Pipe = KvPipe<D, STAGES, 128, KV8>;
    constexpr int SROW = Pipe::SROW;
    constexpr int WK = TC_KT / KW;        // keys per warp per tile
    constexpr int NS = WK / 8;            // score n-tiles per warp
    constexpr int DK = D / 16;            // k-steps over the head dim
    constexpr int DN = D / 8;             // output n-tiles
    extern __shared__ __align__(16) unsigned char smem[];

    const AttnBlock ab = attn_block(query_start_loc, seq_lens, hq, hk, num_splits, 16 * RW, TC_KT, RW > 1);
    if (ab.row0 >= ab.nrows) return;
    const int group = ab.group, kh = ab.kh, b = ab.b, split = ab.split, q0 = ab.q0, qlen = ab.qlen;
    const int ctx = ab.ctx, nrows = ab.nrows, row0 = ab.row0, kv_end = ab.kv_end;
    const int tile0 = ab.tile0, tile1 = ab.tile1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rw = warp / KW, kw = warp % KW;
    const int g = lane >> 2, c = lane & 3;

    // This thread's two rows (g and g + 8 of the warp's 16) and their key limits.
    const int wr0 = row0 + rw * 16;
    const int ra = wr0 + g, rb = wr0 + g + 8;
    const int pos_a = ra < nrows ? ctx - qlen + ra / group : -1;
    const int pos_b = rb < nrows ? ctx - qlen + rb / group : -1;
    const int wlast = min(wr0 + 15, nrows - 1);
    const int warp_pos = wlast >= wr0 ? ctx - qlen + wlast / group : -1;

    const Pipe pipe{reinterpret_cast<bf16_t*>(smem), reinterpret_cast<unsigned int*>(smem + Pipe::KV_BYTES),
                    k_cache, v_cache, block_tables + (size_t)b * max_blocks, block_size, hk, kh, kv_end, tile0, tile1};
    pipe.start((ctx - qlen) / TC_KT);

    // Q fragments (A operand, row major), straight from global memory.
    unsigned int qa[DK][4];
    load_q_frags<D>(qa, q, q_stride, ra, rb, c, nrows, group, q0, kh);

    float o[DN][4];
#pragma unroll
    for (int n = 0; n < DN; ++n) { o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }
    float m_a = -VT_INF, m_b = -VT_INF, l_a = 0.f, l_b = 0.f;

    for (int tile = tile0; tile < tile1; ++tile) {
        pipe.advance(tile, RW == 1 && WK == 16 ? kw * WK : -1);  // decode: each warp converts its own keys
        const int kbase = tile * TC_KT + kw * WK;  // first key of this warp's slice
        if (kbase <= warp_pos) {
            const bf16_t* ks = pipe.k_tile(tile) + kw * WK * SROW;
            const bf16_t* vs = ks + TC_KT * SROW;
            // S = Q K^T over this warp's WK keys.
            float s[NS][4];
#pragma unroll
            for (int n = 0; n < NS; ++n) { s[n][0] = 0.f; s[n][1] = 0.f; s[n][2] = 0.f; s[n][3] = 0.f; }
            const int mi = lane >> 3, mr = lane & 7;
#pragma unroll
            for (int ks_i = 0; ks_i < DK; ++ks_i) {
#pragma unroll
                for (int n = 0; n < NS; n += 2) {
                    unsigned int kb[4];
                    ldsm_x4(kb, ks + (n * 8 + (mi >> 1) * 8 + mr) * SROW + ks_i * 16 + (mi & 1) * 8);
                    mma_bf16(s[n], qa[ks_i], kb[0], kb[1]);
                    mma_bf16(s[n + 1], qa[ks_i], kb[2], kb[3]);
                }
            }
            // Mask, then the online softmax update of rows a (c0, c1) and b (c2, c3).
            unsigned int pa[NS][2];
            softmax_m_tile<NS, DN>(s, kbase, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b, o, pa);
            // O += P V: P's score fragments are already the A fragments of k-steps of 16 keys.
#pragma unroll
            for (int kk = 0; kk < NS / 2; ++kk) {
                const unsigned int a[4] = {pa[2 * kk][0], pa[2 * kk][1], pa[2 * kk + 1][0], pa[2 * kk + 1][1]};
#pragma unroll
                for (int n = 0; n < DN; n += 2) {
                    unsigned int vb[4];
                    ldsm_x4_t(vb, vs + (kk * 16 + (mi & 1) * 8 + mr) * SROW + n * 8 + (mi >> 1) * 8);
                    mma_bf16(o[n], a, vb[0], vb[1]);
                    mma_bf16(o[n + 1], a, vb[2], vb[3]);
                }
            }
        }
    }
    pipe.finish();

    // Row sums were kept per thread; the four threads of a quad share a row.
    l_a = quad_sum(l_a);
    l_b = quad_sum(l_b);

    if constexpr (KW > 1) {
        // Merge the key warps: each leaves (m, l, o) of its 16 rows in shared memory.
        float* red_o = reinterpret_cast<float*>(smem);       // [KW][16][D]
        float* red_ml = red_o + KW * 16 * D;                 // [KW][16][2]
        float* wo = red_o + kw * 16 * D;
#pragma unroll
        for (int n = 0; n < DN; ++n) {
            const int col = n * 8 + 2 * c;
            wo[g * D + col] = o[n][0];
            wo[g * D + col + 1] = o[n][1];
            wo[(g + 8) * D + col] = o[n][2];
            wo[(g + 8) * D + col + 1] = o[n][3];
        }
        if (c == 0) {
            red_ml[(kw * 16 + g) * 2] = m_a;
            red_ml[(kw * 16 + g) * 2 + 1] = l_a;
            red_ml[(kw * 16 + g + 8) * 2] = m_b;
            red_ml[(kw * 16 + g + 8) * 2 + 1] = l_b;
        }
        __syncthreads();
        merge_key_warps<D, KW, 16>(red_o, red_ml, row0, nrows, group, q0, kh, hq, split, total_tokens,
                                   num_splits, out, part_o, part_ml, v_scale);
    } else {
        store_m_tile<D>(o, m_a, m_b, l_a, l_b, ra, rb, c, nrows, group, q0, kh, hq, split, total_tokens, num_splits,
                        out, part_o, part_ml, v_scale);
    }
}

// Prefill on tiles of 16 * MT * NW rows: NW warps, each owning MT m-tiles of 16 consecutive rows
// and streaming every key of the block's K/V tiles. Against the 64-row tiling above, a 128-row
// tile halves the K/V bytes each row costs (L2 reads, cp.async, barriers), and MT = 2 also reads
// each K and V fragment from shared memory once for two m-tiles, half the ldmatrix traffic per
// mma. With MT = 2 the Q fragments would not fit in registers beside two m-tiles' accumulators:
// Q is staged in shared memory once ([ROWS][D + 8], after the pipe) and read a k-step at a time.
// The softmax steps over KSUB keys of the tile at a time: 32 keeps two m-tiles' scores of head
// dim 128 in registers without spilling.
template <int D, int NW, int MT, int STAGES, int KSUB, bool KV8 = false>
__device__ __forceinline__ void attention_tc_prefill_body(ATTN_TC_PARAMS) {
    constexpr int NT = 32 * NW;
    constexpr int ROWS = 16 * MT * NW;
    using Pipe = KvPipe<D, STAGES, NT, KV8>;
    constexpr int SROW = Pipe::SROW;
    constexpr int NS = KSUB / 8;   // score n-tiles of an m-tile in one softmax step
    constexpr int DK = D / 16;     // k-steps over the head dim
    constexpr int DN = D / 8;      // output n-tiles
    constexpr bool Q_SMEM = MT > 1;
    extern __shared__ __align__(16) unsigned char smem[];

    ATTN_BLOCK_LOCALS(ROWS, TC_KT);
    const int tile0 = ab.tile0, tile1 = ab.tile1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3, mi = lane >> 3, mr = lane & 7;

    // This warp's rows start at wr0; m-tile t holds rows wr0 + 16 t + (g, g + 8).
    const int wr0 = row0 + warp * 16 * MT;
    int pos[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int ra = wr0 + 16 * t + g, rb = ra + 8;
        pos[t][0] = ra < nrows ? ctx - qlen + ra / group : -1;
        pos[t][1] = rb < nrows ? ctx - qlen + rb / group : -1;
    }
    const int wlast = min(wr0 + 16 * MT - 1, nrows - 1);
    const int warp_pos = wlast >= wr0 ? ctx - qlen + wlast / group : -1;

    const Pipe pipe{reinterpret_cast<bf16_t*>(smem), reinterpret_cast<unsigned int*>(smem + Pipe::KV_BYTES),
                    k_cache, v_cache, block_tables + (size_t)b * max_blocks, block_size, hk, kh, kv_end, tile0, tile1};
    pipe.start((ctx - qlen) / TC_KT);  // returns after the grid dependency: q is written

    bf16_t* q_s = reinterpret_cast<bf16_t*>(smem + Pipe::BYTES);  // [ROWS][SROW] when Q_SMEM
    unsigned int qa[Q_SMEM ? 1 : DK][4];
    if constexpr (Q_SMEM) {
        // Every thread stages words of Q; the first advance()'s barrier publishes them.
        for (int e = threadIdx.x; e < ROWS * (D / 2); e += NT) {
            const int lr = e / (D / 2), w = e % (D / 2), r = row0 + lr;
            unsigned int v = 0u;
            if (r < nrows)
                v = reinterpret_cast<const unsigned int*>(
                    q + (size_t)(q0 + r / group) * q_stride + (size_t)(kh * group + r % group) * D)[w];
            reinterpret_cast<unsigned int*>(q_s + lr * SROW)[w] = v;
        }
    } else {
        load_q_frags<D>(qa, q, q_stride, wr0 + g, wr0 + g + 8, c, nrows, group, q0, kh);
    }

    float o[MT][DN][4];
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
#pragma unroll
        for (int n = 0; n < DN; ++n) { o[t][n][0] = 0.f; o[t][n][1] = 0.f; o[t][n][2] = 0.f; o[t][n][3] = 0.f; }
        m[t][0] = -VT_INF; m[t][1] = -VT_INF; l[t][0] = 0.f; l[t][1] = 0.f;
    }

    for (int tile = tile0; tile < tile1; ++tile) {
        pipe.advance(tile);
#pragma unroll 1
        for (int sub = 0; sub < TC_KT / KSUB; ++sub) {
            const int kbase = tile * TC_KT + sub * KSUB;
            if (kbase > warp_pos) break;  // this and later keys are after the warp's last row
            const bf16_t* ks = pipe.k_tile(tile) + sub * KSUB * SROW;
            const bf16_t* vs = pipe.k_tile(tile) + (TC_KT + sub * KSUB) * SROW;
            // S = Q K^T: each K fragment serves the warp's MT m-tiles.
            float s[MT][NS][4];
#pragma unroll
            for (int t = 0; t < MT; ++t)
#pragma unroll
                for (int n = 0; n < NS; ++n) { s[t][n][0] = 0.f; s[t][n][1] = 0.f; s[t][n][2] = 0.f; s[t][n][3] = 0.f; }
#pragma unroll
            for (int ks_i = 0; ks_i < DK; ++ks_i) {
                unsigned int qf[MT][4];
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    if constexpr (Q_SMEM) {
                        ldsm_x4(qf[t], q_s + (warp * 16 * MT + 16 * t + (lane & 15)) * SROW + ks_i * 16 + (lane >> 4) * 8);
                    } else {
#pragma unroll
                        for (int i = 0; i < 4; ++i) qf[t][i] = qa[ks_i][i];
                    }
                }
#pragma unroll
                for (int n = 0; n < NS; n += 2) {
                    unsigned int kb[4];
                    ldsm_x4(kb, ks + (n * 8 + (mi >> 1) * 8 + mr) * SROW + ks_i * 16 + (mi & 1) * 8);
#pragma unroll
                    for (int t = 0; t < MT; ++t) {
                        mma_bf16(s[t][n], qf[t], kb[0], kb[1]);
                        mma_bf16(s[t][n + 1], qf[t], kb[2], kb[3]);
                    }
                }
            }
            unsigned int pa[MT][NS][2];
#pragma unroll
            for (int t = 0; t < MT; ++t)
                softmax_m_tile<NS, DN>(s[t], kbase, c, pos[t][0], pos[t][1], scale_log2, m[t][0], m[t][1],
                                       l[t][0], l[t][1], o[t], pa[t]);
            // O += P V: P's score fragments are already the A fragments of k-steps of 16 keys.
#pragma unroll
            for (int kk = 0; kk < NS / 2; ++kk) {
#pragma unroll
                for (int n = 0; n < DN; n += 2) {
                    unsigned int vb[4];
                    ldsm_x4_t(vb, vs + (kk * 16 + (mi & 1) * 8 + mr) * SROW + n * 8 + (mi >> 1) * 8);
#pragma unroll
                    for (int t = 0; t < MT; ++t) {
                        const unsigned int a[4] = {pa[t][2 * kk][0], pa[t][2 * kk][1], pa[t][2 * kk + 1][0],
                                                   pa[t][2 * kk + 1][1]};
                        mma_bf16(o[t][n], a, vb[0], vb[1]);
                        mma_bf16(o[t][n + 1], a, vb[2], vb[3]);
                    }
                }
            }
        }
    }
    pipe.finish();

#pragma unroll
    for (int t = 0; t < MT; ++t) {
        const int ra = wr0 + 16 * t + g;
        store_m_tile<D>(o[t], m[t][0], m[t][1], quad_sum(l[t][0]), quad_sum(l[t][1]), ra, ra + 8, c, nrows, group, q0,
                        kh, hq, split, total_tokens, num_splits, out, part_o, part_ml, v_scale);
    }
}

// Decode with at most 8 rows per kv head (a GQA group of up to 8, or a few tokens of a smaller
// group), computed transposed: S^T = K Q^T and O^T = V^T P^T. Keys and head dims are then the
// 16-wide M side of each mma and the rows its 8-wide N side, which halves the mma count and the
// accumulators of a 16-row tile whose rows would be mostly padding. Four warps each take 16 keys
// of every 64-key tile and are merged at the end.
// KV8: the fragments are widened from the fp8 stages in registers (KvPipe DIRECT), in orders
// that let one 16-byte shared load feed several MMAs. A dot product does not care in which
// order its head dims come, so S^T's k-steps take each lane's four consecutive codes (dims
// dim8(ks, c) + 0..3, pairs (0, 2) and (1, 3)) and Q's fragments are read in the same order.
// O^T's rows (head dims) are renamed instead: m-tile mt's rows g and g + 8 are dims
// (D / 8) g + 2 mt and + 1, so a lane's dims of a V row are D / 8 consecutive codes.
__device__ __forceinline__ int dim8(int ks, int c) { return 64 * (ks / 4) + 16 * c + 4 * (ks % 4); }

__device__ __forceinline__ unsigned int word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

template <int D, int STAGES, bool KV8 = false>
__device__ __forceinline__ void attention_tc_dec8_body(
    ATTN_TC_PARAMS) {
    using Pipe = KvPipe<D, STAGES, 128, KV8, KV8>;
    constexpr int SROW = Pipe::SROW;
    constexpr int DK = D / 16;             // k-steps of S^T over the head dim, m-tiles of O^T
    extern __shared__ __align__(16) unsigned char smem[];

    const AttnBlock ab = attn_block(query_start_loc, seq_lens, hq, hk, num_splits, 8, TC_KT);
    if (ab.row0 >= ab.nrows) return;
    const int group = ab.group, kh = ab.kh, b = ab.b, split = ab.split, q0 = ab.q0, qlen = ab.qlen;
    const int ctx = ab.ctx, nrows = ab.nrows, row0 = ab.row0, kv_end = ab.kv_end;
    const int tile0 = ab.tile0, tile1 = ab.tile1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;

    // The accumulators of this thread hold rows 2c and 2c + 1 of the tile.
    const int r0 = row0 + 2 * c, r1 = r0 + 1;
    const int pos0 = r0 < nrows ? ctx - qlen + r0 / group : -1;
    const int pos1 = r1 < nrows ? ctx - qlen + r1 / group : -1;
    const int tile_pos = ctx - qlen + (min(row0 + 7, nrows - 1)) / group;  // last key any row sees

    const Pipe pipe{reinterpret_cast<bf16_t*>(smem), reinterpret_cast<unsigned int*>(smem + Pipe::KV_BYTES),
                    k_cache, v_cache, block_tables + (size_t)b * max_blocks, block_size, hk, kh, kv_end, tile0, tile1};
    pipe.start((ctx - qlen) / TC_KT);

    // Q^T fragments (B operand): row g of the tile, two dim pairs per k-step.
    unsigned int qb[DK][2];
    {
        const int r = row0 + g;
        const bool ok = r < nrows;
        const bf16_t* p = q + (size_t)(q0 + (ok ? r / group : 0)) * q_stride + (size_t)(kh * group + (ok ? r % group : 0)) * D;
#pragma unroll
        for (int ks = 0; ks < DK; ++ks) {
            if constexpr (KV8) {  // dims dim8 + 0, 2 and + 1, 3: the order the K codes widen in
                const int d0 = dim8(ks, c);
                const unsigned int w01 = ok ? *reinterpret_cast<const unsigned int*>(p + d0) : 0u;
                const unsigned int w23 = ok ? *reinterpret_cast<const unsigned int*>(p + d0 + 2) : 0u;
                qb[ks][0] = __byte_perm(w01, w23, 0x5410);
                qb[ks][1] = __byte_perm(w01, w23, 0x7632);
            } else {
                qb[ks][0] = ok ? *reinterpret_cast<const unsigned int*>(p + ks * 16 + 2 * c) : 0u;
                qb[ks][1] = ok ? *reinterpret_cast<const unsigned int*>(p + ks * 16 + 2 * c + 8) : 0u;
            }
        }
    }

    // o[mt]: O^T of dims mt*16 + g (0, 1) and + 8 (2, 3), rows 2c (0, 2) and 2c + 1 (1, 3).
    float o[DK][4];
#pragma unroll
    for (int n = 0; n < DK; ++n) { o[n][0] = 0.f; o[n][1] = 0.f; o[n][2] = 0.f; o[n][3] = 0.f; }
    float m0 = -VT_INF, m1 = -VT_INF, l0 = 0.f, l1 = 0.f;
    const int mi = lane >> 3, mr = lane & 7;

    for (int tile = tile0; tile < tile1; ++tile) {
        pipe.advance(tile);  // DIRECT widens from the stage; no converted tile
        const int kbase = tile * TC_KT + warp * 16;
        if (kbase <= tile_pos) {
            const bf16_t* ks = pipe.k_tile(tile) + warp * 16 * SROW;
            const bf16_t* vs = ks + TC_KT * SROW;
            // s: S^T of keys kbase + g (0, 1) and + 8 (2, 3), rows 2c (0, 2) and 2c + 1 (1, 3).
            float s[4] = {0.f, 0.f, 0.f, 0.f};
            if constexpr (KV8) {
                const unsigned char* k8 = pipe.stage8(tile) + warp * 16 * D;
                // Keys g and g + 8: this lane's pieces c, c + 4 (D 128) of each, 16 codes a load.
                uint4 kr[2][D / 64];
#pragma unroll
                for (int h = 0; h < D / 64; ++h) {
                    kr[0][h] = *reinterpret_cast<const uint4*>(k8 + g * D + Pipe::k_piece(g, c + 4 * h) * 16);
                    kr[1][h] = *reinterpret_cast<const uint4*>(k8 + (g + 8) * D + Pipe::k_piece(g, c + 4 * h) * 16);
                }
#pragma unroll
                for (int ks_i = 0; ks_i < DK; ++ks_i) {
                    const unsigned int w0 = word_of(kr[0][ks_i / 4], ks_i % 4);
                    const unsigned int w1 = word_of(kr[1][ks_i / 4], ks_i % 4);
                    // e4m3_hi_to_bf16x2 reads the codes in bytes 1 and 3: codes 0, 2 then 1, 3.
                    const unsigned int ka[4] = {e4m3_hi_to_bf16x2(w0 << 8), e4m3_hi_to_bf16x2(w1 << 8),
                                                e4m3_hi_to_bf16x2(w0), e4m3_hi_to_bf16x2(w1)};
                    mma_bf16(s, ka, qb[ks_i][0], qb[ks_i][1]);
                }
            } else {
#pragma unroll
                for (int ks_i = 0; ks_i < DK; ++ks_i) {
                    unsigned int ka[4];
                    ldsm_x4(ka, ks + ((mi & 1) * 8 + mr) * SROW + ks_i * 16 + (mi >> 1) * 8);
                    mma_bf16(s, ka, qb[ks_i][0], qb[ks_i][1]);
                }
            }
            const int ka_pos = kbase + g, kb_pos = ka_pos + 8;
            s[0] = ka_pos <= pos0 ? s[0] * scale_log2 : -VT_INF;
            s[1] = ka_pos <= pos1 ? s[1] * scale_log2 : -VT_INF;
            s[2] = kb_pos <= pos0 ? s[2] * scale_log2 : -VT_INF;
            s[3] = kb_pos <= pos1 ? s[3] * scale_log2 : -VT_INF;
            float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
#pragma unroll
            for (int sh = 4; sh < 32; sh <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, sh));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, sh));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float base0 = mn0 == -VT_INF ? 0.f : mn0, base1 = mn1 == -VT_INF ? 0.f : mn1;
            const float corr0 = exp2f(m0 - base0), corr1 = exp2f(m1 - base1);
            m0 = mn0;
            m1 = mn1;
            const float p0 = exp2f(s[0] - base0), p1 = exp2f(s[1] - base1);
            const float p2 = exp2f(s[2] - base0), p3 = exp2f(s[3] - base1);
            l0 = l0 * corr0 + (p0 + p2);
            l1 = l1 * corr1 + (p1 + p3);
            // Once the running maxima settle the factors are exactly 1: skip the rescale then.
            if (__any_sync(0xffffffffu, corr0 != 1.f || corr1 != 1.f)) {
#pragma unroll
                for (int n = 0; n < DK; ++n) {
                    o[n][0] *= corr0; o[n][1] *= corr1; o[n][2] *= corr0; o[n][3] *= corr1;
                }
            }
            // P^T as the B operand: transpose the two 8x8 [key][row] bf16 blocks.
            const unsigned int pb0 = movmatrix_t(pack2_rn(p0, p1));
            const unsigned int pb1 = movmatrix_t(pack2_rn(p2, p3));
            if constexpr (KV8) {
                // Keys 2c, 2c + 1, 2c + 8, 2c + 9 (the A operand's k), this lane's D / 8 dims of each.
                constexpr int VB = D / 8, VW = VB / 4;
                const unsigned char* v8 = pipe.stage8(tile) + (TC_KT + warp * 16) * D;
                unsigned int vr[4][VW];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int row = 2 * c + (j & 1) + (j >> 1) * 8;
                    const unsigned char* src = v8 + row * D + Pipe::v_piece(row, VB * g / 16) * 16 + VB * g % 16;
                    if constexpr (VW == 4) {
                        const uint4 w = *reinterpret_cast<const uint4*>(src);
                        vr[j][0] = w.x; vr[j][1] = w.y; vr[j][2] = w.z; vr[j][3] = w.w;
                    } else {
                        const uint2 w = *reinterpret_cast<const uint2*>(src);
                        vr[j][0] = w.x; vr[j][1] = w.y;
                    }
                }
#pragma unroll
                for (int mt = 0; mt < DK; ++mt) {
                    // Byte b of two keys' words into bytes 1 and 3 (what e4m3_hi_to_bf16x2 reads).
                    const unsigned int b = 2 * (mt & 1), lo = b * 0x1111u + 0x4400u, hi = lo + 0x1111u;
                    const int i = mt / 2;
                    const unsigned int va[4] = {
                        e4m3_hi_to_bf16x2(__byte_perm(vr[0][i], vr[1][i], lo)),   // dim, keys 2c, 2c + 1
                        e4m3_hi_to_bf16x2(__byte_perm(vr[0][i], vr[1][i], hi)),   // dim + 1
                        e4m3_hi_to_bf16x2(__byte_perm(vr[2][i], vr[3][i], lo)),   // dim, keys 2c + 8, 2c + 9
                        e4m3_hi_to_bf16x2(__byte_perm(vr[2][i], vr[3][i], hi))};  // dim + 1
                    mma_bf16(o[mt], va, pb0, pb1);
                }
            } else {
#pragma unroll
                for (int mt = 0; mt < DK; ++mt) {
                    unsigned int va[4];
                    ldsm_x4_t(va, vs + ((mi >> 1) * 8 + mr) * SROW + mt * 16 + (mi & 1) * 8);
                    mma_bf16(o[mt], va, pb0, pb1);
                }
            }
        }
    }
    pipe.finish();

#pragma unroll
    for (int sh = 4; sh < 32; sh <<= 1) {
        l0 += __shfl_xor_sync(0xffffffffu, l0, sh);
        l1 += __shfl_xor_sync(0xffffffffu, l1, sh);
    }
    float* red_o = reinterpret_cast<float*>(smem);  // [4 warps][8 rows][D]
    float* red_ml = red_o + 4 * 8 * D;               // [4 warps][8 rows][2]
    float* wo = red_o + warp * 8 * D;
#pragma unroll
    for (int mt = 0; mt < DK; ++mt) {
        const int dim = KV8 ? (D / 8) * g + 2 * mt : mt * 16 + g, next = KV8 ? 1 : 8;  // rows g, g + 8
        wo[(2 * c) * D + dim] = o[mt][0];
        wo[(2 * c + 1) * D + dim] = o[mt][1];
        wo[(2 * c) * D + dim + next] = o[mt][2];
        wo[(2 * c + 1) * D + dim + next] = o[mt][3];
    }
    if (g == 0) {
        red_ml[(warp * 8 + 2 * c) * 2] = m0;
        red_ml[(warp * 8 + 2 * c) * 2 + 1] = l0;
        red_ml[(warp * 8 + 2 * c + 1) * 2] = m1;
        red_ml[(warp * 8 + 2 * c + 1) * 2 + 1] = l1;
    }
    __syncthreads();
    merge_key_warps<D, 4, 8>(red_o, red_ml, row0, nrows, group, q0, kh, hq, split, total_tokens, num_splits,
                             out, part_o, part_ml, v_scale);
}

#define ATTENTION_TC_ENTRY(NAME, D, RW, KW, STAGES, KV8)                                         \
    extern "C" __global__ void __launch_bounds__(128) NAME(ATTN_TC_PARAMS) {                       \
        attention_tc_body<D, RW, KW, STAGES, KV8>(ATTN_TC_ARGS);                                   \
    }

ATTENTION_TC_ENTRY(attention_tc_d64_prefill, 64, 4, 1, TC_STAGES, false)
ATTENTION_TC_ENTRY(attention_tc_d64_decode, 64, 1, 4, TC_STAGES, false)
ATTENTION_TC_ENTRY(attention_tc_d128_prefill, 128, 4, 1, TC_STAGES, false)
ATTENTION_TC_ENTRY(attention_tc_d128_decode, 128, 1, 4, TC_STAGES, false)
// fp8 KV cache (e4m3 codes): the same tiles, the K/V stages converted to bf16 in shared memory.
ATTENTION_TC_ENTRY(attention_tc_d64_prefill_kv8, 64, 4, 1, TC_STAGES, true)
ATTENTION_TC_ENTRY(attention_tc_d64_decode_kv8, 64, 1, 4, TC_STAGES, true)
ATTENTION_TC_ENTRY(attention_tc_d128_prefill_kv8, 128, 4, 1, TC_STAGES, true)
ATTENTION_TC_ENTRY(attention_tc_d128_decode_kv8, 128, 1, 4, TC_STAGES, true)

#define ATTENTION_TC_DEC8_ENTRY(NAME, D, STAGES, KV8)                                            \
    extern "C" __global__ void __launch_bounds__(128) NAME(ATTN_TC_PARAMS) {                       \
        attention_tc_dec8_body<D, STAGES, KV8>(ATTN_TC_ARGS);                                      \
    }

ATTENTION_TC_DEC8_ENTRY(attention_tc_d64_decode8, 64, TC_STAGES, false)
ATTENTION_TC_DEC8_ENTRY(attention_tc_d128_decode8, 128, TC_STAGES, false)
ATTENTION_TC_DEC8_ENTRY(attention_tc_d64_decode8_kv8, 64, DEC8_KV8_STAGES, true)
ATTENTION_TC_DEC8_ENTRY(attention_tc_d128_decode8_kv8, 128, DEC8_KV8_STAGES, true)

// Prefill tilings of 128 rows (attention_plan.PREFILL_TILINGS): eight warps of one m-tile, or
// four warps of two m-tiles with Q in shared memory and two K/V stages (two blocks an SM).
#define ATTENTION_TC_PREFILL_ENTRY(NAME, D, NW, MT, STAGES, KSUB, KV8)                           \
    extern "C" __global__ void __launch_bounds__(32 * NW, 1) NAME(ATTN_TC_PARAMS) {                \
        attention_tc_prefill_body<D, NW, MT, STAGES, KSUB, KV8>(ATTN_TC_ARGS);                     \
    }

ATTENTION_TC_PREFILL_ENTRY(attention_tc_d64_prefill_w8, 64, 8, 1, TC_STAGES, 64, false)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d128_prefill_w8, 128, 8, 1, TC_STAGES, 64, false)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d64_prefill_m2, 64, 4, 2, 2, 64, false)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d128_prefill_m2, 128, 4, 2, 2, 32, false)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d64_prefill_w8_kv8, 64, 8, 1, TC_STAGES, 64, true)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d128_prefill_w8_kv8, 128, 8, 1, TC_STAGES, 64, true)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d64_prefill_m2_kv8, 64, 4, 2, 2, 64, true)
ATTENTION_TC_PREFILL_ENTRY(attention_tc_d128_prefill_m2_kv8, 128, 4, 2, 2, 32, true)
