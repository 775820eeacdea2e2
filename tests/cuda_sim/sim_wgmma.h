// Host versions of vt/kernels/wgmma.cu's wrappers. Shared-window addresses are offsets into the
// simulator's shared buffer (1024-aligned, as the swizzle needs). A wgmma runs at once, when the
// last of its warpgroup's 128 threads reaches it: the K-major, 128-byte-swizzled operands are read
// through their descriptors (element (r, k) at start + (r / 8) * SBO + (r % 8) * 128 + 2 k, with
// bits 4-6 of the address XORed by bits 7-9), and every thread's accumulators are written as the
// m64nNk16 layout in wgmma.cu describes. Only the descriptors wgmma.cu builds are accepted.
// The register-A form (WgmmaRATB) keeps a pointer to each thread's four A registers and reads
// them when the product runs: at issue, or late at its wait, so registers changed before the
// wait show.
#pragma once

typedef unsigned long long u64_t;

inline unsigned smem_u32(const void* p) {
    return (unsigned)(static_cast<const unsigned char*>(p) - sim::g_smem);
}
inline unsigned char* sim_smem(unsigned addr) { return sim::g_smem + addr; }

inline void cp_async16_u32(unsigned dst, const void* src, int src_bytes) {
    cp_async16(sim_smem(dst), src, src_bytes != 0);
}

inline u64_t sw128_desc(unsigned addr) {
    return (u64_t)((addr & 0x3FFFF) >> 4) | ((u64_t)1 << 16) | ((u64_t)(1024 >> 4) << 32) | ((u64_t)1 << 62);
}
inline unsigned sw128_at(unsigned base, int r, int ch) { return base + r * 128 + ((ch ^ (r & 7)) << 4); }
inline u64_t sw128_mn_desc(unsigned addr, unsigned lbo) {
    return (u64_t)((addr & 0x3FFFF) >> 4) | ((u64_t)((lbo & 0x3FFFF) >> 4) << 16) | ((u64_t)(1024 >> 4) << 32) |
           ((u64_t)1 << 62);
}

// A warpgroup's wgmma in flight: its product runs at issue or, late, at the wait that needs it.
struct SimWgmma {
    void (*run)(const SimWgmma&);
    u64_t a, b;
    int scale_d;
    float* acc[128];
    const unsigned* areg[128];  // register A: each thread's a[0..3]; else unused
};
struct SimWgmmaQueue {
    std::vector<SimWgmma> open;
    std::deque<std::vector<SimWgmma>> groups;
    unsigned long long serial = 0;
};
inline SimWgmmaQueue& sim_wg_queue(int wg) {
    static SimWgmmaQueue q[8];
    SimWgmmaQueue& mine = q[wg];
    if (mine.serial != sim::block()->serial) {  // a new block: nothing of the last one is in flight
        mine = SimWgmmaQueue{};
        mine.serial = sim::block()->serial;
    }
    return mine;
}

inline void wgmma_fence() {}
inline void wgmma_commit() {
    const int wg = (int)sim::me().tid.x / 128;
    sim::group_barrier(40 + wg, 128, [wg] {
        SimWgmmaQueue& q = sim_wg_queue(wg);
        q.groups.push_back(std::move(q.open));
        q.open.clear();
    });
}
template <int N>
inline void wgmma_wait() {
    const int wg = (int)sim::me().tid.x / 128;
    sim::group_barrier(48 + wg, 128, [wg] {
        SimWgmmaQueue& q = sim_wg_queue(wg);
        while (q.groups.size() > (size_t)N) {
            for (const SimWgmma& w : q.groups.front()) w.run(w);
            q.groups.pop_front();
        }
    });
}
inline void fence_proxy_async() {}
inline void bar_sync(int id, int count) { sim::group_barrier(id, count, nullptr); }
inline void bar_arrive(int id, int count) { sim::group_arrive(id, count); }
// setmaxnreg: registers are the host's, nothing to move.
template <int N>
inline void warpgroup_regs_dec() {}
template <int N>
inline void warpgroup_regs_inc() {}
inline void st_shared_u32(unsigned addr, unsigned v) { std::memcpy(sim_smem(addr), &v, 4); }

inline void st_cg4(float* p, float a, float b, float c, float d) { p[0] = a; p[1] = b; p[2] = c; p[3] = d; }
inline bf16_t round_bf16(float v) { return f2bf(v); }

// bf16 element (r, k) of a swizzled K-major operand described by desc.
inline float sim_operand(u64_t desc, int r, int k) {
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    const unsigned lin = start + (unsigned)(r / 8) * sbo + (unsigned)(r % 8) * 128 + 2u * (unsigned)k;
    const unsigned phys = lin ^ (((lin >> 7) & 7u) << 4);
    uint16_t h;
    std::memcpy(&h, sim_smem(phys), 2);
    return __uint_as_float((uint32_t)h << 16);
}

// bf16 element (n, k) of an N-major swizzled operand (sw128_mn_desc): the 64 n of one k in a
// 128-byte row, 8 rows of k an atom, next 8 k at the stride offset, next 64 n at the leading one.
inline float sim_operand_mn(u64_t desc, int n, int k) {
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned lbo = (unsigned)((desc >> 16) & 0x3FFF) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    const unsigned lin = start + (unsigned)(n / 64) * lbo + (unsigned)(k / 8) * sbo + (unsigned)(k % 8) * 128 +
                         2u * (unsigned)(n % 64);
    const unsigned phys = lin ^ (((lin >> 7) & 7u) << 4);
    uint16_t h;
    std::memcpy(&h, sim_smem(phys), 2);
    return __uint_as_float((uint32_t)h << 16);
}

inline void sim_check_mn_desc(u64_t desc) {
    const bool ok = ((desc >> 16) & 0x3FFF) != 0 && ((desc >> 32) & 0x3FFF) == (1024 >> 4) && (desc >> 62) == 1 &&
                    ((desc >> 49) & 7) == 0;
    if (!ok) {
        std::fprintf(stderr, "cuda_sim: an N-major wgmma descriptor other than sw128_mn_desc's\n");
        std::abort();
    }
}

inline void sim_check_desc(u64_t desc) {
    const bool ok = ((desc >> 16) & 0x3FFF) == 1 && ((desc >> 32) & 0x3FFF) == (1024 >> 4) && (desc >> 62) == 1 &&
                    ((desc >> 49) & 7) == 0;
    if (!ok) {
        std::fprintf(stderr, "cuda_sim: a wgmma descriptor other than sw128_desc's (K-major, 128-byte swizzle)\n");
        std::abort();
    }
}

// d (+)= A B^T for a wgmma whose A has been read: B through its descriptor, every thread's
// accumulators in the m64nNk16 layout.
// d (+)= A B^T of one k-step of K, both operands read: every thread's accumulators in the m64nN layout.
template <int N, int K>
inline void sim_wgmma_accumulate(const float (&A)[64][K], const float (&B)[N][K], const SimWgmma& w) {
    for (int t = 0; t < 128; ++t) {
        float* acc = w.acc[t];
        for (int j = 0; j < N / 2; ++j) {
            const int row = 16 * (t / 32) + (t % 32) / 4 + 8 * ((j / 2) % 2);
            const int col = 8 * (j / 4) + 2 * (t % 4) + j % 2;
            float s = 0.f;
            for (int k = 0; k < K; ++k) s += A[row][k] * B[col][k];
            acc[j] = (w.scale_d ? acc[j] : 0.f) + s;
        }
    }
}

template <int N, bool TB>
inline void sim_wgmma_product(const float (&A)[64][16], const SimWgmma& w) {
    float B[N][16];
    for (int n = 0; n < N; ++n)
        for (int k = 0; k < 16; ++k) B[n][k] = TB ? sim_operand_mn(w.b, n, k) : sim_operand(w.b, n, k);
    sim_wgmma_accumulate<N, 16>(A, B, w);
}

// A warpgroup's wgmma from descriptors: queued (late) or run at once, when its last thread arrives.
inline void sim_wgmma_issue(void (*run)(const SimWgmma&), float* d, u64_t a, u64_t b, int scale_d) {
    sim::Block* blk = sim::block();
    const int tid = (int)sim::me().tid.x, wg = tid / 128;
    blk->wg_acc[tid] = d;
    sim::group_barrier(32 + wg, 128, [&] {
        SimWgmma w{run, a, b, scale_d, {}, {}};
        for (int t = 0; t < 128; ++t) w.acc[t] = blk->wg_acc[wg * 128 + t];
        if (sim::timing().late_wgmma) sim_wg_queue(wg).open.push_back(w);
        else run(w);
    });
}

template <int N, bool TB>
struct SimWgmmaOf {
    static void run(const SimWgmma& w) {
        sim_check_desc(w.a);
        if (TB) sim_check_mn_desc(w.b);
        else sim_check_desc(w.b);
        float A[64][16];
        for (int r = 0; r < 64; ++r)
            for (int k = 0; k < 16; ++k) A[r][k] = sim_operand(w.a, r, k);
        sim_wgmma_product<N, TB>(A, w);
    }
    static void mma(float* d, u64_t a, u64_t b, int scale_d) { sim_wgmma_issue(run, d, a, b, scale_d); }
    static void pin(float*) {}
};
template <int N>
struct Wgmma : SimWgmmaOf<N, false> {};
template <int N>
struct WgmmaTB : SimWgmmaOf<N, true> {};

// The register-A form: A [64][16] from the warpgroup's registers, thread t (warp w = t / 32,
// g = (t % 32) / 4, c = t % 4) holding a[0] = (16 w + g, k 2c..2c+1), a[1] = (16 w + g + 8, same),
// a[2] = (16 w + g, k 8 + 2c..), a[3] = (16 w + g + 8, k 8 + 2c..), the lower k in the low half.
template <int N, bool TB>
struct SimWgmmaRegA {
    static void run(const SimWgmma& w) {
        if (TB) sim_check_mn_desc(w.b);
        else sim_check_desc(w.b);
        float A[64][16];
        for (int t = 0; t < 128; ++t) {
            const int r = 16 * (t / 32) + (t % 32) / 4, c = t % 4;
            for (int i = 0; i < 4; ++i) {
                const int row = r + 8 * (i % 2), k = 8 * (i / 2) + 2 * c;
                A[row][k] = __uint_as_float(w.areg[t][i] << 16);
                A[row][k + 1] = __uint_as_float(w.areg[t][i] & 0xffff0000u);
            }
        }
        sim_wgmma_product<N, TB>(A, w);
    }
    static void mma(float* d, const unsigned* a, u64_t b, int scale_d) {
        sim::Block* blk = sim::block();
        const int tid = (int)sim::me().tid.x, wg = tid / 128;
        blk->wg_acc[tid] = d;
        blk->wg_areg[tid] = a;
        sim::group_barrier(32 + wg, 128, [&] {
            SimWgmma w{run, 0, b, scale_d, {}, {}};
            for (int t = 0; t < 128; ++t) {
                w.acc[t] = blk->wg_acc[wg * 128 + t];
                w.areg[t] = blk->wg_areg[wg * 128 + t];
            }
            if (sim::timing().late_wgmma) sim_wg_queue(wg).open.push_back(w);
            else run(w);
        });
    }
    static void pin(float*) {}
};
template <int N>
struct WgmmaRATB : SimWgmmaRegA<N, true> {};
template <int N>
struct WgmmaRA : SimWgmmaRegA<N, false> {};

// e4m3 code -> float (the format's finite values; the kernels never hold the NaN codes).
inline float sim_e4m3(unsigned char c) {
    const int sign = c >> 7, e = (c >> 3) & 15, m = c & 7;
    const float v = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
    return sign ? -v : v;
}

// e4m3 element (r, k) of a swizzled K-major operand described by desc (a byte an element).
inline float sim_operand_e4m3(u64_t desc, int r, int k) {
    const unsigned start = (unsigned)(desc & 0x3FFF) << 4;
    const unsigned sbo = (unsigned)((desc >> 32) & 0x3FFF) << 4;
    const unsigned lin = start + (unsigned)(r / 8) * sbo + (unsigned)(r % 8) * 128 + (unsigned)k;
    const unsigned phys = lin ^ (((lin >> 7) & 7u) << 4);
    return sim_e4m3(*sim_smem(phys));
}

// The e4m3 form: A [64][32] and B [N][32] codes through their descriptors, the same accumulator
// layout as the bf16 forms.
template <int N>
struct WgmmaE4M3 {
    static void run(const SimWgmma& w) {
        sim_check_desc(w.a);
        sim_check_desc(w.b);
        static float A[64][32], B[N][32];
        for (int r = 0; r < 64; ++r)
            for (int k = 0; k < 32; ++k) A[r][k] = sim_operand_e4m3(w.a, r, k);
        for (int n = 0; n < N; ++n)
            for (int k = 0; k < 32; ++k) B[n][k] = sim_operand_e4m3(w.b, n, k);
        sim_wgmma_accumulate<N, 32>(A, B, w);
    }
    static void mma(float* d, u64_t a, u64_t b, int scale_d) { sim_wgmma_issue(run, d, a, b, scale_d); }
    static void pin(float*) {}
};
