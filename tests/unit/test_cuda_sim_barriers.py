"""Named barriers on the host simulator: `bar_sync` and the non-blocking `bar_arrive` (wgmma.cu),
which a producer / consumer split of a block's warpgroups needs (one side arrives "ready" or
"free", the other syncs). A two-stage handoff between two warpgroups must deliver every round under
every thread order the simulator runs; the same handoff without its "free" barrier must be caught:
the producer then overwrites a stage the consumer has not read and arrives twice in one phase of
its "ready" barrier, which the simulator reports (launch returns 3)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.cuda_sim import LAUNCH_ARGTYPES, SimUnavailable, compile_host, host_source
from vt.kernels.sources import read_source

_KERNEL = r"""
// Warpgroup 0 writes round r into stage r % 2 and arrives at its "ready" barrier (1 + stage);
// warpgroup 1 syncs there, reads another lane's value and arrives at the stage's "free" barrier
// (3 + stage), which warpgroup 0 syncs on before it writes the stage again (unless skip_free).
__global__ void handoff_k(const float* in, float* out, int rounds, int skip_free) {
    extern __shared__ float stage[];
    const int t = threadIdx.x % 128, wg = threadIdx.x / 128;
    for (int r = 0; r < rounds; ++r) {
        const int s = r % 2;
        if (wg == 0) {
            if (r >= 2 && !skip_free) bar_sync(3 + s, 256);
            stage[s * 128 + t] = in[r * 128 + t];
            bar_arrive(1 + s, 256);
        } else {
            bar_sync(1 + s, 256);
            out[r * 128 + t] = stage[s * 128 + (t + 1) % 128];
            bar_arrive(3 + s, 256);
        }
    }
}
extern "C" int sim_handoff_k(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem,
                             const float* in, float* out, int rounds, int skip_free) {
    return sim::launch(gx, gy, gz, threads, smem, [&] { handoff_k(in, out, rounds, skip_free); });
}
"""


@pytest.fixture(scope="module")
def lib():
    src = read_source("cuda_common.cu") + '\n#include "sim_tensor_core.h"\n#include "sim_wgmma.h"\n' + _KERNEL
    try:
        lib = compile_host("barriers", host_source(src))
    except SimUnavailable as e:
        pytest.skip(str(e))
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.sim_handoff_k.argtypes = LAUNCH_ARGTYPES + [ptr, ptr, i32, i32]
    return lib


def _run(lib, rounds: int, skip_free: bool, order: int) -> tuple[int, np.ndarray, np.ndarray]:
    lib.sim_set_timing(0, 0, order)
    src = np.arange(rounds * 128, dtype=np.float32)
    out = np.full(rounds * 128, -1.0, np.float32)
    try:
        rc = lib.sim_handoff_k(1, 1, 1, 256, 2 * 128 * 4, src.ctypes.data, out.ctypes.data, rounds,
                               int(skip_free))
    finally:
        lib.sim_set_timing(0, 0, 0)
    want = np.roll(src.reshape(rounds, 128), -1, axis=1).reshape(-1)
    return rc, out, want


@pytest.mark.parametrize("order", [0, 1, 2, 3])
def test_a_two_stage_handoff_delivers_every_round(lib, order):
    rc, out, want = _run(lib, rounds=7, skip_free=False, order=order)
    assert rc == 0
    np.testing.assert_array_equal(out, want)


def test_a_handoff_without_its_free_barrier_is_caught(lib):
    # Order 1 runs the lowest threads first: the producers race ahead of the consumers.
    rc, out, want = _run(lib, rounds=7, skip_free=True, order=1)
    assert rc == 3
    assert not np.array_equal(out, want)
