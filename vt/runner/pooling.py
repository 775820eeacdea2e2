"""An embedding model's step output: each finishing sequence's last hidden state after the final norm.

The pooling runner computes no logits and samples nothing. A step's forward gives the residual
stream; the rows its sequences end on (the staged logits_indices) are gathered and put through
the final norm (Transformer.norm_rows, the rows and the op the lm_head would read), and copied
into the slot's pinned host buffer in stream order, as the sampler's ids are. They come back in
the activation dtype (float32 on numpy, bf16 bits on CUDA) and are widened to float32 on the
host, where the per-request work (Matryoshka truncation, normalizing: vt.model.pooling) is a
few microseconds a vector. A sequence whose step only computed part of its prompt is gathered
too (the batch's rows are contiguous) and dropped at collection: only `sampled` rows are read.
"""

from __future__ import annotations

import numpy as np

from vt.kernels.base import Array, Backend
from vt.model.transformer import Transformer

# (request id, its pooled hidden state: float32[H]) for each sequence whose prompt the step finished
PooledRow = tuple[str, np.ndarray]


def _act_host_dtype(ops: Backend) -> type:
    """The host twin of the backend's act arrays: numpy computes in float32, CUDA keeps bf16 bits
    in uint16 (vt.kernels.cuda_core), and a copy to the host moves the bytes as they are."""
    return np.float32 if ops.name == "numpy" else np.uint16


def _widen(row: np.ndarray) -> np.ndarray:
    """A row of the host buffer as a float32 array of its own (the buffer is reused)."""
    if row.dtype == np.uint16:
        return (row.astype(np.uint32) << 16).view(np.float32)
    return np.array(row, dtype=np.float32)


class StepPooler:
    """Each slot's pinned buffer of pooled rows (allocated once, max_seqs rows), the device work
    that fills it and the host side that reads it."""

    def __init__(self, ops: Backend, model: Transformer, num_slots: int, max_seqs: int) -> None:
        self.ops, self.model = ops, model
        dtype = _act_host_dtype(ops)
        self.host = [ops.pinned_empty((max_seqs, model.cfg.hidden_size), dtype) for _ in range(num_slots)]

    def pool(self, slot: int, hidden: Array, rows: Array, num_seqs: int) -> None:
        """On slot's stream, after the forward: the final norm of rows `rows` (one per sequence)
        of the residual stream `hidden`, copied into the slot's host buffer."""
        self.ops.copy_d2h(self.host[slot][:num_seqs], self.model.norm_rows(hidden, rows))

    def collect(self, slot: int, sampled: list[tuple[int, str]]) -> tuple[PooledRow, ...]:
        """Once the slot's step completed: the pooled rows of the sequences whose prompt it
        finished, (batch row, request id) as staging listed them."""
        host = self.host[slot]
        return tuple((request_id, _widen(host[b])) for b, request_id in sampled)
