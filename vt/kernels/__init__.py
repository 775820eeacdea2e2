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


def get_backend(name: str = "auto", tensor_parallel_size: int = 1) -> Backend:
    """"auto": CUDA when a device is usable, else numpy; "cuda"; "cpu" or "numpy".
    tensor_parallel_size > 1: a group of that many ranks driven from this process."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be a positive integer, got {tensor_parallel_size!r}")
    if name == "auto":
        name = "cuda" if cuda_available() else "numpy"
    if name in ("cpu", "numpy"):
        from vt.kernels.numpy_ops import NumpyBackend

        if tensor_parallel_size == 1:
            return NumpyBackend()
        from vt.kernels.parallel import InProcessCommunicator
        from vt.kernels.rank_group import RankGroup

        ranks = [NumpyBackend() for _ in range(tensor_parallel_size)]
        return RankGroup(ranks, InProcessCommunicator(tensor_parallel_size))
    if name == "cuda":
        if tensor_parallel_size > 1:
            raise ValueError(f"--tensor-parallel-size {tensor_parallel_size}: the CUDA backend drives one "
                             "GPU for now (tensor parallelism runs on the numpy backend, --device cpu); use "
                             "1, or one server per GPU behind a router (vt replicas)")
        if not cuda_available():
            raise RuntimeError("device 'cuda' requested but CuPy is not installed or finds no CUDA device")
        from vt.kernels.cuda_ops import CudaBackend

        return CudaBackend()
    raise ValueError(f"unknown backend {name!r}; expected 'auto', 'cuda', 'cpu' or 'numpy'")
