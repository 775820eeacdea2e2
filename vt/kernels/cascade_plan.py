"""Cascade attention for decodes that share a prompt prefix (no CuPy here, so the rules are
testable anywhere).

When every decode of a step starts with the same cached blocks (a shared system prompt or
few-shot prefix, which the prefix cache stores once), each decode kernel would read those keys
again for its own query. The cascade reads them once: all the decodes' queries against the shared
keys as one non-causal block (a prompt-attention shape on tensor cores), each decode's own keys
by the decode kernel, and the two merged by their log-sum-exps, the way split-key partials merge.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from vt.kernels.arena import ALIGN, aligned

# Below these a step's decodes attend as usual: the prefix launch and the merge cost more than
# the shared keys' second and later reads (a few decodes, or a short shared prefix).
CASCADE_MIN_DECODES = 32
CASCADE_MIN_KEYS = 256


def common_prefix_blocks(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                         min_decodes: int = CASCADE_MIN_DECODES, min_keys: int = CASCADE_MIN_KEYS) -> int:
    """The leading blocks that every row of block_tables (the step's decodes, i32[B, max_blocks],
    host) holds, limited to blocks of keys before each row's last one (so each decode keeps at
    least its own newest key), or 0 where the step should not cascade: fewer than min_decodes
    rows, or fewer than min_keys shared keys."""
    n = block_tables.shape[0]
    if n < max(min_decodes, 1) or block_size <= 0:
        return 0
    # Blocks holding only keys before a row's last key: (len - 1) // block_size of them.
    limit = min(int((np.min(seq_lens[:n]) - 1) // block_size), block_tables.shape[1])
    if limit * block_size < min_keys:
        return 0
    same = np.all(block_tables[:, :limit] == block_tables[0, :limit], axis=0)
    blocks = int(limit if same.all() else np.argmin(same))
    return blocks if blocks * block_size >= min_keys else 0


class CascadeScratch(NamedTuple):
    """Where a cascade's scratch lies in the attention partials buffer, in bytes from its start:
    the permuted queries act[Hk, B, G, D], the suffix lengths i32[B] and the prefix launch's
    query_start_loc i32[2] and seq_lens i32[1], then o f32[Sp + Ss, B * Hq, D] and (m, l)
    f32[Sp + Ss, B * Hq, 2], the prefix launch's Sp splits first."""

    q_perm: int
    ints: int
    part_o: int
    part_ml: int
    end: int


def cascade_scratch(prefix_splits: int, suffix_splits: int, seqs: int, num_heads: int,
                    head_dim: int) -> CascadeScratch:
    """The layout of a cascade of prefix_splits + suffix_splits key splits over `seqs` decodes."""
    rows = seqs * num_heads
    splits = prefix_splits + suffix_splits
    ints = aligned(rows * head_dim * 2)
    part_o = ints + aligned((seqs + 3) * 4)
    part_ml = part_o + aligned(splits * rows * head_dim * 4)
    return CascadeScratch(0, ints, part_o, part_ml, part_ml + aligned(splits * rows * 2 * 4))


# The most splits a cascade takes: its two launches' key splits together.
CASCADE_MAX_SPLITS = 128
# Fewer than this and it does not run: each of its two launches needs two splits to write partials.
CASCADE_MIN_SPLITS = 4


def cascade_splits_within(budget: int, seqs: int, num_heads: int, head_dim: int) -> int:
    """The most splits (prefix and suffix together, up to CASCADE_MAX_SPLITS) whose cascade
    scratch fits budget bytes; 0 where fewer than CASCADE_MIN_SPLITS fit. Runs at every layer of
    a cascade step: an estimate from the bytes a split takes, then the exact layout's check."""
    def fits(s: int) -> bool:
        return cascade_scratch(s, 0, seqs, num_heads, head_dim).end <= budget

    fixed = cascade_scratch(0, 0, seqs, num_heads, head_dim).end
    per_split = seqs * num_heads * (head_dim + 2) * 4
    s = max(0, min(CASCADE_MAX_SPLITS, (budget - fixed - 2 * ALIGN) // per_split))
    while s < CASCADE_MAX_SPLITS and fits(s + 1):
        s += 1
    while s and not fits(s):
        s -= 1
    return s if s >= CASCADE_MIN_SPLITS else 0
