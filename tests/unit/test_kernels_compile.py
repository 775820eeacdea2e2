"""Every CUDA kernel file compiles with NVRTC for sm_90a, as cuda_ops builds it, on a machine with
no GPU; the tensor-core attention kernels keep every value in registers (a spill to local memory
is a slowdown only a GPU run would otherwise show)."""

from __future__ import annotations

import pytest

from tests.cuda_sim import nvrtc
from vt.kernels.sources import KERNEL_FILES


@pytest.fixture(scope="module")
def reports():
    try:
        lib = nvrtc.load()
    except nvrtc.NvrtcUnavailable as e:
        pytest.skip(str(e))
    return {f: nvrtc.compile_report(lib, f) for f in KERNEL_FILES}


@pytest.mark.parametrize("fname", list(KERNEL_FILES))
def test_kernel_file_compiles_for_hopper(reports, fname):
    rc, log = reports[fname]
    assert rc == 0, log[-3000:]
    assert nvrtc.resources(log), "ptxas reported no kernel"


def test_tensor_core_attention_fits_its_registers(reports):
    _, log = reports["attention_tc.cu"]
    res = {r.name: r for r in nvrtc.resources(log)}
    assert {"attention_tc_d128_prefill", "attention_tc_d128_prefill_m2", "attention_tc_d128_prefill_w8",
            "attention_tc_d128_decode", "attention_tc_d128_decode8"} <= set(res)
    for r in res.values():
        assert r.spill_stores == 0 and r.spill_loads == 0, r
