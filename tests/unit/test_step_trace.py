"""`--step-trace`: every completed step is one line, and the lines account for every token the
requests computed (prompt chunks and decodes), at both depths."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.launch.cli import build_parser
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m"), preset="tiny")


async def _serve(model: Path, trace: Path, async_scheduling: bool) -> None:
    engine = AsyncEngine(EngineConfig(model=str(model), device="cpu", async_scheduling=async_scheduling,
                                      max_num_batched_tokens=32, step_trace=str(trace)))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        # no shared prefixes (the prefix cache would skip tokens); 40 tokens: two chunks of a 32 budget
        prompts = [[5 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate((3, 40, 17))]
        streams = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]

        async def drain(s) -> int:
            return sum([len(o.token_ids) async for o in s])

        assert await asyncio.gather(*(drain(s) for s in streams)) == [6] * 3
    finally:
        await engine.stop()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["depth2", "depth1"])
def test_the_trace_accounts_for_every_computed_token(model: Path, tmp_path: Path,
                                                     async_scheduling: bool) -> None:
    trace = tmp_path / "steps.jsonl"
    asyncio.run(_serve(model, trace, async_scheduling))
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    assert [x["step"] for x in lines] == sorted(x["step"] for x in lines)
    # 60 prompt tokens, then 5 decodes a request (the sixth token is sampled by the fifth decode;
    # the first comes from the prompt's last chunk); at depth 2 no step runs past max_tokens.
    assert sum(x["prompt_tokens"] for x in lines) == 60
    assert sum(x["decodes"] for x in lines) == 15
    assert all(x["tokens"] <= 32 for x in lines)
    assert any(x["prompt_tokens"] == 32 for x in lines)  # the budget split the 40-token prompt
    assert all(x["end"] >= x["start"] >= x["launch"] - 1e-6 and x["device_ms"] >= 0 for x in lines)
    assert max(x["max_context"] for x in lines) == 40 + 5


def test_the_serve_flag_reaches_the_engine_config(tmp_path: Path) -> None:
    from vt.launch.cli import _engine_config

    (tmp_path / "config.json").write_text("{}")
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--step-trace", str(tmp_path / "t")])
    assert _engine_config(args).step_trace == str(tmp_path / "t")
