"""What the runner stages from and into: each slot's host and device buffers, allocated once, and
the sampler row a running request holds.

A slot's buffers belong to the step holding the slot until that step is collected whole (a
masked step's second sampler pass included): staging writes them only for the next step on the
slot, so an in-flight step's inputs and outputs stay untouched. On CUDA the host halves are
pinned, so copies to and from the device are asynchronous on the slot's stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.kernels.base import Backend
from vt.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_BANNED = 16  # eos + stop_token_ids masked while min_tokens is not reached
# Sampling parameters kept by sampler row and gathered into a step's per-sequence buffers.
ROW_PARAM_FIELDS = (("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32),
                    ("min_p", np.float32), ("seeds", np.int64), ("presence", np.float32),
                    ("frequency", np.float32), ("repetition", np.float32))

# A (host, device) pair: the pinned staging array and the device array it is copied to.
HostDevice = tuple[np.ndarray, Any]


@dataclass
class SamplerRow:
    """The sampler row of a running request: its place in the device's per-row state (last
    token, output counts, prompt mask, bias line) and what staging needs to know of it."""

    index: int
    params: SamplingParams
    eos_ids: tuple[int, ...]
    penalized: bool
    guided: bool = False  # a grammar masks its tokens (structured outputs)
    num_blocks: int = 0   # entries of the row's block table line written so far
    # logit_bias / allowed_token_ids as SamplingParams.logit_entries() gives them, or None
    bias: tuple[tuple[int, ...], tuple[float, ...], bool] | None = None


@dataclass(frozen=True)
class SampledBuffers:
    """Pinned host outputs of one sampler pass."""

    ids: np.ndarray
    logprob: np.ndarray
    top_ids: np.ndarray
    top_lp: np.ndarray

    @classmethod
    def pinned(cls, ops: Backend, max_seqs: int) -> SampledBuffers:
        return cls(ops.pinned_empty((max_seqs,), np.int32), ops.pinned_empty((max_seqs,), np.float32),
                   ops.pinned_empty((max_seqs * MAX_LOGPROBS,), np.int32),
                   ops.pinned_empty((max_seqs * MAX_LOGPROBS,), np.float32))


class SlotBuffers:
    """Host staging and device inputs/outputs of one slot, allocated once: each input is a
    (host, device) pair, sized for the largest step."""

    def __init__(self, ops: Backend, max_tokens: int, max_seqs: int, max_blocks: int,
                 mask_words: int) -> None:
        def pair(shape: tuple[int, ...], np_dtype: Any, dtype: str) -> HostDevice:
            return ops.pinned_empty(shape, np_dtype), ops.zeros(shape, dtype)

        i32, f32 = np.int32, np.float32
        self.input_ids = pair((max_tokens,), i32, "i32")
        self.src_rows = pair((max_tokens,), i32, "i32")
        self.positions = pair((max_tokens,), i32, "i32")
        self.slot_mapping = pair((max_tokens,), i32, "i32")
        self.query_start_loc = pair((max_seqs + 1,), i32, "i32")
        self.seq_lens = pair((max_seqs,), i32, "i32")
        self.logits_indices = pair((max_seqs,), i32, "i32")
        self.block_tables = pair((max_seqs * max_blocks,), i32, "i32")
        self.sample_rows = pair((max_seqs,), i32, "i32")
        # The sampler rows whose tokens the step's sampler records: sample_rows, less the guided
        # rows of a masked step (masked_record_rows, recorded by its second sampler pass).
        self.record_rows = pair((max_seqs,), i32, "i32")
        self.masked_record_rows = pair((max_seqs,), i32, "i32")
        self.temperature = pair((max_seqs,), f32, "f32")
        self.top_k = pair((max_seqs,), i32, "i32")
        self.top_p = pair((max_seqs,), f32, "f32")
        self.min_p = pair((max_seqs,), f32, "f32")
        self.seeds = ops.pinned_empty((max_seqs,), np.int64), ops.zeros((max_seqs,), "i64")
        self.offsets = pair((max_seqs,), i32, "i32")
        self.presence = pair((max_seqs,), f32, "f32")
        self.frequency = pair((max_seqs,), f32, "f32")
        self.repetition = pair((max_seqs,), f32, "f32")
        self.ban = pair((max_seqs * MAX_BANNED,), i32, "i32")
        # Structured outputs: the token bitmasks of the step's guided rows, packed, and the batch
        # row each one masks. One mask row per sequence at most, like every per-row buffer.
        self.bitmask = pair((max_seqs * mask_words,), i32, "i32")
        self.mask_rows = pair((max_seqs,), i32, "i32")
        # logit_bias / allowed_token_ids: (batch row, table row, entries, exclusive) per biased row
        self.bias_sel = pair((max_seqs * 4,), i32, "i32")
        # the sampler's outputs: the (first) pass's, and a masked step's second pass's (its
        # guided rows'): ids, the chosen logprob, top ids and top logprobs
        self.out = SampledBuffers.pinned(ops, max_seqs)
        self.masked_out = SampledBuffers.pinned(ops, max_seqs)
