"""A row left with no allowed token samples -1 on both samplers, never token 0 or any token its
constraints exclude; recording -1 leaves the row's history alone. The CUDA kernels run on the host
simulator (tests/cuda_sim) against numpy_sampling, the reference."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from tests.cuda_sim import LAUNCH_ARGTYPES, SimUnavailable, compile_host, host_source
from vt.kernels import numpy_sampling
from vt.kernels.sources import translation_unit

VOCAB = 64
# What sampling.cu needs beyond sim_runtime.h. Fibers switch only at barriers, so these
# read-modify-writes cannot interleave.
_SHIMS = """
inline unsigned atomicMax(unsigned* p, unsigned v) {
    const unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
inline float atomicAdd(float* p, float v) { const float old = *p; *p += v; return old; }
inline int __ffs(int x) { return x ? __builtin_ctz((unsigned)x) + 1 : 0; }
inline int __syncthreads_count(int pred) {
    static int count;
    __syncthreads();  // every thread has read the previous count
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    count += pred != 0;
    __syncthreads();
    return count;
}
"""
_LAUNCHERS = """
extern "C" int sim_sample_k(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem,
    const float* logits, const float* temperature, const int* top_k, const float* top_p, const float* min_p,
    const long long* seeds, const int* offsets, int* out, float* part_v, int* part_i, int vocab, int splits) {
    return sim::launch(gx, gy, gz, threads, smem, [&] { sample_k(logits, temperature, top_k, top_p, min_p,
        seeds, offsets, out, part_v, part_i, vocab, splits); }); }
extern "C" int sim_sample_combine_k(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem,
    const float* part_v, const int* part_i, int* out, int splits) {
    return sim::launch(gx, gy, gz, threads, smem, [&] { sample_combine_k(part_v, part_i, out, splits); }); }
extern "C" int sim_record_sampled_k(unsigned gx, unsigned gy, unsigned gz, unsigned threads, size_t smem,
    int* last_tokens, int* out_counts, const int* rows, const int* ids, int n, int num_rows, int vocab) {
    return sim::launch(gx, gy, gz, threads, smem, [&] { record_sampled_k(last_tokens, out_counts, rows, ids,
        n, num_rows, vocab); }); }
"""
_P, _I = ctypes.c_void_p, ctypes.c_int
_LAUNCH = LAUNCH_ARGTYPES


def _batch() -> dict[str, np.ndarray]:
    """Rows of each sampler path (greedy, plain temperature, top_k + top_p, min_p alone), each
    once with its logits intact, once masked down to three tokens and once with every token -inf."""
    rng = np.random.default_rng(5)
    paths = [(0.0, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.0), (0.8, 5, 0.9, 0.0), (1.3, 0, 1.0, 0.2)]
    rows, params = [], []
    for path in paths:
        for kind in ("intact", "three", "none"):
            row = rng.standard_normal(VOCAB).astype(np.float32) * 3
            if kind == "three":
                keep = rng.choice(VOCAB, 3, replace=False)
                row[np.setdiff1d(np.arange(VOCAB), keep)] = -np.inf
            elif kind == "none":
                row[:] = -np.inf
            rows.append(row)
            params.append(path)
    t, k, p, m = (np.array(col) for col in zip(*params))
    return {"logits": np.stack(rows), "temperature": t.astype(np.float32), "top_k": k.astype(np.int32),
            "top_p": p.astype(np.float32), "min_p": m.astype(np.float32),
            "seeds": np.arange(7, 7 + len(rows), dtype=np.int64),
            "offsets": np.arange(len(rows), dtype=np.int32)}


def _numpy_ids(batch: dict[str, np.ndarray]) -> np.ndarray:
    return numpy_sampling.sample(batch["logits"], batch["temperature"], batch["top_k"], batch["top_p"],
                                 batch["min_p"], batch["seeds"], batch["offsets"])


def test_numpy_samples_minus_one_only_where_no_token_is_allowed() -> None:
    batch = _batch()
    ids = _numpy_ids(batch)
    empty = np.all(batch["logits"] == -np.inf, axis=1)
    assert empty.sum() == 4
    assert (ids[empty] == -1).all()
    assert (ids[~empty] >= 0).all()
    # every other row samples the token it sampled before any row was empty: rows are independent
    for b in np.nonzero(~empty)[0]:
        one = {name: value[b:b + 1] for name, value in batch.items()}
        assert _numpy_ids(one)[0] == ids[b]
        assert batch["logits"][b, ids[b]] > -np.inf  # never a token its constraints exclude


def test_recording_minus_one_leaves_the_row_alone() -> None:
    last = np.array([11, 12, 13], np.int32)
    counts = np.zeros((3, VOCAB), np.int32)
    numpy_sampling.record_sampled(last, counts, np.array([0, 1, 2], np.int32), np.array([5, -1, 7], np.int32))
    assert last.tolist() == [5, 12, 7]  # row 1 keeps its last token: a decode behind it reads a real id
    assert counts.sum() == 2 and counts[0, 5] == 1 and counts[2, 7] == 1 and counts[1].sum() == 0
    lp, _, _ = numpy_sampling.log_softmax_topk(np.zeros((2, VOCAB), np.float32), np.array([3, -1]), 2)
    assert lp[0] == pytest.approx(-np.log(VOCAB)) and lp[1] == -np.inf


@pytest.fixture(scope="module")
def cuda_sampler() -> ctypes.CDLL:
    src = host_source(translation_unit("sampling.cu"))
    src = src.replace('#include "sim_runtime.h"\n', '#include "sim_runtime.h"\n' + _SHIMS, 1) + _LAUNCHERS
    try:
        lib = compile_host("sampling", src)
    except SimUnavailable as e:
        pytest.skip(str(e))
    lib.sim_sample_k.argtypes = _LAUNCH + [_P] * 10 + [_I, _I]
    lib.sim_sample_combine_k.argtypes = _LAUNCH + [_P, _P, _P, _I]
    lib.sim_record_sampled_k.argtypes = _LAUNCH + [_P, _P, _P, _P, _I, _I, _I]
    return lib


@pytest.mark.parametrize("splits", [1, 4])
def test_cuda_sampler_matches_numpy_with_rows_that_allow_nothing(cuda_sampler: ctypes.CDLL,
                                                                  splits: int) -> None:
    batch = _batch()
    n = len(batch["seeds"])
    out = np.full(n, 12345, np.int32)
    part_v = np.zeros(n * splits, np.float32)
    part_i = np.zeros(n * splits, np.int32)
    names = ("logits", "temperature", "top_k", "top_p", "min_p", "seeds", "offsets")
    args = [batch[name].ctypes.data for name in names]
    # Split, an unfiltered row's parts are combined; a filtered row is its first block's.
    assert cuda_sampler.sim_sample_k(splits, n, 1, 1024, 0, *args, out.ctypes.data, part_v.ctypes.data,
                                     part_i.ctypes.data, VOCAB, splits) == 0
    if splits > 1:
        assert cuda_sampler.sim_sample_combine_k(n, 1, 1, 32, 0, part_v.ctypes.data, part_i.ctypes.data,
                                                 out.ctypes.data, splits) == 0
    assert out.tolist() == _numpy_ids(batch).tolist()
    assert (out[np.all(batch["logits"] == -np.inf, axis=1)] == -1).all()


def test_cuda_record_sampled_skips_minus_one(cuda_sampler: ctypes.CDLL) -> None:
    last = np.array([11, 12, 13], np.int32)
    counts = np.zeros((3, VOCAB), np.int32)
    rows, ids = np.array([0, 1, 2], np.int32), np.array([5, -1, 7], np.int32)
    assert cuda_sampler.sim_record_sampled_k(1, 1, 1, 256, 0, last.ctypes.data, counts.ctypes.data,
                                             rows.ctypes.data, ids.ctypes.data, 3, 3, VOCAB) == 0
    assert last.tolist() == [5, 12, 7]
    assert counts.sum() == 2 and counts[1].sum() == 0
