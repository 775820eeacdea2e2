"""Compile vt's kernel files with NVRTC for sm_90a on any machine, GPU or not, and read ptxas'
resource report (registers, spills) per kernel. `python3 -m tests.cuda_sim.nvrtc` prints it;
`python3 -m tests.cuda_sim.nvrtc --code` prints a hash of each kernel's machine code instead.

NVRTC comes from the nvidia-cuda-nvrtc-cu12 wheel (the `test` extra on Linux x86-64) or from a
CUDA install; without either, `load` raises NvrtcUnavailable (under CI, ToolchainMissing: an error,
never a skip)."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.cuda_sim import missing_toolchain
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
    raise missing_toolchain(NvrtcUnavailable, "no libnvrtc (pip install nvidia-cuda-nvrtc-cu12)")


def compile_report(lib: ctypes.CDLL, fname: str, arch: str = "sm_90a") -> tuple[int, str]:
    """(NVRTC's result code, its log with ptxas' -v lines) for one kernel file as cuda_ops builds it."""
    rc, log, _ = _compile(lib, fname, arch)
    return rc, log


def kernel_code(lib: ctypes.CDLL, fname: str, arch: str = "sm_90a") -> dict[str, str]:
    """Each kernel's machine code in the file's cubin, as a short hash: a change whose kernels all
    hash as before compiles to the same instructions, so it needs no device run to be trusted."""
    rc, log, cubin = _compile(lib, fname, arch)
    if rc:
        raise RuntimeError(f"{fname} does not compile:\n{log[-2000:]}")
    return {name[len(".text."):]: hashlib.sha256(code).hexdigest()[:12]
            for name, code in _elf_sections(cubin).items() if name.startswith(".text.")}


def _elf_sections(elf: bytes) -> dict[str, bytes]:
    """Section name -> contents of a little-endian ELF64 file (a cubin)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx]
    strtab = elf[names[4] : names[4] + names[5]]
    out = {}
    for name_off, _type, _flags, _addr, off, size in heads:
        name = strtab[name_off : strtab.index(b"\0", name_off)].decode()
        out[name] = elf[off : off + size]
    return out


def _compile(lib: ctypes.CDLL, fname: str, arch: str) -> tuple[int, str, bytes]:
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
    cubin = b""
    if rc == 0:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        code = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, code)
        cubin = code.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, buf.value.decode(errors="replace"), cubin


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
    """Every kernel file's registers and spills; with --code, each kernel's machine-code hash
    (run it in two checkouts and diff the output to see which kernels a change touched)."""
    lib = load()
    if "--code" in sys.argv[1:]:
        for fname in [*KERNEL_FILES, *ARCH_KERNEL_FILES]:
            for name, digest in sorted(kernel_code(lib, fname).items()):
                print(f"{fname} {name} {digest}")
        return
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
