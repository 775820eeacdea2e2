// Merging a launch's split-key partials (prepended to attention.cu): the merge of one output
// row that attention_combine_k and attention_cascade_combine_k run, and the splits of a decode
// row that hold keys.

// Merge the split partials of one output row into out_row: split s's partial is row where(s) of
// part_o / part_ml (a split that saw no key has m = -inf and weighs nothing). The block's threads
// share the row's d / 2 pairs. Each pass reads MERGE_BATCH splits' values at once and then folds
// them in split order: a decode row's 16-60 splits cost a few L2 round trips a pass instead of one
// a split (which made the merge ~7 us at batch 1), with the arithmetic of a split-at-a-time loop.
// A batch may read the partials of a split that saw no key (rows of the launch's scratch, never
// written): they are never used.
constexpr int MERGE_BATCH = 8;
template <typename Where>
__device__ __forceinline__ void merge_split_partials(const float* part_o, const float* part_ml, int num_splits,
                                                     Where where, bf16_t* out_row, int d) {
    const float2* ml = reinterpret_cast<const float2*>(part_ml);  // (m, l) of a row
    float mmax = -VT_INF;
    for (int s0 = 0; s0 < num_splits; s0 += MERGE_BATCH) {
        float m[MERGE_BATCH];
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            m[j] = s0 + j < num_splits ? part_ml[where(s0 + j) * 2] : -VT_INF;
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j) mmax = fmaxf(mmax, m[j]);
    }
    float denom = 0.f;
    for (int s0 = 0; s0 < num_splits; s0 += MERGE_BATCH) {
        float2 v[MERGE_BATCH];
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            v[j] = s0 + j < num_splits ? ml[where(s0 + j)] : make_float2(-VT_INF, 0.f);
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            if (v[j].x > -VT_INF) denom += exp2f(v[j].x - mmax) * v[j].y;
    }
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    const int half = d / 2;
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
        float a = 0.f, c = 0.f;
        for (int s0 = 0; s0 < num_splits; s0 += MERGE_BATCH) {
            float m[MERGE_BATCH];
            float2 v[MERGE_BATCH];
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; ++j) {
                m[j] = -VT_INF;
                if (s0 + j < num_splits) {
                    const size_t pr = where(s0 + j);
                    m[j] = part_ml[pr * 2];
                    v[j] = reinterpret_cast<const float2*>(part_o + pr * d)[p];
                }
            }
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; ++j) {
                if (m[j] > -VT_INF) {
                    const float wgt = exp2f(m[j] - mmax);
                    a += wgt * v[j].x;
                    c += wgt * v[j].y;
                }
            }
        }
        reinterpret_cast<unsigned int*>(out_row)[p] = pack2(a * inv, c * inv);
    }
}

// The splits of a decode row (one query row of its sequence, kv_end keys) that hold keys, in
// tiles of kt keys: key_chunks' s with s * chunk < ntiles, the leading ones.
__device__ __forceinline__ int splits_with_keys(int kv_end, int kt, int num_splits) {
    const KeyChunks c = key_chunks(kv_end, kt, num_splits);
    return c.chunk > 0 ? (c.ntiles + c.chunk - 1) / c.chunk : 0;
}
