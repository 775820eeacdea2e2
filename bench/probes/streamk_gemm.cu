// A probe, not used by vt: decode GEMM y[M, N] (+)= x[M, K] . w[N, K]^T for few rows M
// (tokens), streaming the weight with every SM busy. Hopper wgmma, weights as the A side (two
// warpgroups, 64 rows each), tokens as the B side (N = NP, the padded token count), both K-major
// in shared memory with the 128-byte swizzle. bench/gemm_decode.py compares it with cuBLAS;
// bench/NOTES_CUDA.md has the figures and why it was not adopted.
//
// Work is split stream-K: a unit is (tile of 128 weight rows, 64 k); the grid's CTAs each take
// an equal run of consecutive units (tile-major), so every SM streams the same number of bytes.
// A tile covered by one CTA is written directly; a tile split between CTAs is summed by the
// last of its parts to arrive, every part in k order (deterministic), the others' fp32
// partials read from the workspace. Counters are reset by that last part, so a captured graph
// can replay the launch.
//
// Loads are cp.async by all 256 threads, STAGES units deep (STAGES - 2 ahead of the unit being
// multiplied: one more stage may still be read by the wgmma group in flight).
// Compiled for sm_90a (wgmma) after vt/kernels/tensor_core.cu and wgmma.cu, whose wrappers it calls.

#define SK_THREADS 256
#define SK_BW 128                // weight rows per tile: a 64-row slab per warpgroup
#define SK_BK 64                 // k per unit: one 128-byte swizzle row of bf16
#define SK_W_BYTES (SK_BW * 128)

// Which CTA's run holds unit u, runs being [g U / G, (g + 1) U / G); the grid is at most U
// CTAs, so no run is empty and the owners of a tile's first and last units bound its parts.
__device__ __forceinline__ int owner_of(long long u, long long units, int ctas) {
    return (int)(((u + 1) * ctas + units - 1) / units) - 1;
}
__device__ __forceinline__ long long run_start(int g, long long units, int ctas) {
    return (long long)g * units / ctas;
}

// A stage: the weight tile [128 rows x 128 B], then the x tile [NP rows x 128 B].
__device__ __forceinline__ void load_w(unsigned stage, const bf16_t* __restrict__ w, int k, int tile, int chunk) {
    const bf16_t* wt = w + (size_t)tile * SK_BW * k + chunk * SK_BK;
#pragma unroll
    for (int i = 0; i < SK_W_BYTES / 16 / SK_THREADS; ++i) {
        const int idx = threadIdx.x + i * SK_THREADS, r = idx >> 3, ch = idx & 7;
        cp_async16_u32(sw128_at(stage, r, ch), wt + (size_t)r * k + ch * 8, 16);
    }
}

template <int NP>
__device__ __forceinline__ void load_x(unsigned stage, const bf16_t* __restrict__ x, int m, int ldx, int chunk) {
    const unsigned xs = stage + SK_W_BYTES;
    const bf16_t* xt = x + chunk * SK_BK;
#pragma unroll
    for (int i = 0; i < (NP * 8 + SK_THREADS - 1) / SK_THREADS; ++i) {
        const int idx = threadIdx.x + i * SK_THREADS, r = idx >> 3, ch = idx & 7;
        if (idx < NP * 8) {
            const bool real = r < m;  // padding token rows are zero-filled, never read
            cp_async16_u32(sw128_at(xs, r, ch), real ? (const void*)(xt + (size_t)r * ldx + ch * 8) : (const void*)x,
                       real ? 16 : 0);
        }
    }
}

// Accumulator element j of a thread: weight row (of its warpgroup's 64) and token.
__device__ __forceinline__ int acc_row(int j) { return ((threadIdx.x & 127) >> 5) * 16 + ((threadIdx.x & 31) >> 2) + ((j >> 1) & 1) * 8; }
__device__ __forceinline__ int acc_tok(int j) { return (j >> 2) * 8 + (threadIdx.x & 3) * 2 + (j & 1); }

template <int NP>
__device__ __forceinline__ void store_tile(const float* acc, bf16_t* __restrict__ y, int ldy, int m, int tile,
                                           int accumulate) {
    const int row0 = tile * SK_BW + (threadIdx.x >> 7) * 64;
#pragma unroll
    for (int j = 0; j < NP / 2; ++j) {
        const int t = acc_tok(j);
        if (t < m) {
            bf16_t* p = y + (size_t)t * ldy + row0 + acc_row(j);
            *p = round_bf16(accumulate ? acc[j] + bf2f(*p) : acc[j]);
        }
    }
}

template <int NP, int STAGES>
__device__ __forceinline__ void gemm_streamk(const bf16_t* __restrict__ w, const bf16_t* __restrict__ x,
                                             bf16_t* __restrict__ y, float* __restrict__ partials,
                                             int* __restrict__ counters, int m, int n, int k, int ldx, int ldy,
                                             int accumulate) {
    extern __shared__ unsigned char sk_smem[];
    constexpr int STAGE_BYTES = SK_W_BYTES + NP * 128;
    constexpr int ACC = NP / 2;
    __shared__ int s_last;
    const unsigned base = (smem_u32(sk_smem) + 1023u) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, g = blockIdx.x, ctas = gridDim.x;
    const int chunks = k / SK_BK;
    const long long units = (long long)(n / SK_BW) * chunks;
    const long long start = run_start(g, units, ctas), end = run_start(g + 1, units, ctas);
    const int count = (int)(end - start);

    // Launched as a programmatic dependent, this kernel may start while the one before still
    // runs: the weights do not depend on it, so they start streaming at once; x, y and the
    // workspace are touched only after the wait. Kernels after this one may start as soon as
    // they fit.
    grid_dependents_go();
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        const long long u = start + s;
        if (s < count) load_w(base + s * STAGE_BYTES, w, k, (int)(u / chunks), (int)(u % chunks));
    }
    grid_dependency_wait();
#pragma unroll
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < count) load_x<NP>(base + s * STAGE_BYTES, x, m, ldx, (int)((start + s) % chunks));
        cp_async_commit();  // group s: unit s's x (and, in group 0, every prologue weight tile)
    }

    float acc[ACC];
#pragma unroll
    for (int j = 0; j < ACC; ++j) acc[j] = 0.f;
    int i = 0;
    while (i < count) {
        // One segment: this CTA's consecutive units of one tile. The k loop carries the
        // accumulators only through wgmma, so nothing reads them while a group is in flight.
        const long long seg_begin = start + i;
        const int tile = (int)(seg_begin / chunks), chunk0 = (int)(seg_begin % chunks);
        const int seg_len = min(count - i, chunks - chunk0), seg_end = i + seg_len;
        for (; i < seg_end; ++i) {
            cp_async_wait<STAGES - 3>();
            fence_proxy_async();
            __syncthreads();
            const int ahead = i + STAGES - 2;
            if (ahead < count) {
                const long long u = start + ahead;
                const unsigned st = base + (ahead % STAGES) * STAGE_BYTES;
                load_w(st, w, k, (int)(u / chunks), (int)(u % chunks));
                load_x<NP>(st, x, m, ldx, (int)(u % chunks));
            }
            cp_async_commit();
            const unsigned st = base + (i % STAGES) * STAGE_BYTES;
            const unsigned a0 = st + wg * (64 * 128), b0 = st + SK_W_BYTES;
            const int fresh = start + i == seg_begin;
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < 4; ++kk)
                Wgmma<NP>::mma(acc, sw128_desc(a0 + kk * 32), sw128_desc(b0 + kk * 32), (fresh && kk == 0) ? 0 : 1);
            wgmma_commit();
            wgmma_wait<1>();
        }
        wgmma_wait<0>();
        Wgmma<NP>::pin(acc);
        if (seg_len == chunks) {  // the whole tile: no other CTA has a part of it
            store_tile<NP>(acc, y, ldy, m, tile, accumulate);
            continue;
        }
        // A part of a split tile. The last part to arrive sums them all, in k order (its own
        // from registers), so the result does not depend on who arrives last. The part holding
        // the tile's first k usually ends its CTA's run, after the others were handed over at
        // the start of theirs: it first looks whether they all have, and then writes nothing.
        const long long tile_u0 = (long long)tile * chunks;
        const int first_owner = owner_of(tile_u0, units, ctas), last_owner = owner_of(tile_u0 + chunks - 1, units, ctas);
        const int others = last_owner - first_owner;
        if (tid == 0) s_last = chunk0 == 0 && atomicAdd(counters + tile, 0) == others;
        __syncthreads();
        if (!s_last) {  // slot 0 holds a CTA's first part, slot 1 its last
            float* mine = partials + (size_t)(2 * g + (seg_begin == start ? 0 : 1)) * SK_BW * NP;
#pragma unroll
            for (int j = 0; j < ACC / 4; ++j)
                st_cg4(mine + (j * SK_THREADS + tid) * 4, acc[4 * j], acc[4 * j + 1], acc[4 * j + 2], acc[4 * j + 3]);
            __threadfence();
            __syncthreads();
            if (tid == 0) s_last = atomicAdd(counters + tile, 1) == others;
            __syncthreads();
            if (!s_last) continue;
        }
        if (tid == 0) counters[tile] = 0;  // every part has arrived: ready for the next launch
        __threadfence();
        float sum[ACC];
#pragma unroll
        for (int j = 0; j < ACC; ++j) sum[j] = 0.f;
        for (int h = first_owner; h <= last_owner; ++h) {
            if (h == g) {
#pragma unroll
                for (int j = 0; j < ACC; ++j) sum[j] += acc[j];
                continue;
            }
            const int slot = run_start(h, units, ctas) >= tile_u0 ? 0 : 1;
            const float4* part = reinterpret_cast<const float4*>(partials + (size_t)(2 * h + slot) * SK_BW * NP);
            // Loads issued eight at a time: one dependent L2 round trip per eight, not per float4.
#pragma unroll
            for (int j0 = 0; j0 < ACC / 4; j0 += 8) {
                float4 v[8];
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (j0 + j < ACC / 4) v[j] = __ldcg(part + (j0 + j) * SK_THREADS + tid);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    if (j0 + j < ACC / 4) {
                        float* a = sum + 4 * (j0 + j);
                        a[0] += v[j].x; a[1] += v[j].y; a[2] += v[j].z; a[3] += v[j].w;
                    }
                }
            }
        }
        store_tile<NP>(sum, y, ldy, m, tile, accumulate);
    }
    cp_async_wait<0>();
}

//@KERNELS@
