"""How each CUDA kernel file becomes one NVRTC translation unit (no CuPy here, so the host
simulator in tests/cuda_sim composes the same sources with its own PTX wrappers)."""

from __future__ import annotations

import importlib.resources
from collections.abc import Mapping

from vt.kernels.attention_plan import TC_STAGES

# Kernel files, each compiled as one module, and the files prepended to it after cuda_common.cu.
KERNEL_FILES: dict[str, tuple[str, ...]] = {
    "elementwise.cu": (),
    "attention.cu": (),
    "attention_tc.cu": ("tensor_core.cu",),
    "sampling.cu": (),
}


def read_source(name: str) -> str:
    return importlib.resources.files("vt.kernels").joinpath(name).read_text()


def defines(fname: str) -> str:
    """Compile-time constants a kernel file takes from the Python side that also sizes its
    launches."""
    return f"#define TC_STAGES {TC_STAGES}\n" if fname == "attention_tc.cu" else ""


def translation_unit(fname: str, replace: Mapping[str, str] | None = None) -> str:
    """cuda_common.cu, the file's defines and preludes, then the file; `replace` swaps a
    prelude's text (the host simulator's PTX wrappers for tensor_core.cu)."""
    replace = replace or {}
    parts = [replace.get("cuda_common.cu", read_source("cuda_common.cu")), defines(fname)]
    parts += [replace.get(p, read_source(p)) for p in KERNEL_FILES[fname]]
    parts.append(read_source(fname))
    return "\n".join(parts)
