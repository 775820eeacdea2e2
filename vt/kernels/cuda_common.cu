// Helpers shared by every kernel file (prepended to each source before NVRTC compiles it).
// bf16 values travel as raw 16-bit patterns: converting by hand keeps the sources free of
// header lookups under NVRTC and rounds exactly like ml_dtypes (round to nearest even).

typedef unsigned short bf16_t;

// NVRTC sees no math.h: spell infinity out.
#define VT_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float bf2f(bf16_t h) { return __uint_as_float(((unsigned int)h) << 16); }

__device__ __forceinline__ bf16_t f2bf(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);  // keep NaN a NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// A 32-bit word holds two bf16: the element at the lower address in the low half.
__device__ __forceinline__ float lo_f(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_f(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ unsigned int pack2(float a, float b) {
    return (unsigned int)f2bf(a) | ((unsigned int)f2bf(b) << 16);
}

// 8 bf16 <-> 8 floats through one 16-byte access.
__device__ __forceinline__ void load8(const bf16_t* p, float* f) {
    uint4 v = *reinterpret_cast<const uint4*>(p);
    f[0] = lo_f(v.x); f[1] = hi_f(v.x); f[2] = lo_f(v.y); f[3] = hi_f(v.y);
    f[4] = lo_f(v.z); f[5] = hi_f(v.z); f[6] = lo_f(v.w); f[7] = hi_f(v.w);
}
// 8 floats from 16-byte aligned memory in two vector loads (per-channel scales: the compiler cannot
// prove the alignment, and 8 scalar loads a chunk made the scaled fp8 kernels load-issue bound).
__device__ __forceinline__ void load8_f32(const float* p, float* f) {
    const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void store8(bf16_t* p, const float* f) {
    uint4 v;
    v.x = pack2(f[0], f[1]); v.y = pack2(f[2], f[3]); v.z = pack2(f[4], f[5]); v.w = pack2(f[6], f[7]);
    *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions (blockDim.x a multiple of 32); every thread gets the result.
// scratch: 32 floats of shared memory; the leading barrier lets callers reuse it back to back.
__device__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_sum(lane < nw ? scratch[lane] : 0.f);
}
// rsqrt(mean(row ** 2) + eps) of one bf16 row (width % 8 == 0, 16-byte aligned), for the whole
// block: every thread calls it and gets the same value.
__device__ float row_inv_rms(const bf16_t* row, int width, float eps, float* scratch) {
    float ss = 0.f;
    for (int c = threadIdx.x * 8; c < width; c += blockDim.x * 8) {
        float f[8];
        load8(row + c, f);
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
    }
    ss = block_sum(ss, scratch);
    return rsqrtf(ss / (float)width + eps);
}
__device__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return warp_max(lane < nw ? scratch[lane] : -VT_INF);
}

// (value, index) argmax with ties to the lower index.
__device__ __forceinline__ bool better(float v, int i, float bv, int bi) {
    return v > bv || (v == bv && i < bi);
}
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, v, o);
        int oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}
// scratch_v / scratch_i: 32 entries each of shared memory.
__device__ void block_argmax(float& v, int& i, float* scratch_v, int* scratch_i) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) { scratch_v[warp] = v; scratch_i[warp] = i; }
    __syncthreads();
    v = lane < nw ? scratch_v[lane] : -VT_INF;
    i = lane < nw ? scratch_i[lane] : 0x7fffffff;
    warp_argmax(v, i);
}

// Programmatic dependent launch (sm_90+; no-ops where the grid was launched plainly).
// grid_dependents_go: the kernels launched after this one as dependents may start now.
// grid_dependency_wait: everything the kernel before wrote is visible after this returns.
__device__ __forceinline__ void grid_dependents_go() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Where a block of the paged attention grid sits (x = row tile, y = kv head, z = sequence *
// num_splits; rows are (token, GQA head) pairs of one kv head), and the key tiles of `kt` keys
// it covers: up to the position of its last row, this split's share of them.
// longest_first: x counts row tiles from the last one, so that the blocks the chip starts first
// are the ones with the most keys (causal prefill: later rows see more keys) and the grid ends on
// short blocks instead of waiting for long ones started last.
struct AttnBlock {
    int group, kh, b, split, q0, qlen, ctx, nrows, row0, kv_end, tile0, tile1;
};
// The chunking of a block's keys: ntiles tiles of kt keys up to kv_end, split s taking tiles
// [s * chunk, min(ntiles, (s + 1) * chunk)). attention_combine_k repeats it to find the splits
// of a decode row that hold keys.
struct KeyChunks {
    int ntiles, chunk;
};
__device__ __forceinline__ KeyChunks key_chunks(int kv_end, int kt, int num_splits) {
    const int ntiles = (kv_end + kt - 1) / kt;
    return {ntiles, (ntiles + num_splits - 1) / num_splits};
}
// A block's keys once its rows are set: the last row's causal limit and its split's key tiles.
__device__ __forceinline__ void attn_block_keys(AttnBlock& a, int rows_per_block, int kt, int num_splits) {
    const int last_row = min(a.row0 + rows_per_block, a.nrows) - 1;
    a.kv_end = min(a.ctx, a.ctx - a.qlen + last_row / a.group + 1);
    const KeyChunks c = key_chunks(a.kv_end, kt, num_splits);
    a.tile0 = a.split * c.chunk;
    a.tile1 = min(c.ntiles, a.tile0 + c.chunk);
}
__device__ __forceinline__ AttnBlock attn_block(const int* query_start_loc, const int* seq_lens, int hq, int hk,
                                                int num_splits, int rows_per_block, int kt,
                                                bool longest_first = false) {
    AttnBlock a;
    a.group = hq / hk;
    a.kh = blockIdx.y;
    a.b = blockIdx.z / num_splits;
    a.split = blockIdx.z % num_splits;
    a.q0 = query_start_loc[a.b];
    a.qlen = query_start_loc[a.b + 1] - a.q0;
    a.ctx = seq_lens[a.b];
    a.nrows = a.qlen * a.group;
    a.row0 = (longest_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * rows_per_block;
    attn_block_keys(a, rows_per_block, kt, num_splits);
    return a;
}
// The same for item i of a kernel that loops over its blocks (persistent): items run longest
// first over the whole launch, row tile row_tiles - 1 of every (kv head, sequence x split) before
// row tile row_tiles - 2 of any, so that a block's items come out of one descending list.
__device__ __forceinline__ AttnBlock attn_item(const int* query_start_loc, const int* seq_lens, int hq, int hk,
                                               int num_splits, int rows_per_block, int kt, int row_tiles,
                                               int zcount, int i) {
    const int per = hk * zcount, rest = i % per;
    AttnBlock a;
    a.group = hq / hk;
    a.kh = rest % hk;
    const int z = rest / hk;
    a.b = z / num_splits;
    a.split = z % num_splits;
    a.q0 = query_start_loc[a.b];
    a.qlen = query_start_loc[a.b + 1] - a.q0;
    a.ctx = seq_lens[a.b];
    a.nrows = a.qlen * a.group;
    a.row0 = (row_tiles - 1 - i / per) * rows_per_block;
    attn_block_keys(a, rows_per_block, kt, num_splits);
    return a;
}
// A tensor-core prompt kernel's place as locals (the kernel's ATTN_TC_PARAMS in scope), longest
// blocks first; a block past its sequence's rows returns from the kernel.
#define ATTN_BLOCK_LOCALS(ROWS, KT)                                                                   \
    const AttnBlock ab = attn_block(query_start_loc, seq_lens, hq, hk, num_splits, ROWS, KT, true);  \
    if (ab.row0 >= ab.nrows) return;                                                                  \
    const int group = ab.group, kh = ab.kh, b = ab.b, split = ab.split, q0 = ab.q0, qlen = ab.qlen;   \
    const int ctx = ab.ctx, nrows = ab.nrows, row0 = ab.row0, kv_end = ab.kv_end

// ---- e4m3 (fp8) codes: the fp8 GEMMs' activations (fp8.cu) and the fp8 KV cache --------------
// float -> e4m3 bits, nearest even, finite values saturated to +-448, NaN kept a NaN. The software
// path is the definition (and what the host simulator runs); sm_89+ converts two values an
// instruction, which rounds the same way.
__device__ __forceinline__ unsigned int f2e4m3(float f) {
    const unsigned int u = __float_as_uint(f);
    const unsigned int sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (a >= 0x43e00000u) return sign | 0x7eu;                 // >= 448: the largest finite e4m3
    if (a < 0x3c800000u) {                                     // below 2^-6: subnormal steps of 2^-9
        return sign | (unsigned int)rintf(__uint_as_float(a) * 512.f);
    }
    const unsigned int r = a + 0x7ffffu + ((a >> 20) & 1u);   // round the 23-bit mantissa to 3 bits
    return sign | ((r >> 20) - (120u << 3));                   // rebias the exponent: 127 -> 7
}

// The n of a row rounded to e4m3 x 2^n: the smallest integer with amax <= 448 x 2^n, clamped to
// +-100 (0 for a zero row). 448 = 1.75 x 2^8: amax = (1 + f) 2^e needs e - 8, or e - 7 when f > 0.75.
__device__ __forceinline__ int e4m3_pow2_exponent(float amax) {
    const unsigned bits = __float_as_uint(amax);
    const int n = amax > 0.f ? (int)((bits >> 23) & 255u) - 127 - 8 + ((bits & 0x7FFFFFu) > 0x600000u) : 0;
    return max(-100, min(100, n));
}

// 2^n as a float, for |n| <= 126.
__device__ __forceinline__ float pow2f(int n) { return __uint_as_float((unsigned)(127 + n) << 23); }

__device__ __forceinline__ unsigned int pack4_e4m3(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
    return (unsigned int)lo | ((unsigned int)hi << 16);
#else
    return f2e4m3(a) | (f2e4m3(b) << 8) | (f2e4m3(c) << 16) | (f2e4m3(d) << 24);
#endif
}

// a * b per bf16 lane, rounded to nearest even: fma with -0 (exact products stay exact, and a
// zero product keeps its sign). The host simulator's path is the definition.
__device__ __forceinline__ unsigned int mul_bf16x2(unsigned int a, unsigned int b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned int d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
#else
    return pack2(lo_f(a) * lo_f(b), hi_f(a) * hi_f(b));
#endif
}

// Two e4m3 codes, each in the high byte of a 16-bit half (s eeee mmm, then 8 zero bits), -> the
// bf16 pair word of their values, exactly: the sign stays, the exponent and mantissa bits shift
// down by 4 into bf16's (exponent field e, mantissa m << 4: 2^(e - 127) (1 + m / 8), or for e = 0
// the bf16 subnormal m 2^-129), and one multiply by 2^120 rebiases (to 2^(e - 7) (1 + m / 8), and
// m 2^-9 for e4m3's subnormals). Integer ops and one bf16 FMA: the conversion unit (a quarter of the
// ALUs' rate, which e4m3 -> f16 -> f32 -> bf16 took three times a pair) is not touched, so reading
// an fp8 KV cache is not bound by it. The NaN codes (0x7f, 0xff) read as +-480: the cache never
// holds them (its writes saturate finite values; a NaN k or v is already a broken model).
__device__ __forceinline__ unsigned int e4m3_hi_to_bf16x2(unsigned int t) {
    return mul_bf16x2(((t >> 4) & 0x07f007f0u) | (t & 0x80008000u), 0x7b807b80u);  // 0x7b80: 2^120
}

// Four codes in a word (the lower address in the low byte) -> two bf16 pair words (elements 0, 1
// and 2, 3).
__device__ __forceinline__ uint2 e4m3x4_to_bf16x4(unsigned int four) {
    return make_uint2(e4m3_hi_to_bf16x2(((four & 0xffu) << 8) | ((four & 0xff00u) << 16)),
                      e4m3_hi_to_bf16x2(((four >> 8) & 0xff00u) | (four & 0xff000000u)));
}

// 8 floats -> 8 e4m3 codes of f / scale (nearest even, saturated) in one 8-byte store: what the
// fp8 KV cache holds (vLLM divides by the scale; IEEE division, so the codes match numpy's).
__device__ __forceinline__ void store8_e4m3_div(unsigned char* p, const float* f, float scale) {
    uint2 w;
    w.x = pack4_e4m3(__fdiv_rn(f[0], scale), __fdiv_rn(f[1], scale), __fdiv_rn(f[2], scale), __fdiv_rn(f[3], scale));
    w.y = pack4_e4m3(__fdiv_rn(f[4], scale), __fdiv_rn(f[5], scale), __fdiv_rn(f[6], scale), __fdiv_rn(f[7], scale));
    *reinterpret_cast<uint2*>(p) = w;
}
