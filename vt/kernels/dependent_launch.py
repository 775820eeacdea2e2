"""Launching a kernel as a programmatic dependent of the kernel before it on its stream
(cuLaunchKernelEx with programmatic stream serialization, through the driver API by ctypes,
since CuPy's launch takes no attributes). Captured into a CUDA graph, the launch becomes a
programmatic edge. The kernel may start while the one before still runs, once that one's blocks
have executed `griddepcontrol.launch_dependents` (or exited); it must execute
`griddepcontrol.wait` before it touches anything the kernel before writes.
"""

from __future__ import annotations

import ctypes
from typing import Any

import cupy
import numpy as np

_ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _Attr(ctypes.Structure):  # CUlaunchAttribute: an id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attr)),
        ("num_attrs", ctypes.c_uint),
    ]


def _c_arg(a: Any) -> Any:
    """One kernel argument as the ctypes value the kernel's parameter expects."""
    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, np.int32):
        return ctypes.c_int32(int(a))
    if isinstance(a, np.float32):
        return ctypes.c_float(float(a))
    if isinstance(a, np.int64):
        return ctypes.c_int64(int(a))
    if isinstance(a, int) and a == 0:  # a null pointer
        return ctypes.c_void_p(0)
    raise TypeError(f"no kernel argument type for {type(a).__name__}")


class DependentLauncher:
    """cuLaunchKernelEx with the programmatic-serialization attribute set, or None from open()
    where the driver has no such entry point (then callers launch plainly)."""

    def __init__(self, launch_ex: Any) -> None:
        self._launch_ex = launch_ex
        self._attr = _Attr()
        self._attr.id = _ATTR_PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value[0] = 1

    @classmethod
    def open(cls) -> DependentLauncher | None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            fn = lib.cuLaunchKernelEx
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                       ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return cls(fn)

    def launch(self, func_ptr: int, grid: tuple[int, ...], block: tuple[int, ...], args: tuple,
               shared_mem: int = 0) -> None:
        """Launch on the current stream; args as for a CuPy RawKernel (arrays, np.int32 /
        np.float32 / np.int64 scalars, 0 for a null pointer)."""
        vals = [_c_arg(a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        g = (*grid, 1, 1)[:3]
        b = (*block, 1, 1)[:3]
        cfg = _Config((ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b), shared_mem,
                      cupy.cuda.get_current_stream().ptr, ctypes.pointer(self._attr), 1)
        rc = self._launch_ex(ctypes.byref(cfg), func_ptr, params, None)
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {rc}")
