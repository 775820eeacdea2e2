// Sampler kernels over f32 logits [B, V]: logprobs + top-k, penalties, bans, the seeded
// Gumbel sampler with top-k / top-p / min-p filters, and the on-device token history update.
// The rules are the ones written in numpy_sampling.py.
//
// Speed without changing a result: a row is read once for its per-thread maxima, whose j-th
// largest bounds the j-th largest of the row from below; a second read (from L2) keeps only
// the keys at or above that bound, usually a few hundred, in shared memory, where the exact
// selection runs. Sums whose value feeds a result (the softmax normaliser, the top-p total)
// are taken in the order the one-block-per-row kernels always used: thread t of 1024 adds the
// elements t, t + 1024, ... in turn, then the block_sum tree. Rows the candidates cannot
// decide take the full-row path.

#define NBINS 256
#define SAMPLER_THREADS 1024  // blockDim of the row kernels; the summation order depends on it
#define CAND_CAP 4096         // candidate keys kept in shared memory
#define TOPP_RANK 896         // thread-maximum rank that bounds the top-p candidates (~2k of them)
#define GUMBEL_MAX 17.f       // above every value gumbel() returns (at most 16.64)
#define KEY_NEG_INF 0x007fffffu
#define VT_FLT_MAX __int_as_float(0x7f7fffff)
#define NO_ID 0x7fffffff

// Order-preserving map of a float to an unsigned key (larger float, larger key); NaN -> 0.
__device__ __forceinline__ unsigned int fkey(float f) {
    if (f != f) return 0u;
    const unsigned int u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// The float of a key that fkey produced.
__device__ __forceinline__ float key_val(unsigned int k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Counter-based Gumbel noise of base.py, bit for bit up to the last ulp of logf, in two halves:
// noise_u24 makes the 24 random bits of a token from `base` (the seed and offset part of the
// hashed sum, mod 2^64), gumbel_u24 turns bits into noise. gumbel() is the two in turn.
__device__ __forceinline__ unsigned long long noise_base(unsigned long long seed, unsigned long long offset) {
    return seed * 0x9E3779B97F4A7C15ull + offset * 0xBF58476D1CE4E5B9ull;
}

__device__ __forceinline__ unsigned int noise_u24(unsigned long long base, unsigned long long tok) {
    unsigned long long x = base + tok * 0x94D049BB133111EBull;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    x ^= x >> 31;
    return (unsigned int)(x >> 40);
}

__device__ __forceinline__ float gumbel_u24(unsigned int m) {
    float u = ((float)m + 0.5f) * __int_as_float(0x33800000);  // * 2^-24
    u = fminf(u, __int_as_float(0x3F7FFFFF));
    return -logf(-logf(u));
}

__device__ __forceinline__ float gumbel(unsigned long long seed, unsigned long long offset, unsigned long long tok) {
    return gumbel_u24(noise_u24(noise_base(seed, offset), tok));
}

__device__ __forceinline__ bool allowed(float l) { return l == l && l > -VT_INF; }

// Thread t visits begin + t, begin + t + 1024, ... in increasing order (the order the sums
// depend on), U loads in flight at a time; `group` runs once per U elements.
template <int U, class F, class G>
__device__ __forceinline__ void strided(const float* __restrict__ row, int begin, int end, F&& f, G&& group) {
    for (int i0 = begin + (int)threadIdx.x; i0 < end; i0 += U * SAMPLER_THREADS) {
        float v[U];
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int i = i0 + j * SAMPLER_THREADS;
            v[j] = i < end ? row[i] : 0.f;
        }
#pragma unroll
        for (int j = 0; j < U; ++j) {
            const int i = i0 + j * SAMPLER_THREADS;
            if (i < end) f(v[j], i);
        }
        group();
    }
}
struct NoGroup {
    __device__ void operator()() const {}
};

__device__ __forceinline__ unsigned int warp_max_u32(unsigned int v) {
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ unsigned int block_max_u32(unsigned int v, unsigned int* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max_u32(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max_u32(lane < nw ? scratch[lane] : 0u);
}

// The k-th largest (1 <= k <= blockDim) of one key per thread: bit by bit, the largest value
// that at least k keys reach.
__device__ unsigned int kth_largest(unsigned int key, int k) {
    unsigned int r = 0u;
    for (int bit = 31; bit >= 0; --bit) {
        const unsigned int c = r | (1u << bit);
        if (__syncthreads_count(key >= c) >= k) r = c;
    }
    return r;
}

// Ascending bitonic sort of a[0, n) in shared memory (n <= 2 * 2 * blockDim); pads to a power of
// two with ~0, which sorts last.
__device__ void bitonic_sort(unsigned long long* a, int n) {
    int p = 1;
    while (p < n) p <<= 1;
    for (int i = n + threadIdx.x; i < p; i += blockDim.x) a[i] = ~0ull;
    __syncthreads();
    for (int size = 2; size <= p; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            for (int t = threadIdx.x; t < (p >> 1); t += blockDim.x) {
                const int lo = 2 * t - (t & (stride - 1)), hi = lo + stride;
                const unsigned long long x = a[lo], y = a[hi];
                if ((x > y) == ((lo & size) == 0)) { a[lo] = y; a[hi] = x; }
            }
            __syncthreads();
        }
    }
}

__device__ __forceinline__ unsigned int low_id(unsigned long long e) { return (unsigned int)e; }
__device__ __forceinline__ unsigned int high_key(unsigned long long e) { return (unsigned int)(e >> 32); }

// Key for value-descending order with -0 equal to +0 (as `<` and `==` see them); NaN -> 0.
__device__ __forceinline__ unsigned int value_key(float v) { return fkey(v == 0.f ? 0.f : v); }

// logprob of ids, and the k best (value desc, id asc) logprobs per row; one block of 1024
// threads per row. The max and the sum are taken exactly as the k-pass kernel took them.
extern "C" __global__ void __launch_bounds__(SAMPLER_THREADS)
log_softmax_topk_k(const float* __restrict__ logits, const int* __restrict__ ids, float* __restrict__ chosen,
                   int* __restrict__ top_ids, float* __restrict__ top_lp, int vocab, int k) {
    __shared__ unsigned long long cand[CAND_CAP];
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ int s_n;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float mx = -VT_INF;
    unsigned int tmax = 0u;
    strided<16>(row, 0, vocab, [&](float v, int) {
        mx = fmaxf(mx, v);
        tmax = max(tmax, value_key(v));
    }, NoGroup());
    mx = block_max(mx, sv);
    // The k-th largest thread maximum: at least k elements reach it, so the k best all do.
    // 0 means fewer than k threads saw a non-NaN value: the k-pass loop below keeps its rules.
    const unsigned int tau = (k >= 1 && k <= SAMPLER_THREADS) ? kth_largest(tmax, k) : 0u;
    if (threadIdx.x == 0) s_n = 0;
    __syncthreads();
    float s = 0.f;
    strided<16>(row, 0, vocab, [&](float v, int i) {
        s += expf(v - mx);
        const unsigned int key = value_key(v);
        if (tau != 0u && key >= tau) {
            const int pos = atomicAdd(&s_n, 1);
            if (pos < CAND_CAP) cand[pos] = ((unsigned long long)~key << 32) | (unsigned int)i;
        }
    }, NoGroup());
    s = block_sum(s, sv);
    const float lse = mx + logf(s);
    if (threadIdx.x == 0) {
        const int id = ids[blockIdx.x];
        chosen[blockIdx.x] = (id >= 0 && id < vocab) ? row[id] - lse : -VT_INF;
    }
    const int n = s_n;  // final: block_sum's barriers follow every append
    if (tau != 0u && n <= CAND_CAP) {
        bitonic_sort(cand, n);  // value desc, id asc; n >= k
        for (int j = threadIdx.x; j < k; j += blockDim.x) {
            const int i = (int)low_id(cand[j]);
            top_ids[(size_t)blockIdx.x * k + j] = i;
            top_lp[(size_t)blockIdx.x * k + j] = row[i] - lse;
        }
        return;
    }
    // k selection passes, each taking the best element strictly after the previous one.
    float pv = VT_INF;
    int pi = -1;
    for (int j = 0; j < k; ++j) {
        float bv = -VT_INF;
        int bi = NO_ID;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float v = row[i];
            const bool after = v < pv || (v == pv && i > pi);
            if (after && better(v, i, bv, bi)) { bv = v; bi = i; }
        }
        block_argmax(bv, bi, sv, si);
        if (bi == NO_ID) { bv = -VT_INF; bi = 0; }
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

// Structured outputs: token t of batch row rows[m] keeps its logit where bit t % 32 of
// bitmask[m, t / 32] is set (llguidance's layout), else it becomes -inf, as do tokens past
// 32 * words. One thread per (mask row, token); rows of -1 (or out of the batch) are skipped.
extern "C" __global__ void apply_token_bitmask_k(float* __restrict__ logits, const int* __restrict__ bitmask,
                                                 const int* __restrict__ rows, int words, int batch,
                                                 int vocab) {
    const int m = blockIdx.y;
    const int b = rows[m];
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < 0 || b >= batch || t >= vocab) return;
    const int w = t >> 5;
    const unsigned int word = w < words ? (unsigned int)bitmask[(size_t)m * words + w] : 0u;
    if (!((word >> (t & 31)) & 1u)) logits[(size_t)b * vocab + t] = -VT_INF;
}

// logit_bias and allowed_token_ids. sel[m] = (batch row b, table row r, count n, exclusive e):
// the n ascending ids tokens[r, :n] get biases[r, :n] added in row b, and with e != 0 every
// other token of row b becomes -inf. One thread per (sel row, token): a binary search finds
// the token among the row's ids, so a thread reads its own logit only.
extern "C" __global__ void bias_logits_k(float* __restrict__ logits, const int* __restrict__ sel,
                                         const int* __restrict__ tokens, const float* __restrict__ biases,
                                         int cap, int batch, int vocab) {
    const int m = blockIdx.y;
    const int b = sel[4 * m], r = sel[4 * m + 1], exclusive = sel[4 * m + 3];
    const int n = max(0, min(sel[4 * m + 2], cap));
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < 0 || b >= batch || t >= vocab) return;
    const int* ids = tokens + (size_t)r * cap;
    int lo = 0, hi = n;  // first index with ids[i] >= t
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (ids[mid] < t) lo = mid + 1; else hi = mid;
    }
    float* x = logits + (size_t)b * vocab + t;
    if (lo < n && ids[lo] == t) *x += biases[(size_t)r * cap + lo];
    else if (exclusive) *x = -VT_INF;
}

// last_tokens[rows[b]] = ids[b]; out_counts[rows[b], ids[b]] += 1. An id of -1 (the row had no
// token to sample) leaves the row as it was: a decode launched behind it reads a valid token.
extern "C" __global__ void record_sampled_k(int* __restrict__ last_tokens, int* __restrict__ out_counts,
                                            const int* __restrict__ rows, const int* __restrict__ ids, int n,
                                            int num_rows, int vocab) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= n) return;
    const int r = rows[b], id = ids[b];
    if (r < 0 || r >= num_rows || id < 0 || id >= vocab) return;
    last_tokens[r] = id;
    atomicAdd(out_counts + (size_t)r * vocab + id, 1);
}

// ---- the sampler ------------------------------------------------------------------------------

// Shared memory of sample_k, shared out between its paths.
__shared__ unsigned long long s_cand[CAND_CAP];  // candidate keys; per-warp histograms on the full path
__shared__ float s_aux[SAMPLER_THREADS];         // noise bound table, or per-thread sums
__shared__ float s_hist[NBINS + 1];
__shared__ unsigned int s_hist_u[NBINS];
__shared__ unsigned int s_sel[2];
__shared__ float s_sv[32];
__shared__ int s_si[32];
__shared__ unsigned int s_su[32];
__shared__ int s_int[2];
__shared__ unsigned int s_best;

// Radix select, MSB digit first: the key of the element where the running mass of kept
// elements, walked from the largest key down, first reaches `target`, e = exp(l - m) summed
// per bin. Returns 0 (keep everything) when the walk never reaches it. Each warp adds into its
// own histogram (wh, 32 * NBINS floats), so only lanes of one warp contend for a bin; the bin's
// mass is then the sum of the warp histograms in warp order.
__device__ unsigned int radix_select_mass(const float* row, float temp, int vocab, unsigned int floor_key, float mx,
                                          float target, float* wh, float* hist, unsigned int* sel) {
    unsigned int prefix = 0u, mask = 0u;
    float above = 0.f;
    float* mine = wh + (threadIdx.x >> 5) * NBINS;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 32 * NBINS; i += blockDim.x) wh[i] = 0.f;
        __syncthreads();
        strided<8>(row, 0, vocab, [&](float v, int) {
            const float l = v / temp;
            const unsigned int key = fkey(l);
            if ((key & mask) == prefix && key >= floor_key && allowed(l))
                atomicAdd(mine + ((key >> shift) & 255u), expf(l - mx));
        }, NoGroup());
        __syncthreads();
        if (threadIdx.x < NBINS) {
            float c = 0.f;
            for (int w = 0; w < 32; ++w) c += wh[w * NBINS + threadIdx.x];
            hist[threadIdx.x] = c;
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

// The k-th largest key of l = row / temp counting duplicates (NaN keys 0 included), by radix
// select on per-warp integer histograms (counts are exact, so this is the float-count select).
__device__ unsigned int radix_kth_key(const float* row, float temp, int vocab, int k, unsigned int* wh,
                                      unsigned int* hist_u, unsigned int* sel) {
    unsigned int prefix = 0u, mask = 0u;
    unsigned int above = 0u;
    unsigned int* mine = wh + (threadIdx.x >> 5) * NBINS;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 32 * NBINS; i += blockDim.x) wh[i] = 0u;
        __syncthreads();
        strided<8>(row, 0, vocab, [&](float v, int) {
            const unsigned int key = fkey(v / temp);
            if ((key & mask) == prefix) atomicAdd(mine + ((key >> shift) & 255u), 1u);
        }, NoGroup());
        __syncthreads();
        if (threadIdx.x < NBINS) {
            unsigned int c = 0u;
            for (int w = 0; w < 32; ++w) c += wh[w * NBINS + threadIdx.x];
            hist_u[threadIdx.x] = c;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned int digit = NBINS, cum = above;
            for (int dgt = NBINS - 1; dgt >= 0; --dgt) {
                if (cum + hist_u[dgt] >= (unsigned int)k) { digit = dgt; break; }
                cum += hist_u[dgt];
            }
            sel[0] = digit;
            sel[1] = cum;
        }
        __syncthreads();
        const unsigned int digit = sel[0];
        if (digit == NBINS) return 0u;
        above = sel[1];
        prefix |= digit << shift;
        mask |= 255u << shift;
        __syncthreads();
    }
    return prefix;
}

// A raw logit r0 such that every r < r0 scores below thr whatever its noise:
// fl(fl(r / t) + GUMBEL_MAX) < thr, checked at r0 (division and addition round monotonically).
// -inf when none is found.
__device__ float raw_floor(float thr, float t) {
    if (!(thr < VT_INF) || !(t <= VT_FLT_MAX)) return -VT_INF;
    float r = (thr - (GUMBEL_MAX + 1.f)) * t;
    for (int it = 0; it < 4; ++it) {
        if (r / t + GUMBEL_MAX < thr) return r;
        r -= fmaxf(fabsf(r) * 1e-6f, 1e-30f);
    }
    return -VT_INF;
}

// Smallest raw key x, stepping down from tau, with fkey(val(x) / t) >= fkey(val(tau) / t) while
// every raw key below x maps under it: raw keys >= x are then exactly the elements whose l-key
// reaches that of tau. 0 (take every element) when the steps run out. t finite and positive,
// where l = r / t is monotone in r.
__device__ unsigned int raw_key_floor(unsigned int tau, float t) {
    if (tau <= KEY_NEG_INF + 1u) return 0u;
    const unsigned int lam = fkey(key_val(tau) / t);
    unsigned int x = tau;
    for (int it = 0; it < 64; ++it) {
        if (x <= KEY_NEG_INF + 1u) return 0u;
        if (fkey(key_val(x - 1u) / t) < lam) return x;
        --x;
    }
    return 0u;
}

// Argmax of l + gumbel over tokens [begin, end) that are allowed and pass keep(l), ties to the
// lowest id, into (bv, bi) of every thread. Exact, with two prunings that drop only tokens
// scoring strictly below a score already reached in this block: raw logits below raw_floor(),
// and tokens whose noise bits lie in a bucket whose largest noise (gup, + 1e-3 for the ulps of
// logf) cannot lift them to that score.
template <class Keep>
__device__ void gumbel_argmax(const float* row, int begin, int end, float t, unsigned long long seed,
                              unsigned long long off, Keep&& keep, float& bv, int& bi) {
    float* gup = s_aux;
    gup[threadIdx.x] = gumbel_u24(((threadIdx.x + 1u) << 14) - 1u) + 1e-3f;  // 1024 buckets of 2^14
    if (threadIdx.x == 0) s_best = 0u;
    __syncthreads();
    const unsigned long long base = noise_base(seed, off);
    float thr = -VT_INF, rho = -VT_INF;
    float best = -VT_INF;  // locals, not the reference arguments, so they stay in registers
    int best_i = NO_ID;
    auto visit = [&](float v, int i) {
        if (v < rho) return;
        const float l = v / t;
        if (!allowed(l)) return;
        if (l + gup[noise_u24(base, (unsigned long long)i) >> 14] < thr) return;
        if (!keep(l)) return;
        const float score = l + gumbel(seed, off, (unsigned long long)i);
        if (better(score, i, best, best_i)) { best = score; best_i = i; }
        if (score > thr) {
            thr = score;
            rho = raw_floor(thr, t);
            atomicMax(&s_best, fkey(score));
        }
    };
    auto refresh = [&]() {
        const unsigned int sk = *(volatile unsigned int*)&s_best;
        if (sk > fkey(thr)) {
            thr = key_val(sk);
            rho = raw_floor(thr, t);
        }
    };
    // Every thread scores its first token unpruned, so the block starts from a real score.
    const int first = begin + (int)threadIdx.x;
    if (first < end) visit(row[first], first);
    __syncthreads();
    refresh();
    strided<8>(row, begin + SAMPLER_THREADS, end, visit, refresh);
    block_argmax(best, best_i, s_sv, s_si);
    bv = best;
    bi = best_i;
}

// A filtered row from its candidates. False (nothing written) when they cannot decide it: the
// caller then runs sample_row_full. Every return is block-uniform.
__device__ __noinline__ bool sample_row_fast(const float* row, int vocab, float t, int k, float tp, float mp,
                                             unsigned long long seed, unsigned long long off, float& bv, int& bi) {
    const bool topk = k >= 1 && k < vocab, usep = tp < 1.f, usem = mp > 0.f;
    if (!(t <= VT_FLT_MAX) || (topk && k > SAMPLER_THREADS)) return false;
    unsigned long long* cand = s_cand;
    const int tid = threadIdx.x;
    // Pass 1: per-thread maximum raw key.
    unsigned int tmax = 0u;
    strided<16>(row, 0, vocab, [&](float v, int) { tmax = max(tmax, fkey(v)); }, NoGroup());
    const unsigned int rmax = block_max_u32(tmax, s_su);
    // The largest allowed l is that of the largest allowed raw value (l is monotone in it).
    const float mx_row = rmax > KEY_NEG_INF ? key_val(rmax) / t : -VT_INF;
    if (!topk) {
        if (!(fabsf(mx_row) <= VT_FLT_MAX)) return false;  // nothing allowed, or an infinite max
        if (!usep) {  // min_p alone: no selection, one pass with its test
            gumbel_argmax(row, 0, vocab, t, seed, off, [&](float l) { return expf(l - mx_row) >= mp; }, bv, bi);
            return true;
        }
    }
    // Candidates: raw keys from rho up. With top_k, the k-th largest thread maximum is at most
    // the k-th largest key, and rho keeps every element whose l-key reaches it, so the top k
    // and their ties are all candidates. For top_p alone the candidates are the complete set
    // of l-keys above some value, which decides the nucleus whenever it ends inside them.
    unsigned int rho = 0u;
    if (vocab > CAND_CAP) rho = raw_key_floor(kth_largest(tmax, topk ? k : TOPP_RANK), t);
    if (tid == 0) s_int[0] = 0;
    __syncthreads();
    const bool zfull = usep && !topk;
    float zpart = 0.f;
    strided<16>(row, 0, vocab, [&](float v, int i) {
        if (fkey(v) >= rho) {
            const int pos = atomicAdd(s_int, 1);
            if (pos < CAND_CAP) cand[pos] = (unsigned long long)i;
        }
        if (zfull) {  // the full path's normaliser, same terms in the same order
            const float l = v / t;
            if (allowed(l)) zpart += expf(l - mx_row);
        }
    }, NoGroup());
    const float zrow = zfull ? block_sum(zpart, s_sv) : 0.f;
    __syncthreads();
    const int n = s_int[0];
    if (n > CAND_CAP || (topk && n < k)) return false;
    for (int j = tid; j < n; j += blockDim.x) {
        const unsigned int i = low_id(cand[j]);
        cand[j] = ((unsigned long long)~fkey(row[i] / t) << 32) | i;
    }
    __syncthreads();
    bitonic_sort(cand, n);  // l-key desc, id asc
    unsigned int floor_key = 1u;
    int m = n;
    if (topk) {
        floor_key = ~high_key(cand[k - 1]);
        if (tid == 0) s_int[1] = n;
        __syncthreads();
        for (int j = k - 1 + tid; j < n - 1; j += blockDim.x)  // the one boundary
            if (~high_key(cand[j]) >= floor_key && ~high_key(cand[j + 1]) < floor_key) s_int[1] = j + 1;
        __syncthreads();
        m = s_int[1];
    }
    float mx = 0.f;
    if (usep || usem) {
        mx = mx_row;
        if (topk) {
            mx = row[low_id(cand[0])] / t;  // the first is the largest; if not allowed, none is
            if (!allowed(mx) || !(mx < VT_INF)) return false;
        }
    }
    unsigned int p_key = 0u;
    if (usep) {
        float z = zrow;
        if (topk) {
            // The normaliser over the top-k set in the full path's order: regroup the allowed
            // ones by thread (id mod 1024) and id, sum each thread's run in turn, then block_sum.
            for (int j = tid; j < m; j += blockDim.x) {
                const unsigned int i = low_id(cand[j]);
                cand[j] = allowed(row[i] / t) ? ((unsigned long long)(i & (SAMPLER_THREADS - 1)) << 32) | i : ~0ull;
            }
            s_aux[tid] = 0.f;
            __syncthreads();
            bitonic_sort(cand, m);
            for (int j = tid; j < m; j += blockDim.x) {
                const unsigned int th = high_key(cand[j]);
                if (cand[j] == ~0ull || (j > 0 && high_key(cand[j - 1]) == th)) continue;
                float s = 0.f;
                for (int q = j; q < m && cand[q] != ~0ull && high_key(cand[q]) == th; ++q) {
                    const float l = row[low_id(cand[q])] / t;
                    s += expf(l - mx);
                }
                s_aux[th] = s;
            }
            __syncthreads();
            z = block_sum(s_aux[tid], s_sv);
            for (int j = tid; j < m; j += blockDim.x) {  // back to l-key order; dropped ones stay last
                if (cand[j] == ~0ull) continue;
                const unsigned int i = low_id(cand[j]);
                cand[j] = ((unsigned long long)~fkey(row[i] / t) << 32) | i;
            }
            __syncthreads();
            bitonic_sort(cand, m);
        }
        // Kept: l-keys down to the one where the running mass, largest first, reaches top_p * z
        // (all of that key's ties included), as the full path's radix walk defines it.
        const float target = tp * z;
        if (!(target > 0.f)) {
            p_key = 0xffffffffu;  // the walk stops at once on the top digit: nothing is kept
        } else {
            if (tid < 32) {
                float carry = 0.f;
                int found = -1;
                for (int j0 = 0; j0 < m; j0 += 32) {
                    const int j = j0 + tid;
                    float e = 0.f;
                    if (j < m && cand[j] != ~0ull) {
                        const float l = row[low_id(cand[j])] / t;
                        if (allowed(l)) e = expf(l - mx);
                    }
                    float s = e;
                    for (int o = 1; o < 32; o <<= 1) {
                        const float y = __shfl_up_sync(0xffffffffu, s, o);
                        if (tid >= o) s += y;
                    }
                    s += carry;
                    // A zero-mass element never ends the walk (its sum is the one before it).
                    const unsigned int hit = __ballot_sync(0xffffffffu, e > 0.f && s >= target);
                    if (hit) {
                        found = j0 + __ffs(hit) - 1;
                        break;
                    }
                    carry = __shfl_sync(0xffffffffu, s, 31);
                }
                if (tid == 0) s_int[1] = found;
            }
            __syncthreads();
            const int found = s_int[1];
            if (found >= 0) {
                p_key = ~high_key(cand[found]);
            } else if (!topk) {
                return false;  // the nucleus reaches below the candidates
            }
        }
    }
    const unsigned int keep_key = max(floor_key, p_key);
    float best = -VT_INF;
    int best_i = NO_ID;
    for (int j = tid; j < m; j += blockDim.x) {
        const unsigned long long c = cand[j];
        if (c == ~0ull || ~high_key(c) < keep_key) continue;
        const int i = (int)low_id(c);
        const float l = row[i] / t;
        if (!allowed(l)) continue;
        if (usem && !(expf(l - mx) >= mp)) continue;
        const float score = l + gumbel(seed, off, (unsigned long long)i);
        if (better(score, i, best, best_i)) { best = score; best_i = i; }
    }
    block_argmax(best, best_i, s_sv, s_si);
    bv = best;
    bi = best_i;
    return true;
}

// A filtered row over the whole vocabulary, step by step as the rules read: the k-th largest
// key, the max, the normaliser, the top-p radix walk, then the Gumbel argmax.
__device__ __noinline__ void sample_row_full(const float* row, int vocab, float t, int k, float tp, float mp,
                                             unsigned long long seed, unsigned long long off, float& bv, int& bi) {
    __syncthreads();  // the fast path may have been reading shared memory this reuses
    unsigned int floor_key = 1u;  // every non-NaN value; allowed() drops -inf below
    if (k >= 1 && k < vocab) floor_key = radix_kth_key(row, t, vocab, k, (unsigned int*)s_cand, s_hist_u, s_sel);
    float mx = 0.f;
    if (tp < 1.f || mp > 0.f) {
        mx = -VT_INF;
        strided<16>(row, 0, vocab, [&](float v, int) {
            const float l = v / t;
            if (allowed(l) && fkey(l) >= floor_key) mx = fmaxf(mx, l);
        }, NoGroup());
        mx = block_max(mx, s_sv);
    }
    unsigned int p_key = 0u;
    if (tp < 1.f && mx > -VT_INF) {
        float z = 0.f;
        strided<16>(row, 0, vocab, [&](float v, int) {
            const float l = v / t;
            if (allowed(l) && fkey(l) >= floor_key) z += expf(l - mx);
        }, NoGroup());
        z = block_sum(z, s_sv);
        // Kept: tokens whose mass strictly before them is < top_p, i.e. up to and including the
        // token where the inclusive running mass first reaches top_p * z.
        p_key = radix_select_mass(row, t, vocab, floor_key, mx, tp * z, (float*)s_cand, s_hist, s_sel);
    }
    const unsigned int keep_key = max(floor_key, p_key);
    gumbel_argmax(row, 0, vocab, t, seed, off, [&](float l) {
        return fkey(l) >= keep_key && !(mp > 0.f && !(expf(l - mx) >= mp));
    }, bv, bi);
}

// Grid (splits, B), blockDim 1024. Greedy rows: argmax of raw logits. Others: l = logits / T,
// filters as in numpy_sampling, then argmax of l + gumbel over the kept tokens. A row with no
// allowed token (every logit -inf) samples -1, as numpy_sampling's does. Unfiltered rows
// are split over `splits` blocks (each an exact argmax of its part); a filtered row is handled
// by its first block. With splits > 1 each block leaves (score, id) in part_v / part_i for
// sample_combine_k; with one split the block writes out[b].
extern "C" __global__ void __launch_bounds__(SAMPLER_THREADS)
sample_k(const float* __restrict__ logits, const float* __restrict__ temperature, const int* __restrict__ top_k,
         const float* __restrict__ top_p, const float* __restrict__ min_p, const long long* __restrict__ seeds,
         const int* __restrict__ offsets, int* __restrict__ out, float* __restrict__ part_v,
         int* __restrict__ part_i, int vocab, int splits) {
    const int b = blockIdx.y, part = blockIdx.x;
    const float* row = logits + (size_t)b * vocab;
    const float t = temperature[b];
    const int chunk = (vocab + splits - 1) / splits;
    const int begin = min(vocab, part * chunk), end = min(vocab, begin + chunk);
    float bv = -VT_INF;
    int bi = NO_ID;
    if (t < 1e-5f) {
        strided<16>(row, begin, end, [&](float v, int i) {
            if (better(v, i, bv, bi)) { bv = v; bi = i; }
        }, NoGroup());
        block_argmax(bv, bi, s_sv, s_si);
    } else {
        const int k = top_k[b];
        const float tp = top_p[b], mp = min_p[b];
        const unsigned long long seed = (unsigned long long)seeds[b];
        const unsigned long long off = (unsigned long long)(long long)offsets[b];
        if (!((k >= 1 && k < vocab) || tp < 1.f || mp > 0.f)) {
            gumbel_argmax(row, begin, end, t, seed, off, [](float) { return true; }, bv, bi);
        } else if (part == 0) {
            if (!sample_row_fast(row, vocab, t, k, tp, mp, seed, off, bv, bi))
                sample_row_full(row, vocab, t, k, tp, mp, seed, off, bv, bi);
        }
    }
    if (threadIdx.x == 0) {
        if (splits == 1) {
            out[b] = (bi == NO_ID || bv == -VT_INF) ? -1 : bi;
        } else {
            part_v[(size_t)b * splits + part] = bv;
            part_i[(size_t)b * splits + part] = bi;
        }
    }
}

// out[b] = best (score desc, id asc) of the row's split results; one warp per row.
extern "C" __global__ void sample_combine_k(const float* __restrict__ part_v, const int* __restrict__ part_i,
                                            int* __restrict__ out, int splits) {
    const int b = blockIdx.x;
    float bv = -VT_INF;
    int bi = NO_ID;
    for (int s = threadIdx.x; s < splits; s += 32) {
        const float v = part_v[(size_t)b * splits + s];
        const int i = part_i[(size_t)b * splits + s];
        if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    warp_argmax(bv, bi);
    if (threadIdx.x == 0) out[b] = (bi == NO_ID || bv == -VT_INF) ? -1 : bi;
}
