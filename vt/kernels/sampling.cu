// Sampler kernels over f32 logits [B, V]: logprobs + top-k, penalties, bans, the seeded
// Gumbel sampler with top-k / top-p / min-p filters, and the on-device token history update.
// The rules are the ones written in numpy_sampling.py; one block handles one row.

#define NBINS 256

// Order-preserving map of a float to an unsigned key (larger float, larger key); NaN -> 0.
__device__ __forceinline__ unsigned int fkey(float f) {
    if (f != f) return 0u;
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Counter-based Gumbel noise of base.py, bit for bit up to the last ulp of logf.
__device__ __forceinline__ float gumbel(unsigned long long seed, unsigned long long offset, unsigned long long tok) {
    unsigned long long x = seed * 0x9E3779B97F4A7C15ull + offset * 0xBF58476D1CE4E5B9ull + tok * 0x94D049BB133111EBull;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    float u = ((float)(unsigned int)(x >> 40) + 0.5f) * __int_as_float(0x33800000);  // * 2^-24
    u = fminf(u, __int_as_float(0x3F7FFFFF));
    return -logf(-logf(u));
}

// logprob of ids, and the k best (value desc, id asc) logprobs per row.
extern "C" __global__ void log_softmax_topk_k(const float* __restrict__ logits, const int* __restrict__ ids,
                                              float* __restrict__ chosen, int* __restrict__ top_ids,
                                              float* __restrict__ top_lp, int vocab, int k) {
    __shared__ float sv[32];
    __shared__ int si[32];
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float mx = -VT_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, row[i]);
    mx = block_max(mx, sv);
    float s = 0.f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(row[i] - mx);
    s = block_sum(s, sv);
    const float lse = mx + logf(s);
    if (threadIdx.x == 0) {
        const int id = ids[blockIdx.x];
        chosen[blockIdx.x] = (id >= 0 && id < vocab) ? row[id] - lse : -VT_INF;
    }
    // k selection passes, each taking the best element strictly after the previous one.
    float pv = VT_INF;
    int pi = -1;
    for (int j = 0; j < k; ++j) {
        float bv = -VT_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            const bool after = v < pv || (v == pv && i > pi);
            if (after && better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        block_argmax(bv, bi, sv, si);
        if (bi == 0x7fffffff) { bv = -VT_INF; bi = 0; }
        if (threadIdx.x == 0) {
            top_ids[(size_t)blockIdx.x * k + j] = bi;
            top_lp[(size_t)blockIdx.x * k + j] = bv - lse;
        }
        pv = bv;
        pi = bi;
    }
}

// vLLM penalties in place; grid (ceil(V / blockDim), B). Explicit roundings keep nvcc from
// contracting into FMAs so the result matches the float32 reference bit for bit.
extern "C" __global__ void penalize_k(float* __restrict__ logits, const int* __restrict__ rows,
                                      const int* __restrict__ out_counts, const unsigned char* __restrict__ prompt_mask,
                                      const float* __restrict__ presence, const float* __restrict__ frequency,
                                      const float* __restrict__ repetition, int vocab) {
    const int b = blockIdx.y;
    const int v = blockIdx.x * blockDim.x + threadIdx.x;
    const int r = rows[b];
    if (r < 0 || v >= vocab) return;
    const size_t at = (size_t)r * vocab + v;
    const int count = out_counts[at];
    const float rep = repetition[b];
    float lg = logits[(size_t)b * vocab + v];
    if ((count > 0 || prompt_mask[at] != 0) && rep != 1.f) lg = lg > 0.f ? lg / rep : __fmul_rn(lg, rep);
    const float pen = __fadd_rn(__fmul_rn(frequency[b], (float)count), __fmul_rn(presence[b], count > 0 ? 1.f : 0.f));
    logits[(size_t)b * vocab + v] = __fsub_rn(lg, pen);
}

// logits[b, ban[b, j]] = -inf for ban[b, j] in [0, V).
extern "C" __global__ void ban_tokens_k(float* __restrict__ logits, const int* __restrict__ ban, int width,
                                        int vocab) {
    const int b = blockIdx.x;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        const int v = ban[(size_t)b * width + j];
        if (v >= 0 && v < vocab) logits[(size_t)b * vocab + v] = -VT_INF;
    }
}

// last_tokens[rows[b]] = ids[b]; out_counts[rows[b], ids[b]] += 1.
extern "C" __global__ void record_sampled_k(int* __restrict__ last_tokens, int* __restrict__ out_counts,
                                            const int* __restrict__ rows, const int* __restrict__ ids, int n,
                                            int num_rows, int vocab) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const int r = rows[b], id = ids[b];
    if (r < 0 || r >= num_rows) return;
    last_tokens[r] = id;
    if (id >= 0 && id < vocab) atomicAdd(out_counts + (size_t)r * vocab + id, 1);
}

__device__ __forceinline__ bool allowed(float l) { return l == l && l > -VT_INF; }

// Radix select, MSB digit first: the key of the element where the running (count or mass) of
// kept elements, walked from the largest key down, first reaches `target`. Returns 0 (keep
// everything) when the walk never reaches it. Mass mode sums e = exp(l - m) instead of counting.
template <bool MASS>
__device__ unsigned int radix_select(const float* row, float temp, int vocab, unsigned int floor_key, float mx,
                                     float target, float* hist, unsigned int* sel) {
    unsigned int prefix = 0u, mask = 0u;
    float above = 0.f;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < NBINS; i += blockDim.x) hist[i] = 0.f;
        __syncthreads();
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i] / temp;
            const unsigned int key = fkey(l);
            if ((key & mask) == prefix && key >= floor_key && (!MASS || allowed(l)))
                atomicAdd(hist + ((key >> shift) & 255u), MASS ? expf(l - mx) : 1.f);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int digit = NBINS;
            float cum = above;
            for (int dgt = NBINS - 1; dgt >= 0; --dgt) {
                if (cum + hist[dgt] >= target) { digit = dgt; break; }
                cum += hist[dgt];
            }
            sel[0] = digit;
            hist[NBINS] = cum;  // mass strictly above the chosen bin
        }
        __syncthreads();
        const unsigned int digit = sel[0];
        if (digit == NBINS) return 0u;
        above = hist[NBINS];
        prefix |= digit << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// One block per row (blockDim 1024). Greedy rows: argmax of raw logits. Others: l = logits / T,
// filters as in numpy_sampling, then argmax of l + gumbel over the kept tokens.
extern "C" __global__ void sample_k(const float* __restrict__ logits, const float* __restrict__ temperature,
                                    const int* __restrict__ top_k, const float* __restrict__ top_p,
                                    const float* __restrict__ min_p, const long long* __restrict__ seeds,
                                    const int* __restrict__ offsets, int* __restrict__ out, int vocab) {
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ float hist[NBINS + 1];
    __shared__ unsigned int sel[1];
    const int b = blockIdx.x;
    const float* row = logits + (size_t)b * vocab;
    const float t = temperature[b];
    float bv = -VT_INF;
    int bi = 0x7fffffff;
    if (t < 1e-5f) {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            if (better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        block_argmax(bv, bi, sv, si);
        if (threadIdx.x == 0) out[b] = bi == 0x7fffffff ? 0 : bi;
        return;
    }
    const int k = top_k[b];
    const float tp = top_p[b], mp = min_p[b];
    unsigned int floor_key = 1u;  // every non-NaN value; allowed() drops -inf below
    if (k >= 1 && k < vocab) floor_key = radix_select<false>(row, t, vocab, 0u, 0.f, (float)k, hist, sel);
    float mx = 0.f;
    if (tp < 1.f || mp > 0.f) {
        mx = -VT_INF;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i] / t;
            if (allowed(l) && fkey(l) >= floor_key) mx = fmaxf(mx, l);
        }
        mx = block_max(mx, sv);
    }
    unsigned int p_key = 0u;
    if (tp < 1.f && mx > -VT_INF) {
        float z = 0.f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float l = row[i] / t;
            if (allowed(l) && fkey(l) >= floor_key) z += expf(l - mx);
        }
        z = block_sum(z, sv);
        // Kept: tokens whose mass strictly before them is < top_p, i.e. up to and including the
        // token where the inclusive running mass first reaches top_p * z.
        p_key = radix_select<true>(row, t, vocab, floor_key, mx, tp * z, hist, sel);
    }
    const unsigned int keep_key = max(floor_key, p_key);
    const unsigned long long seed = (unsigned long long)seeds[b];
    const unsigned long long off = (unsigned long long)(long long)offsets[b];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float l = row[i] / t;
        if (!allowed(l) || fkey(l) < keep_key) continue;
        if (mp > 0.f && !(expf(l - mx) >= mp)) continue;
        const float score = l + gumbel(seed, off, (unsigned long long)i);
        if (better(score, i, bv, bi)) { bv = score; bi = i; }
    }
    block_argmax(bv, bi, sv, si);
    if (threadIdx.x == 0) out[b] = bi == 0x7fffffff ? 0 : bi;
}
