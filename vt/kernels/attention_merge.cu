// Merging a launch's split-key partials (prepended to attention.cu and attention_tc.cu): what
// attention_combine_k does as a launch of its own, and what a decode launch's _selfmerge kernels
// (VT_ATTN_SELF_COMBINE=1) do in the last block of each (row tile, kv head, sequence) to finish.

// One value of the partials: L2_ONLY (a _selfmerge kernel's last block) reads through L2 (__ldcg),
// as other SMs wrote them during this launch and the (m, l) of neighbouring rows, other groups'
// among them, share cache lines that an earlier merge on this SM may hold in its L1;
// attention_combine_k, a launch of its own, reads plainly.
template <bool L2_ONLY, typename T>
__device__ __forceinline__ T partial_at(const T* p) {
    if constexpr (L2_ONLY) {
        return __ldcg(p);
    } else {
        return *p;
    }
}

// Merge the split partials of one output row into out_row: split s's partial is row where(s) of
// part_o / part_ml (a split that saw no key has m = -inf and weighs nothing). The block's threads
// share the row's d / 2 pairs (WARP: the calling warp's lanes do, a warp a row). Each pass reads
// MERGE_BATCH splits' values at once and then folds them in split order: a decode row's 16-60
// splits cost a few L2 round trips a pass instead of one a split (which made the merge ~7 us at
// batch 1), with the arithmetic of a split-at-a-time loop.
// A batch may read the partials of a split that saw no key (rows of the launch's scratch, never
// written): they are never used.
constexpr int MERGE_BATCH = 8;
template <bool L2_ONLY = false, bool WARP = false, typename Where>
__device__ __forceinline__ void merge_split_partials(const float* part_o, const float* part_ml, int num_splits,
                                                     Where where, bf16_t* out_row, int d) {
    const float2* ml = reinterpret_cast<const float2*>(part_ml);  // (m, l) of a row
    float mmax = -VT_INF;
    for (int s0 = 0; s0 < num_splits; s0 += MERGE_BATCH) {
        float m[MERGE_BATCH];
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            m[j] = s0 + j < num_splits ? partial_at<L2_ONLY>(part_ml + where(s0 + j) * 2) : -VT_INF;
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j) mmax = fmaxf(mmax, m[j]);
    }
    float denom = 0.f;
    for (int s0 = 0; s0 < num_splits; s0 += MERGE_BATCH) {
        float2 v[MERGE_BATCH];
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            v[j] = s0 + j < num_splits ? partial_at<L2_ONLY>(ml + where(s0 + j)) : make_float2(-VT_INF, 0.f);
#pragma unroll
        for (int j = 0; j < MERGE_BATCH; ++j)
            if (v[j].x > -VT_INF) denom += exp2f(v[j].x - mmax) * v[j].y;
    }
    const float inv = denom > 0.f ? 1.f / denom : 0.f;
    const int half = d / 2;
    for (int p = WARP ? threadIdx.x & 31 : threadIdx.x; p < half; p += WARP ? 32 : blockDim.x) {
        float a = 0.f, c = 0.f;
        for (int s0 = 0; s0 < num_splits; s0 += MERGE_BATCH) {
            float m[MERGE_BATCH];
            float2 v[MERGE_BATCH];
#pragma unroll
            for (int j = 0; j < MERGE_BATCH; ++j) {
                m[j] = -VT_INF;
                if (s0 + j < num_splits) {
                    const size_t pr = where(s0 + j);
                    m[j] = partial_at<L2_ONLY>(part_ml + pr * 2);
                    v[j] = partial_at<L2_ONLY>(reinterpret_cast<const float2*>(part_o + pr * d) + p);
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


// Per-token e4m3 codes of one bf16 row of k values (a multiple of 8) that other blocks wrote:
// quantize_rows_k's group 0 bit for bit (the same amax floor, inv = FP8_MAX / amax and
// store8_e4m3; a max is exact, so the threads' share of the row does not matter). The row is read
// through L2 (__ldcg): other SMs wrote it during this launch, and no read-only or L1 copy of it
// may be used.
__device__ __forceinline__ void quantize_token_row(const bf16_t* x, unsigned char* q, float* scale, int row, int k,
                                                   float* scratch) {
    float amax = 0.f;
    for (int c = threadIdx.x * 8; c < k; c += blockDim.x * 8) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + c));
        const unsigned int w[4] = {v.x, v.y, v.z, v.w};
        for (int e = 0; e < 4; ++e) amax = fmaxf(amax, fmaxf(fabsf(lo_f(w[e])), fabsf(hi_f(w[e]))));
    }
    amax = fmaxf(block_max(amax, scratch), FP8_AMAX_FLOOR);
    const float inv = FP8_MAX / amax;
    for (int c = threadIdx.x * 8; c < k; c += blockDim.x * 8) {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(x + c));
        const float f[8] = {lo_f(v.x), hi_f(v.x), lo_f(v.y), hi_f(v.y), lo_f(v.z), hi_f(v.z), lo_f(v.w), hi_f(v.w)};
        store8_e4m3(q + c, f, inv);
    }
    if (threadIdx.x == 0) scale[row] = amax / FP8_MAX;
}

// The splits of a decode row (one query row of its sequence, kv_end keys) that hold keys, in
// tiles of kt keys: key_chunks' s with s * chunk < ntiles, the leading ones.
__device__ __forceinline__ int splits_with_keys(int kv_end, int kt, int num_splits) {
    const KeyChunks c = key_chunks(kv_end, kt, num_splits);
    return c.chunk > 0 ? (c.ntiles + c.chunk - 1) / c.chunk : 0;
}

// The split-K arrival: every thread fences its own stores, then thread 0 counts the block in
// *count; true in every thread of the block that brought the count to `arrivals` (it resets the
// counter for the next launch, and fences so the others' stores, counted before, are seen).
// flag: an int of shared memory.
__device__ __forceinline__ bool last_to_arrive(int* count, int arrivals, int* flag) {
    __threadfence();  // this thread's stores are visible device-wide before the count
    __syncthreads();  // ... for every thread of the block
    if (threadIdx.x == 0) {
        const bool last = atomicAdd(count, 1) == arrivals - 1;
        if (last) *count = 0;
        *flag = last;
    }
    __syncthreads();
    if (!*flag) return false;
    __threadfence();  // the other blocks' stores, counted before this block's, are seen
    return true;
}

// The end of a _selfmerge decode kernel, after the body wrote its split partials: the split-K
// "last block merges" pattern, so that no attention_combine_k launch follows. Each block of a
// (row tile, kv head, sequence) group that the merge reads counts itself in counters[group]
// after its stores (each thread fences its own); the one that brings the count to `arrivals` is
// the last, and merges the group's rows exactly as attention_combine_k would (the same splits in
// the same order through merge_split_partials: the same bits), then zeroes the counter for the
// next launch (and graph replay): no other block of this launch touches it after its count.
// Only the splits the merge reads count: those holding keys for a sequence of one query row (as
// the combine picks them), every split otherwise; a group whose rows see no key at all still
// has split 0 arrive, to write the zero rows the combine would. A group with no rows (a
// sequence without a token) returned from the body in every block, and returns here too.
// Anything downstream reads out only after the whole grid completes (a plain launch, or a
// dependent's griddepcontrol.wait: these kernels never trigger their dependents early).
// act_q, act_scale (non-null: a decode launch feeding an fp8 projection with per-token scales):
// the token's last group also writes the codes of its output row (quantize_token_row).
// smem: the kernel's dynamic shared memory, free once the body is done (the first 64 ints are
// used: two flags, then block_max's scratch).
// Not inlined: a call once a block, after the body, whose registers are then free; inlined, the
// L2 reads tipped attention_tc_d64_decode_selfmerge into spills.
__device__ __noinline__ void merge_own_splits(const int* query_start_loc, const int* seq_lens, int hq, int hk,
                                              int num_splits, int rows_per_block, int kt, const float* part_o,
                                              const float* part_ml, bf16_t* out, int total_tokens, int d,
                                              int* counters, int* smem, unsigned char* act_q, float* act_scale) {
    if (num_splits == 1) return;  // the body wrote out itself
    const AttnBlock a = attn_block(query_start_loc, seq_lens, hq, hk, num_splits, rows_per_block, kt);
    if (a.row0 >= a.nrows) return;
    const int n = a.qlen == 1 ? splits_with_keys(a.kv_end, kt, num_splits) : num_splits;
    const int arrivals = max(n, 1);
    if (a.split >= arrivals) return;  // its partials (m = -inf) are never read
    // (its first barrier also ends the body's use of smem)
    if (!last_to_arrive(counters + ((size_t)a.b * hk + a.kh) * gridDim.x + blockIdx.x, arrivals, smem)) return;
    const int row_end = min(a.row0 + rows_per_block, a.nrows);
    for (int r = a.row0; r < row_end; ++r) {
        const int row = (a.q0 + r / a.group) * hq + a.kh * a.group + r % a.group;  // t * hq + h
        merge_split_partials<true>(part_o, part_ml, n, [&](int s) { return (size_t)s * total_tokens * hq + row; },
                             out + (size_t)row * d, d);
    }
    if (act_q == nullptr) return;
    // The token's row spans every kv head (and row tile): its groups' last blocks count in the
    // sequence's counter, after the group counters (attention_plan.ATTN_COUNTERS' layout). The
    // block's place is read again rather than kept live through the merge (attention_r2 spilled).
    const int b = blockIdx.z / num_splits, t = query_start_loc[b];
    if (query_start_loc[b + 1] - t != 1) return;
    // one query row: the group's hq / hk rows in this many row tiles, each a group per kv head
    const int groups = hk * min((int)gridDim.x, (hq / hk + rows_per_block - 1) / rows_per_block);
    if (!last_to_arrive(counters + (size_t)gridDim.x * hk * (gridDim.z / num_splits) + b, groups, smem + 1)) return;
    const int k = hq * d;
    quantize_token_row(out + (size_t)t * k, act_q + (size_t)t * k, act_scale, t, k,
                       reinterpret_cast<float*>(smem + 32));
}
