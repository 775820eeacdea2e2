"""Cascade attention: which steps take it (common_prefix_blocks), the numpy twin against plain
attention, and served tokens with it on and off."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vt.kernels.cascade_plan import (
    cascade_scratch,
    cascade_splits_within,
    common_prefix_blocks,
)
from vt.kernels.numpy_fp8 import to_e4m3
from vt.kernels.numpy_ops import NumpyBackend
from vt.model.make_model import make_model

ops = NumpyBackend()


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", preset="tiny")


def _tables(n: int, shared: int, own: int, nb_start: int = 100) -> np.ndarray:
    """n rows: the same `shared` leading blocks, then `own` blocks of each row's own."""
    own_ids = np.arange(nb_start, nb_start + n * own, dtype=np.int32).reshape(n, own)
    return np.concatenate([np.tile(np.arange(shared, dtype=np.int32), (n, 1)), own_ids], axis=1)


def test_common_prefix_blocks_finds_the_shared_blocks():
    t = _tables(40, 20, 3)
    lens = np.full(40, 20 * 16 + 40)
    assert common_prefix_blocks(t, lens, 16) == 20
    t[7, 17] = 999  # one row leaves the prefix at block 17
    assert common_prefix_blocks(t, lens, 16) == 17
    t[9, 12] = 997  # and one at block 12: 192 shared keys, too few to cascade
    assert common_prefix_blocks(t, lens, 16) == 0
    assert common_prefix_blocks(t, lens, 16, min_keys=192) == 12
    t[3, 0] = 998  # one row shares nothing
    assert common_prefix_blocks(t, lens, 16) == 0


def test_common_prefix_blocks_keeps_each_decodes_last_key_its_own():
    """A row whose context ends inside or right at the end of the shared blocks limits the prefix
    to the blocks before its last key."""
    t = _tables(40, 20, 3)
    lens = np.full(40, 20 * 16 + 40)
    lens[5] = 20 * 16  # its last key is the last of block 19
    assert common_prefix_blocks(t, lens, 16) == 19
    lens[5] = 16 * 16 + 1
    assert common_prefix_blocks(t, lens, 16) == 16


def test_common_prefix_blocks_thresholds():
    t = _tables(40, 20, 3)
    lens = np.full(40, 20 * 16 + 40)
    assert common_prefix_blocks(t[:31], lens, 16) == 0            # fewer than 32 decodes
    assert common_prefix_blocks(t[:31], lens, 16, min_decodes=31) == 20
    assert common_prefix_blocks(t, lens, 16, min_keys=20 * 16 + 1) == 0
    assert common_prefix_blocks(_tables(40, 15, 3), lens, 16) == 0  # 240 shared keys < 256
    assert common_prefix_blocks(t[:0], lens, 16, min_decodes=0) == 0


def test_cascade_scratch_layout_and_split_cap():
    lay = cascade_scratch(3, 2, 256, 32, 128)
    rows = 256 * 32
    assert lay.q_perm == 0 and lay.ints >= rows * 128 * 2
    assert lay.part_o >= lay.ints + 259 * 4
    assert lay.part_ml >= lay.part_o + 5 * rows * 128 * 4
    assert lay.end >= lay.part_ml + 5 * rows * 2 * 4
    cap = cascade_splits_within(64 << 20, 256, 32, 128)
    assert cascade_scratch(cap, 0, 256, 32, 128).end <= 64 << 20
    assert cascade_scratch(cap + 1, 0, 256, 32, 128).end > 64 << 20
    assert cascade_splits_within(cascade_scratch(1, 0, 256, 32, 128).end, 256, 32, 128) == 0


def _paged_case(rng, b: int, hq: int, hk: int, d: int, bs: int, shared: int, own_lens: list[int], fp8: bool):
    """Caches of nb blocks, b decodes sharing `shared` blocks, then own_lens[i] keys of their own."""
    own_blocks = [-(-n // bs) for n in own_lens]
    nb = shared + sum(own_blocks) + 3
    k = rng.standard_normal((nb, bs, hk, d)).astype(np.float32)
    v = rng.standard_normal((nb, bs, hk, d)).astype(np.float32)
    if fp8:
        k, v = to_e4m3(k), to_e4m3(v)
    width = shared + max(own_blocks) + 1
    table = np.zeros((b, width), np.int32)
    prefix = rng.permutation(nb)[:shared]  # the shared blocks, anywhere in the cache
    free = [x for x in range(nb) if x not in set(prefix.tolist())]
    ids = iter(rng.permutation(free).tolist())
    for i in range(b):
        table[i, :shared] = prefix
        table[i, shared: shared + own_blocks[i]] = [next(ids) for _ in range(own_blocks[i])]
    lens = np.array([shared * bs + n for n in own_lens], np.int32)
    q = rng.standard_normal((b, hq, d)).astype(np.float32)
    return q, k, v, table, lens


@pytest.mark.parametrize("hq,hk,fp8", [(8, 2, False), (4, 4, False), (6, 1, True)])
def test_numpy_cascade_equals_plain_attention(hq, hk, fp8):
    rng = np.random.default_rng(3)
    b, d, bs, shared = 5, 16, 4, 6
    own = [1, 3, 4, 9, 2]
    q, k, v, table, lens = _paged_case(rng, b, hq, hk, d, bs, shared, own, fp8)
    qsl = np.arange(b + 1, dtype=np.int32)
    scales = (0.7, 1.3)
    plain = ops.attention(q, k, v, qsl, lens, table, d ** -0.5, 1, int(lens.max()), kv_scales=scales)
    casc = ops.attention(q, k, v, qsl, lens, table, d ** -0.5, 1, int(lens.max()), kv_scales=scales,
                         cascade_blocks=shared)
    np.testing.assert_allclose(casc, plain, rtol=1e-5, atol=1e-5)
    # fewer blocks than they share is a cascade too
    part = ops.attention(q, k, v, qsl, lens, table, d ** -0.5, 1, int(lens.max()), kv_scales=scales,
                         cascade_blocks=2)
    np.testing.assert_allclose(part, plain, rtol=1e-5, atol=1e-5)


def test_numpy_cascade_on_the_decodes_of_a_mixed_batch():
    """decode_seqs decodes first, then a prompt: only the decodes cascade; the prompt's rows are
    plain attention."""
    rng = np.random.default_rng(4)
    b, hq, hk, d, bs, shared = 4, 4, 2, 8, 4, 5
    q, k, v, table, lens = _paged_case(rng, b, hq, hk, d, bs, shared, [2, 5, 1, 7], False)
    # the last sequence is a 3-token prompt chunk
    prompt_q = rng.standard_normal((3, hq, d)).astype(np.float32)
    qq = np.concatenate([q[:3], prompt_q])
    qsl = np.array([0, 1, 2, 3, 6], np.int32)
    plain = ops.attention(qq, k, v, qsl, lens, table, 0.3, 3, int(lens.max()), decode_seqs=3)
    casc = ops.attention(qq, k, v, qsl, lens, table, 0.3, 3, int(lens.max()), decode_seqs=3,
                         cascade_blocks=shared)
    np.testing.assert_allclose(casc, plain, rtol=1e-5, atol=1e-5)


def test_numpy_cascade_refuses_a_prefix_not_shared_or_too_long():
    rng = np.random.default_rng(5)
    q, k, v, table, lens = _paged_case(rng, 3, 4, 2, 8, 4, 4, [2, 2, 2], False)
    qsl = np.arange(4, dtype=np.int32)
    table[1, 2] = table[1, 4]
    with pytest.raises(ValueError, match="do not share"):
        ops.attention(q, k, v, qsl, lens, table, 0.3, 1, int(lens.max()), cascade_blocks=4)
    with pytest.raises(ValueError, match="longer than"):
        ops.attention(q, k, v, qsl, lens, table, 0.3, 1, int(lens.max()), cascade_blocks=5)


def test_served_tokens_with_and_without_cascade(tiny_checkpoint: Path):
    """40 greedy requests behind one 300-token prompt prefix: their decodes cascade (the runner
    counts such steps) and produce the same tokens as with --disable-cascade-attn."""
    from vt.llm import LLM
    from vt.sampling_params import SamplingParams

    rng = np.random.default_rng(6)
    prefix = rng.integers(10, 200, 300).tolist()
    prompts = [prefix + rng.integers(10, 200, 5).tolist() for _ in range(40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs, cascades = [], []
    for disable in (False, True):
        with LLM(str(tiny_checkpoint), device="cpu", max_num_seqs=64, max_model_len=512,
                 max_num_batched_tokens=2048, disable_cascade_attn=disable) as llm:
            outs.append([c.token_ids for c in llm.generate(prompts, params)])
            cascades.append(llm.engine.runner.cascade_steps)
            assert llm.engine.scheduler.kv_usage == 0.0
    assert cascades[0] > 0 and cascades[1] == 0, cascades
    assert outs[0] == outs[1]
