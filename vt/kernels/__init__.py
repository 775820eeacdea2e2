"""Backends: one op set (vt.kernels.base.Backend), a numpy and a CUDA implementation."""

from __future__ import annotations

from vt.kernels.base import Backend


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no cupy, no driver, no device: all mean "not available"
        return False


def get_backend(name: str = "auto") -> Backend:
    """"auto": CUDA when a device is usable, else numpy; "cuda"; "cpu" or "numpy"."""
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name in ("cpu", "numpy"):
        from vt.kernels.numpy_ops import NumpyBackend

        return NumpyBackend()
    if name == "cuda":
        if not cuda_available():
            raise RuntimeError("device 'cuda' requested but CuPy is not installed or finds no CUDA device")
        from vt.kernels.cuda_ops import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown backend {name!r}; expected 'auto', 'cuda', 'cpu' or 'numpy'")
