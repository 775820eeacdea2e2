// What the tensor-core attention kernels (attention_tc.cu, attention_wg.cu) share: their
// parameter list, and the Q fragments, online softmax and output of one 16-row m-tile held as
// mma.m16n8 fragments.

// The kernels' parameters (one contract for every tiling; cuda_ops passes them in this order).
// v_scale multiplies the output (1 for a bf16 cache; an fp8 cache's v_scale, its k_scale being
// folded into scale_log2 by the host).
#define ATTN_TC_PARAMS                                                                                   \
    const bf16_t *__restrict__ q, int q_stride, const bf16_t *__restrict__ k_cache,                     \
        const bf16_t *__restrict__ v_cache, const int *__restrict__ query_start_loc,                    \
        const int *__restrict__ seq_lens, const int *__restrict__ block_tables, int max_blocks,         \
        bf16_t *__restrict__ out, float *__restrict__ part_o, float *__restrict__ part_ml,              \
        int total_tokens, int hq, int hk, int block_size, float scale_log2, int num_splits, float v_scale
#define ATTN_TC_ARGS                                                                                     \
    q, q_stride, k_cache, v_cache, query_start_loc, seq_lens, block_tables, max_blocks, out, part_o,    \
        part_ml, total_tokens, hq, hk, block_size, scale_log2, num_splits, v_scale

// The A fragments of Q for rows ra (this thread's g) and rb (g + 8) of a 16-row m-tile, read
// from global memory: qa[ks] covers head dims 16 ks .. 16 ks + 15; rows past nrows are zero.
template <int D>
__device__ __forceinline__ void load_q_frags(unsigned int (&qa)[D / 16][4], const bf16_t* __restrict__ q,
                                             int q_stride, int ra, int rb, int c, int nrows, int group, int q0,
                                             int kh) {
    const bf16_t* pa = q + (size_t)(q0 + ra / group) * q_stride + (size_t)(kh * group + ra % group) * D;
    const bf16_t* pb = q + (size_t)(q0 + rb / group) * q_stride + (size_t)(kh * group + rb % group) * D;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int col = ks * 16 + 2 * c;
        qa[ks][0] = ra < nrows ? *reinterpret_cast<const unsigned int*>(pa + col) : 0u;
        qa[ks][1] = rb < nrows ? *reinterpret_cast<const unsigned int*>(pb + col) : 0u;
        qa[ks][2] = ra < nrows ? *reinterpret_cast<const unsigned int*>(pa + col + 8) : 0u;
        qa[ks][3] = rb < nrows ? *reinterpret_cast<const unsigned int*>(pb + col + 8) : 0u;
    }
}

// Scores of 16 rows (a: g, b: g + 8 of the m-tile) over 8 * NS keys from kbase, masked
// causally, through the online softmax: updates (m, l), leaves the weights P in s as floats, and
// returns the factors (corr_a, corr_b) the accumulated output must be scaled by before P.V is
// added. The running maxima are kept in log2 units (scores times scale_log2); the scores
// themselves are scaled inside the exponent's fused multiply-add (the softmax is most of a
// prompt tile's instructions). SKIP_WHOLE: tiles wholly visible to both rows (in a long prompt,
// almost all) skip the mask on a branch; the kernels whose registers are tight (ptxas then
// spills) mask every tile.
template <int NS, bool SKIP_WHOLE = false>
__device__ __forceinline__ float2 softmax_weights(float (&s)[NS][4], int kbase, int c, int pos_a, int pos_b,
                                                  float scale_log2, float& m_a, float& m_b, float& l_a,
                                                  float& l_b) {
    if (!SKIP_WHOLE || kbase + 8 * NS - 1 > min(pos_a, pos_b)) {
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            const int k0 = kbase + n * 8 + 2 * c;
            s[n][0] = k0 <= pos_a ? s[n][0] : -VT_INF;
            s[n][1] = k0 + 1 <= pos_a ? s[n][1] : -VT_INF;
            s[n][2] = k0 <= pos_b ? s[n][2] : -VT_INF;
            s[n][3] = k0 + 1 <= pos_b ? s[n][3] : -VT_INF;
        }
    }
    float mx_a = -VT_INF, mx_b = -VT_INF;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
        mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
    }
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 1));
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, 2));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 1));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, 2));
    // scale_log2 > 0, so the maximum of the scaled scores is the scaled maximum (-inf stays).
    const float mn_a = fmaxf(m_a, mx_a * scale_log2), mn_b = fmaxf(m_b, mx_b * scale_log2);
    // A row with no visible key yet keeps m = -inf: use 0 as the base so exp2 gives 0, not NaN.
    const float base_a = mn_a == -VT_INF ? 0.f : mn_a, base_b = mn_b == -VT_INF ? 0.f : mn_b;
    const float corr_a = ex2_ftz(m_a - base_a), corr_b = ex2_ftz(m_b - base_b);
    m_a = mn_a;
    m_b = mn_b;
    float sum_a = 0.f, sum_b = 0.f;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        s[n][0] = ex2_ftz(fmaf(s[n][0], scale_log2, -base_a));
        s[n][1] = ex2_ftz(fmaf(s[n][1], scale_log2, -base_a));
        s[n][2] = ex2_ftz(fmaf(s[n][2], scale_log2, -base_b));
        s[n][3] = ex2_ftz(fmaf(s[n][3], scale_log2, -base_b));
        sum_a += s[n][0] + s[n][1];
        sum_b += s[n][2] + s[n][3];
    }
    l_a = l_a * corr_a + sum_a;
    l_b = l_b * corr_b + sum_b;
    return make_float2(corr_a, corr_b);
}

// softmax_weights, with P packed as the bf16 A fragments of the P.V product (pa[n]: n-tile n's
// rows a, b).
template <int NS, bool SKIP_WHOLE = false>
__device__ __forceinline__ float2 softmax_scores(float (&s)[NS][4], int kbase, int c, int pos_a, int pos_b,
                                                 float scale_log2, float& m_a, float& m_b, float& l_a, float& l_b,
                                                 unsigned int (&pa)[NS][2]) {
    const float2 corr = softmax_weights<NS, SKIP_WHOLE>(s, kbase, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b);
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        pa[n][0] = pack2_rn(s[n][0], s[n][1]);
        pa[n][1] = pack2_rn(s[n][2], s[n][3]);
    }
    return corr;
}

template <int DN>
__device__ __forceinline__ void rescale_m_tile(float (&o)[DN][4], float2 corr) {
#pragma unroll
    for (int n = 0; n < DN; ++n) {
        o[n][0] *= corr.x; o[n][1] *= corr.x; o[n][2] *= corr.y; o[n][3] *= corr.y;
    }
}

// softmax_scores, then the output scaled at once.
template <int NS, int DN>
__device__ __forceinline__ void softmax_m_tile(float (&s)[NS][4], int kbase, int c, int pos_a, int pos_b,
                                               float scale_log2, float& m_a, float& m_b, float& l_a, float& l_b,
                                               float (&o)[DN][4], unsigned int (&pa)[NS][2]) {
    rescale_m_tile<DN>(o, softmax_scores<NS>(s, kbase, c, pos_a, pos_b, scale_log2, m_a, m_b, l_a, l_b, pa));
}

// The output of a 16-row m-tile whose rows a (this thread's g) and b (g + 8) are ra and rb, with
// row sums already summed over the quad: normalised bf16 rows (one split) or the split's
// unnormalised partials and (m, l); both times v_scale.
template <int D>
__device__ __forceinline__ void store_m_tile(const float (&o)[D / 8][4], float m_a, float m_b, float l_a, float l_b,
                                             int ra, int rb, int c, int nrows, int group, int q0, int kh, int hq,
                                             int split, int total_tokens, int num_splits, bf16_t* out, float* part_o,
                                             float* part_ml, float v_scale) {
#pragma unroll
    for (int half_i = 0; half_i < 2; ++half_i) {
        const int r = half_i ? rb : ra;
        if (r >= nrows) continue;
        const float mm = half_i ? m_b : m_a, ll = half_i ? l_b : l_a;
        const int t = q0 + r / group, h = kh * group + r % group;
        if (num_splits == 1) {
            const float inv = ll > 0.f ? v_scale / ll : 0.f;
            unsigned int* orow = reinterpret_cast<unsigned int*>(out + ((size_t)t * hq + h) * D);
#pragma unroll
            for (int n = 0; n < D / 8; ++n) orow[n * 4 + c] = pack2(o[n][2 * half_i] * inv, o[n][2 * half_i + 1] * inv);
        } else {
            const size_t prow = ((size_t)split * total_tokens + t) * hq + h;
            float2* po = reinterpret_cast<float2*>(part_o + prow * D);
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                po[n * 4 + c] = make_float2(o[n][2 * half_i] * v_scale, o[n][2 * half_i + 1] * v_scale);
            if (c == 0) { part_ml[prow * 2] = mm; part_ml[prow * 2 + 1] = ll; }
        }
    }
}

// A row's sum from its quad's four partial sums.
__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}
