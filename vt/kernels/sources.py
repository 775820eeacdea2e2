"""How each CUDA kernel file becomes one NVRTC translation unit (no CuPy here, so the host
simulator in tests/cuda_sim composes the same sources with its own PTX wrappers)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping

from vt.kernels import attention_plan

# Kernel files, each compiled as one module, and the files prepended to it after cuda_common.cu.
KERNEL_FILES: dict[str, tuple[str, ...]] = {
    "elementwise.cu": (),
    "attention.cu": ("attention_merge.cu",),
    "attention_tc.cu": ("tensor_core.cu", "attention_parts.cu"),
    "sampling.cu": (),
    "fp8.cu": (),
    "gemv.cu": ("tensor_core.cu",),
}
# Kernel files that need an arch-specific target (wgmma: sm_90a), compiled only for such a device.
ARCH_KERNEL_FILES: dict[str, tuple[str, ...]] = {
    "attention_wg.cu": ("tensor_core.cu", "wgmma.cu", "attention_parts.cu"),
}


def read_source(name: str) -> str:
    return importlib.resources.files("vt.kernels").joinpath(name).read_text()


def defines(fname: str) -> str:
    """Compile-time constants a kernel file takes from the Python side that also sizes its
    launches."""
    # read at call time, so a benchmark may set other values before the kernels are built
    if fname == "attention.cu":
        return f"#define KT {attention_plan.CUDA_CORE_KEY_TILE}\n"
    if fname != "attention_tc.cu":
        return ""
    return (f"#define TC_STAGES {attention_plan.TC_STAGES}\n"
            f"#define DEC8_KV8_STAGES {attention_plan.DEC8_KV8_STAGES}\n"
            f"#define TC_KT {attention_plan.TC_KEY_TILE}\n")


def translation_unit(fname: str, replace: Mapping[str, str] | None = None) -> str:
    """cuda_common.cu, the file's defines and preludes, then the file; `replace` swaps a
    prelude's text (the host simulator's PTX wrappers for tensor_core.cu)."""
    replace = replace or {}
    parts = [replace.get("cuda_common.cu", read_source("cuda_common.cu")), defines(fname)]
    preludes = KERNEL_FILES[fname] if fname in KERNEL_FILES else ARCH_KERNEL_FILES[fname]
    parts += [replace.get(p, read_source(p)) for p in preludes]
    parts.append(read_source(fname))
    return "\n".join(parts)
