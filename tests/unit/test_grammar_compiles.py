"""Grammar compiles harm no one: they run side by side, each bounded in time and memory in a
child of its own; one whose requests went away, or that is running when the server stops, is
stopped at once (its child killed, its place freed); errors are one line; and what vLLM serves
(a choice of thousands of options, tool_choice required over thousands of tools) compiles."""

from __future__ import annotations

import asyncio
import json
import os
import time

import llguidance
import numpy as np
import pytest

from vt.http.tool_calls import parse_tool_plan
from vt.model.make_model import make_model
from vt.structured import grammar_text as grammar_text_module
from vt.structured.compiler import GrammarCompiler
from vt.structured.grammar_check import GrammarChecker
from vt.structured.grammar_text import grammar_text
from vt.structured.grammar_vocab import grammar_tokenizer_json
from vt.structured.matchers import build_tokenizer, parser_limits
from vt.structured.spec import (
    DEFAULT_JSON_WHITESPACE,
    GrammarError,
    GrammarSpec,
    GrammarUnavailableError,
    error_line,
)
from vt.text.tokenizer import Tokenizer

GOOD = GrammarSpec("regex", "[0-9]{3}")
# A Lark rule of 66,000 alternatives: seconds of compiling, then past llguidance's symbol limit.
SLOW = GrammarSpec("grammar", "start: " + " | ".join(f'"w{i}"' for i in range(66000)))
FAST_ANSWER_S = 5.0    # a fast grammar's compile beside a slow one (a child's start included)
STOP_S = 1.0           # a cancelled or stopped compile's child is gone within this


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = make_model(tmp_path_factory.mktemp("compiles") / "m", preset="tiny")
    return Tokenizer.from_dir(str(model)).raw.to_str()


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer_json: str):
    return build_tokenizer(grammar_tokenizer_json(tokenizer_json), 1024, [0])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def _until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def _started(compiler: GrammarCompiler, busy: int) -> None:
    """Wait until `busy` checks are running in children."""
    assert await _until(lambda: compiler.checker is not None and compiler.checker.busy >= busy
                        and len(compiler.checker.pids) >= busy, 30.0)


def _accepts(tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar's matcher (built as the server builds it) takes text and may stop
    right after it."""
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    ok = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return bool(ok) and not matcher.is_error() and matcher.is_accepting()


def test_a_fast_grammar_is_answered_while_a_slow_one_compiles(tokenizer_json: str):
    async def go() -> None:
        compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
        try:
            await compiler.compile(GOOD)
            slow = asyncio.ensure_future(compiler.compile(SLOW))
            await _started(compiler, 1)
            start = time.monotonic()
            await compiler.compile(GrammarSpec("regex", "[a-c]{3}"))
            assert time.monotonic() - start < FAST_ANSWER_S
            assert not slow.done()  # answered beside it, not after it
            slow.cancel()
        finally:
            compiler.shutdown()

    asyncio.run(go())


def test_a_cancelled_compile_kills_its_child_and_frees_its_place(tokenizer_json: str):
    async def go() -> None:
        compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
        try:
            await compiler.compile(GOOD)
            checker = compiler.checker
            assert checker is not None
            slow = [asyncio.ensure_future(compiler.compile(GrammarSpec(SLOW.kind, SLOW.text + f' | "x{i}"')))
                    for i in range(checker.max_checks)]
            await _started(compiler, checker.max_checks)
            pids = set(checker.pids)
            slow[0].cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow[0]
            # its child is killed at once, its place is free: a new grammar compiles meanwhile
            assert await _until(lambda: len(set(checker.pids) & pids) == checker.max_checks - 1, STOP_S), \
                (pids, checker.pids)
            killed = (pids - set(checker.pids)).pop()
            assert await _until(lambda: _gone(killed), STOP_S)
            start = time.monotonic()
            await compiler.compile(GrammarSpec("regex", "[d-f]{3}"))
            assert time.monotonic() - start < FAST_ANSWER_S
            assert all(not s.done() for s in slow[1:]), [s.result() if s.done() else None for s in slow[1:]]
            for s in slow[1:]:
                s.cancel()
            await asyncio.gather(*slow[1:], return_exceptions=True)
            assert await _until(lambda: compiler.in_flight() == 0 and checker.busy == 0, STOP_S)
            assert all(_gone(p) for p in pids - set(checker.pids))
        finally:
            compiler.shutdown()

    asyncio.run(go())


def test_a_compile_two_requests_wait_for_goes_on_when_one_leaves(tokenizer_json: str):
    async def go() -> None:
        compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
        spec = GrammarSpec("choice", json.dumps([f"option {i}" for i in range(3000)]))
        try:
            first = asyncio.ensure_future(compiler.compile(spec))
            second = asyncio.ensure_future(compiler.compile(spec))
            await asyncio.sleep(0)
            first.cancel()
            compiled = await second
            assert compiled.new_matcher() is not None
            assert await compiler.compile(spec) is compiled  # cached
        finally:
            compiler.shutdown()

    asyncio.run(go())


def test_shutdown_during_a_compile_returns_at_once_and_ends_it(tokenizer_json: str):
    async def go() -> None:
        compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
        await compiler.compile(GOOD)
        slow = asyncio.ensure_future(compiler.compile(SLOW))
        queued = [asyncio.ensure_future(compiler.compile(GrammarSpec(SLOW.kind, SLOW.text + f' | "q{i}"')))
                  for i in range(4)]
        await _started(compiler, 1)
        checker = compiler.checker
        pids = checker.pids
        start = time.monotonic()
        compiler.shutdown()
        assert time.monotonic() - start < STOP_S
        for fut in (slow, *queued):
            with pytest.raises(GrammarUnavailableError):
                await asyncio.wait_for(fut, STOP_S)
        assert await _until(lambda: all(_gone(p) for p in pids), STOP_S)
        # a later compile starts again
        assert (await compiler.compile(GrammarSpec("regex", "z+"))).new_matcher() is not None
        compiler.shutdown()

    asyncio.run(go())


def test_checks_past_their_time_or_memory_are_one_line_errors(tokenizer_json: str):
    text = grammar_tokenizer_json(tokenizer_json)
    quick = GrammarChecker(text, 1024, [0], timeout=1.0)
    try:
        start = time.monotonic()
        with pytest.raises(GrammarError, match="longer than 1 s") as e:
            quick.check(SLOW)
        assert time.monotonic() - start < 1.0 + STOP_S
        assert "\n" not in str(e.value)
        quick.check(GOOD)  # a new child
    finally:
        quick.close()
    small = GrammarChecker(text, 1024, [0], max_memory=64 << 20)
    try:
        big = GrammarSpec("choice", json.dumps([f"{i:08d} some longer option text" for i in range(200000)]))
        with pytest.raises(GrammarError, match="64 MiB") as e:
            small.check(big)
        assert "\n" not in str(e.value)
        small.check(GOOD)
    finally:
        small.close()


def test_engine_messages_are_one_line_without_backtrace(llg_tokenizer):
    panic = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
             "   0: <unknown>\n   1: <unknown>\n")
    assert error_line(panic) == "the grammar is too large: it needs more than 65,000 grammar symbols"
    other = error_line("panic: something odd\n<backtrace>\n   0: <unknown>")
    assert other.startswith("the grammar engine failed") and "backtrace" not in other
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar_text(GrammarSpec("regex", "a(b")), log_level=0)
    line = error_line(matcher.get_error())
    assert "\n" not in line and "unclosed group" in line
    assert len(error_line("x" * 5000)) <= 500


@pytest.mark.parametrize("count", [2001, 66000])
def test_a_choice_of_thousands_compiles_and_allows_only_its_options(tokenizer_json, llg_tokenizer, count):
    options = [f"option {i}" for i in range(count)]
    spec = GrammarSpec("choice", json.dumps(options))
    compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
    try:
        assert compiler.compile_blocking(spec).new_matcher() is not None
    finally:
        compiler.shutdown()
    grammar = grammar_text(spec)
    assert _accepts(llg_tokenizer, grammar, options[-1]) and _accepts(llg_tokenizer, grammar, "option 7")
    assert not _accepts(llg_tokenizer, grammar, f"option {count}")
    assert not _accepts(llg_tokenizer, grammar, "option")


def test_choices_with_markup_prefixes_and_duplicates(llg_tokenizer):
    options = ["a", "ab", 'q"uote', "back\\slash", "new\nline", "é ü 日本", "", "ab"]
    grammar = grammar_text(GrammarSpec("choice", json.dumps(options)))
    for option in options:
        assert _accepts(llg_tokenizer, grammar, option)
    assert not _accepts(llg_tokenizer, grammar, "abc")
    with pytest.raises(GrammarError, match="non-empty list of strings"):
        grammar_text(GrammarSpec("choice", "[]"))


def _tools(n: int) -> tuple[dict, ...]:
    return tuple({"type": "function", "function": {"name": f"tool_{i}", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}} for i in range(n))


def test_tool_choice_required_over_3000_tools_compiles(tokenizer_json: str, llg_tokenizer):
    plan = parse_tool_plan({"tool_choice": "required"}, _tools(3000), False)
    compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
    try:
        assert compiler.compile_blocking(plan.grammar).new_matcher() is not None
    finally:
        compiler.shutdown()
    grammar = grammar_text(plan.grammar)
    call = '[{"name": "tool_2999", "parameters": {"city": "Paris"}}]'
    assert _accepts(llg_tokenizer, grammar, call)
    assert not _accepts(llg_tokenizer, grammar, call.replace("tool_2999", "tool_3000"))


def _same_masks(tokenizer, whole: str, split: str, steps: int, rng: np.random.Generator) -> None:
    """Walk both grammars with the same random allowed tokens: every mask must be equal."""
    a = llguidance.LLMatcher(tokenizer, whole, log_level=0, limits=parser_limits())
    b = llguidance.LLMatcher(tokenizer, split, log_level=0, limits=parser_limits())
    assert not a.is_error() and not b.is_error(), (a.get_error(), b.get_error())
    for _ in range(steps):
        mask = a.compute_bitmask()
        assert mask == b.compute_bitmask()
        if a.is_stopped():
            return
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little"))
        token = int(rng.choice(allowed))
        assert a.consume_token(token) and b.consume_token(token)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("whitespace", [DEFAULT_JSON_WHITESPACE, ""])
def test_a_split_union_allows_what_the_whole_schema_does(llg_tokenizer, monkeypatch, parallel, whitespace):
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "maxLength": 5}, "n": {"type": "integer"},
                                         "e": {"enum": ["x", "y"]}}, "required": ["a"]}}} for i in range(12)]
    tools += [{"type": "function", "function": {"name": "noargs"}},
              {"type": "function", "function": {"name": "d", "parameters": {
                  "type": "object", "properties": {"r": {"$ref": "#/$defs/R"}},
                  "$defs": {"R": {"type": "boolean"}}}}}]
    body = {"tool_choice": "required", "parallel_tool_calls": parallel}
    spec = parse_tool_plan(body, tuple(tools), False).grammar
    spec = GrammarSpec(spec.kind, spec.text, whitespace=whitespace)
    whole = grammar_text(spec)
    monkeypatch.setattr(grammar_text_module, "GROUP_OBJECTS", 20)
    split = grammar_text(spec)
    assert split != whole and "%json" in split
    rng = np.random.default_rng(7)
    for _ in range(12):
        _same_masks(llg_tokenizer, whole, split, 120, rng)


def test_heavy_grammars_leave_the_cache_first(tokenizer_json: str, monkeypatch):
    from vt.structured import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "KEEP_RECENT", 1)
    compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0], cache_bytes=1)
    try:
        first = compiler.compile_blocking(GrammarSpec("choice", json.dumps([f"a{i}" for i in range(20000)])))
        compiler.compile_blocking(GrammarSpec("choice", json.dumps([f"b{i}" for i in range(20000)])))
        # the first weighed more than the bound: a new compile makes a new grammar
        again = compiler.compile_blocking(GrammarSpec("choice", json.dumps([f"a{i}" for i in range(20000)])))
        assert again is not first
        light = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
        try:
            kept = light.compile_blocking(GOOD)
            light.compile_blocking(GrammarSpec("regex", "b+"))
            assert light.compile_blocking(GOOD) is kept
        finally:
            light.shutdown()
    finally:
        compiler.shutdown()


_BRANCHES = [{"type": "object", "properties": {"k": {"const": f"v{i}"}, "n": {"type": "integer"}},
              "required": ["k"], "additionalProperties": False} for i in range(10)] + [{"type": "string"}]


@pytest.mark.parametrize("schema", [
    {"anyOf": _BRANCHES},
    {"type": "array", "items": {"anyOf": _BRANCHES}},
    {"type": "array", "items": {"anyOf": _BRANCHES}, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"anyOf": _BRANCHES}, "maxItems": 1, "title": "at most one"},
], ids=["union", "array", "array 2..3", "array 0..1"])
def test_split_unions_and_arrays_keep_their_language(llg_tokenizer, monkeypatch, schema):
    spec = GrammarSpec("json", json.dumps(schema))
    whole = grammar_text(spec)
    monkeypatch.setattr(grammar_text_module, "GROUP_OBJECTS", 8)
    split = grammar_text(spec)
    assert "%json" in split
    rng = np.random.default_rng(11)
    for _ in range(12):
        _same_masks(llg_tokenizer, whole, split, 80, rng)
