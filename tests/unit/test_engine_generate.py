"""Whole-engine greedy generation equals transformers' generate(), token for token.

Checkpoints are made by transformers itself (tests/unit/hf_models.py); a tokenizer from
`vt make-model` is copied beside them because the engine serves text too.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.hf_models import load_hf_model, make_hf_checkpoint
from vt.llm import LLM
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tok"), preset="tiny")


def _checkpoint(root: Path, arch: str, tokenizer_dir: Path) -> Path:
    import json

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    path = make_hf_checkpoint(root / arch, arch=arch, vocab_size=vocab, initializer_range=0.2,
                              max_position_embeddings=1024)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         tokenizer_dir: Path) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(checkpoint, prompts, transformers' greedy continuations)."""
    path = _checkpoint(tmp_path_factory.mktemp("hf"), request.param, tokenizer_dir)
    rng = np.random.default_rng(1)
    shared = rng.integers(3, 200, size=40).tolist()  # a common prefix: prefix-cache hits
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 17, 33, 70)]
    prompts += [shared + [7, 8, 9], shared + [10, 11]]
    model = load_hf_model(path)
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    return path, prompts, expected


ENGINES = {
    "default": dict(),
    "sync": dict(async_scheduling=False),
    "chunked": dict(max_num_batched_tokens=24),
    # the last prompt in line spread over the steps beside the decodes
    "paced": dict(max_num_batched_tokens=32, prefill_pacing=True),
    "preempt": dict(num_gpu_blocks=20, block_size=8, max_num_batched_tokens=64),
    "preempt-sync": dict(num_gpu_blocks=20, block_size=8, max_num_batched_tokens=64,
                         async_scheduling=False),
    "no-chunk-no-cache": dict(enable_chunked_prefill=False, enable_prefix_caching=False),
    "graph-path": dict(),  # the CUDA-graph decode path (padding, static block tables) on numpy
    "graph-path-sync": dict(async_scheduling=False),
    # the model split over numpy ranks (vt.kernels.rank_group): the same greedy tokens
    "tp2": dict(tensor_parallel_size=2),
    "preempt-tp4": dict(num_gpu_blocks=20, block_size=8, max_num_batched_tokens=64, tensor_parallel_size=4),
    "graph-path-tp2": dict(tensor_parallel_size=2),
}


@pytest.mark.parametrize("variant", list(ENGINES))
def test_greedy_matches_transformers(case: tuple, variant: str) -> None:
    path, prompts, expected = case
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(path), device="cpu", max_num_seqs=8, **ENGINES[variant]) as llm:
        if variant.startswith("graph-path"):
            llm.engine.runner.capture_graphs()  # as on CUDA: every size before the first step
        paced_chunks = _count_paced_chunks(llm) if variant == "paced" else None
        got = llm.generate(prompts, params)
        # A second round hits the prefix cache for every prompt.
        again = llm.generate(prompts, params)
        stats = llm.engine.stats()
        # The second round reuses every prompt's full blocks, unless caching is off.
        cached = ENGINES[variant].get("enable_prefix_caching", True)
        assert (stats.prefix_cache_hit_tokens_total > 0) == cached
        if variant.startswith("preempt"):
            assert stats.num_preemptions_total > 0, "the small KV pool should force preemption"
        llm.engine.scheduler.check_invariants()
        assert llm.engine.scheduler.kv_usage == 0.0
        if variant.startswith("graph-path"):
            assert llm.engine.runner.graphs, "decode steps should have gone through captured graphs"
        if paced_chunks is not None:
            assert paced_chunks, "no prompt chunk was paced"
    for i, (g, a, e) in enumerate(zip(got, again, expected)):
        assert g.token_ids == e, f"prompt {i}: first divergence at {_first_diff(g.token_ids, e)}"
        assert a.token_ids == e, f"prompt {i} (cached): first divergence at {_first_diff(a.token_ids, e)}"
        assert g.finish_reason == "length"


def _count_paced_chunks(llm: LLM) -> list[int]:
    """Pacing's floor made small enough for these prompts; returns a list that fills with the
    prompt chunks scheduled short of both their prompt's end and the step's budget."""
    sched = llm.engine.scheduler
    sched.cfg = dataclasses.replace(sched.cfg, pacing_floor=4)
    schedule, paced = sched.schedule, []

    def recording(*args: object, **kw: object):
        batch = schedule(*args, **kw)
        if batch.num_tokens < sched.cfg.max_num_batched_tokens:
            paced.extend(s.num_tokens for s in batch.seqs if s.num_tokens > 1 and not s.sample)
        return batch

    sched.schedule = recording
    return paced


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def test_seeded_sampling_is_reproducible_and_batch_independent(case: tuple) -> None:
    path, prompts, _ = case
    params = [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=50, seed=100 + i,
                             ignore_eos=True) for i in range(len(prompts))]
    with LLM(str(path), device="cpu", max_num_seqs=8) as llm:
        together = llm.generate(prompts, params)
    with LLM(str(path), device="cpu", max_num_seqs=8, async_scheduling=False) as llm:
        alone = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert len({tuple(c.token_ids) for c in together}) == len(prompts)
