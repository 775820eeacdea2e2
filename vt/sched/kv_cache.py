"""BlockPool: KV block ids with ref counts, a free side and a prefix cache of full blocks.

A block is either owned (ref count > 0) or on the free side. The free side has two parts:
blocks with no cached content (handed out first) and blocks that still hold a registered
full-block hash, kept in least-recently-freed order so they can be hit again until evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from vt.sched.kv_events import BlockStored, KVEventLog


class InvariantError(RuntimeError):
    """The pool's or the scheduler's bookkeeping is inconsistent (a bug, never a user error)."""


def hash_block(parent_hash: int | None, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Stable chained hash of one full block: blake2b over the parent hash and the token ids.

    A request's cache_salt enters the first block's hash (the one without a parent), as vLLM
    salts it: every later block chains from that one, so requests with different salts never
    share a cached block and requests with the same salt do."""
    h = hashlib.blake2b(digest_size=8)
    # A leading flag byte keeps "no parent", "a parent" and "a salt" apart from each other.
    if parent_hash is not None:
        h.update(b"\x01" + parent_hash.to_bytes(8, "little", signed=False))
    elif salt is None:
        h.update(b"\x00")
    else:
        encoded = salt.encode("utf-8", "surrogatepass")
        h.update(b"\x02" + len(encoded).to_bytes(8, "little") + encoded)
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little", signed=False)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        # Content of a cached block: (hash, parent_hash, token_ids, salt); None when it holds no
        # hash. The salt is a first block's cache_salt (None past the first block, or unsalted).
        self._content: list[tuple[int, int | None, tuple[int, ...], str | None] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # hash -> block id
        self._free_plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # LRU order: oldest first
        self.events: KVEventLog | None = None  # set to record KV events (a router mirrors them)

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: plain free ones plus evictable cached ones."""
        return len(self._free_plain) + len(self._free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by some request."""
        return 1.0 - self.num_free / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._content[block_id] is not None

    # ---- allocation ---------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref count 1, or None (and no change) if not enough are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            return None
        out: list[int] = []
        for _ in range(n):
            if self._free_plain:
                b, _ = self._free_plain.popitem(last=False)
            else:
                b, _ = self._free_cached.popitem(last=False)
                self._evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; at zero it goes to the free side, keeping its hash."""
        for b in block_ids:
            if self._ref[b] <= 0:
                raise InvariantError(f"double free of block {b}")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._content[b] is not None:
                    self._free_cached[b] = None  # most recently freed: evicted last
                else:
                    self._free_plain[b] = None

    def _evict(self, b: int) -> None:
        content = self._content[b]
        if content is not None:
            if self._cached.get(content[0]) == b:
                del self._cached[content[0]]
                if self.events is not None:
                    self.events.removed(content[0])
            self._content[b] = None

    # ---- prefix cache -------------------------------------------------------------------------
    def register_full(self, block_id: int, parent_hash: int | None, token_ids: Sequence[int],
                      salt: str | None = None) -> int:
        """Record an owned, full, computed block's content; returns its chained hash. `salt` is
        the request's cache_salt, read for a first block only (parent_hash None).

        If the same content is already cached in another block, that one stays the cache entry
        and this block stays uncached (it is freed to the plain side)."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"a full block has {self.block_size} tokens, got {len(token_ids)}")
        if self._ref[block_id] <= 0:
            raise InvariantError(f"register_full on unowned block {block_id}")
        salt = salt if parent_hash is None else None
        h = hash_block(parent_hash, token_ids, salt)
        if not self.enable_prefix_caching or self._content[block_id] is not None:
            return h
        if h not in self._cached:
            self._cached[h] = block_id
            self._content[block_id] = (h, parent_hash, tuple(token_ids), salt)
            if self.events is not None:
                self.events.stored(h, parent_hash, self._content[block_id][2])
        return h

    def cached_blocks(self) -> list[BlockStored]:
        """Every cached block (owned or free), one BlockStored each, in the order they were
        cached: a snapshot a KV-event subscriber can rebuild the cache from."""
        out = []
        for h, b in self._cached.items():
            _, parent, tokens, _ = self._content[b]
            out.append(BlockStored((h,), parent, tokens, self.block_size))
        return out

    def _lookup(self, parent: int | None, tokens: tuple[int, ...],
                salt: str | None) -> tuple[int, int] | None:
        h = hash_block(parent, tokens, salt)
        b = self._cached.get(h)
        if b is None:
            return None
        content = self._content[b]
        # Collision check: the stored content must match exactly, parent and salt included.
        if content is None or content[1] != parent or content[2] != tokens or content[3] != salt:
            return None
        return h, b

    def _walk(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        blocks: list[int] = []
        if not self.enable_prefix_caching:
            return blocks
        parent: int | None = None
        bs = self.block_size
        for i in range(len(token_ids) // bs):
            hit = self._lookup(parent, tuple(token_ids[i * bs:(i + 1) * bs]), salt if i == 0 else None)
            if hit is None:
                break
            parent, b = hit
            blocks.append(b)
        return blocks

    def peek_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> tuple[int, int]:
        """(cached tokens, how many of those blocks sit on the free side), taking no references."""
        blocks = self._walk(token_ids, salt)
        return len(blocks) * self.block_size, sum(1 for b in blocks if self._ref[b] == 0)

    def find_prefix(self, token_ids: Sequence[int], salt: str | None = None) -> tuple[list[int], int]:
        """Longest chain of cached full blocks covering a prefix of token_ids (whose first block
        was cached under the same salt); takes a reference on each (reviving freed ones).
        Returns (block_ids, number of tokens they cover)."""
        blocks = self._walk(token_ids, salt)
        for b in blocks:
            if self._ref[b] == 0:
                self._free_cached.pop(b)
            self._ref[b] += 1
        return blocks, len(blocks) * self.block_size

    # ---- integrity ----------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise InvariantError unless every block is exactly one of: owned, free plain, free cached."""
        plain, cached = set(self._free_plain), set(self._free_cached)
        if plain & cached:
            raise InvariantError(f"blocks on both free lists: {sorted(plain & cached)}")
        for b in range(self.num_blocks):
            ref = self._ref[b]
            if ref < 0:
                raise InvariantError(f"block {b} has negative ref count {ref}")
            free = b in plain or b in cached
            if ref > 0 and free:
                raise InvariantError(f"block {b} is owned (ref {ref}) and free")
            if ref == 0 and not free:
                raise InvariantError(f"block {b} is neither owned nor free (leak)")
            if b in cached and self._content[b] is None:
                raise InvariantError(f"block {b} on the cached free list has no hash")
            if b in plain and self._content[b] is not None:
                raise InvariantError(f"block {b} on the plain free list still has a hash")
            content = self._content[b]
            if content is not None and self._cached.get(content[0]) != b:
                raise InvariantError(f"block {b} has a hash that is not its cache entry")
        for h, b in self._cached.items():
            content = self._content[b]
            if content is None or content[0] != h:
                raise InvariantError(f"cache entry {h:#x} points at block {b} with other content")
        if len(plain) + len(cached) + sum(1 for r in self._ref if r > 0) != self.num_blocks:
            raise InvariantError("block count mismatch")
