"""Depth 2 really overlaps: step N+1 is scheduled and launched before step N completes, read from
the engine's own step events (launch / done), not from timing. Depth 1 never does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m"), preset="tiny")


async def _events(model: Path, async_scheduling: bool) -> list[tuple[str, int]]:
    engine = AsyncEngine(EngineConfig(model=str(model), device="cpu", async_scheduling=async_scheduling))
    engine.record_events = True
    await engine.start()
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        streams = [engine.add_request(f"r{i}", [5 + i, 6, 7], params) for i in range(4)]

        async def drain(s) -> int:
            return sum([len(o.token_ids) async for o in s])

        counts = await asyncio.gather(*(drain(s) for s in streams))
        assert counts == [12] * 4
    finally:
        await engine.stop()
    return [(e.kind, e.step_id) for e in engine.events]


def _overlaps(events: list[tuple[str, int]]) -> int:
    """How many steps N+1 were launched before step N was done."""
    pos = {e: i for i, e in enumerate(events)}
    steps = sorted(n for kind, n in events if kind == "launch")
    return sum(1 for n in steps if ("launch", n + 1) in pos and ("done", n) in pos
               and pos[("launch", n + 1)] < pos[("done", n)])


def test_depth_two_launches_the_next_step_before_the_previous_is_done(model: Path) -> None:
    events = asyncio.run(_events(model, async_scheduling=True))
    steps = sum(1 for k, _ in events if k == "launch")
    # Every decode step after the first is launched while its predecessor runs.
    assert _overlaps(events) >= steps - 3


def test_depth_one_waits_for_each_step(model: Path) -> None:
    events = asyncio.run(_events(model, async_scheduling=False))
    assert _overlaps(events) == 0
    assert sum(1 for k, _ in events if k == "launch") >= 12
