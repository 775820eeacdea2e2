"""The memory plan covers every step: the numpy backend keeps the CUDA arena's ledger (each op
output at its CUDA size and alignment, rewound per layer as on the GPU) and fails a step that
asks for more than the plan reserved, so these runs check the plan that sizes the CUDA arena."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.hf_models import make_hf_checkpoint
from vt.config import EngineConfig, ModelConfig
from vt.kernels import get_backend
from vt.kernels.arena import ArenaExhausted, aligned
from vt.kernels.attention_plan import (
    MAX_KEY_SPLITS,
    attention_partial_bytes,
    key_splits,
    max_splits_within,
)
from vt.kernels.numpy_ops import NumpyBackend
from vt.llm import LLM
from vt.model.make_model import make_model
from vt.runner.memory_plan import StartupMemoryError, plan_step_memory, step_arena_bytes
from vt.runner.runner import ModelRunner
from vt.sampling_params import MAX_LOGPROBS, SamplingParams


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tok"), preset="tiny")


@pytest.fixture(scope="module", params=[16, 24], ids=["fused-prologue", "three-op-prologue"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               tokenizer_dir: Path) -> Path:
    """Qwen3 (q/k norms); head dim 24 takes CUDA's three-op prologue, whose norms allocate."""
    import json

    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    path = make_hf_checkpoint(tmp_path_factory.mktemp("m") / "qwen3", vocab_size=vocab,
                              head_dim=request.param, max_position_embeddings=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def _runner(checkpoint: Path, **flags: object) -> tuple[ModelRunner, NumpyBackend]:
    cfg = EngineConfig(model=str(checkpoint), device="cpu", **flags)
    ops = NumpyBackend()
    return ModelRunner(ModelConfig.from_dir(checkpoint), cfg, ops, 512), ops


@pytest.mark.parametrize("tokens,seqs", [(64, 8), (40, 40), (16, 64)])
def test_the_largest_step_takes_exactly_the_planned_arena(checkpoint: Path, tokens: int, seqs: int) -> None:
    runner, ops = _runner(checkpoint, max_num_batched_tokens=tokens, max_num_seqs=seqs)
    runner.profile_run()  # the most tokens over the most sequences, logprobs 20, longest context
    # its steps are guided and sample twice, but the counters of served steps stay at zero
    assert not runner.routes and not runner.guided_routes and runner.deferred_samples == 0
    plan = runner.step_memory
    assert plan.tokens == max(tokens, seqs) and plan.seqs == seqs
    # The plan rounds the last output up to the alignment too.
    assert [aligned(ops.arena_high(i)) for i in range(2)] == [plan.arena_bytes] * 2
    # One byte less than that step reaches and it cannot run: the ledger enforces the plan.
    ops.ensure_workspace(ops.arena_high(0) - 1)
    with pytest.raises(ArenaExhausted, match="memory plan"):
        runner.profile_run()


def test_served_steps_stay_within_the_plan(checkpoint: Path) -> None:
    """Prefill chunks beside decodes, logprobs, penalties, preemption: every step runs inside the
    planned arena (a step past it would fail its requests) and none reaches past it."""
    rng = np.random.default_rng(0)
    with LLM(str(checkpoint), device="cpu", max_num_seqs=6, max_num_batched_tokens=48,
             num_gpu_blocks=40, max_model_len=512) as llm:
        prompts = [rng.integers(3, 200, size=n).tolist() for n in (1, 47, 48, 49, 130, 7, 300, 2)]
        params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                 logprobs=[None, 20, 3][i % 3], presence_penalty=0.5 * (i % 2))
                  for i in range(len(prompts))]
        outs = llm.generate(prompts, params)
        plan = llm.engine.runner.step_memory
        highs = [llm.engine.runner.ops.arena_high(i) for i in range(2)]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert 0 < max(highs) <= plan.arena_bytes


def test_arena_bytes_grow_with_every_dimension() -> None:
    mc = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
                                "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "max_position_embeddings": 40960})
    base = step_arena_bytes(mc, 2048, 256, 20)
    assert step_arena_bytes(mc, 2049, 256, 20) > base
    assert step_arena_bytes(mc, 2048, 257, 20) > base
    assert step_arena_bytes(mc, 2048, 256, 0) < base
    plan = plan_step_memory(mc, 2048, 256)
    assert plan.arena_bytes == base
    # 8B at 2048 tokens: the residual stream, one layer and the head, well under a GiB a slot
    assert 100 << 20 < plan.arena_bytes < 1 << 30


@settings(max_examples=200, deadline=None)
@given(budget=st.integers(0, 1 << 28), tokens=st.integers(1, 8192), heads=st.integers(1, 64),
       dim=st.sampled_from([64, 128, 256]))
def test_split_partials_fit_the_budget(budget: int, tokens: int, heads: int, dim: int) -> None:
    s = max_splits_within(budget, tokens, heads, dim)
    assert 1 <= s <= MAX_KEY_SPLITS
    assert s == 1 or attention_partial_bytes(s, tokens, heads, dim) <= budget
    assert s == MAX_KEY_SPLITS or attention_partial_bytes(s + 1, tokens, heads, dim) > budget - 512
    assert key_splits(8, 396, 40960, s) <= s


def test_start_refuses_step_memory_the_card_lacks_naming_the_flags(checkpoint: Path) -> None:
    class Card(NumpyBackend):
        name = "cuda"  # sized as the CUDA backend is

        def mem_info(self) -> tuple[int, int]:
            return 64 << 20, 80 << 30  # 64 MiB free of 80 GiB

    cfg = EngineConfig(model=str(checkpoint), max_num_batched_tokens=65536, max_num_seqs=256)
    with pytest.raises(StartupMemoryError, match="--max-num-batched-tokens 65536.*--max-num-seqs 256"):
        ModelRunner(ModelConfig.from_dir(checkpoint), cfg, Card(), 512)


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_takes_exactly_its_planned_arena(checkpoint: Path, size: int) -> None:
    """Split over ranks, each rank's arena holds the whole residual stream, its own heads' and
    MLP columns' activations, its vocabulary rows' logits and the gathered ones: the per-rank
    plan, exactly, on every rank (the vocabulary divides by 2 and 4)."""
    cfg = EngineConfig(model=str(checkpoint), device="cpu", max_num_batched_tokens=64, max_num_seqs=8,
                       tensor_parallel_size=size)
    ops = get_backend("cpu", size)
    runner = ModelRunner(ModelConfig.from_dir(checkpoint), cfg, ops, 512)
    runner.profile_run()
    plan = runner.step_memory
    assert plan == plan_step_memory(runner.model_cfg, 64, 8, size)
    for rank in ops.ranks:
        assert [aligned(rank.arena_high(i)) for i in range(2)] == [plan.arena_bytes] * 2
    # One byte less on any one rank and the largest step cannot run.
    ops.ranks[-1].ensure_workspace(ops.ranks[-1].arena_high(0) - 1)
    with pytest.raises(ArenaExhausted, match="memory plan"):
        runner.profile_run()


def test_fp8_plan_covers_the_decode_sized_steps_that_hold_a_product_beside_the_stream() -> None:
    """With fp8 channel weights, steps of 17-256 rows run o_proj and down with unit scales into a
    product of their own (quantized.unit_scale_rows): a 256-row step then needs more arena than a
    257-row one, and the plan of a larger largest step still covers it."""
    from vt.model.quantization import ONLINE, Fp8Format

    mc = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936,
                                "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                                "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                "max_position_embeddings": 40960})
    small = step_arena_bytes(mc, 256, 256, MAX_LOGPROBS, fp8=ONLINE)
    assert small > step_arena_bytes(mc, 257, 256, MAX_LOGPROBS, fp8=ONLINE)
    assert plan_step_memory(mc, 257, 256, fp8=ONLINE).arena_bytes == small
    assert plan_step_memory(mc, 8192, 256, fp8=ONLINE).arena_bytes == step_arena_bytes(
        mc, 8192, 256, MAX_LOGPROBS, fp8=ONLINE)
    # block scales (Qwen3's FP8 checkpoints) keep the block-scaled GEMM, which accumulates in place
    block = Fp8Format(online=False, block=True, scale_name="weight_scale_inv")
    assert step_arena_bytes(mc, 256, 256, MAX_LOGPROBS, fp8=block) < step_arena_bytes(
        mc, 257, 256, MAX_LOGPROBS, fp8=block)
