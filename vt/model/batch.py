"""ForwardBatch: the arrays one forward pass reads, already on the backend."""

from __future__ import annotations

from typing import Any, NamedTuple


class ForwardBatch(NamedTuple):
    """Inputs of one step over a ragged batch (backend arrays unless noted).

    T tokens from B sequences; sequence b owns rows query_start_loc[b]:query_start_loc[b+1].
    """

    input_ids: Any        # i32[T]
    positions: Any        # i32[T]
    slot_mapping: Any     # i32[T]  block * block_size + offset; < 0 = padding, not written
    query_start_loc: Any  # i32[B + 1]
    seq_lens: Any         # i32[B]  context length after this step's tokens
    block_tables: Any     # i32[B, max_blocks]
    logits_indices: Any   # i32[B]  row of each sequence's last token
    max_query_len: int    # host
    max_seq_len: int      # host
    num_decodes: int = 0  # host: the first num_decodes sequences have one query row each
    cascade_blocks: int = 0  # host: leading blocks every decode shares (cascade attention), or 0
