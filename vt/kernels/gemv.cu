// Decode GEMVs: 1-16 tokens against a row-major weight, bf16 or fp8 (e4m3 with scales). At a few
// rows a projection is a stream of its weight, and cuBLAS' kernels read it at 60-80% of copy
// bandwidth at some shapes (bench/NOTES_CUDA.md); here each block owns 16 weight rows and its 8
// warps split k, each warp keeping GEMV_UNROLL_* 16-byte loads of both row halves in flight.
//
// The products run on mma.sync with the weight rows as A (16 rows) and the tokens as B (8 a tile),
// so nothing is converted by hand. A chunk is 64 bytes of a row: lane l (g = l / 4, l4 = l % 4)
// loads bytes 16 l4 .. 16 l4 + 15 of chunk c of rows g and g + 8, and the same bytes of token g's
// row. The MMA fragments only need A and B to share one order of k, so those 16 bytes go straight
// into the registers: words 0-1 feed the chunk's first MMA and words 2-3 its second (fp8:
// m16n8k32, 64 k a chunk; bf16: m16n8k16, 32 k a chunk).
//
// fp8 scales: channel (block == 0): xs[t] per token, ws[n] per row, applied to the whole sum;
// block (block == 1): xs[g * xs_ld + t] per 128 columns (group-major) and ws[(n / 128) * ws_ld + g]
// per 128x128 block, applied to each chunk's product. Every chunk's product starts from zero and
// joins the running sum in f32 (as the numpy twins' f32 sums do).

#define GEMV_WARPS 8
#define GEMV_ROWS 16
// Chunks a warp loads before it computes (bf16, fp8), and the blocks an SM should hold (registers
// permitting). H100, 8B shapes, 1 and 8 tokens (bench/probes/gemv.py --sweep, 2026-12-06): bf16 8
// beat 4 by ~1 us on each of qkv, o_proj and down; fp8 at 2, 4 or 8 with 2 blocks an SM were
// within the run-to-run spread (1-2 us), 8 with 1 block lost 2-10 us. --sweep compiles others.
#ifndef GEMV_UNROLL_BF16
#define GEMV_UNROLL_BF16 8
#endif
#ifndef GEMV_UNROLL_FP8
#define GEMV_UNROLL_FP8 4
#endif
#ifndef GEMV_MIN_BLOCKS
#define GEMV_MIN_BLOCKS 1
#endif
// fp8's one-tile kernel (1-8 tokens) at three blocks an SM: 80 registers, no spills, so an 8B qkv's
// 384 blocks run in one wave of 396 rather than 1.45 waves of 264. The two-tile kernel spills at
// that bound and keeps GEMV_MIN_BLOCKS.
#ifndef GEMV_MIN_BLOCKS_FP8_8
#define GEMV_MIN_BLOCKS_FP8_8 3
#endif

struct GemvScales {  // fp8 only; all null for bf16
    const float* xs;
    int xs_ld;
    const float* ws;
    int ws_ld;
    int block;
};

template <int TILES, bool FP8, int UNROLL>
__device__ __forceinline__ void gemv(const unsigned char* __restrict__ x, long long x_row_bytes,
                                     const unsigned char* __restrict__ w, long long w_row_bytes,
                                     GemvScales sc, const bf16_t* __restrict__ bias, bf16_t* __restrict__ y,
                                     int ldy, int tokens, int n, int chunks, int accumulate) {
    __shared__ float part[GEMV_WARPS][GEMV_ROWS][16];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, l4 = lane % 4;
    const int n0 = blockIdx.x * GEMV_ROWS;
    const uint4* wa = reinterpret_cast<const uint4*>(w + min(n0 + g, n - 1) * w_row_bytes) + l4;
    const uint4* wb = reinterpret_cast<const uint4*>(w + min(n0 + g + 8, n - 1) * w_row_bytes) + l4;
    const uint4* xr[TILES];
    for (int j = 0; j < TILES; ++j) {
        xr[j] = reinterpret_cast<const uint4*>(x + min(g + 8 * j, tokens - 1) * x_row_bytes) + l4;
    }
    float acc[TILES][4];
    for (int j = 0; j < TILES; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    uint4 a[UNROLL], b[UNROLL];
    auto load_weights = [&](int c0) {
        for (int u = 0; u < UNROLL; ++u) {
            const bool in = c0 + u < chunks;
            a[u] = in ? wa[(c0 + u) * 4] : zero;
            b[u] = in ? wb[(c0 + u) * 4] : zero;
        }
    };
    // Launched as a programmatic dependent, the kernel starts while the one before (the norm,
    // SiLU-mul or quantization that makes x) still runs: the weights do not come from it, so the
    // first round of them streams in before the wait.
    const int first = warp * UNROLL;
    grid_dependents_go();  // the next layer's GEMV (bf16: x is the residual stream) may start too
    load_weights(first);
    grid_dependency_wait();
    for (int c0 = first; c0 < chunks; c0 += GEMV_WARPS * UNROLL) {
        if (c0 != first) load_weights(c0);
        uint4 xv[TILES][UNROLL];
        for (int u = 0; u < UNROLL; ++u) {
            for (int j = 0; j < TILES; ++j) {
                xv[j][u] = c0 + u < chunks && g + 8 * j < tokens ? xr[j][(c0 + u) * 4] : zero;
            }
        }
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u;
            if (c >= chunks) break;
            const unsigned int lo[4] = {a[u].x, b[u].x, a[u].y, b[u].y};
            const unsigned int hi[4] = {a[u].z, b[u].z, a[u].w, b[u].w};
            const float wf = FP8 && sc.block ? sc.ws[(size_t)(n0 / 128) * sc.ws_ld + c / 2] : 1.f;
            for (int j = 0; j < TILES; ++j) {
                float d[4] = {0.f, 0.f, 0.f, 0.f};
                if constexpr (FP8) {
                    mma_e4m3(d, lo, xv[j][u].x, xv[j][u].y);
                    mma_e4m3(d, hi, xv[j][u].z, xv[j][u].w);
                } else {
                    mma_bf16(d, lo, xv[j][u].x, xv[j][u].y);
                    mma_bf16(d, hi, xv[j][u].z, xv[j][u].w);
                }
                float f0 = 1.f, f1 = 1.f;
                if (FP8 && sc.block) {  // 64 columns a chunk: chunk c lies in 128-column group c / 2
                    const int t0 = 8 * j + 2 * l4;
                    f0 = t0 < tokens ? sc.xs[(size_t)(c / 2) * sc.xs_ld + t0] * wf : 0.f;
                    f1 = t0 + 1 < tokens ? sc.xs[(size_t)(c / 2) * sc.xs_ld + t0 + 1] * wf : 0.f;
                }
                acc[j][0] += d[0] * f0;
                acc[j][1] += d[1] * f1;
                acc[j][2] += d[2] * f0;
                acc[j][3] += d[3] * f1;
            }
        }
    }
    // C fragment: e = 0, 1 -> row g, tokens 2 l4 and 2 l4 + 1 of tile j; e = 2, 3 -> row g + 8.
    for (int j = 0; j < TILES; ++j) {
        for (int e = 0; e < 4; ++e) part[warp][g + 8 * (e / 2)][8 * j + 2 * l4 + (e % 2)] = acc[j][e];
    }
    __syncthreads();
    const int row = threadIdx.x % GEMV_ROWS, t = threadIdx.x / GEMV_ROWS, col = n0 + row;
    if (t >= tokens || t >= 8 * TILES || col >= n) return;
    float s = 0.f;
    for (int v = 0; v < GEMV_WARPS; ++v) s += part[v][row][t];
    if (FP8 && !sc.block) s *= sc.xs[t] * sc.ws[col];
    if (bias != nullptr) s += bf2f(bias[col]);
    bf16_t* out = y + (size_t)t * ldy + col;
    if (accumulate) s += bf2f(*out);
    *out = f2bf(s);
}

// Grid: ceil(n / 16) blocks of 256 threads; *8_k take up to 8 tokens, *16_k up to 16.
// fp8: xq e4m3 [tokens, k] (row stride k), wq e4m3 [n, k]; k a multiple of 64 (128 with block).
#define GEMV_FP8_ENTRY(NAME, TILES, MIN_BLOCKS)                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, MIN_BLOCKS) NAME(                       \
        const unsigned char* __restrict__ xq, const float* __restrict__ xs, int xs_ld,                     \
        const unsigned char* __restrict__ wq, const float* __restrict__ ws, int ws_ld,                     \
        bf16_t* __restrict__ y, int ldy, int tokens, int n, int k, int block, int accumulate) {            \
        gemv<TILES, true, GEMV_UNROLL_FP8>(xq, k, wq, k, GemvScales{xs, xs_ld, ws, ws_ld, block}, nullptr, \
                                           y, ldy, tokens, n, k / 64, accumulate);                         \
    }
GEMV_FP8_ENTRY(gemv_fp8_8_k, 1, GEMV_MIN_BLOCKS_FP8_8)
GEMV_FP8_ENTRY(gemv_fp8_16_k, 2, GEMV_MIN_BLOCKS)

// bf16: x [tokens, k] (row stride ldx elements, 16-byte aligned rows), w [n, k] row-major; k a
// multiple of 32; bias [n] or null.
#define GEMV_BF16_ENTRY(NAME, TILES)                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32, GEMV_MIN_BLOCKS) NAME(                  \
        const bf16_t* __restrict__ x, int ldx, const bf16_t* __restrict__ w,                               \
        const bf16_t* __restrict__ bias, bf16_t* __restrict__ y, int ldy, int tokens, int n, int k,        \
        int accumulate) {                                                                                  \
        gemv<TILES, false, GEMV_UNROLL_BF16>(reinterpret_cast<const unsigned char*>(x), 2LL * ldx,         \
                                             reinterpret_cast<const unsigned char*>(w), 2LL * k,           \
                                             GemvScales{nullptr, 0, nullptr, 0, 0}, bias, y, ldy, tokens,  \
                                             n, k / 32, accumulate);                                       \
    }
GEMV_BF16_ENTRY(gemv_bf16_8_k, 1)
GEMV_BF16_ENTRY(gemv_bf16_16_k, 2)
