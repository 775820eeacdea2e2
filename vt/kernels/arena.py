"""The bookkeeping of a step's workspace arena, shared by both backends.

CUDA ops take their outputs from a bump allocator over one preallocated buffer per slot; the
numpy backend keeps the same ledger without the buffer, with each array counted at the size the
CUDA backend would take (bf16 activations), so CPU runs check the memory plan that sizes the CUDA
arena: a step that asks for more than the plan reserved fails on numpy exactly as it would on the
GPU.
"""

from __future__ import annotations

ALIGN = 256  # every allocation starts on a 256-byte boundary (cuBLAS and vector loads like it)
ITEM_BYTES = {"act": 2, "f32": 4, "i32": 4, "u8": 1, "i64": 8, "fp8": 1}  # CUDA sizes of backend dtypes


def aligned(nbytes: int) -> int:
    """nbytes rounded up to the arena's alignment."""
    return -(-nbytes // ALIGN) * ALIGN


class ArenaExhausted(MemoryError):
    """A step asked its arena for more than the memory plan reserved: a bug in the plan."""


class ArenaLedger:
    """Offsets of a bump allocator over nbytes (None: unbounded, only counted). reset() frees
    everything at once; high is the furthest offset handed out since the last reset."""

    def __init__(self, nbytes: int | None) -> None:
        self.nbytes = nbytes
        self.offset = 0
        self.high = 0

    def take(self, size: int) -> int:
        """Start offset of a new allocation of size bytes."""
        start = aligned(self.offset)
        if self.nbytes is not None and start + size > self.nbytes:
            raise ArenaExhausted(
                f"step workspace exhausted: {size} bytes asked at offset {start} of {self.nbytes}; "
                f"the memory plan (vt.runner.memory_plan) under-counts this step"
            )
        self.offset = start + size
        self.high = max(self.high, self.offset)
        return start

    def reset(self) -> None:
        self.offset = self.high = 0

    @staticmethod
    def _check_mark(mark: int, top: int) -> None:
        if not 0 <= mark <= top:
            raise ValueError(f"arena mark {mark} is not within 0..{top}")

    def rewind(self, mark: int) -> None:
        """Free everything handed out after mark (an offset taken earlier)."""
        self._check_mark(mark, self.offset)
        self.offset = mark

    def reserve(self, mark: int) -> None:
        """Hand out nothing below mark from now on."""
        self._check_mark(mark, mark if self.nbytes is None else self.nbytes)
        self.offset = max(self.offset, mark)
        self.high = max(self.high, self.offset)
