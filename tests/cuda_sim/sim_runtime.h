// The CUDA C++ surface our kernels use, on the host: each thread of a block is a fiber
// (ucontext), run round-robin; warp collectives (shuffles, votes, and the tensor-core wrappers in
// sim_tensor_core.h) and __syncthreads are barriers between fibers. Blocks run one after another,
// so one static buffer serves as every block's shared memory. Device pointers are host pointers.
// This checks what a kernel computes (indexing, fragment layouts, masking, barriers' placement,
// waits: asynchronous work can be made to land only at its wait), not its speed. Threads switch
// only at collectives and barriers, so a race between plain loads and stores of different warps
// shows only as far as that order happens to expose it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <deque>
#include <functional>
#include <iterator>
#include <math.h>
#include <ucontext.h>
#include <vector>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n)
#define __noinline__
#define __shared__ static  // blocks run one at a time: a static is the block's shared variable

struct uint3_ { unsigned int x, y, z; };
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct int2 { int x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
// Rounded-to-nearest arithmetic the kernels spell out (so NVRTC does not contract it into FMAs).
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }

namespace sim {

constexpr int kMaxThreads = 1024;
constexpr size_t kStack = 256 * 1024;
constexpr size_t kSmem = 256 * 1024;
alignas(1024) inline unsigned char g_smem[kSmem];

// When asynchronous work lands (cp.async copies, wgmma products). Early: at issue, which shows
// a buffer refilled while others still read it. Late: only at the wait that guarantees it, which
// shows a read before that wait. Tests run kernels both ways.
// order: which waiting-free thread runs next when one blocks. 0: round-robin; 1: the lowest
// (warp 0 runs ahead of the others as far as barriers let it); 2: the highest; 3 and up: a
// random one, seeded. A barrier missing between warps shows in the orders that skew them.
struct Timing {
    bool late_copies = false;
    bool late_wgmma = false;
    unsigned order = 0;
};
inline Timing& timing() { static Timing t; return t; }

// A 16-byte copy in flight (src null: zero fill).
struct Copy {
    void* dst;
    const void* src;
};

struct Fiber {
    ucontext_t ctx;
    uint3_ tid;
    int warp = 0, lane = 0;
    bool done = false;
    unsigned coll = 0;  // warp collectives this thread has passed: picks the exchange buffer
    const unsigned* wait_gen = nullptr;  // blocked until *wait_gen != wait_val
    unsigned wait_val = 0;
    std::vector<Copy> open;             // copies since the last commit
    std::deque<std::vector<Copy>> groups;  // committed, not yet waited for
    unsigned bar_phase[64] = {};  // per named barrier: 1 + the phase this thread last counted in
};

// A warp's exchange area: each lane writes its inputs, all meet, each reads what it needs.
// Collectives alternate between two buffers, so one barrier each suffices: a lane can write the
// buffer of collective k + 2 only after all lanes reached k + 1, i.e. finished reading k.
struct WarpX {
    uint32_t word[2][32][16];
    const void* ptr[2][32];
    int arrived = 0, live = 0;
    unsigned gen = 0;
};

// A barrier among `count` threads (named barriers, warpgroups).
struct Group {
    int arrived = 0;
    unsigned gen = 0;
};

struct Block {
    std::vector<Fiber> fibers;
    std::vector<char> stacks;
    WarpX warps[kMaxThreads / 32];
    Group groups[64];
    float* wg_acc[kMaxThreads];  // each thread's accumulators, for the warpgroup's wgmma
    const unsigned* wg_areg[kMaxThreads];  // each thread's A registers, for a register-A wgmma
    int arrived = 0, live = 0;
    unsigned gen = 0;
    bool twice = false;  // a thread counted twice in one phase of a named barrier (launch returns 3)
    ucontext_t sched;
    int cur = 0;
    unsigned long long serial = 0;  // blocks run so far: per-block state kept elsewhere resets on change
    unsigned long long rng = 0;
};

inline bool runnable(const Fiber& f) { return !f.done && (!f.wait_gen || *f.wait_gen != f.wait_val); }

// The thread to run after `prev` (itself only when no other can run; -1: none can).
inline int next_fiber(Block* b, int prev, unsigned order) {
    const int n = (int)b->fibers.size();
    int pick = -1;
    if (order == 1 || order == 2) {
        for (int i = 0; i < n && pick < 0; ++i) {
            const int c = order == 1 ? i : n - 1 - i;
            if (c != prev && runnable(b->fibers[c])) pick = c;
        }
    } else if (order >= 3) {
        int count = 0;
        for (int c = 0; c < n; ++c) count += c != prev && runnable(b->fibers[c]);
        if (count) {
            b->rng ^= b->rng << 13;
            b->rng ^= b->rng >> 7;
            b->rng ^= b->rng << 17;
            int k = (int)(b->rng % (unsigned long long)count);
            for (int c = 0; c < n; ++c)
                if (c != prev && runnable(b->fibers[c]) && k-- == 0) { pick = c; break; }
        }
    } else {
        for (int i = 1; i < n && pick < 0; ++i) {
            const int c = (prev + i) % n;
            if (runnable(b->fibers[c])) pick = c;
        }
    }
    if (pick < 0 && prev >= 0 && runnable(b->fibers[prev])) pick = prev;
    return pick;
}

inline Block*& block() { static Block* b = nullptr; return b; }
inline Fiber& me() { return block()->fibers[block()->cur]; }
inline uint3_& grid_dim() { static uint3_ v; return v; }
inline uint3_& block_idx() { static uint3_ v; return v; }
inline uint3_& block_dim() { static uint3_ v; return v; }
inline std::function<void()>& body() { static std::function<void()> f; return f; }

inline void deadlock() {
    std::fprintf(stderr, "cuda_sim: deadlock in block (%u, %u, %u): a barrier some threads never reach\n",
                 block_idx().x, block_idx().y, block_idx().z);
    std::abort();
}

// No thread can run. After a thread counted twice in a barrier phase that is the expected end
// (the phase completed without its other side, which now waits forever): the block stops and
// launch() reports the double count; otherwise a deadlock.
inline void stuck(Fiber& f) {
    Block* b = block();
    if (!b->twice) deadlock();
    swapcontext(&f.ctx, &b->sched);
}

// Switch straight to the next thread to run, not through the scheduler.
inline void yield() {
    Block* b = block();
    const int prev = b->cur, next = next_fiber(b, prev, timing().order);
    if (next < 0) stuck(b->fibers[prev]);
    if (next == prev) return;
    b->cur = next;
    swapcontext(&b->fibers[prev].ctx, &b->fibers[next].ctx);
}

// Block this thread until *gen moves on from `val`.
inline void wait_for(const unsigned* gen, unsigned val) {
    Fiber& f = me();
    while (*gen == val) {
        f.wait_gen = gen;
        f.wait_val = val;
        yield();
    }
    f.wait_gen = nullptr;
}

inline void warp_barrier() {
    Block* b = block();
    WarpX& w = b->warps[me().warp];
    const unsigned gen = w.gen;
    if (++w.arrived == w.live) { w.arrived = 0; ++w.gen; return; }
    wait_for(&w.gen, gen);
}

// This thread counts toward the current phase of group `key`. On the device a thread that arrives
// twice before the phase completes counts twice toward it (bar.arrive, then bar.sync or another
// arrive, with the other side behind): a protocol error, recorded for launch() to report.
inline void count_arrival(Block* b, int key, unsigned gen) {
    unsigned& seen = me().bar_phase[key];
    if (seen == gen + 1) b->twice = true;
    seen = gen + 1;
}

// A thread arrives at group `key` of `count` threads and goes on (bar.arrive): the phase
// completes, releasing the threads that sync there, once `count` arrivals and syncs are in.
inline void group_arrive(int key, int count) {
    Block* b = block();
    Group& g = b->groups[key];
    count_arrival(b, key, g.gen);
    if (++g.arrived == count) {
        g.arrived = 0;
        ++g.gen;
    }
}

// Threads meet at group `key` (count of them); the last to arrive runs `last` before releasing.
inline void group_barrier(int key, int count, const std::function<void()>& last) {
    Block* b = block();
    Group& g = b->groups[key];
    const unsigned gen = g.gen;
    count_arrival(b, key, gen);
    if (++g.arrived == count) {
        if (last) last();
        g.arrived = 0;
        ++g.gen;
        return;
    }
    wait_for(&g.gen, gen);
}

// This lane's slot of its warp's current exchange buffer, then the barrier and the buffer to read.
inline uint32_t* xin() { return block()->warps[me().warp].word[me().coll & 1][me().lane]; }
inline const void*& xptr() { return block()->warps[me().warp].ptr[me().coll & 1][me().lane]; }
struct XOut {
    uint32_t (*word)[16];
    const void** ptr;
};
inline XOut xmeet() {
    WarpX& w = block()->warps[me().warp];
    const unsigned k = me().coll++ & 1;
    warp_barrier();
    return {w.word[k], w.ptr[k]};
}

inline void block_barrier() {
    Block* b = block();
    const unsigned gen = b->gen;
    if (++b->arrived == b->live) { b->arrived = 0; ++b->gen; return; }
    wait_for(&b->gen, gen);
}

inline void fiber_main() {
    body()();
    Block* b = block();
    Fiber& f = me();
    f.done = true;
    WarpX& w = b->warps[f.warp];
    // Threads that have exited no longer hold back the barriers the others wait at.
    if (--w.live > 0 && w.arrived == w.live) { w.arrived = 0; ++w.gen; }
    if (--b->live > 0 && b->arrived == b->live) { b->arrived = 0; ++b->gen; }
    if (b->live == 0) {
        swapcontext(&f.ctx, &b->sched);  // the block is done
        return;
    }
    const int next = next_fiber(b, b->cur, timing().order);
    if (next < 0) stuck(f);
    b->cur = next;
    swapcontext(&f.ctx, &b->fibers[next].ctx);
}

// Run `kernel` (a call of the kernel with its arguments) over the grid: 0, or 1 when the launch
// asks for more than the simulator has, or 2 when a block wrote past the smem_bytes it was
// launched with (the bytes after them hold a pattern that must survive every block), or 3 when a
// thread counted twice in one phase of a named barrier (count_arrival).
inline int launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem_bytes,
                  std::function<void()> kernel) {
    if (threads == 0 || threads > (unsigned)kMaxThreads || threads % 32 || smem_bytes > kSmem) return 1;
    body() = std::move(kernel);
    grid_dim() = {gx, gy, gz};
    block_dim() = {threads, 1, 1};
    constexpr unsigned char kGuard = 0x5C;
    const size_t guard_end = smem_bytes + 16384 < kSmem ? smem_bytes + 16384 : kSmem;
    std::memset(g_smem + smem_bytes, kGuard, guard_end - smem_bytes);
    Block b;
    b.fibers.resize(threads);
    b.stacks.resize((size_t)threads * kStack);
    block() = &b;
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                block_idx() = {x, y, z};
                ++b.serial;
                b.rng = ((timing().order + 1) * 0x9E3779B97F4A7C15ull) ^ (b.serial * 0xBF58476D1CE4E5B9ull);
                std::memset(g_smem, 0xFF, smem_bytes);  // stale garbage, as a real block sees: NaN as bf16 and f32
                b.live = (int)threads;
                b.arrived = 0;
                for (unsigned w = 0; w < threads / 32; ++w) { b.warps[w].live = 32; b.warps[w].arrived = 0; }
                for (Group& g : b.groups) g.arrived = 0;
                b.twice = false;
                for (unsigned t = 0; t < threads; ++t) {
                    Fiber& f = b.fibers[t];
                    f.tid = {t, 0, 0};
                    f.warp = (int)(t / 32);
                    f.lane = (int)(t % 32);
                    f.done = false;
                    f.wait_gen = nullptr;
                    f.coll = 0;
                    f.open.clear();
                    f.groups.clear();
                    std::fill(std::begin(f.bar_phase), std::end(f.bar_phase), 0u);
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = b.stacks.data() + (size_t)t * kStack;
                    f.ctx.uc_stack.ss_size = kStack;
                    f.ctx.uc_link = nullptr;
                    makecontext(&f.ctx, fiber_main, 0);
                }
                b.cur = 0;
                swapcontext(&b.sched, &b.fibers[0].ctx);  // back when every thread has exited
                if (b.twice) {
                    block() = nullptr;
                    return 3;
                }
                for (size_t i = smem_bytes; i < guard_end; ++i)
                    if (g_smem[i] != kGuard) {
                        block() = nullptr;
                        return 2;
                    }
            }
    block() = nullptr;
    return 0;
}

}  // namespace sim

extern "C" void sim_set_timing(int late_copies, int late_wgmma, unsigned order) {
    sim::timing().late_copies = late_copies != 0;
    sim::timing().late_wgmma = late_wgmma != 0;
    sim::timing().order = order;
}

#define threadIdx (sim::me().tid)
#define blockIdx (sim::block_idx())
#define blockDim (sim::block_dim())
#define gridDim (sim::grid_dim())

inline void __syncthreads() { sim::block_barrier(); }
inline void __threadfence() {}
template <class T> inline T __ldcg(const T* p) { return *p; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned old = *p; *p += v; return old; }
inline void __syncwarp(unsigned = 0xffffffffu) { sim::warp_barrier(); }
// Byte i of the result is byte (s >> 4i) & 7 of y:x (prmt's default mode).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const unsigned long long v = ((unsigned long long)y << 32) | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned int)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}

template <class T>
inline T sim_shfl(T v, int src_of_lane(int, int), int arg) {
    static_assert(sizeof(T) == 4, "32-bit shuffles only");
    const int lane = sim::me().lane;
    std::memcpy(sim::xin(), &v, 4);
    const sim::XOut x = sim::xmeet();
    T r;
    std::memcpy(&r, x.word[src_of_lane(lane, arg) & 31], 4);
    return r;
}
inline int sim_xor(int lane, int m) { return lane ^ m; }
inline int sim_idx(int, int src) { return src; }
inline int sim_down(int lane, int d) { return lane + d < 32 ? lane + d : lane; }
inline int sim_up(int lane, int d) { return lane - d >= 0 ? lane - d : lane; }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) { return sim_shfl(v, sim_xor, m); }
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return sim_shfl(v, sim_idx, src); }
template <class T> inline T __shfl_down_sync(unsigned, T v, int d) { return sim_shfl(v, sim_down, d); }
template <class T> inline T __shfl_up_sync(unsigned, T v, int d) { return sim_shfl(v, sim_up, d); }

inline unsigned __ballot_sync(unsigned, int pred) {
    sim::xin()[0] = pred ? 1u : 0u;
    const sim::XOut x = sim::xmeet();
    unsigned r = 0;
    for (int l = 0; l < 32; ++l) r |= x.word[l][0] << l;
    return r;
}
inline int __any_sync(unsigned m, int pred) { return __ballot_sync(m, pred) != 0; }
inline int __all_sync(unsigned m, int pred) { return __ballot_sync(m, pred) == 0xffffffffu; }
