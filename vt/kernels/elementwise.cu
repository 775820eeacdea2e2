// Row and element kernels of the model: gather, norms, RoPE, KV write, SiLU-mul, bias, input fill.
// Vectorised paths need rows of a multiple of 8 elements on 16-byte aligned pointers; the host
// side checks that before launching.

// out[r] = src[idx[r]] (embedding lookup and row gather); an index out of range gives zeros.
extern "C" __global__ void gather_rows_k(const int* __restrict__ idx, const bf16_t* __restrict__ src,
                                         bf16_t* __restrict__ out, int rows, int width, int nsrc) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int s = idx[r];
    const bool ok = s >= 0 && s < nsrc;
    const uint4* sp = reinterpret_cast<const uint4*>(src + (size_t)(ok ? s : 0) * width);
    uint4* dp = reinterpret_cast<uint4*>(out + (size_t)r * width);
    for (int c = threadIdx.x; c < width / 8; c += blockDim.x) dp[c] = ok ? sp[c] : make_uint4(0, 0, 0, 0);
}

// r = x + residual (rounded to bf16, as stored); y = r * rsqrt(mean(r^2) + eps) * w.
// One block per row. residual may be null: then r is x and r_out is not written.
extern "C" __global__ void rms_norm_k(const bf16_t* __restrict__ x, const bf16_t* __restrict__ residual,
                                      const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                      bf16_t* __restrict__ r_out, int width, float eps) {
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * width;
    float ss = 0.f;
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
        float f[8];
        load8(x + base + c, f);
        if (residual != nullptr) {
            float g[8];
            load8(residual + base + c, g);
            for (int e = 0; e < 8; ++e) f[e] = bf2f(f2bf(f[e] + g[e]));
            store8(r_out + base + c, f);
        }
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)width + eps);
    const bf16_t* r = residual != nullptr ? r_out : x;
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
        float f[8], g[8];
        load8(r + base + c, f);
        load8(w + c, g);
        for (int e = 0; e < 8; ++e) f[e] = f[e] * inv * g[e];
        store8(y + base + c, f);
    }
}

// Per-head RMS norm: one warp per (token, head) row of length d; x rows are token-strided.
extern "C" __global__ void head_rms_norm_k(const bf16_t* __restrict__ x, int x_stride,
                                           const bf16_t* __restrict__ w, bf16_t* __restrict__ y,
                                           int tokens, int heads, int d, float eps) {
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= tokens * heads) return;
    const int t = row / heads, h = row % heads;
    const bf16_t* xr = x + (size_t)t * x_stride + (size_t)h * d;
    bf16_t* yr = y + (size_t)row * d;
    float ss = 0.f;
    for (int c = lane * 8; c < d; c += 256) {
        float f[8];
        load8(xr + c, f);
        for (int e = 0; e < 8; ++e) ss = __fmaf_rn(f[e], f[e], ss);
    }
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / (float)d + eps);
    for (int c = lane * 8; c < d; c += 256) {
        float f[8], g[8];
        load8(xr + c, f);
        load8(w + c, g);
        for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(__fmul_rn(f[e], inv), g[e]);
        store8(yr + c, f);
    }
}

// The neox rotation of the pair (x1, x2) = (x[i], x[i + d/2]), rounded step by step (no FMA
// contraction) so that every kernel that rotates gets the same bits.
__device__ __forceinline__ float rot_first(float x1, float x2, float c, float s) {
    return __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
}
__device__ __forceinline__ float rot_second(float x1, float x2, float c, float s) {
    return __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// Neox RoPE in place on q and k (token-strided rows): pairs (i, i + d/2) rotate by
// position * inv_freq[i]. One block per token; threads walk (head, i) of q then k.
extern "C" __global__ void rope_k(bf16_t* __restrict__ q, int q_stride, bf16_t* __restrict__ k, int k_stride,
                                  const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                  int hq, int hk, int d) {
    const int t = blockIdx.x;
    const int half = d / 2;
    const float pos = (float)positions[t];
    const int total = (hq + hk) * half;
    for (int j = threadIdx.x; j < total; j += blockDim.x) {
        const int h = j / half, i = j % half;
        bf16_t* row = h < hq ? q + (size_t)t * q_stride + (size_t)h * d
                             : k + (size_t)t * k_stride + (size_t)(h - hq) * d;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        const float x1 = bf2f(row[i]), x2 = bf2f(row[i + half]);
        row[i] = f2bf(rot_first(x1, x2, c, s));
        row[i + half] = f2bf(rot_second(x1, x2, c, s));
    }
}

// k, v rows (token-strided, hk * d each) into caches [slots, hk, d] at slot_mapping[t]; < 0 or
// beyond the cache is skipped. kv8: the caches hold e4m3 codes (one byte an element) of
// k / k_scale and v / v_scale (vLLM's fp8 KV cache); the scales are unused otherwise.
extern "C" __global__ void write_kv_k(const bf16_t* __restrict__ k, int k_stride, const bf16_t* __restrict__ v,
                                      int v_stride, bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache,
                                      const int* __restrict__ slot_mapping, int row_elems, long long num_slots,
                                      float k_scale, float v_scale, int kv8) {
    const int t = blockIdx.x;
    const long long slot = slot_mapping[t];
    if (slot < 0 || slot >= num_slots) return;
    const uint4* ks = reinterpret_cast<const uint4*>(k + (size_t)t * k_stride);
    const uint4* vs = reinterpret_cast<const uint4*>(v + (size_t)t * v_stride);
    if (kv8) {
        unsigned char* kd = reinterpret_cast<unsigned char*>(k_cache) + (size_t)slot * row_elems;
        unsigned char* vd = reinterpret_cast<unsigned char*>(v_cache) + (size_t)slot * row_elems;
        for (int c = threadIdx.x; c < row_elems / 8; c += blockDim.x) {
            float f[8];
            load8(k + (size_t)t * k_stride + c * 8, f);
            store8_e4m3_div(kd + c * 8, f, k_scale);
            load8(v + (size_t)t * v_stride + c * 8, f);
            store8_e4m3_div(vd + c * 8, f, v_scale);
        }
        return;
    }
    uint4* kd = reinterpret_cast<uint4*>(k_cache + (size_t)slot * row_elems);
    uint4* vd = reinterpret_cast<uint4*>(v_cache + (size_t)slot * row_elems);
    for (int c = threadIdx.x; c < row_elems / 8; c += blockDim.x) {
        kd[c] = ks[c];
        vd[c] = vs[c];
    }
}

// f[e] *= xs * ws[e]: a unit-scale fp8 product given its token's and its 8 channels' scales (one
// float32 product of the two scales, then one of the value), before scale_bias8 rounds it.
__device__ __forceinline__ void unit_scales8(float* f, float xs, const float* __restrict__ ws) {
    float w[8];
    load8_f32(ws, w);
    for (int e = 0; e < 8; ++e) f[e] = __fmul_rn(f[e], __fmul_rn(xs, w[e]));
}

// x * s + b (b may be null), rounded to bf16 as the projection's stored output would be.
__device__ __forceinline__ void scale_bias8(float* f, float s, const bf16_t* b) {
    float g[8];
    if (b != nullptr) load8(b, g);
    for (int e = 0; e < 8; ++e) f[e] = bf2f(f2bf(b != nullptr ? f[e] * s + g[e] : f[e] * s));
}

// 8 values into a KV cache at element `at`: bf16 as store8 rounds them, or with kv8 the e4m3
// codes of those bf16 values / scale (what write_kv_k stores from the rounded k and v).
__device__ __forceinline__ void store_kv8(bf16_t* cache, size_t at, const float* f, float scale, int kv8) {
    if (!kv8) {
        store8(cache + at, f);
        return;
    }
    float r[8];
    for (int e = 0; e < 8; ++e) r[e] = bf2f(f2bf(f[e]));
    store8_e4m3_div(reinterpret_cast<unsigned char*>(cache) + at, r, scale);
}

// A q row over an fp8 cache, held as 8 values in each of its g lanes (g a power of two, the row's
// lanes aligned in the warp): rounded to bf16 as store8 would, then to e4m3 x 2^n, n the smallest
// integer with the row's amax <= 448 x 2^n (as wgq_load_q takes it). Every attention kernel then
// reads this one query: the e4m3 Q K^T prompt kernel's codes are exact, and the decode kernels'
// bf16 products of it are the same products. Every lane of the warp calls it (the shuffles);
// `live` lanes hold a q row's values, the others add nothing to any row's amax.
__device__ __forceinline__ void round_q_row_e4m3_pow2(float (&r)[8], int g, bool live) {
    float amax = 0.f;
    if (live) {
        for (int e = 0; e < 8; ++e) {
            r[e] = bf2f(f2bf(r[e]));
            amax = fmaxf(amax, fabsf(r[e]));
        }
    }
    for (int o = g >> 1; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (!live) return;
    const int n = e4m3_pow2_exponent(amax);
    const float inv = pow2f(-n), sc = pow2f(n);
    for (int h = 0; h < 8; h += 4) {
        const uint2 w = e4m3x4_to_bf16x4(pack4_e4m3(r[h] * inv, r[h + 1] * inv, r[h + 2] * inv, r[h + 3] * inv));
        r[h] = lo_f(w.x) * sc;
        r[h + 1] = hi_f(w.x) * sc;
        r[h + 2] = lo_f(w.y) * sc;
        r[h + 3] = hi_f(w.y) * sc;
    }
}

// q[t, h, :] (rows of d elements at token stride q_stride) rounded in place as
// round_q_row_e4m3_pow2 rounds them: the prologue's three-op path over an fp8 cache. One warp a
// row; grid (tokens, heads).
extern "C" __global__ void round_q_e4m3_pow2_k(bf16_t* __restrict__ q, int q_stride, int d) {
    bf16_t* row = q + (size_t)blockIdx.x * q_stride + (size_t)blockIdx.y * d;
    float amax = 0.f;
    for (int i = threadIdx.x; i < d; i += 32) amax = fmaxf(amax, fabsf(bf2f(row[i])));
    const int n = e4m3_pow2_exponent(warp_max(amax));
    const float inv = pow2f(-n), sc = pow2f(n);
    for (int i = threadIdx.x; i < d; i += 32) {
        const uint2 w = e4m3x4_to_bf16x4(pack4_e4m3(bf2f(row[i]) * inv, 0.f, 0.f, 0.f));
        row[i] = f2bf(lo_f(w.x) * sc);
    }
}

// The attention prologue in one launch (head_rms_norm of q and k, neox rope, write_kv), bit
// for bit equal to head_rms_norm_k + rope_k + write_kv_k: the same sum order, and bf16 rounding
// after the norm and after the rotation. Head rows of a token: 0..hq-1 are q heads, then hk k
// heads, then hk v heads (copied to the cache). A group of g lanes (g the power of two >= d/8:
// half a warp at d=128) holds one row, lane l of it elements 8l..8l+7 (d <= 256, d % 16 == 0);
// the rotation partner of a lane is the lane d/16 away. A group's xor reduction over its g lanes
// adds what a whole warp's would (the other lanes' terms reach it as exact zeros), so the head
// norm's sums are head_rms_norm_k's. Grid (parts, tokens): a block walks the rows
// part, part + parts, ... in steps of its groups, after computing its token's rotation (one
// sincosf per frequency, not one per row) and input-norm scale once; the parts of a token are
// neighbours, so their re-reads of rms_of hit L2.
// rms_of (may be null): every row is first scaled by its token's rsqrt(mean(rms_of[t]^2) + eps)
// (the input norm, its weight folded into the qkv projection), then bias (may be null) is
// added, and the rounded values are written back into q, k and v. x_scale and w_scale (both or
// neither): q, k and v hold an fp8 projection's unit-scale sums, each value first multiplied by
// x_scale[t] * w_scale[column] (unit_scales8; the column of qkv: row * d + element).
// qk_norm_rope_write_kv8_k, for an fp8 cache: the caches take e4m3 codes of the bf16-rounded
// k / k_scale and v / v_scale, as write_kv_k's, and each q row is left rounded to e4m3 x 2^n
// (round_q_row_e4m3_pow2). Two kernels of one body: the rounding's registers would make the
// bf16 cache's kernel spill.
#define QK_PROLOGUE_PARAMS                                                                               \
    bf16_t* __restrict__ q, int q_stride, bf16_t* __restrict__ k, int k_stride, bf16_t* __restrict__ v,    \
        int v_stride, const bf16_t* __restrict__ q_norm, const bf16_t* __restrict__ k_norm, float eps,     \
        const int* __restrict__ positions, const float* __restrict__ inv_freq, bf16_t* __restrict__ k_cache, \
        bf16_t* __restrict__ v_cache, const int* __restrict__ slot_mapping, long long num_slots, int tokens, \
        int hq, int hk, int d, const bf16_t* __restrict__ rms_of, int rms_width,                          \
        const bf16_t* __restrict__ bias, float k_scale, float v_scale, const float* __restrict__ x_scale,   \
        const float* __restrict__ w_scale
#define QK_PROLOGUE_ARGS                                                                                 \
    q, q_stride, k, k_stride, v, v_stride, q_norm, k_norm, eps, positions, inv_freq, k_cache, v_cache,     \
        slot_mapping, num_slots, tokens, hq, hk, d, rms_of, rms_width, bias, k_scale, v_scale, x_scale, w_scale
template <bool KV8>
__device__ __forceinline__ void qk_norm_rope_write_kv_body(QK_PROLOGUE_PARAMS) {
    constexpr int kv8 = KV8;
    __shared__ float scratch[32];
    __shared__ float rot_c[128], rot_s[128];
    // Attention, launched as a dependent, reads only the K/V this kernel does not write before
    // it waits for it: let its blocks start on that now.
    grid_dependents_go();
    const int half = d / 2, span = half / 8, rows = hq + 2 * hk;
    int g = 1;
    while (g * 8 < d) g <<= 1;
    const int lane = threadIdx.x & 31, sub = lane & (g - 1), groups = blockDim.x / g;
    const int partner = (lane & ~(g - 1)) | (sub * 8 < half ? sub + span : sub - span);
    const bool first = sub * 8 < half, lane_live = sub * 8 < d;
    const bool prescale = rms_of != nullptr || bias != nullptr || x_scale != nullptr;
    const int base0 = blockIdx.x * groups, base_step = gridDim.x * groups;
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        // Row `row` of this token: its q, k or v head.
        auto row_at = [&](int row) -> bf16_t* {
            const bool is_v = row >= hq + hk, is_q = row < hq;
            const int h = is_q ? row : is_v ? row - hq - hk : row - hq;
            return is_q ? q + (size_t)t * q_stride + (size_t)h * d
                 : is_v ? v + (size_t)t * v_stride + (size_t)h * d : k + (size_t)t * k_stride + (size_t)h * d;
        };
        // This lane's 8 elements of the row its group takes at `base` (zeros past the rows).
        // (Raw bf16 pairs: a row loaded ahead holds 4 registers, not 8, while the one before is
        // computed.)
        auto load_row = [&](int base) -> uint4 {
            const int row = base + (int)threadIdx.x / g;
            return lane_live && row < rows ? *reinterpret_cast<const uint4*>(row_at(row) + sub * 8)
                                           : make_uint4(0u, 0u, 0u, 0u);
        };
        auto unpack_row = [](uint4 v, float (&f)[8]) {
            f[0] = lo_f(v.x); f[1] = hi_f(v.x); f[2] = lo_f(v.y); f[3] = hi_f(v.y);
            f[4] = lo_f(v.z); f[5] = hi_f(v.z); f[6] = lo_f(v.w); f[7] = hi_f(v.w);
        };
        // The first row is loaded before the token's tables are made, and each later one while
        // the one before is computed: a block's rows are otherwise a chain of dependent loads.
        float f[8];
        unpack_row(load_row(base0), f);
        const long long slot = slot_mapping[t];
        const bool cache = slot >= 0 && slot < num_slots;
        const float pos = (float)positions[t];
        __syncthreads();  // the previous token's rows are done with the tables
        for (int i = threadIdx.x; i < half; i += blockDim.x) sincosf(pos * inv_freq[i], &rot_s[i], &rot_c[i]);
        const float scale =
            rms_of != nullptr ? row_inv_rms(rms_of + (size_t)t * rms_width, rms_width, eps, scratch) : 1.f;
        __syncthreads();
        // Every lane of a warp runs every iteration (the shuffles need them all).
        for (int base = base0; base < rows; base += base_step) {
            const bool more = base + base_step < rows;
            const uint4 fn = more ? load_row(base + base_step) : make_uint4(0u, 0u, 0u, 0u);
            const int row = base + (int)threadIdx.x / g;
            const bool mine = lane_live && row < rows;
            const bool is_v = row >= hq + hk, is_q = row < hq;
            const int h = is_q ? row : is_v ? row - hq - hk : row - hq;
            bf16_t* xr = row_at(row);
            if (mine && x_scale != nullptr) unit_scales8(f, x_scale[t], w_scale + (size_t)row * d + sub * 8);
            if (mine && prescale) scale_bias8(f, scale, bias != nullptr ? bias + (size_t)row * d + sub * 8 : nullptr);
            if (q_norm != nullptr) {  // both norms or neither (the host checks)
                float ss = 0.f;
                for (int e = 0; e < 8; ++e) ss = __fmaf_rn(f[e], f[e], ss);
                for (int o = g >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
                const float inv = rsqrtf(ss / (float)d + eps);
                if (mine && !is_v) {
                    float w[8];
                    load8((is_q ? q_norm : k_norm) + sub * 8, w);
                    for (int e = 0; e < 8; ++e) f[e] = bf2f(f2bf(__fmul_rn(__fmul_rn(f[e], inv), w[e])));
                }
            }
            float other[8];
            for (int e = 0; e < 8; ++e) other[e] = __shfl_sync(0xffffffffu, f[e], partner);
            if (mine && is_v) {  // v head: into the cache (and back into v when scaled)
                if (prescale) store8(xr + sub * 8, f);
                if (cache) store_kv8(v_cache, ((size_t)slot * hk + h) * d + sub * 8, f, v_scale, kv8);
            }
            float r[8];  // the rotated q or k row (v rows and dead lanes: unused)
            for (int e = 0; e < 8; ++e) {
                const int i = (first ? sub * 8 : sub * 8 - half) + e;
                r[e] = lane_live ? first ? rot_first(f[e], other[e], rot_c[i], rot_s[i])
                                         : rot_second(other[e], f[e], rot_c[i], rot_s[i])
                                 : 0.f;
            }
            if constexpr (KV8) round_q_row_e4m3_pow2(r, g, mine && is_q);  // every lane: shuffles
            if (mine && !is_v) {
                store8(xr + sub * 8, r);
                if (!is_q && cache) store_kv8(k_cache, ((size_t)slot * hk + h) * d + sub * 8, r, k_scale, kv8);
            }
            if (more) unpack_row(fn, f);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope_write_kv_k(QK_PROLOGUE_PARAMS) {
    qk_norm_rope_write_kv_body<false>(QK_PROLOGUE_ARGS);
}
extern "C" __global__ void __launch_bounds__(256, 4) qk_norm_rope_write_kv8_k(QK_PROLOGUE_PARAMS) {
    qk_norm_rope_write_kv_body<true>(QK_PROLOGUE_ARGS);
}

// x[t, :n] = x * s_t + bias in place on token-strided rows, s_t = rsqrt(mean(rms_of[t]^2) + eps)
// (1 without rms_of), bias may be null, x first given unit scales x_scale[t] * w_scale[:n] where
// x_scale is not null: the prologue's prescale for shapes its kernel does not take.
extern "C" __global__ void rms_scale_k(bf16_t* __restrict__ x, int x_stride, int n, const bf16_t* __restrict__ rms_of,
                                       int rms_width, float eps, const bf16_t* __restrict__ bias,
                                       const float* __restrict__ x_scale, const float* __restrict__ w_scale) {
    __shared__ float scratch[32];
    const int t = blockIdx.x;
    const float s = rms_of != nullptr ? row_inv_rms(rms_of + (size_t)t * rms_width, rms_width, eps, scratch) : 1.f;
    for (int c = threadIdx.x * 8; c < n; c += blockDim.x * 8) {
        float f[8];
        load8(x + (size_t)t * x_stride + c, f);
        if (x_scale != nullptr) unit_scales8(f, x_scale[t], w_scale + c);
        scale_bias8(f, s, bias != nullptr ? bias + c : nullptr);
        store8(x + (size_t)t * x_stride + c, f);
    }
}

// out[t, :] = silu(s x[t, :inter]) * (s x[t, inter:]), s = rsqrt(mean(rms_of[t]^2) + eps), or 1
// without rms_of (the post-attention norm, its weight folded into gate_up). Grid (parts,
// tokens): block p of a row does its chunks of 8 outputs p * blockDim.x + threadIdx.x, stepping
// by parts * blockDim.x. A token's parts are neighbours, so their reads of rms_of hit L2.
// SILU_AHEAD chunks of a thread are loaded before any is computed (the first ones before the
// row's scale is reduced), so their latencies overlap instead of forming a chain; the sigmoid
// uses the fast exponential and division, as IEEE expf and '/' cost ~30 instructions an element,
// as much issue time as the element's bytes take to move (the result is rounded to bf16).
#define SILU_AHEAD 4
extern "C" __global__ void silu_mul_k(const bf16_t* __restrict__ x, bf16_t* __restrict__ out, int tokens, int inter,
                                      const bf16_t* __restrict__ rms_of, int rms_width, float eps) {
    grid_dependents_go();  // the down projection's GEMV after this may start streaming its weights
    __shared__ float scratch[32];
    const int per_row = inter / 8, step = gridDim.x * blockDim.x;
    const int c0 = blockIdx.x * blockDim.x + threadIdx.x;
    for (int t = blockIdx.y; t < tokens; t += gridDim.y) {
        const bf16_t* xr = x + (size_t)t * 2 * inter;
        uint4 gv[SILU_AHEAD], uv[SILU_AHEAD];
        auto load_group = [&](int c) {
#pragma unroll
            for (int j = 0; j < SILU_AHEAD; ++j) {
                const int cj = c + j * step;
                if (cj < per_row) {
                    gv[j] = *reinterpret_cast<const uint4*>(xr + cj * 8);
                    uv[j] = *reinterpret_cast<const uint4*>(xr + inter + cj * 8);
                }
            }
        };
        load_group(c0);
        const float s = rms_of != nullptr ? row_inv_rms(rms_of + (size_t)t * rms_width, rms_width, eps, scratch) : 1.f;
        for (int c = c0; c < per_row; c += SILU_AHEAD * step) {
            if (c != c0) load_group(c);
#pragma unroll
            for (int j = 0; j < SILU_AHEAD; ++j) {
                const int cj = c + j * step;
                if (cj >= per_row) break;
                const unsigned int gw[4] = {gv[j].x, gv[j].y, gv[j].z, gv[j].w};
                const unsigned int uw[4] = {uv[j].x, uv[j].y, uv[j].z, uv[j].w};
                float o[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const float a = (e & 1 ? hi_f(gw[e / 2]) : lo_f(gw[e / 2])) * s;
                    const float b = (e & 1 ? hi_f(uw[e / 2]) : lo_f(uw[e / 2])) * s;
                    o[e] = __fdividef(a, 1.f + __expf(-a)) * b;
                }
                store8(out + (size_t)t * inter + cj * 8, o);
            }
        }
    }
}

// w[r, :] *= s per column, in place (an RMS norm's weight folded into the projection after it).
extern "C" __global__ void scale_columns_k(bf16_t* __restrict__ w, const bf16_t* __restrict__ s, long long rows,
                                           int cols) {
    const long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = cols / 8;
    if (chunk >= rows * per_row) return;
    const long long r = chunk / per_row;
    const int c = (int)(chunk % per_row) * 8;
    float a[8], b[8];
    load8(w + r * cols + c, a);
    load8(s + c, b);
    for (int e = 0; e < 8; ++e) a[e] *= b[e];
    store8(w + r * cols + c, a);
}

// y[t, :] += bias (in place on the GEMM output).
extern "C" __global__ void bias_add_k(bf16_t* __restrict__ y, const bf16_t* __restrict__ bias,
                                      int rows, int n) {
    const long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const int per_row = n / 8;
    if (chunk >= (long long)rows * per_row) return;
    const int t = (int)(chunk / per_row), c = (int)(chunk % per_row) * 8;
    float a[8], b[8];
    load8(y + (size_t)t * n + c, a);
    load8(bias + c, b);
    for (int e = 0; e < 8; ++e) a[e] += b[e];
    store8(y + (size_t)t * n + c, a);
}

// input_ids[t] = last_tokens[src_rows[t]] where src_rows[t] >= 0.
extern "C" __global__ void fill_from_last_k(int* __restrict__ input_ids, const int* __restrict__ src_rows,
                                            const int* __restrict__ last_tokens, int n, int num_last) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const int r = src_rows[t];
    if (r >= 0 && r < num_last) input_ids[t] = last_tokens[r];
}
