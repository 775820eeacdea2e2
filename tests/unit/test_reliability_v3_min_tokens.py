"""min_tokens holds back every stop kind until it is reached, as vLLM does, at depth 1 and 2: the
end of sequence, stop_token_ids, stop strings (looked for only in text the tokens after
min_tokens add; one may begin before) and a grammar's end (while the grammar can go on; a
complete grammar that cannot ends there, as in vLLM).

Each stop is made the greedy choice by a logit_bias of +100, so without min_tokens the request
stops at its first token, and with it exactly where min_tokens lets it.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest

from tests.unit.test_reliability_v3_allowed import Result, drain, one_token
from vt.config import EngineConfig
from vt.engine.engine import AsyncEngine
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams
from vt.structured.spec import GrammarSpec, StructuredOutput
from vt.text.tokenizer import DetokStream, Tokenizer

MIN = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("rv3-min-tokens") / "m")


def _cases(engine: AsyncEngine, min_tokens: int) -> dict[str, SamplingParams]:
    a, b = one_token(engine, "a"), one_token(engine, "b")
    eos = min(engine.eos_token_ids)
    greedy = {"max_tokens": 16, "temperature": 0.0, "min_tokens": min_tokens}
    plus_a = {"logit_bias": {a: 100.0}, "ignore_eos": True, **greedy}
    return {
        "eos": SamplingParams(logit_bias={eos: 100.0}, **greedy),
        "stop id": SamplingParams(logit_bias={b: 100.0}, stop_token_ids=[b], ignore_eos=True, **greedy),
        "stop string": SamplingParams(stop=["a"], **plus_a),
        "stop string across": SamplingParams(stop=["aa"], **plus_a),
        "grammar end": SamplingParams(logit_bias={eos: 100.0}, **greedy,
                                      structured=StructuredOutput(GrammarSpec("regex", "a+"))),
        "complete grammar": SamplingParams(logit_bias={eos: 100.0}, **greedy,
                                           structured=StructuredOutput(GrammarSpec("choice", '["yes"]'))),
    }


async def _run(model_dir: Path, depth: int, min_tokens: int) -> tuple[dict[str, Result], AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(model_dir), device="cpu", async_scheduling=depth == 2))
    await engine.start()
    try:
        cases = _cases(engine, min_tokens)
        for params in cases.values():
            if params.structured is not None:
                await engine.compile_grammar(params.structured.grammar)
        prompt = engine.tokenizer.encode("x y")
        streams = {name: engine.add_request(name, prompt, params) for name, params in cases.items()}
        results = await asyncio.gather(*(drain(s) for s in streams.values()))
        return dict(zip(streams, results)), engine
    finally:
        await engine.stop()


@pytest.mark.parametrize("depth", [1, 2])
async def test_min_tokens_holds_back_each_stop_kind(model_dir: Path, depth: int) -> None:
    free, engine = await _run(model_dir, depth, 0)
    held, _ = await _run(model_dir, depth, MIN)
    a, b = one_token(engine, "a"), one_token(engine, "b")
    for name, result in [*free.items(), *held.items()]:
        assert result.error is None and result.finish_reason == "stop", (name, result)

    # without min_tokens each stops at once ...
    assert len(free["eos"].tokens) == 1 and free["eos"].tokens[0] in engine.eos_token_ids
    assert free["stop id"].tokens == [b] and free["stop id"].stop_reason == b
    assert (free["stop string"].tokens, free["stop string"].text) == ([a], "")
    assert len(free["grammar end"].tokens) == 2 and free["grammar end"].text == "a"

    # ... and with it, right after min_tokens tokens
    assert len(held["eos"].tokens) == MIN + 1 and held["eos"].tokens[-1] in engine.eos_token_ids
    assert not set(held["eos"].tokens[:-1]) & engine.eos_token_ids
    assert len(held["stop id"].tokens) == MIN + 1 and held["stop id"].stop_reason == b
    assert b not in held["stop id"].tokens[:-1]
    assert held["stop string"].tokens == [a] * (MIN + 1) and held["stop string"].stop_reason == "a"
    assert held["stop string"].text == "a" * MIN
    # a stop string may begin in the text before min_tokens was reached, as long as it ends after
    across = held["stop string across"]
    assert (across.tokens, across.text, across.stop_reason) == ([a] * (MIN + 1), "a" * (MIN - 1), "aa")
    grammar = held["grammar end"]
    assert len(grammar.tokens) == MIN + 1 and grammar.tokens[-1] in engine.eos_token_ids
    assert re.fullmatch("a+", grammar.text), grammar

    # a grammar that is complete and admits nothing more ends there, min_tokens or not (vLLM)
    assert held["complete grammar"] == free["complete grammar"]
    assert held["complete grammar"].text == "yes" and len(held["complete grammar"].tokens) < MIN


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.mark.parametrize(("stop", "min_tokens", "texts", "want"), [
    ("a", 0, ["x", "a", "b"], ("x", "a")),
    ("a", 2, ["x", "a", "b", "a"], ("xab", "a")),   # the "a" among the first two tokens is not a stop
    ("ab", 2, ["x", "a", "b"], ("x", "ab")),        # begins before min_tokens was reached, ends after
    ("xa", 2, ["x", "a", "b", "x", "a"], ("xab", "xa")),  # ends within the first two: looked for later
])
def test_detokenizer_looks_for_stop_strings_past_min_tokens(tokenizer: Tokenizer, stop: str, min_tokens: int,
                                                             texts: list[str], want: tuple[str, str]) -> None:
    ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    assert all(len(i) == 1 for i in ids)
    detok = DetokStream(tokenizer, tokenizer.encode("z"), stop=[stop], min_tokens=min_tokens)
    text = ""
    for [token] in ids:
        text += detok.push(token)
        if detok.stopped:
            break
    assert (text, detok.stop_str) == want

