"""Cascade attention on the GPU: decodes sharing their first blocks attend to them in one prompt-kernel
launch, merged with each decode's own keys (AttentionOps._cascade), against the numpy twin's plain
attention; and served tokens with it on and off."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.unit.cascade_batches import bf16, shared_prefix_batch
from vt.kernels.numpy_fp8 import to_e4m3
from vt.kernels.numpy_ops import NumpyBackend

pytestmark = pytest.mark.gpu
BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def cb():
    from vt.kernels.cuda_ops import CudaBackend

    return CudaBackend(workspace_bytes=256 << 20)


@pytest.fixture
def rng(request):
    return np.random.default_rng(zlib.crc32(request.node.name.encode()))


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def _case(rng, b: int, hq: int, hk: int, d: int, bs: int, shared: int, max_own: int, kv8: bool):
    """shared_prefix_batch, its caches as e4m3 codes where kv8."""
    q, kc, vc, lens, table = shared_prefix_batch(rng, b, hq, hk, d, bs, shared, max_own)
    if kv8:
        kc, vc = to_e4m3(kc * 40), to_e4m3(vc * 40)
    return q, kc, vc, lens, table


def _cache(cb, c: np.ndarray):
    return cb.from_host(c.view(np.uint8), "fp8") if c.dtype.itemsize == 1 else cb.from_host(bf16(c), "act")


@pytest.mark.parametrize("b,hq,hk,d,shared,max_own,kv8,in_slot", [
    (256, 32, 8, 128, 128, 200, False, True),   # the 8B shared-prefix row: 2048 shared keys
    (64, 32, 8, 128, 40, 130, True, True),      # an fp8 cache (wgr_kv8, decode8_kv8)
    (40, 16, 8, 64, 20, 60, False, True),       # head dim 64: the fallback prompt tiling
    (33, 8, 2, 128, 17, 16, False, False),      # outside a step: scratch from the pool
])
def test_cascade_equals_plain_attention(cb, rng, b, hq, hk, d, shared, max_own, kv8, in_slot):
    bs, scale = 16, d ** -0.5
    q, kc, vc, lens, table = _case(rng, b, hq, hk, d, bs, shared, max_own, kv8)
    scales = (0.025, 0.04) if kv8 else (1.0, 1.0)
    qsl = np.arange(b + 1, dtype=np.int32)
    top = int(lens.max())
    ref = NumpyBackend().attention(q, kc, vc, qsl, lens, table, scale, 1, top, kv_scales=scales)

    def run(cascade_blocks: int) -> np.ndarray:
        dev = [cb.from_host(a, "i32") for a in (qsl, lens, table)]
        out = cb.attention(cb.from_host(q, "act"), _cache(cb, kc), _cache(cb, vc), *dev, scale, 1, top,
                           kv_scales=scales, cascade_blocks=cascade_blocks)
        return cb.to_host(out)

    if in_slot:
        import cupy

        cb._slots[0].partials.fill(255)  # NaN scratch: a read of what no launch wrote shows
        cupy.cuda.Device().synchronize()
        with cb.slot(0):
            got, plain = run(shared), run(0)
    else:
        got, plain = run(shared), run(0)
    assert rel_err(got, ref) < BF16_TOL
    assert rel_err(got, plain) < BF16_TOL


def test_cascade_on_the_decodes_of_a_mixed_step_from_a_strided_q(cb, rng):
    """Decodes first, then a prompt chunk (decode_seqs): the decodes cascade, the prompt's rows run
    their own launch; q a view of a wider qkv row, as the model passes it."""
    hq, hk, d, bs, shared = 32, 8, 128, 16, 24
    q, kc, vc, lens, table = _case(rng, 48, hq, hk, d, bs, shared, 90, False)
    chunk = 37
    # the last sequence: a prompt chunk over its own fresh blocks after the shared ones
    lens[-1] = shared * bs + chunk
    table[-1, shared: shared + 3] = table[-2, shared: shared + 3]  # its own blocks (reused ids, fine)
    qq = np.concatenate([q[:-1], bf16(rng.standard_normal((chunk, hq, d)))])
    qsl = np.concatenate([np.arange(48), [47 + chunk]]).astype(np.int32)
    t = qq.shape[0]
    wide = np.concatenate([qq.reshape(t, -1), bf16(rng.standard_normal((t, 2 * hk * d)))], axis=1)
    ref = NumpyBackend().attention(qq, kc, vc, qsl, lens, table, d ** -0.5, chunk, int(lens.max()),
                                   decode_seqs=47)
    with cb.slot(0):
        q_view = cb.from_host(wide, "act")[:, : hq * d].reshape(t, hq, d)
        dev = [cb.from_host(a, "i32") for a in (qsl, lens, table)]
        out = cb.attention(q_view, cb.from_host(kc, "act"), cb.from_host(vc, "act"), *dev, d ** -0.5, chunk,
                           int(lens.max()), decode_seqs=47, cascade_blocks=shared)
        got = cb.to_host(out)
    assert rel_err(got, ref) < BF16_TOL


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vt.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", preset="tiny")


def test_served_tokens_with_and_without_cascade_on_gpu(tiny_checkpoint: Path):
    """64 greedy requests behind one 600-token prefix, graphs on: their decode steps cascade (the
    layer-graph route) and give the tokens of --disable-cascade-attn."""
    from vt.llm import LLM
    from vt.sampling_params import SamplingParams

    rng = np.random.default_rng(8)
    prefix = rng.integers(10, 200, 600).tolist()
    prompts = [prefix + rng.integers(10, 200, 7).tolist() for _ in range(64)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs, cascades, routes = [], [], []
    for disable in (False, True):
        with LLM(str(tiny_checkpoint), device="cuda", max_num_seqs=64, max_model_len=1024,
                 max_num_batched_tokens=2048, disable_cascade_attn=disable) as llm:
            outs.append([c.token_ids for c in llm.generate(prompts, params)])
            cascades.append(llm.engine.runner.cascade_steps)
            routes.append(dict(llm.engine.runner.routes))
            assert llm.engine.scheduler.kv_usage == 0.0
    assert cascades[0] > 0 and cascades[1] == 0, (cascades, routes)
    same = sum(a == b for a, b in zip(outs[0], outs[1], strict=True))
    assert same == len(prompts), f"{same} of {len(prompts)} requests gave the same tokens"
