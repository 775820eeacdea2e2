"""Preemption never changes a request's output: the engine in-process, a small KV pool vs a big one.

Greedy and seeded (temperature > 0) requests share each batch. The small pool forces preemption by
KV exhaustion; the priority policy also preempts when a better request arrives at a full batch.
Both policies, async scheduling on and off; the reference is one unconstrained run.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tiny") / "tiny-qwen3", preset="tiny")


def _workload() -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, priority) per request; two prompts share three full blocks."""
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 900, size=48).tolist()
    prompts = [rng.integers(3, 900, size=n).tolist() for n in (9, 23, 40, 57, 31)]
    prompts += [shared + [5, 6], shared + [7]]
    out = []
    for i, p in enumerate(prompts):
        if i % 2:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, top_k=40,
                                    seed=77 + i, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        out.append((p, params, i % 3))
    return out


async def _collect(stream) -> list[int]:
    toks: list[int] = []
    async for out in stream:
        toks.extend(out.token_ids)
        last = out
    assert last.finish_reason == "length"
    return toks


async def _run(model_dir: Path, staggered: bool,
               **engine_args: object) -> tuple[list[list[int]], AsyncEngine]:
    """Run the workload; staggered: half the requests arrive while the first half is decoding."""
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", **engine_args))
    await engine.start()
    try:
        work = _workload()
        tasks: list[asyncio.Task] = []
        first = work[: len(work) // 2] if staggered else work
        for i, (p, sp, prio) in enumerate(first):
            tasks.append(asyncio.create_task(_collect(engine.add_request(f"r{i}", p, sp, prio))))
        if staggered:
            # the later, better-priority half arrives once the first half is decoding
            for _ in range(10_000):
                if engine.stats().generation_tokens_total >= 8:
                    break
                await asyncio.sleep(0.001)
            for i, (p, sp, prio) in enumerate(work[len(first):], start=len(first)):
                tasks.append(asyncio.create_task(_collect(engine.add_request(f"r{i}", p, sp, prio - 3))))
        outs = await asyncio.gather(*tasks)
    finally:
        await engine.stop()
    return list(outs), engine


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> list[list[int]]:
    outs, engine = asyncio.run(_run(model_dir, False, max_num_seqs=16, async_scheduling=False))
    assert engine.stats().num_preemptions_total == 0
    return outs


def _check_idle(engine: AsyncEngine) -> None:
    s = engine.stats()
    assert s.kv_cache_usage_perc == 0.0
    assert s.num_requests_running == 0 and s.num_requests_waiting == 0
    engine.scheduler.check_invariants()


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("async_scheduling", [True, False])
async def test_kv_exhaustion_preemption_keeps_outputs(model_dir: Path, reference: list[list[int]],
                                                      policy: str, async_scheduling: bool) -> None:
    # 8 blocks of 16 tokens: the longest request needs 6, the whole batch about 25
    outs, engine = await _run(model_dir, False, num_gpu_blocks=8, block_size=16, max_num_seqs=8,
                              scheduling_policy=policy, async_scheduling=async_scheduling)
    assert engine.stats().num_preemptions_total > 0, "the small pool should force preemption"
    _check_idle(engine)
    for i, (got, want) in enumerate(zip(outs, reference)):
        assert got == want, f"request {i}: output changed by preemption"


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("num_gpu_blocks", [None, 9])
async def test_priority_arrival_preemption_keeps_outputs(model_dir: Path, reference: list[list[int]],
                                                         async_scheduling: bool,
                                                         num_gpu_blocks: int | None) -> None:
    # A full batch of 3 seats: better-priority arrivals preempt running requests (with a small
    # pool, KV exhaustion adds its own preemptions).
    extra = {} if num_gpu_blocks is None else {"num_gpu_blocks": num_gpu_blocks}
    outs, engine = await _run(model_dir, True, block_size=16, max_num_seqs=3, scheduling_policy="priority",
                              async_scheduling=async_scheduling, **extra)
    assert engine.stats().num_preemptions_total > 0, "better arrivals should preempt"
    _check_idle(engine)
    for i, (got, want) in enumerate(zip(outs, reference)):
        assert got == want, f"request {i}: output changed by preemption"
