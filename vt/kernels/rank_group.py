"""RankGroup: one Backend over the ranks of a tensor-parallel group, driven from one thread.

The runner and the model call each op once, as on one device; the group runs it on every rank
with that rank's part of each Ranked argument (vt.kernels.parallel) and returns a Ranked result. Weights
are per-rank shards (vt.model.shard), activations have the same local shape on every rank, and
the sampler's inputs and state are replicated, so every op but two is just "the same op on each
rank". The two that are not are where the logical op spans the split:
- linear_residual with x and w split along K (o_proj, down) is a sum over ranks: each rank's
  product is a partial sum, and an all-reduce adds them into the residual stream on every rank;
- logits with lm_head split by vocabulary gathers each rank's columns into the full f32[B, V]
  row on every rank, so each rank samples the same tokens from the same logits.
Host staging is shared: inputs are copied to every rank, results come back from rank 0.

Each rank keeps its own slots (streams, arenas, events): slot i of the group is slot i on every
rank, so depth-2 scheduling works as on one device, and each rank's arena holds its own shard's
activations (vt.runner.memory_plan counts one rank). Ranks are numpy backends for now: CUDA ranks also
need an NCCL communicator and a capture that begins on every device's stream before the step and
ends on each after it, so that the collectives are captured inside each device's graph.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from vt.kernels.base import Backend
from vt.kernels.parallel import Communicator, Ranked, pick

# Ops that are the same op on each rank: the group calls rank r's with rank r's arguments.
_PER_RANK = frozenset({
    "zeros", "from_host", "copy_h2d", "scratch", "ensure_workspace",
    "embed", "rms_norm", "head_rms_norm", "linear", "gemm_layout", "fold_norm_weight", "rope",
    "write_kv", "qk_norm_rope_write_kv", "attention", "silu_mul", "gather_rows", "fill_from_last",
    "log_softmax_topk", "penalize", "ban_tokens", "sample", "record_sampled", "apply_token_bitmask",
    "bias_logits",
    "arena_reserve",
    "after", "record", "wait", "limit_gemm_sms",
})


class RankGroup:
    """A Backend whose every array is a Ranked value, one part per rank."""

    def __init__(self, ranks: Sequence[Backend], comm: Communicator) -> None:
        if not ranks:
            raise ValueError("a rank group needs at least one rank")
        if comm.size != len(ranks):
            raise ValueError(f"the communicator spans {comm.size} ranks, the group has {len(ranks)}")
        if any(r.name != "numpy" for r in ranks):
            raise ValueError("a rank group runs numpy ranks only: CUDA ranks need an NCCL communicator "
                             "and graphs captured on every device at once")
        self.ranks = tuple(ranks)
        self.comm = comm
        self.size = len(ranks)
        self.name = ranks[0].name

    def _each(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """rank r's op on rank r's arguments, for every rank; the results as Ranked values
        (a tuple of them for ops returning tuples; None for in-place ops)."""
        outs = [getattr(rank, op)(*(pick(a, r) for a in args), **{k: pick(v, r) for k, v in kwargs.items()})
                for r, rank in enumerate(self.ranks)]
        first = outs[0]
        if first is None:
            return None
        if isinstance(first, tuple):
            return tuple(Ranked([o[i] for o in outs]) for i in range(len(first)))
        return Ranked(outs)

    def __getattr__(self, op: str) -> Callable[..., Any]:
        if op in _PER_RANK:
            return functools.partial(self._each, op)
        raise AttributeError(f"{type(self).__name__} has no attribute {op!r}")

    # ---- memory ---------------------------------------------------------------------------
    def upload(self, host: np.ndarray | Ranked) -> Ranked:
        """A weight onto every rank: each rank's own slice when given one per rank (a shard),
        else the same array on each (a replicated weight)."""
        if isinstance(host, Ranked) and len(host.parts) != self.size:
            raise ValueError(f"upload: {len(host.parts)} shards for {self.size} ranks")
        return self._each("upload", host)

    def to_host(self, x: Ranked) -> np.ndarray:
        """Rank 0's copy: replicated values are the same on every rank."""
        return self.ranks[0].to_host(pick(x, 0))

    def pinned_empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """One host buffer for the group: inputs are staged once and copied to every rank."""
        return self.ranks[0].pinned_empty(shape, dtype)

    def copy_d2h(self, dst: np.ndarray, src: Ranked) -> None:
        """From rank 0: every rank computes the same sampler outputs."""
        self.ranks[0].copy_d2h(dst, pick(src, 0))

    # ---- the two ops that span the split ---------------------------------------------------
    def linear_residual(self, x: Ranked, w: Ranked, residual: Ranked) -> None:
        """residual += sum over ranks of x_r @ w_r.T (x, w split along K: o_proj and down).
        Rank 0 adds its product into its residual; every other rank writes its own into its copy
        of the residual, zeroed first (the layer read it already), and the all-reduce leaves the
        residual plus the whole product on every rank."""
        for r, rank in enumerate(self.ranks):
            res = pick(residual, r)
            if r:
                res.fill(0)
            rank.linear_residual(pick(x, r), pick(w, r), res)
        self.comm.all_reduce(residual)

    def logits(self, x: Ranked, w: Ranked) -> Ranked:
        """f32[B, V] on every rank from each rank's vocabulary rows of lm_head: each rank's
        f32[B, V_r] is gathered rank-major into a staging buffer (NCCL's layout) and laid out as
        columns V_0, V_1, ... of the full row."""
        parts = self._each("logits", x, w)
        b = parts.shape[0]
        widths = [p.shape[1] for p in parts.parts]
        staging = self._each("scratch", (b * sum(widths),), "f32")
        self.comm.all_gather(parts, staging)
        out = self._each("scratch", (b, sum(widths)), "f32")
        for o, s in zip(out.parts, staging.parts, strict=True):
            col = 0
            for width in widths:
                o[:, col: col + width] = s[b * col: b * (col + width)].reshape(b, width)
                col += width
        return out

    # ---- slots: slot i of the group is slot i on every rank -------------------------------
    def num_slots(self) -> int:
        return self.ranks[0].num_slots()

    def num_sms(self) -> int:
        return self.ranks[0].num_sms()

    def slot(self, i: int) -> contextlib.AbstractContextManager[None]:
        return self._open_slots([rank.slot(i) for rank in self.ranks])

    @staticmethod
    @contextlib.contextmanager
    def _open_slots(slots: list[contextlib.AbstractContextManager[None]]) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for s in slots:
                stack.enter_context(s)
            yield

    def done(self, i: int) -> bool:
        return all(rank.done(i) for rank in self.ranks)

    def capture(self, i: int, fn: Callable[[], Any]) -> Any:
        """numpy ranks replay by calling fn again, which drives every rank."""
        return self.ranks[0].capture(i, fn)

    def capture_parts(self, i: int, parts: Sequence[Callable[[], Any]]) -> list[Any]:
        return self.ranks[0].capture_parts(i, parts)

    def arena_mark(self) -> Ranked | None:
        marks = [rank.arena_mark() for rank in self.ranks]
        return None if any(m is None for m in marks) else Ranked(marks)

    def arena_reset(self, mark: Ranked | None) -> None:
        for r, rank in enumerate(self.ranks):
            rank.arena_reset(pick(mark, r))

    def arena_high(self, i: int) -> int:
        """The furthest any rank's arena reached in slot i's last step."""
        return max(rank.arena_high(i) for rank in self.ranks)


def rank_count(ops: Backend | RankGroup) -> int:
    """How many ranks a backend drives (1 for a single device)."""
    return ops.size if isinstance(ops, RankGroup) else 1
