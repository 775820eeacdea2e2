"""The simulator's wgmma (tests/cuda_sim/sim_wgmma.h: descriptors, the 128-byte swizzle, the
m64nNk16 accumulator layout) is checked against a kernel proven on the H200: bench/streamk_gemm.cu,
the stream-K GEMM whose outputs matched cuBLAS there (bench/NOTES_CUDA.md). Run on the host, it
must give x . w^T too, with split tiles summed across CTAs. Kernels built on vt/kernels/wgmma.cu
can then be checked on the host with some trust that what passes here runs the same on Hopper."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from tests.cuda_sim import SIM_WRAPPERS, SimUnavailable, compile_host, host_source

BENCH = Path(__file__).resolve().parents[2] / "bench"


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
