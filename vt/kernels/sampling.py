"""Launchers of sampling.cu: logit processing (biases, penalties, bans, grammar masks), the
counter-based sampler, logprobs, and recording sampled tokens into the rows' history.
Shapes and semantics are base.Backend's; numpy_sampling is the reference."""

from __future__ import annotations

import cupy
import numpy as np

from vt.kernels.cuda_core import CudaCore

KERNELS = {
    "sampling.cu": (
        "log_softmax_topk_k",
        "penalize_k",
        "ban_tokens_k",
        "apply_token_bitmask_k",
        "bias_logits_k",
        "record_sampled_k",
        "sample_k",
        "sample_combine_k",
    ),
}
_SAMPLE_SPLIT_MIN = 16384  # fewest logits per block when a sampler row is split
_i32 = np.int32


def _logits_shape(logits: cupy.ndarray) -> tuple[int, int]:
    if logits.dtype != np.float32 or logits.ndim != 2 or not logits.flags.c_contiguous:
        raise ValueError(f"logits must be C-contiguous f32[B, V], got {logits.dtype}{logits.shape}")
    return logits.shape


class SamplingOps(CudaCore):
    def log_softmax_topk(
        self, logits: cupy.ndarray, ids: cupy.ndarray, k: int
    ) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
        b, v = _logits_shape(logits)
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        k = min(k, v)
        chosen = self._out((b,), np.float32)
        top_ids = self._out((b, k), np.int32)
        top_lp = self._out((b, k), np.float32)
        if b:
            self._launch(
                "log_softmax_topk_k", (b,), (1024,), (logits, ids, chosen, top_ids, top_lp, _i32(v), _i32(k))
            )
        return chosen, top_ids, top_lp

    def penalize(
        self,
        logits: cupy.ndarray,
        rows: cupy.ndarray,
        out_counts: cupy.ndarray,
        prompt_mask: cupy.ndarray,
        presence: cupy.ndarray,
        frequency: cupy.ndarray,
        repetition: cupy.ndarray,
    ) -> None:
        b, v = _logits_shape(logits)
        if out_counts.shape[1] != v or prompt_mask.shape[1] != v:
            raise ValueError(
                f"penalize: vocab {v} vs out_counts {out_counts.shape}, prompt_mask {prompt_mask.shape}"
            )
        if b:
            self._launch(
                "penalize_k",
                (-(-v // 256), b),
                (256,),
                (logits, rows, out_counts, prompt_mask, presence, frequency, repetition, _i32(v)),
            )

    def ban_tokens(self, logits: cupy.ndarray, ban: cupy.ndarray) -> None:
        b, v = _logits_shape(logits)
        if b and ban.shape[1]:
            self._launch("ban_tokens_k", (b,), (128,), (logits, ban, _i32(ban.shape[1]), _i32(v)))

    def bias_logits(self, logits: cupy.ndarray, sel: cupy.ndarray, tokens: cupy.ndarray,
                    biases: cupy.ndarray) -> None:
        b, v = _logits_shape(logits)
        m = sel.shape[0]
        if sel.dtype != np.int32 or sel.ndim != 2 or sel.shape[1] != 4 or not sel.flags.c_contiguous:
            raise ValueError(f"sel must be C-contiguous i32[{m}, 4], got {sel.dtype}{sel.shape}")
        if tokens.shape != biases.shape or tokens.dtype != np.int32 or biases.dtype != np.float32:
            raise ValueError(f"tokens i32[R, C] and biases f32[R, C] must match, got "
                             f"{tokens.dtype}{tokens.shape} and {biases.dtype}{biases.shape}")
        if m and b:
            self._launch("bias_logits_k", (-(-v // 256), m), (256,),
                         (logits, sel, tokens, biases, _i32(tokens.shape[1]), _i32(b), _i32(v)))

    def apply_token_bitmask(self, logits: cupy.ndarray, bitmask: cupy.ndarray, rows: cupy.ndarray) -> None:
        b, v = _logits_shape(logits)
        m = rows.shape[0]
        if bitmask.dtype != np.int32 or bitmask.ndim != 2 or bitmask.shape[0] != m \
                or not bitmask.flags.c_contiguous:
            raise ValueError(f"bitmask must be C-contiguous i32[{m}, W], got {bitmask.dtype}{bitmask.shape}")
        if m and b:
            self._launch("apply_token_bitmask_k", (-(-v // 256), m), (256,),
                         (logits, bitmask, rows, _i32(bitmask.shape[1]), _i32(b), _i32(v)))

    def sample(
        self,
        logits: cupy.ndarray,
        temperature: cupy.ndarray,
        top_k: cupy.ndarray,
        top_p: cupy.ndarray,
        min_p: cupy.ndarray,
        seeds: cupy.ndarray,
        offsets: cupy.ndarray,
    ) -> cupy.ndarray:
        b, v = _logits_shape(logits)
        if seeds.dtype.itemsize != 8:
            raise ValueError(f"seeds must be 64-bit, got {seeds.dtype}")
        out = self._out((b,), np.int32)
        if b:
            # Rows without filters (greedy, plain temperature) split over several blocks when
            # the batch leaves SMs idle; their (score, id) partials are combined exactly.
            splits = max(1, min(self._num_sms // b, v // _SAMPLE_SPLIT_MIN, 32))
            part_v = part_i = 0
            if splits > 1:
                s = self._slot_ctx()
                scratch = s.sampler if s is not None else cupy.empty((self._sampler_bytes,), np.uint8)
                part_v = cupy.ndarray((b * splits,), np.float32, memptr=scratch.data)
                part_i = cupy.ndarray((b * splits,), np.int32, memptr=scratch.data + self._sampler_bytes // 2)
            self._launch(
                "sample_k",
                (splits, b),
                (1024,),
                (logits, temperature, top_k, top_p, min_p, seeds, offsets, out, part_v, part_i, _i32(v),
                 _i32(splits)),
            )
            if splits > 1:
                self._launch("sample_combine_k", (b,), (32,), (part_v, part_i, out, _i32(splits)))
        return out

    def record_sampled(
        self, last_tokens: cupy.ndarray, out_counts: cupy.ndarray, rows: cupy.ndarray, ids: cupy.ndarray
    ) -> None:
        n = rows.shape[0]
        if n:
            self._launch(
                "record_sampled_k",
                (-(-n // 256),),
                (256,),
                (
                    last_tokens,
                    out_counts,
                    rows,
                    ids,
                    _i32(n),
                    _i32(out_counts.shape[0]),
                    _i32(out_counts.shape[1]),
                ),
            )
