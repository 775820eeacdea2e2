"""BlockPool: allocation, ref counts, prefix cache hits, LRU eviction and integrity checks."""

from __future__ import annotations

import random

import pytest

from vt.sched.kv_cache import BlockPool, InvariantError, hash_block

BS = 4


def _fill(pool: BlockPool, tokens: list[int]) -> list[int]:
    """Allocate blocks for the full blocks of tokens and register them, as a request would."""
    n = len(tokens) // pool.block_size
    blocks = pool.allocate(n)
    assert blocks is not None
    parent = None
    for i, b in enumerate(blocks):
        parent = pool.register_full(b, parent, tokens[i * BS:(i + 1) * BS])
    return blocks


def test_allocate_and_free_counts():
    pool = BlockPool(8, BS)
    a = pool.allocate(3)
    assert a is not None and len(set(a)) == 3
    assert pool.num_free == 5
    assert pool.usage == pytest.approx(3 / 8)
    assert pool.allocate(6) is None
    assert pool.num_free == 5  # a failed allocation changes nothing
    pool.free(a)
    assert pool.num_free == 8 and pool.usage == 0.0
    pool.check_invariants()


def test_double_free_raises():
    pool = BlockPool(4, BS)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(InvariantError):
        pool.free(a)


def test_bad_sizes_raise():
    with pytest.raises(ValueError):
        BlockPool(0, BS)
    with pytest.raises(ValueError):
        BlockPool(4, 0)


def test_hash_is_chained_and_stable():
    assert hash_block(None, [1, 2, 3, 4]) == hash_block(None, [1, 2, 3, 4])
    h = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])


def test_prefix_hit_shares_blocks_across_requests():
    pool = BlockPool(16, BS)
    prompt = list(range(10))  # two full blocks and a partial one
    first = _fill(pool, prompt)
    hit, n = pool.find_prefix(prompt)
    assert hit == first and n == 8
    assert [pool.ref_count(b) for b in first] == [2, 2]
    # A different second block only matches the first.
    other = prompt[:4] + [99, 98, 97, 96]
    hit2, n2 = pool.find_prefix(other)
    assert hit2 == first[:1] and n2 == 4
    assert pool.ref_count(first[0]) == 3
    pool.free(hit2)
    pool.free(hit)
    pool.free(first)
    assert pool.num_free == 16
    pool.check_invariants()


def test_freed_cached_blocks_are_hit_again():
    pool = BlockPool(8, BS)
    prompt = list(range(8))
    first = _fill(pool, prompt)
    pool.free(first)
    assert pool.num_free == 8
    hit, n = pool.find_prefix(prompt)
    assert hit == first and n == 8
    assert pool.num_free == 6  # revived from the free side
    pool.check_invariants()
    pool.free(hit)


def test_plain_free_blocks_are_used_before_cached_ones():
    pool = BlockPool(4, BS)
    cached = _fill(pool, list(range(8)))
    pool.free(cached)
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(cached)
    pool.free(fresh)
    assert pool.find_prefix(list(range(8)))[1] == 8


def test_lru_eviction_order():
    pool = BlockPool(3, BS)
    a = _fill(pool, [1] * 4)
    b = _fill(pool, [2] * 4)
    c = _fill(pool, [3] * 4)
    # Freed in the order b, a, c: b is least recently freed, so it is evicted first.
    pool.free(b)
    pool.free(a)
    pool.free(c)
    got = pool.allocate(1)
    assert got == b
    assert pool.find_prefix([2] * 4) == ([], 0)
    assert pool.find_prefix([1] * 4)[1] == 4  # a and c survive
    assert pool.find_prefix([3] * 4)[1] == 4
    pool.free(got)
    pool.free(a)
    pool.free(c)
    # Hitting a block refreshes it: a was taken and freed again after c.
    pool.free(pool.find_prefix([1] * 4)[0])
    assert pool.allocate(1) == got  # the plain block first
    assert pool.allocate(1) == c    # then the least recently freed cached one
    pool.check_invariants()


def test_duplicate_content_keeps_one_cache_entry():
    pool = BlockPool(4, BS)
    a = _fill(pool, [7] * 4)
    b = _fill(pool, [7] * 4)
    assert a != b
    assert pool.is_cached(a[0]) and not pool.is_cached(b[0])
    pool.free(b)
    pool.free(a)
    pool.check_invariants()
    assert pool.find_prefix([7] * 4)[0] == a


def test_register_checks_size_and_owner():
    pool = BlockPool(4, BS)
    with pytest.raises(InvariantError):
        pool.register_full(0, None, [1, 2, 3, 4])  # not owned
    b = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.register_full(b[0], None, [1, 2])


def test_hash_collision_is_rejected_by_content_check():
    pool = BlockPool(4, BS)
    a = _fill(pool, [1, 2, 3, 4])
    # Forge a collision: point the hash of other content at block a.
    forged = hash_block(None, [9, 9, 9, 9])
    pool._cached[forged] = a[0]
    assert pool.find_prefix([9, 9, 9, 9]) == ([], 0)


def test_prefix_caching_off_never_hits():
    pool = BlockPool(4, BS, enable_prefix_caching=False)
    a = _fill(pool, list(range(8)))
    assert pool.find_prefix(list(range(8))) == ([], 0)
    pool.free(a)
    pool.check_invariants()


def test_check_invariants_detects_leak():
    pool = BlockPool(4, BS)
    pool.allocate(1)
    pool._ref[0] = 0  # corrupt: neither owned nor free
    with pytest.raises(InvariantError):
        pool.check_invariants()


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_prefix_sequences_do_not_leak(seed):
    rng = random.Random(seed)
    pool = BlockPool(32, BS)
    owned: list[list[int]] = []
    vocab = [rng.randrange(3) for _ in range(4)]  # a tiny vocabulary makes prefix hits common
    for _ in range(400):
        op = rng.random()
        if op < 0.35:
            got = pool.allocate(rng.randrange(0, 6))
            if got is not None:
                owned.append(got)
        elif op < 0.6:
            tokens = [rng.choice(vocab) for _ in range(rng.randrange(4, 17))]
            hit, n = pool.find_prefix(tokens)
            assert n == len(hit) * BS <= len(tokens)
            need = len(tokens) // BS - len(hit)
            fresh = pool.allocate(need)
            if fresh is None:
                pool.free(hit)
                continue
            blocks = hit + fresh
            parent = None
            for i, b in enumerate(blocks):
                parent = pool.register_full(b, parent, tokens[i * BS:(i + 1) * BS])
            owned.append(blocks)
        elif owned:
            pool.free(owned.pop(rng.randrange(len(owned))))
        pool.check_invariants()
        refs = {}
        for blocks in owned:
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        assert all(pool.ref_count(b) == refs.get(b, 0) for b in range(32))
    for blocks in owned:
        pool.free(blocks)
    assert pool.num_free == 32
    pool.check_invariants()
