"""KV-cache events: what a prefix-aware router needs to mirror this replica's prefix cache.

The block pool records an event when a full block's hash enters the cache (BlockStored) and when a
cached hash leaves it by eviction (BlockRemoved); AllBlocksCleared says "forget everything". They
are vLLM's KV events; vt.sched.kv_publisher puts them on the wire in vLLM's format. Recording is a list
append on the pool's own thread; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """A chain of full blocks entered the cache: block_hashes[0]'s parent is parent_block_hash,
    each next block's parent is the one before it; token_ids holds block_size ids per block."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Events in the order the pool made them, taken out in batches by take().

    Consecutive stores that continue one chain become one BlockStored, and consecutive removals
    one BlockRemoved, as vLLM groups them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # ("s", hashes, parent, token_ids) or ("r", hashes), both lists still growing
        self._open: list[tuple] = []

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        last = self._open[-1] if self._open else None
        if last is not None and last[0] == "s" and last[1][-1] == parent_hash:
            last[1].append(block_hash)
            last[3].extend(token_ids)
        else:
            self._open.append(("s", [block_hash], parent_hash, list(token_ids)))

    def removed(self, block_hash: int) -> None:
        last = self._open[-1] if self._open else None
        if last is not None and last[0] == "r":
            last[1].append(block_hash)
        else:
            self._open.append(("r", [block_hash]))

    def __len__(self) -> int:
        return len(self._open)

    def take(self) -> list[KVEvent]:
        """The events recorded since the last take(), oldest first."""
        out: list[KVEvent] = []
        for rec in self._open:
            if rec[0] == "s":
                out.append(BlockStored(tuple(rec[1]), rec[2], tuple(rec[3]), self.block_size))
            else:
                out.append(BlockRemoved(tuple(rec[1])))
        self._open = []
        return out
