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

Every term is monotone in tokens, sequences and logprobs (but one: with fp8 weights, steps of up to
quantized.UNIT_SCALE_MAX_ROWS rows hold an extra product, so that step is planned too), so the step of
max(max_num_batched_tokens, max_num_seqs) tokens over max_num_seqs sequences, each sampled with
MAX_LOGPROBS top logprobs, bounds every step: a step never has more tokens (the scheduler's
budget; chunked or not, a prompt longer than the budget is refused at admission), more sequences,
or more logprobs. Decode graphs and per-layer graphs are captured for sizes within those bounds
and replay the same allocations.

The KV cache gets what is left (reserve_step_memory first, then kv_cache_blocks); where the
card cannot hold the step or one sequence of --max-model-len, start-up fails with a
StartupMemoryError naming the flags to change.
"""

from __future__ import annotations

from dataclasses import dataclass

from vt.config import EngineConfig, ModelConfig
from vt.kernels.arena import aligned
from vt.kernels.attention_plan import MAX_KEY_SPLITS, attention_partial_bytes
from vt.kernels.base import Backend, prologue_fused
from vt.kernels.quantized import UNIT_SCALE_MAX_ROWS, gemm_rows, unit_scale_rows
from vt.model.quantization import Fp8Format
from vt.model.shard import TensorSplit
from vt.model.transformer import Transformer
from vt.sampling_params import MAX_LOGPROBS

ACT_BYTES = 2  # bf16 activations on CUDA; the numpy ledger counts them at this size too
# Split-key partials of one attention launch: enough for every decode batch and short prefill
# to spread its keys over the whole chip (a few MiB at 8B shapes); launches that would need more
# take fewer splits.
ATTENTION_PARTIALS_MAX = 64 << 20
# Device memory kept free for the captured graphs when the KV cache is sized from what is left.
GRAPH_RESERVE = 512 << 20


class StartupMemoryError(ValueError):
    """The flags ask for more device memory than the card has left; the message names them."""


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


def _fp8_layer_sizes(tokens: int, h: int, inter: int, hq: int, hk: int, d: int, qk_norm: bool,
                     group: int | None) -> list[int]:
    """One fp8 layer's arena outputs, in order: each projection's quantized input (codes and scales,
    rows padded as quantized.gemm_rows pads them), its output, and for the projections that add
    into the residual stream a product beside it where the rows were padded or the GEMM runs with
    unit scales (quantized.unit_scale_rows)."""
    rows = gemm_rows(tokens, group)

    def quantized(k: int) -> list[int]:
        return [rows * k, rows * (1 if group is None else k // group) * 4]

    beside = [rows * h * ACT_BYTES] if rows != tokens or unit_scale_rows(tokens, group) else []
    sizes = quantized(h) + [rows * (hq + 2 * hk) * d * ACT_BYTES]      # input norm, qkv
    if qk_norm and not prologue_fused(d, True, True):
        sizes += [tokens * hq * d * ACT_BYTES, tokens * hk * d * ACT_BYTES]  # head norms
    sizes += [tokens * hq * d * ACT_BYTES] + quantized(hq * d) + beside  # attention output, o_proj
    sizes += quantized(h) + [rows * 2 * inter * ACT_BYTES]             # post-attention norm, gate_up
    return sizes + quantized(inter) + beside                           # silu_mul, down


def step_arena_bytes(mc: ModelConfig, tokens: int, seqs: int, logprobs_k: int,
                     tensor_parallel_size: int = 1, fp8: Fp8Format | None = None,
                     pooling: bool = False) -> int:
    """Arena bytes of a step of `tokens` tokens over `seqs` sampled sequences with logprobs_k top
    logprobs (0: none), as the forward, the head and the sampler allocate them (on one rank of a
    tensor_parallel_size split: the one with the most vocabulary rows), with fp8 weights in that
    format when given. pooling: an embedding model's step, which stops at the final norm of each
    sequence's last row (no logits, no sampler; vt.runner.pooling)."""
    split = TensorSplit.of(mc, tensor_parallel_size)
    h, inter, v = mc.hidden_size, split.intermediate, mc.vocab_size
    hq, hk, d = split.heads, split.kv_heads, mc.head_dim
    sizes = [tokens * h * ACT_BYTES]                       # embed: the residual stream
    # The last layer's outputs are still live when the head runs; earlier layers were rewound.
    if fp8 is not None:
        sizes += _fp8_layer_sizes(tokens, h, inter, hq, hk, d, mc.qk_norm, fp8.activation_group)
    else:
        sizes.append(tokens * (hq + 2 * hk) * d * ACT_BYTES)   # qkv
        if mc.qk_norm and not prologue_fused(d, True, True):
            sizes += [tokens * hq * d * ACT_BYTES, tokens * hk * d * ACT_BYTES]  # head norms
        sizes += [tokens * hq * d * ACT_BYTES,                 # attention output
                  tokens * 2 * inter * ACT_BYTES,              # gate_up
                  tokens * inter * ACT_BYTES]                  # silu_mul
    sizes += [seqs * h * ACT_BYTES, seqs * h * ACT_BYTES]  # gathered last rows, final norm
    if pooling:
        return sum(aligned(s) for s in sizes)
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
                     tensor_parallel_size: int = 1, fp8: Fp8Format | None = None,
                     pooling: bool = False) -> StepMemory:
    """The per-slot memory of the largest step these flags allow (on each rank of the split;
    pooling: of an embedding model's steps)."""
    tokens = max(max_num_batched_tokens, max_num_seqs)
    seqs = max_num_seqs
    heads = TensorSplit.of(mc, tensor_parallel_size).heads
    partials = min(ATTENTION_PARTIALS_MAX,
                   attention_partial_bytes(MAX_KEY_SPLITS, tokens, heads, mc.head_dim))
    arena = step_arena_bytes(mc, tokens, seqs, MAX_LOGPROBS, tensor_parallel_size, fp8, pooling)
    if fp8 is not None and tokens > UNIT_SCALE_MAX_ROWS:
        # the one term that is not monotone: steps of up to UNIT_SCALE_MAX_ROWS rows hold a
        # residual projection's product beside the stream, which larger steps do not
        small = UNIT_SCALE_MAX_ROWS
        arena = max(arena, step_arena_bytes(mc, small, min(seqs, small), MAX_LOGPROBS, tensor_parallel_size,
                                            fp8, pooling))
    return StepMemory(tokens=tokens, seqs=seqs, arena_bytes=arena, attention_partials_bytes=partials)


def reserve_step_memory(ops: Backend, cfg: EngineConfig, plan: StepMemory) -> None:
    """Reserve every slot's step memory, or refuse to start, naming the flags that size it."""
    need = ops.num_slots() * plan.per_slot_bytes
    advice = (f"the largest step these flags allow ({plan.tokens} tokens over {plan.seqs} sequences: "
              f"--max-num-batched-tokens {cfg.max_num_batched_tokens}, --max-num-seqs "
              f"{cfg.max_num_seqs}) needs {need / 2**30:.2f} GiB of step memory")
    if ops.name == "cuda" and hasattr(ops, "mem_info"):
        free, total = ops.mem_info()
        allowed = free - total * (1.0 - cfg.gpu_memory_utilization)
        if need > allowed:
            raise StartupMemoryError(
                f"{advice}, but only {max(allowed, 0) / 2**30:.2f} GiB is left after the weights "
                f"within --gpu-memory-utilization {cfg.gpu_memory_utilization}; lower "
                f"--max-num-batched-tokens or --max-num-seqs")
    try:
        ops.ensure_workspace(plan.arena_bytes, plan.attention_partials_bytes)
    except MemoryError as e:
        raise StartupMemoryError(f"{advice} and the device could not provide it ({e}); lower "
                                 f"--max-num-batched-tokens or --max-num-seqs") from None


def kv_item_bytes(backend: str, kv_cache_dtype: str) -> int:
    """Bytes of one cached K or V element: an e4m3 code with --kv-cache-dtype fp8, else the
    backend's activation (bf16 on CUDA, float32 on numpy)."""
    if kv_cache_dtype == "fp8":
        return 1
    return ACT_BYTES if backend == "cuda" else 4


def kv_cache_blocks(ops: Backend, cfg: EngineConfig, mc: ModelConfig, max_model_len: int) -> int:
    """KV blocks: explicit (--num-gpu-blocks, --kv-cache-memory) or what the device has left
    within --gpu-memory-utilization once weights, step memory and sampler rows are taken.
    An fp8 cache's blocks take half a bf16 one's bytes, so the same memory holds twice the blocks."""
    tp = cfg.tensor_parallel_size  # the budget and the block sizes are one rank's
    max_blocks = -(-max_model_len // cfg.block_size)  # one sequence of max_model_len
    dtype_bytes = kv_item_bytes(ops.name, cfg.kv_cache_dtype)
    per_block = Transformer.kv_bytes_per_block(mc, cfg.block_size, dtype_bytes, tp)
    if cfg.num_gpu_blocks is not None:
        if cfg.num_gpu_blocks < 1:
            raise ValueError("--num-gpu-blocks must be at least 1")
        return cfg.num_gpu_blocks
    from_memory = cfg.kv_cache_memory is None and ops.name == "cuda" and hasattr(ops, "mem_info")
    if cfg.kv_cache_memory is not None:
        budget = cfg.kv_cache_memory
    elif from_memory:
        free, total = ops.mem_info()
        graphs = 0 if cfg.enforce_eager else GRAPH_RESERVE
        budget = int(free - total * (1.0 - cfg.gpu_memory_utilization) - graphs)
    else:
        # CPU: enough for every sequence at full length, capped at 1 GiB but never below one.
        need = cfg.max_num_seqs * max_model_len * Transformer.kv_bytes_per_block(mc, 1, dtype_bytes, tp)
        budget = max(min(need, 1024**3), max_blocks * per_block)
    # More blocks than every sequence at full length (twice, for prefix-cache reuse) buys
    # nothing but a longer free list.
    useful = 2 * cfg.max_num_seqs * max_blocks
    blocks = min(max(budget, 0) // per_block, useful)
    if from_memory and blocks < max_blocks:
        raise StartupMemoryError(
            f"the KV cache gets {max(budget, 0) / 2**30:.2f} GiB ({blocks} blocks of {cfg.block_size} "
            f"tokens), less than one sequence of --max-model-len {max_model_len} needs "
            f"({max_blocks} blocks, {max_blocks * per_block / 2**30:.2f} GiB); raise "
            f"--gpu-memory-utilization or lower --max-model-len, --max-num-batched-tokens or "
            f"--max-num-seqs")
    if blocks < 1:
        raise StartupMemoryError(f"no memory left for the KV cache ({budget} bytes, {per_block} bytes a "
                                 f"block)")
    return int(blocks)


def check_serves_full_context(cfg: EngineConfig, max_model_len: int, num_blocks: int) -> None:
    """Refuse to serve (StartupMemoryError naming the flags) where a request within
    --max-model-len could still never run: a KV cache smaller than one sequence of that
    length, or, without chunked prefill, a step too small for one such prompt."""
    bs, mml = cfg.block_size, max_model_len
    max_blocks = -(-mml // bs)
    if num_blocks < max_blocks:
        if cfg.num_gpu_blocks is not None:
            more = f"raise --num-gpu-blocks to at least {max_blocks}"
        elif cfg.kv_cache_memory is not None:
            more = "raise --kv-cache-memory"
        else:
            more = "raise --gpu-memory-utilization"
        raise StartupMemoryError(
            f"the KV cache holds {num_blocks} blocks of {bs} tokens ({num_blocks * bs} tokens), less than "
            f"one sequence of --max-model-len {mml} needs ({max_blocks} blocks); lower "
            f"--max-model-len to at most {num_blocks * bs}, or {more}")
    if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < mml:
        raise StartupMemoryError(
            f"without chunked prefill a prompt must fit one step, and --max-num-batched-tokens "
            f"{cfg.max_num_batched_tokens} is less than --max-model-len {mml}; raise "
            f"--max-num-batched-tokens, lower --max-model-len, or enable chunked prefill")
