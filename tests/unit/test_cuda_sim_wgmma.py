"""The simulator's wgmma (tests/cuda_sim/sim_wgmma.h: descriptors, the 128-byte swizzle, the
m64nNk16 accumulator layout) is checked against a kernel proven on the H200: bench/probes/streamk_gemm.cu,
the stream-K GEMM whose outputs matched cuBLAS there (bench/NOTES_CUDA.md). Run on the host, it
must give x . w^T too, with split tiles summed across CTAs. Kernels built on vt/kernels/wgmma.cu
can then be checked on the host with some trust that what passes here runs the same on Hopper.
The register-A form (O += P V with P in registers), which the probe does not use, is checked
against numpy here too, with the wait it needs."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_sim import SIM_WRAPPERS, SimUnavailable, compile_host, host_source

BENCH = Path(__file__).resolve().parents[2] / "bench" / "probes"


def _probe():
    spec = importlib.util.spec_from_file_location("bench_streamk_gemm", BENCH / "streamk_gemm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sk():
    sk = _probe()
    launchers = "".join(
        f'extern "C" int sim_{sk.kernel_name(n)}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, '
        f"size_t smem, const bf16_t* w, const bf16_t* x, bf16_t* y, float* partials, int* counters, int m, "
        f"int n, int k, int ldx, int ldy, int accumulate) {{ return sim::launch(gx, gy, gz, threads, smem, "
        f"[&] {{ {sk.kernel_name(n)}(w, x, y, partials, counters, m, n, k, ldx, ldy, accumulate); }}); }}\n"
        for n in sk.TOKEN_TILES)
    try:
        lib = compile_host("streamk_gemm", host_source(sk.source(replace=SIM_WRAPPERS)) + "\n" + launchers)
    except SimUnavailable as e:
        pytest.skip(str(e))
    return sk, lib


def _bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("rows,ctas,accumulate",
                         [(5, 3, False), (16, 4, True), (40, 1, False), (100, 5, False)])
def test_streamk_gemm_on_the_simulator_matches_numpy(sk, rows, ctas, accumulate):
    mod, lib = sk
    rng = np.random.default_rng(rows)
    n, k = 256, 512  # 2 weight tiles x 8 k chunks: with 3-5 CTAs every tile is split
    w = _bf16(rng.standard_normal((n, k)))
    x = _bf16(rng.standard_normal((rows, k)))
    y0 = _bf16(rng.standard_normal((rows, n)))
    y = y0.copy()
    tokens = next(t for t in mod.TOKEN_TILES if t >= rows)
    partials = np.zeros(2 * ctas * mod.WEIGHT_ROWS * tokens, np.float32)
    counters = np.zeros(n // mod.WEIGHT_ROWS, np.int32)
    fn = getattr(lib, f"sim_{mod.kernel_name(tokens)}")
    fn.argtypes = [ctypes.c_uint] * 4 + [ctypes.c_size_t] + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6
    rc = fn(ctas, 1, 1, mod.THREADS, mod.smem_bytes(tokens), w.ctypes.data, x.ctypes.data, y.ctypes.data,
            partials.ctypes.data, counters.ctypes.data, rows, n, k, k, n, int(accumulate))
    assert rc == 0
    ref = x.astype(np.float64) @ w.astype(np.float64).T + (y0.astype(np.float64) if accumulate else 0)
    err = np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-2
    assert not counters.any()  # the last part of every split tile reset its counter


# O += P V's form with A from registers (wgmma.cu's WgmmaRATB): a warpgroup multiplies A [64][16],
# each thread's four registers loaded by the PTX manual's fragment layout (mma.m16n8k16's A per
# warp), by B [16][128] stored N-major for sw128_mn_desc (two 64-n halves of [16 k][128 B], the
# 128-byte swizzle). clobber zeroes the registers after the issue, before the wait: the product
# must not see that when it reads A at issue, and must when it reads A at the wait ("late").
_REG_A_PROBE = r"""
extern "C" __global__ void wgmma_reg_a_probe(const bf16_t* a, const bf16_t* b, float* d, int clobber) {
    extern __shared__ __align__(16) unsigned char smem[];
    const unsigned base = (smem_u32(smem) + 1023u) & ~1023u;
    const int t = threadIdx.x, w = t / 32, g = (t % 32) / 4, c = t % 4;
    for (int e = t; e < 16 * 16; e += 128) {  // k row, 16-byte chunk of 8 n
        const int k = e / 16, ch = e % 16;
        const unsigned dst = sw128_at(base + (ch / 8) * 2048, k, ch % 8);
        for (int i = 0; i < 4; ++i)
            st_shared_u32(dst + 4 * i, *reinterpret_cast<const unsigned*>(b + k * 128 + ch * 8 + 2 * i));
    }
    fence_proxy_async();
    __syncthreads();
    const int r = 16 * w + g;
    unsigned ra[4];
    ra[0] = *reinterpret_cast<const unsigned*>(a + r * 16 + 2 * c);
    ra[1] = *reinterpret_cast<const unsigned*>(a + (r + 8) * 16 + 2 * c);
    ra[2] = *reinterpret_cast<const unsigned*>(a + r * 16 + 8 + 2 * c);
    ra[3] = *reinterpret_cast<const unsigned*>(a + (r + 8) * 16 + 8 + 2 * c);
    float acc[64];
    for (int j = 0; j < 64; ++j) acc[j] = 0.f;
    wgmma_fence();
    WgmmaRATB<128>::mma(acc, ra, sw128_mn_desc(base, 2048), 0);
    wgmma_commit();
    if (clobber)
        for (int i = 0; i < 4; ++i) ra[i] = 0u;
    wgmma_wait<0>();
    WgmmaRATB<128>::pin(acc);
    for (int j = 0; j < 64; ++j)
        d[(r + 8 * ((j / 2) % 2)) * 128 + 8 * (j / 4) + 2 * c + j % 2] = acc[j];
}
extern "C" int sim_wgmma_reg_a_probe(const bf16_t* a, const bf16_t* b, float* d, int clobber) {
    return sim::launch(1, 1, 1, 128, 2 * 2048 + 1024, [&] { wgmma_reg_a_probe(a, b, d, clobber); });
}
"""


@pytest.fixture(scope="module")
def reg_a():
    from vt.kernels.sources import read_source

    wrappers = SIM_WRAPPERS["tensor_core.cu"] + SIM_WRAPPERS["wgmma.cu"]
    src = host_source(read_source("cuda_common.cu") + wrappers + _REG_A_PROBE)
    try:
        lib = compile_host("wgmma_reg_a_probe", src)
    except SimUnavailable as e:
        pytest.skip(str(e))
    lib.sim_wgmma_reg_a_probe.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int]
    return lib


def _reg_a_product(lib, a, b, late, clobber):
    d = np.zeros((64, 128), np.float32)
    lib.sim_set_timing(0, int(late), ctypes.c_uint(0))
    assert lib.sim_wgmma_reg_a_probe(a.ctypes.data, b.ctypes.data, d.ctypes.data, int(clobber)) == 0
    return d


@pytest.mark.parametrize("late", [False, True], ids=["at-issue", "late"])
def test_register_a_wgmma_matches_numpy(reg_a, late):
    rng = np.random.default_rng(21)
    a, b = _bf16(rng.standard_normal((64, 16))), _bf16(rng.standard_normal((16, 128)))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    d = _reg_a_product(reg_a, a, b, late, clobber=False)
    assert np.abs(d - ref).max() < 1e-4 * np.abs(ref).max()
    # a transposed fragment (rows g + 8 and k 8.. swapped) would not match
    wrong = a.reshape(4, 2, 8, 2, 8).transpose(0, 3, 2, 1, 4).reshape(64, 16).astype(np.float64) @ b
    assert np.abs(d - wrong).max() > 0.1 * np.abs(ref).max()


def test_register_a_changed_before_the_wait_is_caught_late(reg_a):
    """A kernel that overwrites the A registers before the wgmma_wait retiring their product
    computes garbage on Hopper; the simulator shows it when products land at their waits."""
    rng = np.random.default_rng(22)
    a, b = _bf16(rng.standard_normal((64, 16))), _bf16(rng.standard_normal((16, 128)))
    ref = a.astype(np.float64) @ b.astype(np.float64)
    early = _reg_a_product(reg_a, a, b, late=False, clobber=True)
    late = _reg_a_product(reg_a, a, b, late=True, clobber=True)
    assert np.abs(early - ref).max() < 1e-4 * np.abs(ref).max()  # read at issue: the registers then
    assert not late.any()  # read at the wait: the zeroed registers
