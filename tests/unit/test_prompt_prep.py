"""Prompt work that grows with the request: refused before it is done when it cannot fit, run off
the event loop, and bounded in time and memory when it is a chat template."""

from __future__ import annotations

import asyncio
import sys
from types import SimpleNamespace

import pytest

from vt.http import prompt_prep
from vt.http.prompt_prep import PromptPreparer
from vt.http.protocol import ProtocolError
from vt.model.make_model import make_model
from vt.text.tokenizer import Tokenizer


class CountingTokenizer:
    """Four characters a token at most; counts encode calls; renders templates with `render`."""

    def __init__(self, render=None, normalize=None) -> None:
        self.raw = SimpleNamespace(get_vocab=lambda with_added_tokens: {"abcd": 0, "e": 1},
                                   normalizer=SimpleNamespace(normalize_str=normalize) if normalize else None)
        self.calls = 0
        self.render = render

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls += 1
        return [0] * -(-len(text) // 4)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return self.render(messages)


async def ticking(coro) -> tuple[object, int]:
    """Run coro while a task counts loop turns of 5 ms: how often the loop got to run meanwhile."""
    ticks = 0
    stop = False

    async def tick() -> None:
        nonlocal ticks
        while not stop:
            await asyncio.sleep(0.005)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    try:
        return await coro, ticks
    except Exception as e:
        return e, ticks
    finally:
        stop = True
        await ticker


async def test_text_that_cannot_fit_is_refused_untokenized() -> None:
    tok = CountingTokenizer()
    prep = PromptPreparer(tok, max_model_len=2000)  # at most 8000 characters can fit
    assert prep.max_chars == 8000
    with pytest.raises(ProtocolError, match="maximum context length is 2000") as e:
        await prep.encode("x" * 8001, "prompt")
    assert e.value.param == "prompt" and tok.calls == 0
    assert len(await prep.encode("x" * 7999, "prompt")) == 2000 and tok.calls == 1


async def test_the_bound_is_measured_after_normalizing() -> None:
    tok = CountingTokenizer(normalize=lambda s: s.replace("  ", ""))  # shrinks text
    prep = PromptPreparer(tok, max_model_len=2000)
    assert len(await prep.encode("  " * 6000, "prompt")) == 3000  # 12000 chars, 0 once normalized


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_model(tmp_path_factory.mktemp("prep") / "tiny"))


async def test_long_text_is_tokenized_off_the_loop(tiny_tokenizer: Tokenizer) -> None:
    text = "the quick brown fox jumps over lazy dog " * 20_000
    prep = PromptPreparer(tiny_tokenizer, max_model_len=10**6)
    ids, ticks = await ticking(prep.encode(text, "prompt"))
    assert ids == list(tiny_tokenizer.raw.encode(text).ids)
    assert ticks >= 3  # the loop kept turning while the tokenizer worked
    # long token lists decode through the GIL-free call, to the same text
    assert tiny_tokenizer.decode(ids, skip_special_tokens=False) == tiny_tokenizer.raw.decode(
        ids, skip_special_tokens=False)


def _spin_forever(messages) -> str:
    while True:
        pass


def _grow_forever(messages) -> str:
    hoard = []
    while True:
        hoard.append("y" * 1_000_000)


def _recurse(messages) -> str:
    return _recurse(messages)


@pytest.mark.parametrize(("render", "expect"), [
    (_spin_forever, "ran for more than"),
    (_grow_forever, "used more than"),
    (_recurse, "recursed too deep"),
    (lambda messages: "z" * 9000, "maximum context length"),
])
async def test_chat_template_is_bounded_and_off_the_loop(monkeypatch, render, expect) -> None:
    # a second of template time: long enough that a busy CI machine's loop still turns a few times
    monkeypatch.setattr(prompt_prep, "TEMPLATE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(prompt_prep, "TEMPLATE_MAX_GROWTH", 64 << 20)
    prep = PromptPreparer(CountingTokenizer(render), max_model_len=2000)
    err, ticks = await ticking(prep.render_chat([{"role": "user", "content": "hi"}], True))
    assert isinstance(err, ProtocolError) and err.param == "messages", err
    assert expect in str(err)
    if render is _spin_forever:  # a second of template: the loop kept turning (~95 turns of 5 ms)
        assert ticks >= 20, ticks
    if render is _grow_forever:  # it reaches the bound in ~20 ms: the loop turned meanwhile (a
        # render on the loop's thread would leave it none); how often, in so short a time, is the
        # switch interval's business (2-4 turns), so the spinning template above checks the rate
        assert ticks >= 1, ticks
    assert sys.gettrace() is None  # the tracer lived in the worker thread only


async def test_chat_template_that_behaves_renders() -> None:
    prep = PromptPreparer(CountingTokenizer(lambda m: "<u>" + m[0]["content"]), max_model_len=2000)
    assert await prep.render_chat([{"role": "user", "content": "hi"}], True) == "<u>hi"


def test_max_token_chars_of_a_real_vocabulary(tiny_tokenizer: Tokenizer) -> None:
    longest = prompt_prep.max_token_chars(tiny_tokenizer)
    assert longest == max(len(t) for t in tiny_tokenizer.raw.get_vocab(with_added_tokens=True))
    assert prompt_prep.max_token_chars(SimpleNamespace()) is None
