// Host versions of vt/kernels/tensor_core.cu's wrappers, by the PTX ISA's fragment layouts:
// lane l = 4 g + c. mma.m16n8k16: A regs {a0: (g, 2c..2c+1), a1: (g+8, 2c..), a2: (g, 2c+8..),
// a3: (g+8, 2c+8..)}; B regs {b0: (k 2c..2c+1, n g), b1: (k 2c+8.., n g)}; C/D {(g, 2c), (g, 2c+1),
// (g+8, 2c), (g+8, 2c+1)}. ldmatrix: lanes 8i..8i+7 give the row addresses of matrix i, and r[i]
// of lane l holds row l/4, elements 2(l%4) and 2(l%4)+1 (.trans: column l/4, rows 2(l%4) and
// 2(l%4)+1). The lower-indexed element is in the low half of a word.
#pragma once

inline float sim_bf(uint32_t w, int hi) { return __uint_as_float(hi ? (w & 0xffff0000u) : (w << 16)); }

inline unsigned int smem_addr(const void* p) { return (unsigned int)(uintptr_t)p; }

inline float ex2_ftz(float x) {
    if (std::fabs(x) < 1.17549435e-38f) x = 0.f;
    const float y = std::exp2(x);
    return y < 1.17549435e-38f ? 0.f : y;
}

inline void sim_land(const sim::Copy& c) {
    if (c.src) std::memcpy(c.dst, c.src, 16);
    else std::memset(c.dst, 0, 16);
}
inline void cp_async16(void* dst, const void* src, bool pred) {
    const sim::Copy c{dst, pred ? src : nullptr};
    if (sim::timing().late_copies) sim::me().open.push_back(c);
    else sim_land(c);
}
inline void cp_async_commit() {
    sim::Fiber& f = sim::me();
    f.groups.push_back(std::move(f.open));
    f.open.clear();
}
template <int N>
inline void cp_async_wait() {
    sim::Fiber& f = sim::me();
    while (f.groups.size() > (size_t)N) {
        for (const sim::Copy& c : f.groups.front()) sim_land(c);
        f.groups.pop_front();
    }
}

inline void sim_ldsm(unsigned int* r, const void* p, bool trans) {
    const int lane = sim::me().lane;
    sim::xptr() = p;
    const sim::XOut x = sim::xmeet();
    const int row = lane / 4, pair = lane % 4;
    for (int i = 0; i < 4; ++i) {
        if (!trans) {
            std::memcpy(&r[i], static_cast<const char*>(x.ptr[8 * i + row]) + 4 * pair, 4);
        } else {
            uint16_t lo, hi;
            std::memcpy(&lo, static_cast<const char*>(x.ptr[8 * i + 2 * pair]) + 2 * row, 2);
            std::memcpy(&hi, static_cast<const char*>(x.ptr[8 * i + 2 * pair + 1]) + 2 * row, 2);
            r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
}
inline void ldsm_x4(unsigned int* r, const void* p) { sim_ldsm(r, p, false); }
inline void ldsm_x4_t(unsigned int* r, const void* p) { sim_ldsm(r, p, true); }

// One warp's m16n8k(8E) MMA on E-element words (bf16: E = 2, e4m3: E = 4): the PTX fragment layouts
// above with k's 4E-wide halves in regs a0/a1 and a2/a3 (b0 and b1); decode(word, i) is element i of
// a word, the lower-indexed element in the low bits.
template <int E, class Decode>
inline void sim_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1, Decode decode) {
    const int lane = sim::me().lane;
    uint32_t* mine = sim::xin();
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    const sim::XOut x = sim::xmeet();
    constexpr int H = 4 * E;  // k a register covers: each half of the MMA's k
    auto A = [&](int r, int k) { return decode(x.word[4 * (r % 8) + (k % H) / E][r / 8 + 2 * (k / H)], k % E); };
    auto B = [&](int k, int n) { return decode(x.word[4 * n + (k % H) / E][4 + k / H], k % E); };
    const int g = lane / 4, cc = lane % 4;
    for (int e = 0; e < 4; ++e) {
        const int r = g + 8 * (e / 2), n = 2 * cc + (e % 2);
        float acc = 0.f;
        for (int k = 0; k < 8 * E; ++k) acc += A(r, k) * B(k, n);
        c[e] += acc;
    }
}

inline void mma_bf16(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    sim_mma<2>(c, a, b0, b1, [](uint32_t w, int i) { return sim_bf(w, i); });
}

// Round to nearest even, as cvt.rn does: cuda_common.cu's pack2 (compiled before this header).
inline unsigned int pack2_rn(float lo, float hi) { return pack2(lo, hi); }

inline unsigned int movmatrix_t(unsigned int a) {
    const int lane = sim::me().lane;
    sim::xin()[0] = a;
    const sim::XOut x = sim::xmeet();
    // out(lane) = M[2(l%4)][l/4], M[2(l%4)+1][l/4]; M[r][c] is half c%2 of lane 4r + c/2.
    const int col = lane / 4, r0 = 2 * (lane % 4);
    auto M = [&](int r, int c) {
        const uint32_t w = x.word[4 * r + c / 2][0];
        return c % 2 ? w >> 16 : w & 0xffffu;
    };
    return M(r0, col) | (M(r0 + 1, col) << 16);
}

// e4m3 code -> float (bias 7, subnormals at steps of 2^-9, 0x7f / 0xff NaN).
inline float sim_e4m3(uint32_t code) {
    const uint32_t e = (code >> 3) & 15u, m = code & 7u;
    if (e == 15u && m == 7u) return NAN;
    const float mag = e ? std::ldexp(1.f + m / 8.f, (int)e - 7) : std::ldexp((float)m, -9);
    return (code & 0x80u) ? -mag : mag;
}

// mma.m16n8k32 e4m3 (sm_89+): as m16n8k16 with four codes a register.
inline void mma_e4m3(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
    sim_mma<4>(c, a, b0, b1, [](uint32_t w, int i) { return sim_e4m3((w >> (8 * i)) & 0xffu); });
}
