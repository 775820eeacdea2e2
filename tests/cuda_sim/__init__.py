"""Build vt's CUDA kernel files for the host simulator (sim_runtime.h) and launch them from numpy.

The kernels are the very sources NVRTC compiles (vt.kernels.sources), with the PTX wrappers
(tensor_core.cu, wgmma.cu) swapped for sim_tensor_core.h and sim_wgmma.h. Needs a C++17
compiler; `build` raises SimUnavailable without one. `python3 -m tests.cuda_sim.nvrtc` compiles
the same files for sm_90a instead.

Tests skip on SimUnavailable (and nvrtc.NvrtcUnavailable) where the toolchain is missing, except
under CI: there the toolchain is part of the image, and `missing_toolchain` raises ToolchainMissing,
which no test catches, so a CI run that lost g++ or NVRTC fails rather than skipping every kernel
check it exists for."""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from vt.kernels.attention_plan import launch_shape
from vt.kernels.sources import read_source, translation_unit

HERE = Path(__file__).resolve().parent

# The tensor-core kernels' parameter list (ATTN_TC_PARAMS) as ctypes types, in order.
_TC_ARGTYPES = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                ctypes.c_int, ctypes.c_float]
_LAUNCH_ARGTYPES = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t]
# The blocks a persistent grid has on the simulator: few, so that each runs several items.
SIM_RESIDENT = 3


class SimUnavailable(RuntimeError):
    """No host C++ compiler: the simulator tests skip (never under CI, see missing_toolchain)."""


class ToolchainMissing(RuntimeError):
    """A compiler or NVRTC missing under CI: an error, never a skip."""


def under_ci() -> bool:
    """CI services set CI (GitHub Actions, GitLab CI, Buildkite, ...: CI=true)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def missing_toolchain(skippable: type[RuntimeError], message: str) -> RuntimeError:
    """The exception to raise for a missing toolchain: `skippable` (which tests turn into a skip),
    or under CI a ToolchainMissing naming what to install."""
    if under_ci():
        return ToolchainMissing(f"{message}; CI runs the kernel tests, so its image must provide it")
    return skippable(message)


# The simulator's versions of the PTX wrapper files.
SIM_WRAPPERS = {"tensor_core.cu": '#include "sim_tensor_core.h"\n', "wgmma.cu": '#include "sim_wgmma.h"\n'}


def host_source(tu: str) -> str:
    """A translation unit (with SIM_WRAPPERS in place of the PTX wrappers) as host C++."""
    # Blocks run one at a time on the host: dynamic shared memory is the simulator's buffer.
    tu = re.sub(r"extern __shared__\s+(?:__align__\(\d+\)\s*)?([\w ]+?)\s+(\w+)\[\];",
                r"\1* \2 = reinterpret_cast<\1*>(sim::g_smem);", tu)
    return '#include "sim_runtime.h"\n' + tu


def _launchers(src: str) -> str:
    out = []
    for name in re.findall(r"^ATTENTION_(?!ITEMS_)\w*ENTRY\((\w+)[,)]", src, flags=re.M):
        out.append(f'extern "C" int sim_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, '
                   f'size_t smem, ATTN_TC_PARAMS) {{ return sim::launch(gx, gy, gz, threads, smem, '
                   f'[&] {{ {name}(ATTN_TC_ARGS); }}); }}')
    # the kernels over items take the launch's item space last (attention_plan.launch_shape)
    for name in re.findall(r"^ATTENTION_ITEMS_ENTRY\((\w+)[,)]", src, flags=re.M):
        out.append(f'extern "C" int sim_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, '
                   f'size_t smem, ATTN_TC_PARAMS, int row_tiles, int zcount) {{ return sim::launch(gx, gy, '
                   f'gz, threads, smem, [&] {{ {name}(ATTN_TC_ARGS, row_tiles, zcount); }}); }}')
    return "\n".join(out)


_SCALAR = """
#define SIM_SCALAR_ATTENTION(NAME)                                                                   \\
    extern "C" int sim_##NAME(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem,  \\
                              const bf16_t* q, int q_stride, const bf16_t* k_cache, const bf16_t* v_cache, \\
                              const int* qsl, const int* seq_lens, const int* block_tables, int max_blocks, \\
                              bf16_t* out, float* part_o, float* part_ml, int total_tokens, int hq, int hk, \\
                              int d, int block_size, float scale_log2, int num_splits, float v_scale) { \\
        return sim::launch(gx, gy, gz, threads, smem, [&] {                                          \\
            NAME(q, q_stride, k_cache, v_cache, qsl, seq_lens, block_tables, max_blocks, out, part_o,  \\
                 part_ml, total_tokens, hq, hk, d, block_size, scale_log2, num_splits, v_scale); }); \\
    }
SIM_SCALAR_ATTENTION(attention_r1)
SIM_SCALAR_ATTENTION(attention_r2)
SIM_SCALAR_ATTENTION(attention_r4)
SIM_SCALAR_ATTENTION(attention_r1_kv8)
SIM_SCALAR_ATTENTION(attention_r2_kv8)
SIM_SCALAR_ATTENTION(attention_r4_kv8)
"""

_COMBINE = """
extern "C" int sim_attention_combine_k(unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                                       size_t smem, const float* part_o, const float* part_ml,
                                       const int* qsl, const int* seq_lens, int num_seqs, bf16_t* out,
                                       int total_tokens, int hq, int d, int num_splits, int key_tile) {
    return sim::launch(gx, gy, gz, threads, smem, [&] {
        attention_combine_k(part_o, part_ml, qsl, seq_lens, num_seqs, out, total_tokens, hq, d, num_splits,
                            key_tile); });
}
"""


# Element kernels the simulator launches: name -> (C parameters, the call's arguments).
_ELEMENT_KERNELS = {
    "silu_mul_k": ("const bf16_t* x, bf16_t* out, int tokens, int inter, const bf16_t* rms_of, "
                   "int rms_width, float eps", "x, out, tokens, inter, rms_of, rms_width, eps"),
    **{name: (
        "bf16_t* q, int q_stride, bf16_t* k, int k_stride, bf16_t* v, int v_stride, const bf16_t* q_norm, "
        "const bf16_t* k_norm, float eps, const int* positions, const float* inv_freq, bf16_t* k_cache, "
        "bf16_t* v_cache, const int* slot_mapping, long long num_slots, int tokens, int hq, int hk, int d, "
        "const bf16_t* rms_of, int rms_width, const bf16_t* bias, float k_scale, float v_scale, "
        "const float* x_scale, const float* w_scale",
        "q, q_stride, k, k_stride, v, v_stride, q_norm, k_norm, eps, positions, inv_freq, k_cache, v_cache, "
        "slot_mapping, num_slots, tokens, hq, hk, d, rms_of, rms_width, bias, k_scale, v_scale, x_scale, "
        "w_scale")
       for name in ("qk_norm_rope_write_kv_k", "qk_norm_rope_write_kv8_k")},
    "round_q_e4m3_pow2_k": ("bf16_t* q, int q_stride, int d", "q, q_stride, d"),
    "write_kv_k": (
        "const bf16_t* k, int k_stride, const bf16_t* v, int v_stride, bf16_t* k_cache, bf16_t* v_cache, "
        "const int* slot_mapping, int row_elems, long long num_slots, float k_scale, float v_scale, int kv8",
        "k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, row_elems, num_slots, k_scale, v_scale, "
        "kv8"),
}


def launchers(kernels: Mapping[str, tuple[str, str]]) -> str:
    """A `sim_<kernel>` launcher (grid x, y, z, threads, smem bytes, then the kernel's arguments)
    for each kernel: name -> (its C parameters, the call's arguments)."""
    return "\n".join(
        f'extern "C" int sim_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem, '
        f"{params}) {{ return sim::launch(gx, gy, gz, threads, smem, [&] {{ {name}({args}); }}); }}"
        for name, (params, args) in kernels.items()
    )


def compile_host(tag: str, src: str) -> ctypes.CDLL:
    """Host C++ (from host_source, plus launchers) built once per content into a shared library."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise missing_toolchain(SimUnavailable, "no C++ compiler (g++) on this machine")
    headers = "".join((HERE / h).read_text() for h in ("sim_runtime.h", "sim_tensor_core.h", "sim_wgmma.h"))
    key = hashlib.sha256((src + headers).encode()).hexdigest()[:16]
    cache = Path(tempfile.gettempdir()) / "vt-cuda-sim"
    cache.mkdir(exist_ok=True)
    lib = cache / f"{tag}-{key}.so"
    if not lib.exists():
        cpp = cache / f"{tag}-{key}.cpp"
        cpp.write_text(src)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        cmd = [cxx, "-std=c++17", "-O1", "-shared", "-fPIC", "-w", f"-I{HERE}", str(cpp), "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"host build of {tag} failed:\n{res.stderr[-4000:]}")
        tmp.replace(lib)
    return ctypes.CDLL(str(lib))


def build(fname: str) -> ctypes.CDLL:
    """The kernel file compiled for the host, with a `sim_<kernel>` launcher per entry point
    (grid x, y, z, threads, smem bytes, then the kernel's own arguments)."""
    src = host_source(translation_unit(fname, replace=SIM_WRAPPERS))
    if fname in ("attention_tc.cu", "attention_wg.cu"):
        src += "\n" + _launchers(read_source(fname))
    elif fname == "attention.cu":
        src += _SCALAR + _COMBINE
    elif fname == "elementwise.cu":
        src += "\n" + launchers(_ELEMENT_KERNELS)
    return compile_host(Path(fname).stem, src)


# The launch arguments every sim_<kernel> takes first: grid x, y, z, threads, shared memory bytes.
LAUNCH_ARGTYPES = [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_size_t]


def build_kernels(fname: str, kernels: Mapping[str, tuple[str, str, list]]) -> ctypes.CDLL:
    """The kernel file compiled for the host with a typed `sim_<kernel>` launcher for each of
    `kernels`: name -> (its C parameters, the call's arguments, their ctypes after the launch's)."""
    src = host_source(translation_unit(fname, replace=SIM_WRAPPERS))
    typed = launchers({n: (params, args) for n, (params, args, _) in kernels.items()})
    lib = compile_host(Path(fname).stem, src + "\n" + typed)
    for name, (_, _, argtypes) in kernels.items():
        getattr(lib, f"sim_{name}").argtypes = LAUNCH_ARGTYPES + argtypes
    return lib


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16, as the uint16 bits the kernels read (contiguous)."""
    return np.ascontiguousarray(np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16))


def bf16_float(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) as float32 values."""
    return bits.view(ml_dtypes.bfloat16).astype(np.float32)


def _ptr(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


class SimAttention:
    """The attention kernels (attention_tc.cu, attention_wg.cu, attention.cu's CUDA-core ones and
    attention_combine_k), launched over numpy arrays laid out as cuda_ops lays them (bf16 as
    uint16 bits)."""

    def __init__(self) -> None:
        self.tc = build("attention_tc.cu")
        self.wg = build("attention_wg.cu")
        self.scalar = build("attention.cu")
        self.scalar.sim_attention_combine_k.argtypes = _LAUNCH_ARGTYPES + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]

    def launch(self, kernel: str, grid: tuple[int, int, int], threads: int, smem: int,
               q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, query_start_loc: np.ndarray,
               seq_lens: np.ndarray, block_tables: np.ndarray, scale: float, splits: int,
               late: bool = False, order: int = 0, kv_scales: tuple[float, float] = (1.0, 1.0),
               key_tile: int = 0) -> np.ndarray:
        """The attention kernel (partials), then with splits > 1 attention_combine_k told key_tile
        (attention_plan.combine_key_tile; 0 merges every split): the output rows."""
        out, part_o, part_ml = self.partials(kernel, grid, threads, smem, q, k_cache, v_cache,
                                             query_start_loc, seq_lens, block_tables, scale, splits, late,
                                             order, kv_scales)
        if splits > 1:
            self.combine(part_o, part_ml, query_start_loc, seq_lens, out, key_tile)
        return out

    def partials(self, kernel: str, grid: tuple[int, int, int], threads: int, smem: int,
                 q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, query_start_loc: np.ndarray,
                 seq_lens: np.ndarray, block_tables: np.ndarray, scale: float, splits: int,
                 late: bool = False, order: int = 0, kv_scales: tuple[float, float] = (1.0, 1.0)
                 ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """The attention kernel alone: (out, part_o, part_ml), out written with one split, the
        split partials (None with one) otherwise.
        late: asynchronous copies and wgmma products land only at the waits that guarantee
        them (a read before its wait sees stale data); otherwise at issue (a buffer refilled
        while still read shows). order: which thread runs when one blocks (sim_runtime.h: 0
        round-robin, 1 lowest first, 2 highest first, 3+ seeded random); a barrier missing
        between warps shows in the orders that let one run ahead. kv_scales: an fp8 cache's
        (k_scale, v_scale), passed as cuda_ops passes them (k_scale in the score scale)."""
        t, hq, d = q.shape
        _, bs, hk, _ = k_cache.shape
        out = np.zeros((t, hq, d), np.uint16)
        part_o = np.zeros((splits, t, hq, d), np.float32) if splits > 1 else None
        part_ml = np.zeros((splits, t, hq, 2), np.float32) if splits > 1 else None
        scalar = kernel.startswith("attention_r")
        lib = self.scalar if scalar else self.wg if kernel.startswith("attention_wg") else self.tc
        lib.sim_set_timing(int(late), int(late), ctypes.c_uint(order))
        fn = getattr(lib, f"sim_{kernel}")
        # a kernel over items: its 1-D grid (a persistent one of SIM_RESIDENT blocks) and item space
        grid, items = launch_shape(kernel, grid[0], grid[1], grid[2], SIM_RESIDENT)
        # the CUDA-core kernels take the head dim after hk (attention.cu)
        fn.argtypes = (_LAUNCH_ARGTYPES + _TC_ARGTYPES[:14] + [ctypes.c_int] * scalar + _TC_ARGTYPES[14:]
                       + [ctypes.c_int] * len(items))
        head = (d,) if scalar else ()
        rc = fn(*grid, threads, smem, _ptr(q), hq * d, _ptr(k_cache), _ptr(v_cache), _ptr(query_start_loc),
                _ptr(seq_lens), _ptr(block_tables), block_tables.shape[1], _ptr(out), _ptr(part_o),
                _ptr(part_ml), t, hq, hk, *head, bs, scale * np.log2(np.e) * kv_scales[0], splits,
                kv_scales[1], *items)
        if rc == 2:
            raise ValueError(f"{kernel}: a block wrote past the {smem} bytes of shared memory it was "
                             "launched with")
        if rc:
            raise ValueError(f"{kernel}: launch refused ({threads} threads, {smem} bytes of shared memory)")
        return out, part_o, part_ml

    def combine(self, part_o: np.ndarray, part_ml: np.ndarray, query_start_loc: np.ndarray,
                seq_lens: np.ndarray, out: np.ndarray, key_tile: int = 0) -> np.ndarray:
        """attention_combine_k over split partials [splits, T, Hq, D | 2] into out [T, Hq, D]
        (bf16 bits), as cuda_ops launches it: key_tile 0 merges every split."""
        splits, t, hq, d = part_o.shape
        assert part_o.flags.c_contiguous and part_ml.flags.c_contiguous and out.flags.c_contiguous
        rc = self.scalar.sim_attention_combine_k(t * hq, 1, 1, 64, 0, _ptr(part_o), _ptr(part_ml),
                                                 _ptr(query_start_loc), _ptr(seq_lens), seq_lens.shape[0],
                                                 _ptr(out), t, hq, d, splits, key_tile)
        assert rc == 0
        return out
