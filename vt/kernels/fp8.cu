// FP8 (e4m3) activation quantization, fused into the kernels that produce the activations: the
// input norms (rms_norm_quant_k), SiLU-mul (silu_mul_quant_k), and a plain pass for the attention
// output (quantize_rows_k, also used on weights at load). The semantics are vt/kernels/numpy_fp8.py's:
// per group of a row, amax = max(|x|, FP8_AMAX_FLOOR), scale = amax / 448, q = e4m3(x * (448 / amax)),
// nearest even, saturated. group 0 means one group a row (per-token scales, scale[row]); group 128
// gives a scale per row and 128 columns, stored group-major as cuBLASLt's VEC128 scales want them:
// scale[g * scale_ld + row]. Rows are bf16 with a multiple of 8 elements on 16-byte aligned memory;
// with group 128 the row length is a multiple of 128.

#define FP8_MAX 448.f
#define FP8_AMAX_FLOOR 1e-12f
#define FP8_THREADS 256

// f2e4m3 and pack4_e4m3 (float -> e4m3 bits) are in cuda_common.cu: the KV cache write uses them too.

// 8 codes of f * inv in one 8-byte store: p is 8-byte aligned (a chunk of 8 in a row of a multiple
// of 8 codes, on memory the host allocates at 256-byte boundaries).
__device__ __forceinline__ void store8_e4m3(unsigned char* p, const float* f, float inv) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack4_e4m3(f[0] * inv, f[1] * inv, f[2] * inv, f[3] * inv),
                                              pack4_e4m3(f[4] * inv, f[5] * inv, f[6] * inv, f[7] * inv));
}

// The max over the 16 lanes of a half warp (a group of 128 values, 8 a lane).
__device__ __forceinline__ float half_warp_max(float v) {
    for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The 8 values of chunk c of a row, as each kernel computes them.
struct RowSource {
    const bf16_t* x;       // the row (quantize, norm) or the row's gate half (silu_mul)
    const bf16_t* up;      // silu_mul: the row's up half; null otherwise
    const bf16_t* weight;  // norm: the norm weight; null otherwise
    float s;               // norm: rsqrt(mean(x^2) + eps); 1 otherwise
    __device__ __forceinline__ void load(int c, float* f) const {
        load8(x + c, f);
        if (up != nullptr) {
            float u[8];
            load8(up + c, u);
            for (int e = 0; e < 8; ++e) f[e] = __fdividef(f[e], 1.f + __expf(-f[e])) * u[e];
        } else if (weight != nullptr) {
            float w[8];
            load8(weight + c, w);
            for (int e = 0; e < 8; ++e) f[e] = f[e] * s * w[e];
        }
    }
};

// SiLU-mul's 8 values of chunk c from a unit-scale gate_up product (bf16 sums of the codes'
// products): gate and up each times the token's scale and its channel's, then silu(gate) * up.
struct ScaledSiluSource {
    const bf16_t* gate;
    const bf16_t* up;
    const float* gate_scale;  // the weight's channel scales of the gate half
    const float* up_scale;    // and of the up half
    float rs;                 // the token's activation scale
    __device__ __forceinline__ void load(int c, float* f) const {
        float u[8], gs[8], us[8];
        load8(gate + c, f);
        load8(up + c, u);
        load8_f32(gate_scale + c, gs);
        load8_f32(up_scale + c, us);
        for (int e = 0; e < 8; ++e) {
            const float g = f[e] * (rs * gs[e]);
            f[e] = __fdividef(g, 1.f + __expf(-g)) * (u[e] * (rs * us[e]));
        }
    }
};

// Chunks of 8 a thread keeps in registers between a row's amax and its quantization. The generic
// kernels (any width, group 128) hold up to FP8_ROW_CHUNKS (SiLU-mul's HOLD) or read the row again;
// the _held<CH> kernels below hold exactly CH chunks, CH = ceil(width / (FP8_THREADS * 8)) rounded
// up to an instantiated count (fp8.py: held_chunks), so their registers fit the row they take.
#define FP8_ROW_CHUNKS 8

// A row quantized from registers by the generic kernels: per-token scales (group 0) and at most
// FP8_ROW_CHUNKS chunks a thread.
__device__ __forceinline__ bool row_held(int group, int k) {
    return group == 0 && k <= FP8_THREADS * 8 * FP8_ROW_CHUNKS;
}

// The row's values held in registers (chunk i of this thread at column (threadIdx.x + i *
// FP8_THREADS) * 8): its amax, codes and scale.
template <int CH>
__device__ __forceinline__ void quantize_held(float (&f)[CH][8], unsigned char* __restrict__ q,
                                              float* __restrict__ scale, int row, int k, float* scratch) {
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < CH; ++i) {
        if ((threadIdx.x + i * FP8_THREADS) * 8 < k) {
            for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[i][e]));
        }
    }
    amax = fmaxf(block_max(amax, scratch), FP8_AMAX_FLOOR);
    const float inv = FP8_MAX / amax;
#pragma unroll
    for (int i = 0; i < CH; ++i) {
        const int c = (threadIdx.x + i * FP8_THREADS) * 8;
        if (c < k) store8_e4m3(q + c, f[i], inv);
    }
    if (threadIdx.x == 0) scale[row] = amax / FP8_MAX;
}

// A source's row of width k <= CH * FP8_THREADS * 8 read once into registers, then quantized
// per token: the generic kernels' codes and scale, bit for bit.
template <int CH, class Source>
__device__ __forceinline__ void quantize_row_held(const Source& src, unsigned char* __restrict__ q,
                                                  float* __restrict__ scale, int row, int k, float* scratch) {
    float f[CH][8];
#pragma unroll
    for (int i = 0; i < CH; ++i) {
        const int c = (threadIdx.x + i * FP8_THREADS) * 8;
        if (c < k) src.load(c, f[i]);
    }
    quantize_held<CH>(f, q, scale, row, k, scratch);
}

// One block a row of width k: amax, then the quantized row (HOLD: held in registers where it fits;
// otherwise a second read of the row, from cache).
template <bool HOLD, class Source = RowSource>
__device__ void quantize_row(const Source& src, unsigned char* __restrict__ q, float* __restrict__ scale,
                             int row, int k, int group, int scale_ld, float* scratch) {
    if (HOLD && row_held(group, k)) {
        quantize_row_held<FP8_ROW_CHUNKS>(src, q, scale, row, k, scratch);
        return;
    }
    if (group == 0) {
        float amax = 0.f;
        for (int c = threadIdx.x * 8; c < k; c += FP8_THREADS * 8) {
            float f[8];
            src.load(c, f);
            for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
        }
        amax = fmaxf(block_max(amax, scratch), FP8_AMAX_FLOOR);
        const float inv = FP8_MAX / amax;
        for (int c = threadIdx.x * 8; c < k; c += FP8_THREADS * 8) {
            float f[8];
            src.load(c, f);
            store8_e4m3(q + c, f, inv);
        }
        if (threadIdx.x == 0) scale[row] = amax / FP8_MAX;
        return;
    }
    // group == 128: 16 lanes a group; the loop bound is the same for every lane of a warp, so the
    // shuffles always see the whole warp (lanes past the row contribute nothing).
    for (int base = 0; base < k; base += FP8_THREADS * 8) {
        const int c = base + threadIdx.x * 8;
        float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (c < k) src.load(c, f);
        float amax = 0.f;
        for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(f[e]));
        amax = fmaxf(half_warp_max(amax), FP8_AMAX_FLOOR);
        if (c < k) {
            store8_e4m3(q + c, f, FP8_MAX / amax);
            if ((threadIdx.x & 15) == 0) scale[(size_t)(c / 128) * scale_ld + row] = amax / FP8_MAX;
        }
    }
}

// q[r, :k], scale <- x[r, :k] (row stride ld). Grid: rows.
extern "C" __global__ void quantize_rows_k(const bf16_t* __restrict__ x, long long ld, unsigned char* __restrict__ q,
                                           float* __restrict__ scale, int k, int group, int scale_ld) {
    grid_dependents_go();  // the GEMV after this may start streaming its weights
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const RowSource src{x + (size_t)row * ld, nullptr, nullptr, 1.f};
    quantize_row<false>(src, q + (size_t)row * k, scale, row, k, group, scale_ld, scratch);
}

// The input norm of an fp8 projection: q, scale <- x[r] * rsqrt(mean(x[r]^2) + eps) * weight.
// Grid: rows.
extern "C" __global__ void rms_norm_quant_k(const bf16_t* __restrict__ x, const bf16_t* __restrict__ weight,
                                            float eps, unsigned char* __restrict__ q, float* __restrict__ scale,
                                            int k, int group, int scale_ld) {
    grid_dependents_go();  // the GEMV after this may start streaming its weights
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const bf16_t* xr = x + (size_t)row * k;
    const RowSource src{xr, nullptr, weight, row_inv_rms(xr, k, eps, scratch)};
    quantize_row<false>(src, q + (size_t)row * k, scale, row, k, group, scale_ld, scratch);
}

// down_proj's input: q, scale <- silu(x[r, :inter]) * x[r, inter:]. Grid: rows.
extern "C" __global__ void silu_mul_quant_k(const bf16_t* __restrict__ x, unsigned char* __restrict__ q,
                                            float* __restrict__ scale, int inter, int group, int scale_ld) {
    grid_dependents_go();  // the GEMV after this may start streaming its weights
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const bf16_t* xr = x + (size_t)row * 2 * inter;
    const RowSource src{xr, xr + inter, nullptr, 1.f};
    quantize_row<true>(src, q + (size_t)row * inter, scale, row, inter, group, scale_ld, scratch);
}

// down_proj's input from a unit-scale gate_up product y (fp8.py's 17-256-row path): q, scale <-
// silu(y[r, :inter] * xs[r] * ws[:inter]) * (y[r, inter:] * xs[r] * ws[inter:]), per-token codes.
// Grid: rows.
extern "C" __global__ void silu_mul_quant_scaled_k(const bf16_t* __restrict__ y, const float* __restrict__ xs,
                                                   const float* __restrict__ ws, unsigned char* __restrict__ q,
                                                   float* __restrict__ scale, int inter) {
    grid_dependents_go();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const bf16_t* yr = y + (size_t)row * 2 * inter;
    const ScaledSiluSource src{yr, yr + inter, ws, ws + inter, xs[row]};
    quantize_row<true>(src, q + (size_t)row * inter, scale, row, inter, 0, 0, scratch);
}

// y += x elementwise over chunks of 8 bf16 (rounded once): a block-scaled product computed for
// padded rows, added to the residual stream's real rows.
extern "C" __global__ void add_rows_k(bf16_t* __restrict__ y, const bf16_t* __restrict__ x, long long chunks) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= chunks) return;
    float a[8], b[8];
    load8(y + c * 8, a);
    load8(x + c * 8, b);
    for (int e = 0; e < 8; ++e) a[e] += b[e];
    store8(y + c * 8, a);
}

// r[t, :n] += y[t, :n] * (x_scale[t] * w_scale[:n]), one fused multiply-add a value, rounded once to
// bf16: the product of a unit-scale (per-tensor) fp8 GEMM, y, given its per-token and per-channel
// scales after the fact and added to the residual stream. Chunks of 8 values, n a multiple of 8.
extern "C" __global__ void add_scaled_rows_k(bf16_t* __restrict__ r, const bf16_t* __restrict__ y,
                                             const float* __restrict__ x_scale, const float* __restrict__ w_scale,
                                             int n, long long chunks) {
    const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= chunks) return;
    const long long i = c * 8;
    const int t = (int)(i / n), col = (int)(i % n);
    float a[8], b[8];
    load8(r + i, a);
    load8(y + i, b);
    const float xs = x_scale[t];
    float ws[8];
    load8_f32(w_scale + col, ws);
    for (int e = 0; e < 8; ++e) a[e] = __fmaf_rn(b[e], xs * ws[e], a[e]);
    store8(r + i, a);
}

// r[c .. c + 7] += y[c .. c + 7] * (xs * w_scale[c .. c + 7]) as add_scaled_rows_k adds it, stored
// as bf16; a gets the sums in fp32 (before that rounding).
__device__ __forceinline__ void add_scaled8(bf16_t* rr, const bf16_t* __restrict__ yr,
                                            const float* __restrict__ w_scale, float xs, int c, float (&a)[8]) {
    float b[8], ws[8];
    load8(rr + c, a);
    load8(yr + c, b);
    load8_f32(w_scale + c, ws);
    for (int e = 0; e < 8; ++e) a[e] = __fmaf_rn(b[e], xs * ws[e], a[e]);
    store8(rr + c, a);
}

// The post-attention norm of a 17-256-row step whose o_proj ran with unit scales (fp8.py): r[t] +=
// y[t] * (x_scale[t] * w_scale) as add_scaled_rows_k adds it, then rms_norm_quant_k of the new
// row (per-token codes), by the same arithmetic: the same bits as those two kernels, one launch
// fewer. r is not restrict: it is read back after the add. Grid: rows; k a multiple of 8.
extern "C" __global__ void add_scaled_rms_norm_quant_k(bf16_t* r, const bf16_t* __restrict__ y,
                                                       const float* __restrict__ x_scale,
                                                       const float* __restrict__ w_scale,
                                                       const bf16_t* __restrict__ weight, float eps,
                                                       unsigned char* __restrict__ q, float* __restrict__ scale,
                                                       int k) {
    grid_dependents_go();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    bf16_t* rr = r + (size_t)row * k;
    const bf16_t* yr = y + (size_t)row * k;
    const float xs = x_scale[row];
    for (int c = threadIdx.x * 8; c < k; c += FP8_THREADS * 8) {
        float a[8];
        add_scaled8(rr, yr, w_scale, xs, c, a);
    }
    // row_inv_rms and quantize_row read the row in the loop's own pattern: each thread reads back
    // only the chunks it stored, so no barrier is needed between.
    const RowSource src{rr, nullptr, weight, row_inv_rms(rr, k, eps, scratch)};
    quantize_row<false>(src, q + (size_t)row * k, scale, row, k, 0, 0, scratch);
}

// ---- held-row kernels: the per-token kernels above for rows of at most CH * FP8_THREADS * 8 values,
// each row read once into registers (CH chunks of 8 a thread) and quantized from there. The same
// codes and scales, bit for bit: the sums of squares in row_inv_rms' order, the values as RowSource
// and ScaledSiluSource make them. fp8.py launches them where held_chunks finds a CH; the generic
// kernels above take group 128 and wider rows. One read instead of two or three (an input norm read
// its row for the sum of squares, the amax and the codes) shortens a decode step's chain of
// dependent loads; registers sized to the row keep the prompt steps' blocks an SM.

// The input norm's codes of one row, held: load(c, v) gives the row's 8 values at column c (as the
// generic kernel reads them back); each chunk is loaded with its norm weight before the sum of
// squares' reduction, then x * rsqrt(mean(x^2) + eps) * weight is quantized from registers.
template <int CH, class Load>
__device__ __forceinline__ void rms_norm_quant_held(const Load& load, const bf16_t* __restrict__ weight, float eps,
                                                    unsigned char* __restrict__ q, float* __restrict__ scale,
                                                    int row, int k, float* scratch) {
    float f[CH][8];
    uint4 wr[CH];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < CH; ++i) {
        const int c = (threadIdx.x + i * FP8_THREADS) * 8;
        if (c < k) {
            load(c, f[i]);
            wr[i] = *reinterpret_cast<const uint4*>(weight + c);
            for (int e = 0; e < 8; ++e) ss += f[i][e] * f[i][e];
        }
    }
    const float s = rsqrtf(block_sum(ss, scratch) / (float)k + eps);
#pragma unroll
    for (int i = 0; i < CH; ++i) {
        if ((threadIdx.x + i * FP8_THREADS) * 8 < k) {
            const float w[8] = {lo_f(wr[i].x), hi_f(wr[i].x), lo_f(wr[i].y), hi_f(wr[i].y),
                                lo_f(wr[i].z), hi_f(wr[i].z), lo_f(wr[i].w), hi_f(wr[i].w)};
            for (int e = 0; e < 8; ++e) f[i][e] = f[i][e] * s * w[e];
        }
    }
    quantize_held<CH>(f, q + (size_t)row * k, scale, row, k, scratch);
}

template <int CH>
__device__ __forceinline__ void rms_norm_quant_held_body(const bf16_t* __restrict__ x,
                                                         const bf16_t* __restrict__ weight, float eps,
                                                         unsigned char* __restrict__ q, float* __restrict__ scale,
                                                         int k) {
    grid_dependents_go();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    const bf16_t* xr = x + (size_t)row * k;
    const auto load = [&](int c, float (&v)[8]) { load8(xr + c, v); };
    rms_norm_quant_held<CH>(load, weight, eps, q, scale, row, k, scratch);
}

// add_scaled_rms_norm_quant_k held: the sum is stored rounded to bf16, and the rounded values are
// what the norm reads (as that kernel reads them back).
template <int CH>
__device__ __forceinline__ void add_scaled_rms_norm_quant_held_body(
    bf16_t* __restrict__ r, const bf16_t* __restrict__ y, const float* __restrict__ x_scale,
    const float* __restrict__ w_scale, const bf16_t* __restrict__ weight, float eps, unsigned char* __restrict__ q,
    float* __restrict__ scale, int k) {
    grid_dependents_go();
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    bf16_t* rr = r + (size_t)row * k;
    const bf16_t* yr = y + (size_t)row * k;
    const float xs = x_scale[row];
    const auto load = [&](int c, float (&v)[8]) {
        add_scaled8(rr, yr, w_scale, xs, c, v);
        for (int e = 0; e < 8; ++e) v[e] = bf2f(f2bf(v[e]));
    };
    rms_norm_quant_held<CH>(load, weight, eps, q, scale, row, k, scratch);
}

// FP8_HELD_NORMS(CH, MIN_BLOCKS): rms_norm_quant_k, add_scaled_rms_norm_quant_k and quantize_rows_k
// (group 0) for rows of at most CH chunks a thread. Grid: rows. The norm and the quantization run
// at MIN_BLOCKS blocks an SM (no spills): a prompt step's 4096-wide rows lost half their speed
// when held at two blocks an SM (bench/RESULTS.md); the add (17-256 rows) keeps its registers.
#define FP8_HELD_NORMS(CH, MIN_BLOCKS)                                                                       \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MIN_BLOCKS) rms_norm_quant_held##CH##_k(     \
        const bf16_t* __restrict__ x, const bf16_t* __restrict__ weight, float eps,                         \
        unsigned char* __restrict__ q, float* __restrict__ scale, int k) {                                  \
        rms_norm_quant_held_body<CH>(x, weight, eps, q, scale, k);                                           \
    }                                                                                                        \
    extern "C" __global__ void add_scaled_rms_norm_quant_held##CH##_k(                                       \
        bf16_t* __restrict__ r, const bf16_t* __restrict__ y, const float* __restrict__ x_scale,             \
        const float* __restrict__ w_scale, const bf16_t* __restrict__ weight, float eps,                     \
        unsigned char* __restrict__ q, float* __restrict__ scale, int k) {                                   \
        add_scaled_rms_norm_quant_held_body<CH>(r, y, x_scale, w_scale, weight, eps, q, scale, k);           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MIN_BLOCKS) quantize_rows_held##CH##_k(      \
        const bf16_t* __restrict__ x, long long ld, unsigned char* __restrict__ q, float* __restrict__ scale, \
        int k) {                                                                                             \
        grid_dependents_go();                                                                                \
        __shared__ float scratch[32];                                                                        \
        const int row = blockIdx.x;                                                                          \
        const RowSource src{x + (size_t)row * ld, nullptr, nullptr, 1.f};                                    \
        quantize_row_held<CH>(src, q + (size_t)row * k, scale, row, k, scratch);                             \
    }
FP8_HELD_NORMS(1, 8)
FP8_HELD_NORMS(2, 6)
FP8_HELD_NORMS(4, 3)

// FP8_HELD_SILU(CH, MIN_BLOCKS): silu_mul_quant_k and silu_mul_quant_scaled_k (group 0) for an
// intermediate size of at most CH chunks a thread, at MIN_BLOCKS blocks an SM (the register bound
// that keeps a prompt step's rows streaming: the generic kernel's 96 registers allowed two).
#define FP8_HELD_SILU(CH, MIN_BLOCKS)                                                                        \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MIN_BLOCKS) silu_mul_quant_held##CH##_k(      \
        const bf16_t* __restrict__ x, unsigned char* __restrict__ q, float* __restrict__ scale, int inter) { \
        grid_dependents_go();                                                                                \
        __shared__ float scratch[32];                                                                        \
        const int row = blockIdx.x;                                                                          \
        const bf16_t* xr = x + (size_t)row * 2 * inter;                                                      \
        const RowSource src{xr, xr + inter, nullptr, 1.f};                                                   \
        quantize_row_held<CH>(src, q + (size_t)row * inter, scale, row, inter, scratch);                     \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(FP8_THREADS, MIN_BLOCKS) silu_mul_quant_scaled_held##CH##_k( \
        const bf16_t* __restrict__ y, const float* __restrict__ xs, const float* __restrict__ ws,             \
        unsigned char* __restrict__ q, float* __restrict__ scale, int inter) {                               \
        grid_dependents_go();                                                                                \
        __shared__ float scratch[32];                                                                        \
        const int row = blockIdx.x;                                                                          \
        const bf16_t* yr = y + (size_t)row * 2 * inter;                                                      \
        const ScaledSiluSource src{yr, yr + inter, ws, ws + inter, xs[row]};                                 \
        quantize_row_held<CH>(src, q + (size_t)row * inter, scale, row, inter, scratch);                     \
    }
FP8_HELD_SILU(2, 4)
FP8_HELD_SILU(4, 4)
FP8_HELD_SILU(6, 3)
FP8_HELD_SILU(8, 2)
