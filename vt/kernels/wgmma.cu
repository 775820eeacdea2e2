// PTX wrappers of Hopper's warpgroup MMA (wgmma, sm_90a only) and what goes with it: 32-bit
// shared-window addresses, shared-memory matrix descriptors for the 128-byte swizzle, the
// async-proxy fence, named barriers. Like tensor_core.cu, kernels call only these, and
// tests/cuda_sim has host versions of exactly this list.
//
// Operands are K-major in shared memory with the 128-byte swizzle: rows of 128 bytes (64 bf16 of
// k), 8-row groups 1024 bytes apart, the 16-byte chunk c of row r stored at chunk c ^ (r % 8).
// A k-step of 16 advances the descriptor's start by 32 bytes. m64nNk16 accumulators: thread t of
// the warpgroup holds d[j] for row 16 (t / 32) + (t % 32) / 4 + 8 ((j / 2) % 2) and column
// 8 (j / 4) + 2 (t % 4) + j % 2, i.e. per warp, mma.m16n8's C fragments n-tile after n-tile.
// Two forms take A from registers instead (WgmmaRATB, WgmmaRA, at the end).

typedef unsigned long long u64_t;

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16-byte global -> shared copy to a shared-window address; src_bytes 0 zero-fills.
__device__ __forceinline__ void cp_async16_u32(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// Descriptor of a K-major, 128-byte-swizzled operand starting at shared address addr.
__device__ __forceinline__ u64_t sw128_desc(unsigned addr) {
    return (u64_t)((addr & 0x3FFFF) >> 4) | ((u64_t)1 << 16) | ((u64_t)(1024 >> 4) << 32) | ((u64_t)1 << 62);
}

// Descriptor of an N-major (MN-major), 128-byte-swizzled B operand at shared address addr: rows of
// 128 bytes hold 64 consecutive n of one k, 8 rows of k (1024 bytes) make a swizzle atom, atoms
// of the next 8 k follow 1024 bytes on (the stride offset) and those of the next 64 n `lbo`
// bytes on (the leading offset). Laid out this way, a [keys][dims] tile stored like K (two
// 64-dim halves of [keys][128 B], lbo = keys * 128) is V as P V's B; a k-step of 16 keys
// advances addr by 2048.
__device__ __forceinline__ u64_t sw128_mn_desc(unsigned addr, unsigned lbo) {
    return (u64_t)((addr & 0x3FFFF) >> 4) | ((u64_t)((lbo & 0x3FFFF) >> 4) << 16) | ((u64_t)(1024 >> 4) << 32) |
           ((u64_t)1 << 62);
}

// Shared address of 16-byte chunk ch (0..7) of row r of a swizzled tile at a 1024-aligned base.
__device__ __forceinline__ unsigned sw128_at(unsigned base, int r, int ch) {
    return base + r * 128 + ((ch ^ (r & 7)) << 4);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Shared-memory writes of this thread (st.shared, cp.async) become visible to wgmma's reads
// (the async proxy) once a barrier after this fence has been passed.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Barrier `id` (1..15; 0 is __syncthreads') among `count` threads, a multiple of 32.
__device__ __forceinline__ void bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// The same barrier's arrival without the wait (a producer's "ready" or a consumer's "free"): the
// phase completes when `count` threads have arrived or synced. A thread must not arrive again at
// `id` before that phase completes.
__device__ __forceinline__ void bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

// A warpgroup's registers a thread set to N (a multiple of 8, 24..256), all its threads together:
// a producer warpgroup gives registers back (dec) for the consumers to take (inc, which waits
// until the block's pool has them).
template <int N>
__device__ __forceinline__ void warpgroup_regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void warpgroup_regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

// A 32-bit word at a shared-window address.
__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// Float-typed stores and rounding: a bit cast of an accumulator (f2bf's, or a float4 store's)
// makes the compiler carry the accumulators as integers through the k loop, moving them around
// every wgmma.
__device__ __forceinline__ void st_cg4(float* p, float a, float b, float c, float d) {
    asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
__device__ __forceinline__ bf16_t round_bf16(float v) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(v));
    return h;
}

// d (m64nN accumulators, N / 2 a thread) (+)= A . B^T from descriptors; scale_d 0 overwrites.
// pin(d) after wgmma_wait keeps the compiler from reading d before the wait.
template <int N>
struct Wgmma;
// The same with B N-major (imm-trans-b): B [K][N] with N contiguous, as a tile stored [keys][dims]
// is for O += P V (N = the head dim). Its descriptor is sw128_mn_desc's.
template <int N>
struct WgmmaTB;

// Accumulator operand lists: N / 2 floats of d, as "+f" constraints.
#define WG_D4(i) "+f"(d[i]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3])
#define WG_D8(i) WG_D4(i), WG_D4((i) + 4)
#define WG_D16(i) WG_D8(i), WG_D8((i) + 8)
#define WG_D32(i) WG_D16(i), WG_D16((i) + 16)
#define WG_D64(i) WG_D32(i), WG_D32((i) + 32)

// Wgmma<N>: the wgmma of that N; REGS names its accumulator operands, A, B and P the operand
// numbers of the two descriptors and of scale_d; TB "1" reads B N-major (WgmmaTB).
#define WGMMA_M64(NAME, N, ACC, REGS, A, B, P, TB)                                                  \
    template <>                                                                                    \
    struct NAME {                                                                                  \
        static __device__ __forceinline__ void mma(float* d, u64_t a, u64_t b, int scale_d) {      \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                            \
                         "wgmma.mma_async.sync.aligned.m64n" N "k16.f32.bf16.bf16 {" REGS "}, " A   \
                         ", " B ", p, 1, 1, 0, " TB ";\n}\n"                                       \
                         : ACC(0)                                                                  \
                         : "l"(a), "l"(b), "r"(scale_d));                                          \
        }                                                                                          \
        static __device__ __forceinline__ void pin(float* d) { asm volatile("" : ACC(0)::"memory"); } \
    };

WGMMA_M64(Wgmma<16>, "16", WG_D8, "%0, %1, %2, %3, %4, %5, %6, %7",
          "%8", "%9", "%10", "0")
WGMMA_M64(Wgmma<32>, "32", WG_D16, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15",
          "%16", "%17", "%18", "0")
WGMMA_M64(Wgmma<64>, "64", WG_D32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31",
          "%32", "%33", "%34", "0")
WGMMA_M64(Wgmma<128>, "128", WG_D64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
          "%64", "%65", "%66", "0")
WGMMA_M64(WgmmaTB<128>, "128", WG_D64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63",
          "%64", "%65", "%66", "1")

// O += P V with P in registers: wgmma's register-A form. The calling thread's a[0..3] are the
// k-step's A fragment, each warp of the warpgroup holding its 16 rows (16 w .. 16 w + 15) as
// mma.m16n8k16's A: with lane = 4 g + c, a[0] = row g, k 2c..2c+1 (the lower k in the low half);
// a[1] = row g + 8, same k; a[2] = row g, k 8 + 2c..; a[3] = row g + 8, k 8 + 2c... B is read
// N-major (sw128_mn_desc). PTX operand order of this form: d, a, b-desc, scale-d, imm-scale-a,
// imm-scale-b, imm-trans-b: registers hold A K-major, so there is no imm-trans-a.
// The product reads a[] when it runs, asynchronously: the registers must keep their values until
// a wgmma_wait has retired it. Write the next A only after that wait: ptxas, which allocates the
// registers, otherwise moves the wait up to where they are overwritten.
// TB: imm-trans-b, 1 for an N-major B (WgmmaRATB), 0 for a K-major one (WgmmaRA, a sw128_desc
// descriptor as Wgmma's: S = Q K^T with Q in registers).
template <int TB>
struct WgmmaRegA128 {
    static __device__ __forceinline__ void mma(float* d, const unsigned* a, u64_t b, int scale_d) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
                     "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "
                     "%28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "
                     "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                     "{%64, %65, %66, %67}, %68, p, 1, 1, %70;\n}\n"
                     : WG_D64(0)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d), "n"(TB));
    }
    static __device__ __forceinline__ void pin(float* d) { asm volatile("" : WG_D64(0)::"memory"); }
};
template <int N>
struct WgmmaRATB;
template <>
struct WgmmaRATB<128> : WgmmaRegA128<1> {};
template <int N>
struct WgmmaRA;
template <>
struct WgmmaRA<128> : WgmmaRegA128<0> {};

// d (m64nN accumulators) (+)= A . B^T with A and B e4m3 codes, both K-major from sw128_desc
// descriptors (fp8 wgmma has no transposed form): a k-step is 32 codes, 32 bytes, so the
// descriptors advance as bf16's k16 steps do, and a 128-byte swizzled row holds 128 codes.
template <int N>
struct WgmmaE4M3;
template <>
struct WgmmaE4M3<128> {
    static __device__ __forceinline__ void mma(float* d, u64_t a, u64_t b, int scale_d) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, "
                     "%9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, "
                     "%28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, "
                     "%47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
                     "%64, %65, p, 1, 1;\n}\n"
                     : WG_D64(0)
                     : "l"(a), "l"(b), "r"(scale_d));
    }
    static __device__ __forceinline__ void pin(float* d) { asm volatile("" : WG_D64(0)::"memory"); }
};
