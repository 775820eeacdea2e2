"""Every way a request's row can be left with no token to sample, in the engine at depth 1 and 2.

What the request states up front (allowed_token_ids, or a grammar's first tokens, against the ids
min_tokens holds back) is refused at admission, naming the field. What only shows at a step (a
grammar state whose only continuations are held back) ends that request alone: with an error of
its own, or at its grammar's end where the grammar is complete (as vLLM lets a complete grammar
stop under min_tokens). No request ever gets a token its constraints exclude (token 0 was the
old fallback), and the requests beside it sample what they sample alone.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.engine.outputs import ERROR_REQUEST
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams, SamplingParamsError
from vt.structured.spec import GrammarSpec, StructuredOutput


@dataclass
class Result:
    tokens: list[int]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None
    error: str | None
    error_kind: str


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("rv3-allowed") / "m")


def one_token(engine: AsyncEngine, text: str) -> int:
    [token] = engine.tokenizer.encode(text, add_special_tokens=False)
    return token


def choice(*options: str) -> StructuredOutput:
    return StructuredOutput(GrammarSpec("choice", json.dumps(list(options))))


async def drain(stream) -> Result:
    tokens, text = [], []
    async for out in stream:
        tokens.extend(out.token_ids)
        text.append(out.text)
        last = out
    return Result(tokens, "".join(text), last.finish_reason, last.stop_reason, last.error, last.error_kind)


async def run(model_dir: Path, depth: int, make) -> list[Result]:
    """The requests make(engine) lists, (prompt, params) each, side by side in one engine."""
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", async_scheduling=depth == 2))
    await engine.start()
    try:
        requests = make(engine)
        for _, params in requests:
            if params.structured is not None:
                await engine.compile_grammar(params.structured.grammar)
        streams = [engine.add_request(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
        return list(await asyncio.gather(*(drain(s) for s in streams)))
    finally:
        await engine.stop()


def free_requests(engine: AsyncEngine) -> list[tuple[list[int], SamplingParams]]:
    prompts = ["hello there", "the", "a b c d"]
    return [(engine.tokenizer.encode(p),
             SamplingParams(max_tokens=12, temperature=t, seed=3, ignore_eos=True))
            for p, t in zip(prompts, (0.0, 1.0, 0.7))]


async def test_conflicts_known_up_front_are_refused_naming_the_field(model_dir: Path) -> None:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu"))
    await engine.start()
    try:
        bracket = one_token(engine, "[")
        eos = min(engine.eos_token_ids)
        prompt = engine.tokenizer.encode("x")
        await engine.compile_grammar(choice("[").grammar)
        refused = {
            "allowed_token_ids": SamplingParams(max_tokens=4, min_tokens=1, allowed_token_ids=[eos]),
            "allowed_token_ids ": SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=[bracket, eos],
                                                 stop_token_ids=[bracket]),
            "min_tokens": SamplingParams(max_tokens=3, min_tokens=1, stop_token_ids=[bracket],
                                         structured=choice("[")),
        }
        for param, params in refused.items():
            with pytest.raises(SamplingParamsError) as info:
                engine.add_request(f"refused-{param}", prompt, params)
            assert info.value.param == param.strip()
            assert "no token could be sampled" in str(info.value)
        assert not engine.stats().num_requests_waiting  # nothing of them was queued
        # the same constraints without the conflict are served
        served = [SamplingParams(max_tokens=3, stop_token_ids=[bracket], structured=choice("[")),
                  SamplingParams(max_tokens=3, min_tokens=1, allowed_token_ids=[bracket, eos],
                                 stop_token_ids=[eos], ignore_eos=True)]
        for i, params in enumerate(served):
            result = await drain(engine.add_request(f"served-{i}", prompt, params))
            assert result.error is None and result.tokens, result
    finally:
        await engine.stop()


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_grammar_state_whose_continuations_are_all_held_back_ends_that_request_alone(
        model_dir: Path, depth: int) -> None:
    def make(engine: AsyncEngine) -> list[tuple[list[int], SamplingParams]]:
        bracket = one_token(engine, "[")
        # "a" then "[": the grammar's second token is a stop id that min_tokens holds back
        guided = SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[bracket], structured=choice("a["))
        return [*free_requests(engine), (engine.tokenizer.encode("x"), guided)]

    alone = await run(model_dir, depth, lambda engine: free_requests(engine))
    *free, guided = await run(model_dir, depth, make)
    assert free == alone  # the requests beside it lose nothing
    assert guided.finish_reason == "error" and guided.error_kind == ERROR_REQUEST, guided
    assert "output token 2" in guided.error and "min_tokens (3)" in guided.error
    assert guided.text == "a" and len(guided.tokens) == 1  # no excluded token was sampled or streamed


@pytest.mark.parametrize("depth", [1, 2])
async def test_a_complete_grammar_ends_there_under_min_tokens(model_dir: Path, depth: int) -> None:
    """vLLM lets a complete grammar stop under min_tokens: "a" is a whole match of a | a[, and its
    only continuations ("[" and the end) are held back."""
    def make(engine: AsyncEngine) -> list[tuple[list[int], SamplingParams]]:
        bracket = one_token(engine, "[")
        prompt = engine.tokenizer.encode("x")
        return [(prompt, SamplingParams(max_tokens=6, min_tokens=3, stop_token_ids=[bracket],
                                        structured=choice("a", "a["))),
                (prompt, SamplingParams(max_tokens=6, min_tokens=5, structured=choice("yes")))]

    held, terminal = await run(model_dir, depth, make)
    assert (held.text, held.finish_reason, held.error) == ("a", "stop", None)
    assert (terminal.text, terminal.finish_reason, terminal.error) == ("yes", "stop", None)
    assert len(terminal.tokens) < 5
