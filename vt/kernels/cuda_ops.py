"""The CUDA backend: bf16 weights and activations, RawKernels from the *.cu files, cuBLAS GEMMs.

CudaBackend is the core (cuda_core.py: kernels, memory, slots, graphs) with every op family's
launchers, each beside its kernels: elementwise.py, attention.py, sampling.py, gemm.py, fp8.py.
"""

from __future__ import annotations

from vt.kernels import attention, elementwise, fp8, gemm, sampling
from vt.kernels.attention import AttentionOps, requested_prefill_tiling
from vt.kernels.cuda_core import requested_count, requested_switch
from vt.kernels.elementwise import ElementwiseOps
from vt.kernels.fp8 import UNIT_ROWS_LIMIT, Fp8Ops, requested_fp8_per_tensor_rows
from vt.kernels.gemm import GemmOps, requested_gemv_max_tokens
from vt.kernels.quantized import UNIT_SCALE_MAX_ROWS
from vt.kernels.sampling import SamplingOps


class CudaBackend(ElementwiseOps, AttentionOps, SamplingOps, GemmOps, Fp8Ops):
    """base.Backend on one GPU; prefill_tiling (or VT_PREFILL_TILING) picks the prompt attention
    tiling (attention_plan.PREFILL_TILINGS); gemv_max_tokens (or VT_GEMV_MAX_TOKENS) the largest
    step whose projections run on gemv.cu; fp8_per_tensor_rows (or VT_FP8_PER_TENSOR_ROWS) the
    largest whose fp8 residual projections take unit-scale GEMMs (quantized.unit_scale_rows);
    VT_FP8_FOLD_ADD=0 adds o_proj's unit-scale product in a launch of its own rather than in the
    post-attention norm (fp8.linear_fp8_residual);
    VT_FP8_UNIT_GATE_UP_ROWS and VT_FP8_UNIT_QKV_ROWS the most rows whose gate_up (fp8.mlp_act_fp8)
    and qkv (fp8.linear_fp8_defer) take cuBLASLt's per-tensor kernel with unit scales (0: none);
    VT_FP8_HELD_ROWS=0 the generic per-token quantizing kernels in place of the held-row ones (fp8.py)."""

    def __init__(self, workspace_bytes: int = 512 << 20, cublas_workspace_bytes: int = 32 << 20,
                 partials_bytes: int = 64 << 20, prefill_tiling: str | None = None,
                 gemv_max_tokens: int | None = None, fp8_per_tensor_rows: int | None = None) -> None:
        requested = requested_prefill_tiling(prefill_tiling)
        self.gemv_max_tokens = requested_gemv_max_tokens(gemv_max_tokens)
        self.fp8_per_tensor_rows = requested_fp8_per_tensor_rows(fp8_per_tensor_rows)
        self.fp8_fold_add = requested_switch("VT_FP8_FOLD_ADD")
        self.fp8_held_rows = requested_switch("VT_FP8_HELD_ROWS")
        self.fp8_unit_gate_up_rows = requested_count(None, "VT_FP8_UNIT_GATE_UP_ROWS", UNIT_SCALE_MAX_ROWS,
                                                     UNIT_ROWS_LIMIT)
        self.fp8_unit_qkv_rows = requested_count(None, "VT_FP8_UNIT_QKV_ROWS", UNIT_SCALE_MAX_ROWS,
                                                 UNIT_ROWS_LIMIT)
        kernels = {**elementwise.KERNELS, **attention.KERNELS, **sampling.KERNELS, **gemm.KERNELS,
                   **fp8.KERNELS}
        super().__init__(kernels, workspace_bytes, cublas_workspace_bytes, partials_bytes)
        self._init_attention(requested)
