"""Every CUDA kernel file compiles with NVRTC for sm_90a, as cuda_ops builds it, on a machine with
no GPU; the tensor-core attention kernels keep every value in registers and no wgmma is
serialized (slowdowns only a GPU run would otherwise show)."""

from __future__ import annotations

import pytest

from tests.cuda_sim import nvrtc
from vt.kernels.sources import ARCH_KERNEL_FILES, KERNEL_FILES


@pytest.fixture(scope="module")
def reports():
    try:
        lib = nvrtc.load()
    except nvrtc.NvrtcUnavailable as e:
        pytest.skip(str(e))
    return {f: nvrtc.compile_report(lib, f) for f in [*KERNEL_FILES, *ARCH_KERNEL_FILES]}


@pytest.mark.parametrize("fname", [*KERNEL_FILES, *ARCH_KERNEL_FILES])
def test_kernel_file_compiles_for_hopper(reports, fname):
    rc, log = reports[fname]
    assert rc == 0, log[-3000:]
    assert nvrtc.resources(log), "ptxas reported no kernel"


def test_tensor_core_attention_fits_its_registers(reports):
    res = {r.name: r for f in ("attention_tc.cu", "attention_wg.cu") for r in nvrtc.resources(reports[f][1])}
    assert {"attention_tc_d128_prefill", "attention_tc_d128_prefill_m2", "attention_tc_d128_prefill_w8",
            "attention_tc_d128_decode", "attention_tc_d128_decode8", "attention_wg_d128_prefill",
            "attention_wgv_d128_prefill", "attention_wgr_d128_prefill"} <= set(res)
    for r in res.values():
        assert r.spill_stores == 0 and r.spill_loads == 0, r


def test_no_wgmma_is_serialized(reports):
    """ptxas serializes every wgmma of a kernel when one depends on a branch or lacks registers
    (warning C7520, "Potential Performance Loss"): the overlap the kernel was written for is gone."""
    _, log = reports["attention_wg.cu"]
    assert "Potential Performance Loss" not in log, log
