"""The engine's promises with fp8 weights, on the numpy backend: the largest step takes exactly the
planned arena; preemption, prefix caching and async depth 2 leave greedy and seeded tokens as
they were; structured outputs at depth 2 sample the tokens of depth 1. Both weight formats: a
bf16 checkpoint quantized at load (per channel, per-token activations) and a 128x128-block fp8
checkpoint (per-token-and-128-column activations, rows padded for the block GEMMs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.unit import test_preemption_exact as preemption
from tests.unit import test_structured_engine as structured
from vt.config import EngineConfig, ModelConfig
from vt.kernels.arena import ArenaExhausted, aligned
from vt.kernels.numpy_ops import NumpyBackend
from vt.model.make_model import make_model
from vt.runner.runner import ModelRunner

FORMATS = {"online": ("tiny", None, "fp8"), "block": ("tiny128", "fp8-block", None)}


@pytest.fixture(scope="module", params=list(FORMATS))
def fp8_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    preset, checkpoint_quantization, flag = FORMATS[request.param]
    path = make_model(tmp_path_factory.mktemp(request.param) / "m", preset=preset,
                      quantization=checkpoint_quantization)
    return path, {"quantization": flag}


@pytest.mark.parametrize("tokens,seqs", [(64, 8), (37, 37)])
def test_the_largest_fp8_step_takes_exactly_the_planned_arena(fp8_model, tokens: int, seqs: int) -> None:
    path, flags = fp8_model
    cfg = EngineConfig(model=str(path), device="cpu", max_num_batched_tokens=tokens, max_num_seqs=seqs,
                       **flags)
    ops = NumpyBackend()
    runner = ModelRunner(ModelConfig.from_dir(path), cfg, ops, 512)
    assert runner.fp8 is not None
    runner.profile_run()
    plan = runner.step_memory
    assert [aligned(ops.arena_high(i)) for i in range(2)] == [plan.arena_bytes] * 2
    ops.ensure_workspace(ops.arena_high(0) - 1)
    with pytest.raises(ArenaExhausted, match="memory plan"):
        runner.profile_run()


def test_preemption_and_depth_keep_fp8_outputs(fp8_model) -> None:
    path, flags = fp8_model
    reference, engine = asyncio.run(preemption._run(path, False, max_num_seqs=16, async_scheduling=False,
                                                    **flags))
    assert engine.stats().num_preemptions_total == 0
    for policy, async_scheduling in (("fcfs", True), ("priority", False)):
        small = {"num_gpu_blocks": 8, "block_size": 16, "max_num_seqs": 8}
        outs, engine = asyncio.run(preemption._run(path, False, scheduling_policy=policy,
                                                   async_scheduling=async_scheduling, **small, **flags))
        assert engine.stats().num_preemptions_total > 0
        preemption._check_idle(engine)
        assert outs == reference, (policy, async_scheduling)
    # better-priority arrivals preempt running requests; the shared-prefix prompts hit the cache
    outs, engine = asyncio.run(preemption._run(path, True, block_size=16, max_num_seqs=3,
                                               scheduling_policy="priority", async_scheduling=True, **flags))
    assert engine.stats().num_preemptions_total > 0 and engine.stats().prefix_cache_hit_tokens_total > 0
    assert outs == reference


def test_fp8_structured_outputs_at_depth_two_sample_depth_ones_tokens(tmp_path: Path) -> None:
    path = make_model(tmp_path / "m", preset="tiny")
    small = {"num_gpu_blocks": 40, "block_size": 16, "quantization": "fp8"}
    two, engine2 = asyncio.run(structured._run(path, async_scheduling=True, **small))
    one, _ = asyncio.run(structured._run(path, async_scheduling=False, **small))
    assert [t for t, _, _ in two] == [t for t, _, _ in one]
    assert engine2.runner.deferred_samples > 20 and engine2.runner.fp8 is not None
    for (_, _, kind), (_, text, reason) in zip(structured._workload(engine2.tokenizer), two, strict=True):
        if kind is not None:
            assert reason == "stop" and structured.follows(kind, text), (kind, text)
