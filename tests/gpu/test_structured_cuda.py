"""Structured outputs on the GPU: guided requests beside free ones, graphs on, two steps deep.

Guided steps take the graph routes and, at depth 2, sample only once the previous
step's tokens have advanced the grammars (runner.deferred_samples); every guided output must
follow its grammar. bf16 batches of other shapes may round a close call differently, so depth 1
and depth 2 are compared on what cannot depend on rounding: every output is valid either way.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest

from tests.e2e.test_structured_outputs import SCHEMA as PERSON
from tests.unit.test_structured_engine import GRAMMARS, follows
from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams
from vt.structured.spec import GrammarSpec, StructuredOutput
from vt.text.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("guided-cuda") / "m", preset="tiny")


async def _serve(model_dir: Path, work: list[tuple[list[int], SamplingParams]],
                 **engine_args: object) -> tuple[list[tuple[str, str]], AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cuda", max_num_seqs=64, **engine_args))
    await engine.start()
    try:
        for _, params in work:
            if params.structured is not None:
                await engine.compile_grammar(params.structured.grammar)
        streams = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(work)]

        async def drain(stream) -> tuple[str, str]:
            text = []
            async for out in stream:
                text.append(out.text)
                last = out
            assert last.error is None, last.error
            return "".join(text), last.finish_reason

        return list(await asyncio.gather(*map(drain, streams))), engine
    finally:
        await engine.stop()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_200_json_schema_requests_on_cuda_all_validate(model_dir: Path, async_scheduling: bool) -> None:
    spec = StructuredOutput(GrammarSpec("json", json.dumps(PERSON)))
    prompt = Tokenizer.from_dir(model_dir).encode("Describe a person.")
    work = [(prompt, SamplingParams(max_tokens=600, temperature=1.0, seed=s, structured=spec))
            for s in range(200)]
    work += [(prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=s, ignore_eos=True))
             for s in range(64)]
    results, engine = asyncio.run(_serve(model_dir, work, async_scheduling=async_scheduling))
    for text, reason in results[:200]:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert all(reason == "length" for _, reason in results[200:])
    assert engine.runner.guided_routes["graph"] > 0  # masks go between the decode graph's parts
    assert (engine.runner.deferred_samples > 0) == async_scheduling


def test_regex_and_choice_on_cuda(model_dir: Path) -> None:
    prompt = Tokenizer.from_dir(model_dir).encode("Answer:")
    work = [(prompt, SamplingParams(max_tokens=100, temperature=1.0, seed=s,
                                    structured=StructuredOutput(GRAMMARS[kind])))
            for s in range(40) for kind in ("regex", "choice")]
    results, _ = asyncio.run(_serve(model_dir, work))
    kinds = [kind for _ in range(40) for kind in ("regex", "choice")]
    for kind, (text, reason) in zip(kinds, results):
        assert reason == "stop" and follows(kind, text), (kind, text)
