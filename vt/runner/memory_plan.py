"""Device memory a step needs, derived from the ops that run it, for the largest step the flags allow.

Each in-flight slot owns two fixed regions, reserved at start before the KV cache is sized:
- the arena, a bump allocator the ops take their outputs from (vt.kernels.arena). A step holds
  the residual stream for its whole length, one layer's outputs at a time (the forward rewinds
  the arena at each layer), then the head's and the sampler's outputs, twice (a step with guided
  rows samples them again in a second pass once their masks are in). `step_arena_bytes` counts
  exactly those allocations, in the forward's order and alignment; the numpy backend keeps the
  same ledger at CUDA sizes, so every CPU run checks this count.
- split-key attention partials, which attention keeps between its kernel and the combine.
  Attention chooses its key splits to fit the budget, so no context length or batch shape can
  outgrow it; the budget only limits how far short grids are spread over the chip. (The split
  sampler's partials, at most one per SM, are sized by the CUDA backend from the chip itself
  and taken when it starts, before this plan is checked against free memory.)

Split over a tensor-parallel group, each rank has its own arena and scratch, and the plan is one
rank's: the residual stream in full, its own heads and MLP columns, its vocabulary rows' logits
and the gathered full logits (vt.kernels.rank_group).

Every term is monotone in tokens, sequences and logprobs, so the step of
max(max_num_batched_tokens, max_num_seqs) tokens over max_num_seqs sequences, each sampled with
MAX_LOGPROBS top logprobs, bounds every step: a step never has more tokens (the scheduler's
budget; chunked or not, a prompt longer than the budget is refused at admission), more sequences,
or more logprobs. Decode graphs and piecewise graphs are captured for sizes within those bounds
and replay the same allocations.
"""

from __future__ import annotations

from dataclasses import dataclass

from vt.config import ModelConfig
from vt.kernels.arena import aligned
from vt.kernels.attention_plan import MAX_KEY_SPLITS, attention_partial_bytes
from vt.kernels.base import prologue_fused
from vt.model.shard import TensorSplit
from vt.sampling_params import MAX_LOGPROBS

ACT_BYTES = 2  # bf16 activations on CUDA; the numpy ledger counts them at this size too
# Split-key partials of one attention launch: enough for every decode batch and short prefill
# to spread its keys over the whole chip (a few MiB at 8B shapes); launches that would need more
# take fewer splits.
ATTENTION_PARTIALS_MAX = 64 << 20


@dataclass(frozen=True)
class StepMemory:
    """Per-slot device memory of the largest step, in bytes."""

    tokens: int
    seqs: int
    arena_bytes: int
    attention_partials_bytes: int

    @property
    def per_slot_bytes(self) -> int:
        return self.arena_bytes + self.attention_partials_bytes


def step_arena_bytes(mc: ModelConfig, tokens: int, seqs: int, logprobs_k: int,
                     tensor_parallel_size: int = 1) -> int:
    """Arena bytes of a step of `tokens` tokens over `seqs` sampled sequences with logprobs_k top
    logprobs (0: none), as the forward, the head and the sampler allocate them (on one rank of a
    tensor_parallel_size split: the one with the most vocabulary rows)."""
    split = TensorSplit.of(mc, tensor_parallel_size)
    h, inter, v = mc.hidden_size, split.intermediate, mc.vocab_size
    hq, hk, d = split.heads, split.kv_heads, mc.head_dim
    sizes = [tokens * h * ACT_BYTES]                       # embed: the residual stream
    # The last layer's outputs are still live when the head runs; earlier layers were rewound.
    sizes.append(tokens * (hq + 2 * hk) * d * ACT_BYTES)   # qkv
    if mc.qk_norm and not prologue_fused(d, True, True):
        sizes += [tokens * hq * d * ACT_BYTES, tokens * hk * d * ACT_BYTES]  # head norms
    sizes += [tokens * hq * d * ACT_BYTES,                 # attention output
              tokens * 2 * inter * ACT_BYTES,              # gate_up
              tokens * inter * ACT_BYTES]                  # silu_mul
    sizes += [seqs * h * ACT_BYTES, seqs * h * ACT_BYTES]  # gathered last rows, final norm
    if split.size > 1:
        sizes += [seqs * split.max_vocab_rows * 4,         # this rank's f32 logits
                  seqs * v * 4]                            # all ranks' logits, gathered rank-major
    sizes.append(seqs * v * 4)                             # f32 logits
    sampler = [seqs * 4]                                   # sampled ids
    if logprobs_k:
        k = min(logprobs_k, v)
        sampler += [seqs * 4, seqs * k * 4, seqs * k * 4]  # chosen logprob, top ids, top logprobs
    # twice: a step with guided rows samples again once their masks are in (its second pass)
    sizes += sampler * 2
    return sum(aligned(s) for s in sizes)


def plan_step_memory(mc: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                     tensor_parallel_size: int = 1) -> StepMemory:
    """The per-slot memory of the largest step these flags allow (on each rank of the split)."""
    tokens = max(max_num_batched_tokens, max_num_seqs)
    seqs = max_num_seqs
    heads = TensorSplit.of(mc, tensor_parallel_size).heads
    partials = min(ATTENTION_PARTIALS_MAX,
                   attention_partial_bytes(MAX_KEY_SPLITS, tokens, heads, mc.head_dim))
    return StepMemory(tokens=tokens, seqs=seqs,
                      arena_bytes=step_arena_bytes(mc, tokens, seqs, MAX_LOGPROBS, tensor_parallel_size),
                      attention_partials_bytes=partials)
