"""Tensor parallelism inside one process: a value held once per rank, and the collectives between ranks.

One process drives every rank of a tensor-parallel group: the runner calls each op once and the
rank group (vt.kernels.rank_group) runs it on every rank's device. The ranks meet only at two
collectives, the two places where the sharded forward needs the others' results:
- all_reduce after each row-split projection (o_proj, down): each rank holds a partial sum of
  the full product, and every rank needs the whole sum (the residual stream is replicated);
- all_gather of the vocabulary-split logits, so that every rank samples from the full row (each
  rank runs the same sampler on the same logits and keeps its own sampler state in step).

`Communicator` is the contract a device implementation meets (NCCL through CuPy: all-reduce and
all-gather with one communicator per device, grouped from the one driving thread);
`InProcessCommunicator` meets it on host arrays for the numpy ranks, so CPU runs check the
sharding arithmetic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np


class Ranked:
    """One value per rank (a device array on each rank, or a host array to upload to each).

    Indexing, reshape and fill act on every rank's value alike, so runner and model code that
    slices its arrays works unchanged over a group; `parts[r]` is rank r's own value."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Any]) -> None:
        if not parts:
            raise ValueError("a Ranked value needs at least one rank")
        self.parts = tuple(parts)

    def __len__(self) -> int:
        return len(self.parts[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """Rank 0's shape: every rank's activations have the same local shape."""
        return tuple(self.parts[0].shape)

    @property
    def dtype(self) -> Any:
        return self.parts[0].dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __getitem__(self, key: Any) -> Ranked:
        return Ranked([p[pick(key, r)] for r, p in enumerate(self.parts)])

    def __setitem__(self, key: Any, value: Any) -> None:
        for r, p in enumerate(self.parts):
            p[pick(key, r)] = pick(value, r)

    def reshape(self, *shape: Any) -> Ranked:
        return Ranked([p.reshape(*shape) for p in self.parts])

    def fill(self, value: Any) -> None:
        for p in self.parts:
            p.fill(value)

    def __array__(self, *_: Any, **__: Any) -> np.ndarray:
        # Converting the group's value to one array is always a bug: say which rank to take.
        raise TypeError("a Ranked value holds one array per rank; take one with .parts[rank]")

    def __repr__(self) -> str:
        return f"Ranked({len(self.parts)} ranks, shape {self.shape})"


def pick(value: Any, rank: int) -> Any:
    """Rank `rank`'s view of an op argument: its part of a Ranked value (also inside a tuple,
    as in an index key); anything else is the same on every rank."""
    if isinstance(value, Ranked):
        return value.parts[rank]
    if isinstance(value, tuple) and any(isinstance(v, Ranked) for v in value):
        return tuple(pick(v, rank) for v in value)
    return value


class Communicator(Protocol):
    """Collectives over the ranks of one group; every call is enqueued on each rank's current
    stream (after the ops before it, before the ops after it) and never blocks the host."""

    size: int

    def all_reduce(self, x: Ranked) -> None:
        """In place: every rank's x becomes the element-wise sum over ranks, the same bits on
        every rank (one summation order for all of them)."""

    def all_gather(self, parts: Ranked, out: Ranked) -> None:
        """Every rank's out (flat, as long as all parts together) receives every rank's part,
        flattened, in rank order: NCCL's all-gather, with parts that may differ in length."""


class InProcessCommunicator:
    """The collectives over host arrays of ranks that live in this process (the numpy backend)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a communicator needs at least one rank, got {size}")
        self.size = size

    def _check(self, x: Ranked, what: str) -> None:
        if len(x.parts) != self.size:
            raise ValueError(f"{what}: {len(x.parts)} parts for a group of {self.size} ranks")

    def all_reduce(self, x: Ranked) -> None:
        self._check(x, "all_reduce")
        total = np.array(x.parts[0], copy=True)
        for p in x.parts[1:]:
            total += p
        for p in x.parts:
            p[...] = total

    def all_gather(self, parts: Ranked, out: Ranked) -> None:
        self._check(parts, "all_gather")
        self._check(out, "all_gather")
        flat = np.concatenate([np.ravel(p) for p in parts.parts])
        for o in out.parts:
            if o.shape != flat.shape:
                raise ValueError(f"all_gather: out {o.shape} does not hold the {flat.size} gathered values")
            o[...] = flat
