"""Which slice of which checkpoint tensor each rank of a tensor-parallel group holds.

Megatron's split, as vLLM runs it:
- q, k, v and gate, up are column-parallel: a rank keeps the output rows of its query heads, of
  the KV heads those read, and of its share of the intermediate size, so attention and silu_mul
  run on local heads and columns with no communication;
- o_proj and down are row-parallel: a rank keeps the matching input columns, its product is a
  partial sum of the full one, and an all-reduce adds them up (vt.kernels.parallel);
- lm_head is split by vocabulary (contiguous ranges, the first V mod N ranks one row longer);
  the logits are all-gathered so every rank samples from the full row;
- the embedding, the norms and the q/k-norm weights are replicated.
KV heads: a rank holds Hk / N of them, or, when the model has fewer KV heads than ranks, the one
head its query heads read (each KV head then lives on N / Hk ranks).

A rank's slices are views of the memory-mapped checkpoint: a rank copies only its own shard
when it uploads, and no device ever holds a full projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.config import ModelConfig
from vt.kernels.parallel import Ranked, pick

# checkpoint tensor kind (the name's second-to-last part) -> (axis, what the axis is split by)
_SPLITS = {
    "q_proj": (0, "heads"), "k_proj": (0, "kv"), "v_proj": (0, "kv"), "o_proj": (1, "heads"),
    "gate_proj": (0, "mlp"), "up_proj": (0, "mlp"), "down_proj": (1, "mlp"), "lm_head": (0, "vocab"),
}


def _split_of(name: str) -> tuple[int, str] | None:
    """(axis, split by) of a checkpoint tensor, or None for a replicated one."""
    return _SPLITS.get(name.split(".")[-2]) if "." in name else None


class ShardError(ValueError):
    """The model cannot be split over this many ranks; the message says why and which sizes can."""


def split_problems(cfg: ModelConfig, size: int) -> list[str]:
    """Why `size` ranks cannot split this model (empty when they can)."""
    out = []
    if cfg.num_heads % size:
        out.append(f"its {cfg.num_heads} attention heads (num_attention_heads) do not divide by {size}")
    hk = cfg.num_kv_heads
    if hk % size and size % hk:
        out.append(f"its {hk} KV heads (num_key_value_heads) neither divide by {size} nor divide it")
    if cfg.intermediate_size % size:
        out.append(f"its intermediate size {cfg.intermediate_size} (intermediate_size) does not divide "
                   f"by {size}")
    if cfg.vocab_size < size:
        out.append(f"its vocabulary of {cfg.vocab_size} is smaller than {size}")
    return out


@dataclass(frozen=True)
class TensorSplit:
    """The shapes of one rank's shard for a model split `size` ways (size 1: the whole model)."""

    size: int
    heads: int                      # query heads a rank holds
    kv_heads: int                   # KV heads a rank holds (and caches)
    intermediate: int               # MLP columns a rank holds
    head_dim: int
    vocab_bounds: tuple[int, ...]   # rank r's lm_head rows: vocab_bounds[r]:vocab_bounds[r + 1]
    kv_replicas: int                # ranks holding each KV head (1 unless Hk < size)

    @classmethod
    def of(cls, cfg: ModelConfig, size: int) -> TensorSplit:
        """The split, or ShardError naming what does not divide and the sizes that would."""
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ShardError(f"--tensor-parallel-size must be a positive integer, got {size!r}")
        problems = split_problems(cfg, size)
        if problems:
            valid = [n for n in range(1, cfg.num_heads + 1) if not split_problems(cfg, n)]
            raise ShardError(f"--tensor-parallel-size {size} cannot split this model: "
                             f"{'; '.join(problems)}. Sizes that can: {', '.join(map(str, valid))}")
        base, extra = divmod(cfg.vocab_size, size)
        bounds = [0]
        for r in range(size):
            bounds.append(bounds[-1] + base + (r < extra))
        hk = cfg.num_kv_heads
        return cls(size=size, heads=cfg.num_heads // size, kv_heads=max(hk // size, 1),
                   intermediate=cfg.intermediate_size // size, head_dim=cfg.head_dim,
                   vocab_bounds=tuple(bounds), kv_replicas=max(size // hk, 1))

    @property
    def max_vocab_rows(self) -> int:
        """The longest lm_head shard (rank 0's): the widest logits a rank computes."""
        return self.vocab_bounds[1] - self.vocab_bounds[0]

    def _rows(self, what: str, rank: int) -> slice:
        d = self.head_dim
        if what == "heads":
            return slice(rank * self.heads * d, (rank + 1) * self.heads * d)
        if what == "kv":
            first = (rank // self.kv_replicas) * self.kv_heads
            return slice(first * d, (first + self.kv_heads) * d)
        if what == "mlp":
            return slice(rank * self.intermediate, (rank + 1) * self.intermediate)
        return slice(self.vocab_bounds[rank], self.vocab_bounds[rank + 1])

    def take(self, name: str, tensor: np.ndarray, rank: int) -> np.ndarray:
        """Rank `rank`'s slice of checkpoint tensor `name` (a view; the tensor itself when it is
        replicated)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} out of range 0..{self.size - 1}")
        split = _split_of(name)
        if split is None or self.size == 1:
            return tensor
        axis, what = split
        rows = self._rows(what, rank)
        return tensor[rows] if axis == 0 else tensor[:, rows]

    def select(self, name: str, tensor: np.ndarray) -> np.ndarray | Ranked:
        """What the ranks upload for `name`: one slice per rank, or the one replicated tensor."""
        if self.size == 1 or _split_of(name) is None:
            return tensor
        return Ranked([self.take(name, tensor, r) for r in range(self.size)])

    def lm_head_of(self, embed: Any) -> Any:
        """A tied lm_head: each rank's vocabulary rows of its (replicated) embedding, as views."""
        if self.size == 1:
            return embed
        return Ranked([pick(embed, r)[self._rows("vocab", r)] for r in range(self.size)])


def concat_rows(tensors: Sequence[np.ndarray | Ranked]) -> np.ndarray | Ranked:
    """np.concatenate along axis 0, rank by rank where the tensors are per-rank slices."""
    ranked = [t for t in tensors if isinstance(t, Ranked)]
    if not ranked:
        return np.concatenate(tensors, axis=0)
    return Ranked([np.concatenate([pick(t, r) for t in tensors], axis=0)
                   for r in range(len(ranked[0].parts))])
