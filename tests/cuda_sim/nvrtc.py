"""Compile vt's kernel files with NVRTC for sm_90a on any machine, GPU or not, and read ptxas'
resource report (registers, spills) per kernel. `python3 -m tests.cuda_sim.nvrtc` prints it.

NVRTC comes from the nvidia-cuda-nvrtc-cu12 wheel (the `test` extra on Linux x86-64) or from a
CUDA install; without either, `load` raises NvrtcUnavailable."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import re
from dataclasses import dataclass
from pathlib import Path

from vt.kernels.sources import ARCH_KERNEL_FILES, KERNEL_FILES, translation_unit


class NvrtcUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class KernelResources:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int


def load() -> ctypes.CDLL:
    candidates: list[str] = []
    try:
        import nvidia.cuda_nvrtc as pkg  # the pip wheel

        for root in pkg.__path__:
            candidates += sorted(glob.glob(str(Path(root) / "lib" / "libnvrtc.so*")))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for c in candidates:
        if "builtins" in c or ".alt." in c:
            continue
        try:
            return ctypes.CDLL(c)
        except OSError:
            continue
    raise NvrtcUnavailable("no libnvrtc (pip install nvidia-cuda-nvrtc-cu12)")


def compile_report(lib: ctypes.CDLL, fname: str, arch: str = "sm_90a") -> tuple[int, str]:
    """(NVRTC's result code, its log with ptxas' -v lines) for one kernel file as cuda_ops builds it."""
    prog = ctypes.c_void_p()
    src = translation_unit(fname).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), src, fname.encode(), 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    opts = [b"-std=c++17", f"-arch={arch}".encode(), b"-Xptxas", b"-v"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, buf.value.decode(errors="replace")


def resources(log: str) -> list[KernelResources]:
    out: list[KernelResources] = []
    name, stores, loads = None, 0, 0
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            name, stores, loads = m.group(1), 0, 0
        elif m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line):
            stores, loads = int(m.group(1)), int(m.group(2))
        elif (m := re.search(r"Used (\d+) registers", line)) and name:
            out.append(KernelResources(name, int(m.group(1)), stores, loads))
            name = None
    return out


def main() -> None:
    lib = load()
    for fname in [*KERNEL_FILES, *ARCH_KERNEL_FILES]:
        rc, log = compile_report(lib, fname)
        print(f"{fname}: {'ok' if rc == 0 else 'FAILED'}")
        if rc:
            print(log)
        for r in sorted(resources(log), key=lambda r: r.name):
            spilled = r.spill_stores or r.spill_loads
            spill = f", spills {r.spill_stores} / {r.spill_loads} bytes" if spilled else ""
            print(f"  {r.name:36s} {r.registers:4d} registers{spill}")


if __name__ == "__main__":
    main()
