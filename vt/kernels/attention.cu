// Paged causal attention over a ragged batch: one kernel for prefill, chunked prefill and decode,
// on CUDA cores. Head dims 64 and 128 run on tensor cores instead (attention_tc.cu); this kernel
// serves the others (multiples of 8 up to 256).
//
// Grid: x = tiles of 4 * R query rows, y = kv head, z = sequence * num_splits. A query "row" of a
// sequence is a (token j, head g of the GQA group) pair, row = j * G + g, so the G heads that share
// a kv head share every K/V tile the block loads. Each warp owns R rows; lane l scores key l of
// the 32-key tile and owns output dims (2p, 2p + 1) for p = l + 32 i. Scores live in the log2
// domain (q pre-scaled by scale * log2 e) with an online softmax in fp32.
// With num_splits > 1 each split covers a slice of the key tiles and writes unnormalised
// partials (o, m, l) that attention_combine_k merges; the slice is derived from the actual
// seq_len, so a captured launch stays right for any context up to the one it was sized for.
//
// Shared memory (dynamic): V tile [32][d/2] words, Q rows [4R][d/2] float2, K tile [32][d/2 + 1]
// words (the pad word makes lane l's row start in bank l, so the score loop is conflict free).
// KV8 (the _kv8 kernels): the caches hold e4m3 codes, 8 an 8-byte load, converted exactly to bf16
// as they are staged; k_scale is in scale_log2 (the host folds it in) and v_scale multiplies the
// output (and the split partials, which attention_combine_k only weighs and sums).

// Eight cached elements of a K or V row from element `at`: 16 bytes of bf16, or 8 e4m3 codes
// widened to the same four bf16 pair words.
template <bool KV8>
__device__ __forceinline__ uint4 load_kv8(const bf16_t* cache, size_t at) {
    if constexpr (KV8) {
        const uint2 w = *reinterpret_cast<const uint2*>(reinterpret_cast<const unsigned char*>(cache) + at);
        const uint2 a = e4m3x4_to_bf16x4(w.x), b = e4m3x4_to_bf16x4(w.y);
        return make_uint4(a.x, a.y, b.x, b.y);
    } else {
        return *reinterpret_cast<const uint4*>(cache + at);
    }
}

// KT (keys a tile) is attention_plan.CUDA_CORE_KEY_TILE (sources.py defines it), which the
// launcher also hands attention_combine_k for its chunking.
static_assert(KT == 32, "lane l scores key l of a tile");
#define MAXP 4  // head dim up to 256

template <int R, bool KV8>
__device__ __forceinline__ void attention_body(
    const bf16_t* __restrict__ q, int q_stride, const bf16_t* __restrict__ k_cache,
    const bf16_t* __restrict__ v_cache, const int* __restrict__ query_start_loc,
    const int* __restrict__ seq_lens, const int* __restrict__ block_tables, int max_blocks,
    bf16_t* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_ml,
    int total_tokens, int hq, int hk, int d, int block_size, float scale_log2, int num_splits, float v_scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int half = d / 2;
    unsigned int* vs = reinterpret_cast<unsigned int*>(smem);
    float2* qs = reinterpret_cast<float2*>(smem + KT * half * 4);
    unsigned int* ks = reinterpret_cast<unsigned int*>(smem + KT * half * 4 + 4 * R * half * 8);

    const AttnBlock a = attn_block(query_start_loc, seq_lens, hq, hk, num_splits, 4 * R, KT);
    if (a.row0 >= a.nrows) return;
    const int group = a.group, kh = a.kh, b = a.b, split = a.split, q0 = a.q0, qlen = a.qlen, ctx = a.ctx;
    const int nrows = a.nrows, row0 = a.row0, kv_end = a.kv_end, tile0 = a.tile0, tile1 = a.tile1;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    // Stage this block's query rows, scaled, as float pairs.
    for (int e = threadIdx.x; e < 4 * R * half; e += blockDim.x) {
        const int lr = e / half, p = e % half, r = row0 + lr;
        float2 v = make_float2(0.f, 0.f);
        if (r < nrows) {
            const int t = q0 + r / group, h = kh * group + r % group;
            const unsigned int w =
                *reinterpret_cast<const unsigned int*>(q + (size_t)t * q_stride + (size_t)h * d + 2 * p);
            v = make_float2(lo_f(w) * scale_log2, hi_f(w) * scale_log2);
        }
        qs[e] = v;
    }

    int pos[R];
    float m[R], l[R], o_lo[R][MAXP], o_hi[R][MAXP];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        const int r = row0 + warp * R + rr;
        pos[rr] = r < nrows ? ctx - qlen + r / group : -1;
        m[rr] = -VT_INF;
        l[rr] = 0.f;
#pragma unroll
        for (int i = 0; i < MAXP; ++i) { o_lo[rr][i] = 0.f; o_hi[rr][i] = 0.f; }
    }

    const int chunks_per_tok = d / 8;
    for (int tile = tile0; tile < tile1; ++tile) {
        __syncthreads();  // previous tile fully consumed (and q staged, on the first pass)
        for (int c = threadIdx.x; c < KT * chunks_per_tok; c += blockDim.x) {
            const int tok = c / chunks_per_tok, part = c % chunks_per_tok;
            const int kpos = tile * KT + tok;
            uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
            if (kpos < kv_end) {
                const int blk = block_tables[(size_t)b * max_blocks + kpos / block_size];
                const size_t base = (((size_t)blk * block_size + kpos % block_size) * hk + kh) * d + part * 8;
                kv = load_kv8<KV8>(k_cache, base);
                vv = load_kv8<KV8>(v_cache, base);
            }
            unsigned int* kr = ks + tok * (half + 1) + part * 4;
            kr[0] = kv.x; kr[1] = kv.y; kr[2] = kv.z; kr[3] = kv.w;
            *reinterpret_cast<uint4*>(vs + tok * half + part * 4) = vv;
        }
        __syncthreads();
        const int kpos = tile * KT + lane;
#pragma unroll
        for (int rr = 0; rr < R; ++rr) {
            if (pos[rr] < tile * KT) continue;  // warp-uniform: this row sees nothing of the tile
            const float2* qr = qs + (warp * R + rr) * half;
            const unsigned int* kr = ks + lane * (half + 1);
            float s = 0.f;
            for (int p = 0; p < half; ++p) {
                const float2 qq = qr[p];
                const unsigned int w = kr[p];
                s += qq.x * lo_f(w) + qq.y * hi_f(w);
            }
            const bool valid = kpos <= pos[rr];
            s = valid ? s : -VT_INF;
            const float m_new = fmaxf(m[rr], warp_max(s));
            const float corr = exp2f(m[rr] - m_new);
            const float pj = valid ? exp2f(s - m_new) : 0.f;
            l[rr] = l[rr] * corr + warp_sum(pj);
            m[rr] = m_new;
#pragma unroll
            for (int i = 0; i < MAXP; ++i) { o_lo[rr][i] *= corr; o_hi[rr][i] *= corr; }
            const int jmax = min(KT, pos[rr] - tile * KT + 1);
            for (int j = 0; j < jmax; ++j) {
                const float pb = __shfl_sync(0xffffffffu, pj, j);
                const unsigned int* vr = vs + j * half;
#pragma unroll
                for (int i = 0; i < MAXP; ++i) {
                    const int p = lane + 32 * i;
                    if (p < half) {
                        const unsigned int w = vr[p];
                        o_lo[rr][i] += pb * lo_f(w);
                        o_hi[rr][i] += pb * hi_f(w);
                    }
                }
            }
        }
    }

#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        if (pos[rr] < 0) continue;
        const int r = row0 + warp * R + rr;
        const int t = q0 + r / group, h = kh * group + r % group;
        if (num_splits == 1) {
            const float inv = l[rr] > 0.f ? v_scale / l[rr] : 0.f;
            unsigned int* orow = reinterpret_cast<unsigned int*>(out + ((size_t)t * hq + h) * d);
#pragma unroll
            for (int i = 0; i < MAXP; ++i) {
                const int p = lane + 32 * i;
                if (p < half) orow[p] = pack2(o_lo[rr][i] * inv, o_hi[rr][i] * inv);
            }
        } else {
            const size_t prow = ((size_t)split * total_tokens + t) * hq + h;
            float2* po = reinterpret_cast<float2*>(part_o + prow * d);
#pragma unroll
            for (int i = 0; i < MAXP; ++i) {
                const int p = lane + 32 * i;
                if (p < half) po[p] = make_float2(o_lo[rr][i] * v_scale, o_hi[rr][i] * v_scale);
            }
            if (lane == 0) { part_ml[prow * 2] = m[rr]; part_ml[prow * 2 + 1] = l[rr]; }
        }
    }
}

#define ATTENTION_ENTRY(NAME, R, KV8)                                                                     \
    extern "C" __global__ void __launch_bounds__(128) NAME(                                              \
        const bf16_t* q, int q_stride, const bf16_t* k_cache, const bf16_t* v_cache,                     \
        const int* query_start_loc, const int* seq_lens, const int* block_tables, int max_blocks,        \
        bf16_t* out, float* part_o, float* part_ml, int total_tokens, int hq, int hk, int d,             \
        int block_size, float scale_log2, int num_splits, float v_scale) {                               \
        attention_body<R, KV8>(q, q_stride, k_cache, v_cache, query_start_loc, seq_lens, block_tables,   \
                               max_blocks, out, part_o, part_ml, total_tokens, hq, hk, d, block_size,    \
                               scale_log2, num_splits, v_scale);                                         \
    }

ATTENTION_ENTRY(attention_r1, 1, false)
ATTENTION_ENTRY(attention_r2, 2, false)
ATTENTION_ENTRY(attention_r4, 4, false)
ATTENTION_ENTRY(attention_r1_kv8, 1, true)
ATTENTION_ENTRY(attention_r2_kv8, 2, true)
ATTENTION_ENTRY(attention_r4_kv8, 4, true)

// Merge split partials of every (token, head) row: one block of 64 threads per row.
// Rows no split wrote (padding tokens) are left alone by checking the coverage mask.
// key_tile > 0 (attention_plan.combine_key_tile: a launch of one query row a sequence, whose
// kernel split tiles of key_tile keys): only the splits holding keys of the row's sequence are
// read, found by the kernel's own chunking (key_chunks) of its length. A decode graph sized for a
// long context splits 30-60 ways however short the real one; the splits past the keys carry
// m = -inf and weigh nothing, and the ones read are the leading ones in order, so the sums are
// the same bits. key_tile 0: every split.
extern "C" __global__ void attention_combine_k(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                                               const int* __restrict__ query_start_loc,
                                               const int* __restrict__ seq_lens, int num_seqs,
                                               bf16_t* __restrict__ out, int total_tokens, int hq, int d,
                                               int num_splits, int key_tile) {
    const int row = blockIdx.x;  // t * hq + h
    const int t = row / hq;
    // rows of no sequence here: padding past the last one, or rows before the first (a launch
    // over a later part of the batch)
    const int first = query_start_loc[0];
    if (t < first || t >= query_start_loc[num_seqs]) return;
    int splits = num_splits;
    const int b = t - first;  // the row's sequence, unless one before it has no token
    if (key_tile > 0 && b < num_seqs && query_start_loc[b] == t && query_start_loc[b + 1] == t + 1) {
        // one query row sees every key of its sequence: the kernel's kv_end is seq_lens[b]
        splits = splits_with_keys(seq_lens[b], key_tile, num_splits);
    }
    merge_split_partials(part_o, part_ml, splits, [&](int s) { return (size_t)s * total_tokens * hq + row; },
                         out + (size_t)row * d, d);
}

// ---- cascade attention (cascade_plan.py): decodes sharing their first prefix_len keys ---------
// The prefix part runs as one prompt-kernel "sequence" of one token whose GQA group is every
// decode's (rows (kv head, decode, head of the group), at position prefix_len - 1, so every shared
// key is admitted), the suffix part as the decodes' own launch over their later blocks; both write
// split partials that attention_cascade_combine_k merges.

// One block per decode: its query rows into q_perm [hk][num_seqs][group][d] (16-byte units), its
// suffix length into ints[b]; block 0 also writes the prefix launch's query_start_loc {0, 1}
// (ints[num_seqs..]) and seq_lens {prefix_len} (ints[num_seqs + 2]).
extern "C" __global__ void attention_cascade_prep_k(const bf16_t* __restrict__ q, int q_stride,
                                                    const int* __restrict__ seq_lens, int num_seqs, int hq, int hk,
                                                    int d, int prefix_len, bf16_t* __restrict__ q_perm,
                                                    int* __restrict__ ints) {
    const int b = blockIdx.x, group = hq / hk, units = d / 8;
    const uint4* src = reinterpret_cast<const uint4*>(q + (size_t)b * q_stride);
    uint4* dst = reinterpret_cast<uint4*>(q_perm);
    for (int e = threadIdx.x; e < hq * units; e += blockDim.x) {
        const int h = e / units, u = e % units;
        const size_t row = ((size_t)(h / group) * num_seqs + b) * group + h % group;
        dst[row * units + u] = src[e];
    }
    if (threadIdx.x == 0) {
        ints[b] = seq_lens[b] - prefix_len;
        if (b == 0) {
            ints[num_seqs] = 0;
            ints[num_seqs + 1] = 1;
            ints[num_seqs + 2] = prefix_len;
        }
    }
}

// Merge a cascade's partials into out [num_seqs][hq][d]: splits 0..prefix_splits-1 are the prefix
// launch's (rows in q_perm's order), the rest the suffix launch's (rows b * hq + h). One block of
// 64 threads per row, as attention_combine_k.
extern "C" __global__ void attention_cascade_combine_k(const float* __restrict__ part_o,
                                                       const float* __restrict__ part_ml, int prefix_splits,
                                                       int suffix_splits, int num_seqs, int hq, int hk, int d,
                                                       bf16_t* __restrict__ out) {
    const int row = blockIdx.x;  // b * hq + h
    const int b = row / hq, h = row % hq, group = hq / hk;
    const size_t rows = (size_t)num_seqs * hq;
    const size_t prow = ((size_t)(h / group) * num_seqs + b) * group + h % group;
    merge_split_partials(part_o, part_ml, prefix_splits + suffix_splits,
                         [&](int s) { return s * rows + (s < prefix_splits ? prow : row); },
                         out + (size_t)row * d, d);
}
