"""Embedding models on the numpy backend against transformers' own pooled output.

A Qwen3-Embedding-style checkpoint (tests/unit/embedding_models.py) is served by the pooling
runner: every prompt's vector is the final norm of its last token's hidden state, L2-normalized,
batched through the scheduler with prompts of different lengths, chunked prefill, prefix-cache
hits and preemption, at both scheduling depths; it equals transformers' within float32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.unit.embedding_models import (
    hf_embeddings,
    write_embedding_checkpoint,
    write_sentence_transformers_files,
)
from vt.config import EngineConfig, ModelConfig
from vt.engine.outputs import PromptTooLongError
from vt.kernels.arena import ArenaExhausted, aligned
from vt.kernels.numpy_ops import NumpyBackend
from vt.llm import LLM
from vt.model.loader import CheckpointError
from vt.model.make_model import make_model
from vt.model.pooling import (
    PoolingConfig,
    PoolingConfigError,
    load_pooling_config,
    pooled_vector,
    resolve_runner,
)
from vt.runner.memory_plan import plan_step_memory, step_arena_bytes
from vt.runner.runner import ModelRunner
from vt.sampling_params import SamplingParams, SamplingParamsError

ATOL = 2e-6  # unit vectors of 64 float32 values: transformers and numpy differ by rounding only
PROMPT_LENS = (37, 1, 9, 20, 64, 3)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tok") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return write_embedding_checkpoint(tmp_path_factory.mktemp("emb") / "qwen3-embedding", tokenizer_dir,
                                      config_extra={"is_matryoshka": True})


def prompts(vocab: int, lens: tuple[int, ...] = PROMPT_LENS, seed: int = 5) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lens]


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32 and g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=ATOL)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["depth2", "depth1"])
def test_batched_vectors_equal_transformers(embedding_model: Path, async_scheduling: bool) -> None:
    """Six prompts of 1 to 64 tokens in one call, with a 16-token step budget: the long ones are
    chunked over several steps, beside the short ones."""
    ps = prompts(ModelConfig.from_dir(embedding_model).vocab_size)
    with LLM(str(embedding_model), device="cpu", max_num_seqs=4, max_num_batched_tokens=16,
             async_scheduling=async_scheduling) as llm:
        assert llm.engine.pooling is not None and llm.engine.runner.model.lm_head is None
        got = llm.embed(ps)
        assert sum(llm.engine.runner.routes.values()) >= -(-sum(PROMPT_LENS) // 16)  # 16 tokens a step
        assert llm.engine.idle
    assert_close(got, hf_embeddings(embedding_model, ps))
    for v in got:
        assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-6


def test_single_inputs_and_text_equal_transformers(embedding_model: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog; " * 4
    with LLM(str(embedding_model), device="cpu") as llm:
        ids = llm.tokenizer.encode(text)
        assert len(ids) > 32
        one = llm.embed([text])
        again = llm.embed([ids])  # the same prompt again: now a prefix-cache hit
        assert llm.engine.stats().prefix_cache_hit_tokens_total > 0
    want = hf_embeddings(embedding_model, [ids])
    assert_close(one, want)
    assert_close(again, want)  # computed from the cached KV of its first 32 tokens


def test_shared_prefixes_and_preemption_keep_the_vectors(embedding_model: Path) -> None:
    """Prompts sharing a 32-token prefix (cache hits) and others, chunked, on a KV cache of five
    blocks (prompts in flight are preempted and recomputed)."""
    vocab = ModelConfig.from_dir(embedding_model).vocab_size
    head = prompts(vocab, (32,), seed=9)[0]
    ps = prompts(vocab, (60, 45, 33, 50, 20, 7), seed=10)
    ps += [head + tail for tail in prompts(vocab, (5, 17, 1, 30, 9, 2), seed=11)]
    with LLM(str(embedding_model), device="cpu", max_num_seqs=8, max_num_batched_tokens=24,
             num_gpu_blocks=5, max_model_len=64) as llm:
        got = llm.embed(ps)
        stats = llm.engine.stats()
        assert stats.prefix_cache_hit_tokens_total > 0 and stats.num_preemptions_total > 0
        llm.engine.scheduler.check_invariants()
    assert_close(got, hf_embeddings(embedding_model, ps))


def test_matryoshka_dimensions_truncate_then_normalize(embedding_model: Path) -> None:
    ps = prompts(ModelConfig.from_dir(embedding_model).vocab_size, (7, 12))
    with LLM(str(embedding_model), device="cpu") as llm:
        got = llm.embed(ps, dimensions=16)
        with pytest.raises(SamplingParamsError, match="dimensions"):
            llm.embed(ps, dimensions=65)
    assert_close(got, hf_embeddings(embedding_model, ps, dimensions=16))


@pytest.mark.parametrize("layout", ["base", "causal"])
def test_checkpoints_without_lm_head_load_with_or_without_the_model_prefix(
        tmp_path: Path, tokenizer_dir: Path, layout: str) -> None:
    """Qwen3Model (no `model.` prefix) and Qwen3ForCausalLM without its lm_head.weight, with no
    sentence-transformers files: --runner pooling pools the last token and normalizes."""
    path = write_embedding_checkpoint(tmp_path / layout, tokenizer_dir, layout=layout,
                                      sentence_transformers=False, seed=3)
    assert resolve_runner(path) == ("pooling" if layout == "base" else "generate")
    ps = prompts(ModelConfig.from_dir(path).vocab_size, (4, 21))
    with LLM(str(path), device="cpu", runner="pooling", max_num_batched_tokens=8) as llm:
        got = llm.embed(ps)
    assert_close(got, hf_embeddings(path, ps))
    if layout == "causal":  # a generation runner needs the lm_head it lacks, and says what to do
        with pytest.raises(CheckpointError, match="lm_head.weight.*--runner pooling"):
            LLM(str(path), device="cpu")


def test_without_a_normalize_module_vectors_are_not_normalized(tmp_path: Path, tokenizer_dir: Path) -> None:
    path = write_embedding_checkpoint(tmp_path / "raw", tokenizer_dir, normalize=False, seed=4)
    assert load_pooling_config(path) == PoolingConfig(normalize=False, source="modules.json")
    ps = prompts(ModelConfig.from_dir(path).vocab_size, (6, 2, 15))
    with LLM(str(path), device="cpu") as llm:
        got = llm.embed(ps)
    assert_close(got, hf_embeddings(path, ps, normalize=False))


def test_the_runner_comes_from_the_checkpoint(tmp_path: Path, tokenizer_dir: Path) -> None:
    assert resolve_runner(tokenizer_dir) == "generate"  # a *ForCausalLM without sentence-transformers files
    assert resolve_runner(tokenizer_dir, "pooling") == "pooling"
    path = write_embedding_checkpoint(tmp_path / "st", tokenizer_dir, layout="causal",
                                      config_extra={"matryoshka_dimensions": [16, 32]})
    assert resolve_runner(path) == "pooling"  # its modules.json names a Pooling module
    assert resolve_runner(path, "generate") == "generate"
    assert load_pooling_config(path, "generate") is None
    cfg = load_pooling_config(path)
    assert cfg == PoolingConfig("LAST", True, True, (16, 32), "modules.json")
    cfg.check_dimensions(32, 64, "m")
    with pytest.raises(SamplingParamsError, match=r'Model "m" only supports \[16, 32\] matryoshka'):
        cfg.check_dimensions(24, 64, "m")
    with pytest.raises(SamplingParamsError, match='Model "m" does not support matryoshka representation'):
        PoolingConfig().check_dimensions(8, 64, "m")
    with pytest.raises(PoolingConfigError, match="unknown runner"):
        resolve_runner(path, "draft")


@pytest.mark.parametrize("mode,modules,match", [
    ("pooling_mode_mean_tokens", None, "MEAN pooling; vt serves last-token pooling"),
    ("pooling_mode_cls_token", None, "CLS pooling"),
    ("pooling_mode_lasttoken", [{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}],
     "names sentence_transformers.models.Dense"),
])
def test_pooling_vt_does_not_do_is_refused_at_start(tmp_path: Path, mode: str, modules: list | None,
                                                    match: str) -> None:
    write_sentence_transformers_files(tmp_path, 64, mode)
    if modules:
        listed = json.loads((tmp_path / "modules.json").read_text())
        (tmp_path / "modules.json").write_text(json.dumps(listed + modules))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(PoolingConfigError, match=match):
        load_pooling_config(tmp_path)


def test_pooled_vector() -> None:
    h = np.array([3.0, 4.0, 12.0], np.float32)
    np.testing.assert_allclose(pooled_vector(h, True), h / 13, rtol=1e-7)
    np.testing.assert_allclose(pooled_vector(h, True, 2), [0.6, 0.8], rtol=1e-7)
    np.testing.assert_array_equal(pooled_vector(h, False, 2), [3.0, 4.0])
    np.testing.assert_array_equal(pooled_vector(np.zeros(4, np.float32), True), np.zeros(4))


def test_each_runner_refuses_the_other_ones_requests(embedding_model: Path, tokenizer_dir: Path) -> None:
    with LLM(str(embedding_model), device="cpu", max_model_len=64) as llm:
        with pytest.raises(ValueError, match="embedding model .* generates no text"):
            llm.generate(["hello"], SamplingParams(max_tokens=2))
        # the whole context is the prompt's: 64 tokens fit, 65 do not
        assert llm.embed([[5] * 64])[0].shape == (64,)
        with pytest.raises(PromptTooLongError, match="65 tokens"):
            llm.embed([[5] * 65])
        with pytest.raises(ValueError, match="empty"):
            llm.embed([[]])
    with LLM(str(tokenizer_dir), device="cpu") as llm:
        with pytest.raises(ValueError, match="generative model: it has no embeddings"):
            llm.embed(["hello"])


@pytest.mark.parametrize("tokens,seqs", [(64, 8), (16, 32)])
def test_the_largest_pooling_step_takes_exactly_its_planned_arena(embedding_model: Path, tokens: int,
                                                                  seqs: int) -> None:
    """No logits and no sampler: the plan stops at the final norm, and the numpy ledger (at CUDA
    sizes) holds the largest pooling step to it."""
    mc = ModelConfig.from_dir(embedding_model)
    cfg = EngineConfig(model=str(embedding_model), device="cpu", max_num_batched_tokens=tokens,
                       max_num_seqs=seqs)
    ops = NumpyBackend()
    runner = ModelRunner(mc, cfg, ops, 256, pooling=PoolingConfig())
    plan = runner.step_memory
    assert plan == plan_step_memory(mc, tokens, seqs, pooling=True)
    assert plan.arena_bytes < step_arena_bytes(mc, max(tokens, seqs), seqs, 0)  # no logits, no sampler
    runner.profile_run()
    assert [aligned(ops.arena_high(i)) for i in range(2)] == [plan.arena_bytes] * 2
    ops.ensure_workspace(ops.arena_high(0) - 1)
    with pytest.raises(ArenaExhausted, match="memory plan"):
        runner.profile_run()


def test_a_tensor_parallel_split_gives_the_same_vectors(embedding_model: Path) -> None:
    """Each rank holds its heads and MLP columns; the pooled rows (replicated after the
    all-reduce) come from rank 0."""
    ps = prompts(ModelConfig.from_dir(embedding_model).vocab_size, (40, 3, 17))
    with LLM(str(embedding_model), device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16) as llm:
        got = llm.embed(ps)
    assert_close(got, hf_embeddings(embedding_model, ps))
