"""Grammars are compiled in a child process first: one that crashes or stalls the grammar engine
is its request's error, and the server's process never runs it."""

from __future__ import annotations

import json
import os

import pytest

from vt.model.make_model import make_model
from vt.structured.compiler import GrammarCompiler
from vt.structured.grammar_check import GrammarChecker
from vt.structured.grammar_vocab import grammar_tokenizer_json
from vt.structured.matchers import MAX_ITEMS_IN_ROW
from vt.structured.spec import GrammarError, GrammarSpec
from vt.text.tokenizer import Tokenizer

GOOD = GrammarSpec("regex", "[0-9]{3}")
# $refs chained 3,000 deep: llguidance's recursive compile overflows a thread's stack (SIGSEGV)
REF_CHAIN = GrammarSpec("json", json.dumps({
    "$defs": {**{f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                 for i in range(3000)}, "d3000": {"type": "integer"}}, "$ref": "#/$defs/d0"}))


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> str:
    model = make_model(tmp_path_factory.mktemp("check") / "m", preset="tiny")
    return Tokenizer.from_dir(str(model)).raw.to_str()


def test_a_grammar_that_crashes_the_engine_is_an_error_and_the_next_check_works(tokenizer_json: str):
    checker = GrammarChecker(grammar_tokenizer_json(tokenizer_json), 1024, [0])
    try:
        checker.check(GOOD)
        with pytest.raises(GrammarError, match="crashed"):
            checker.check(REF_CHAIN)
        checker.check(GOOD)  # a new child
        # limits llguidance enforces only while it runs show in the walk (a choice is one lexeme
        # and never meets the row limit; a Lark rule of as many alternatives does)
        over = MAX_ITEMS_IN_ROW + 1
        with pytest.raises(GrammarError, match=f"max is {MAX_ITEMS_IN_ROW}"):
            checker.check(GrammarSpec("grammar", "start: " + " | ".join(f'"c{i}"' for i in range(over))))
        with pytest.raises(GrammarError, match="too many expressions"):
            checker.check(GrammarSpec("regex", "(a){1000000}"))
    finally:
        checker.close()


def test_a_check_past_its_time_is_an_error(tokenizer_json: str):
    checker = GrammarChecker(grammar_tokenizer_json(tokenizer_json), 1024, [0], timeout=0.0)
    try:
        with pytest.raises(GrammarError, match="took longer"):
            checker.check(GOOD)
    finally:
        checker.close()


def test_the_compiler_checks_first_and_caches_the_error(tokenizer_json: str, monkeypatch):
    compiler = GrammarCompiler(lambda: tokenizer_json, 1024, [0])
    try:
        with pytest.raises(GrammarError, match="crashed"):
            compiler.compile_blocking(REF_CHAIN)
        with pytest.raises(GrammarError, match="crashed"):
            compiler.compile_blocking(REF_CHAIN)  # cached: not checked again
        assert compiler.compile_blocking(GOOD).new_matcher() is not None
    finally:
        compiler.shutdown()
    unchecked = GrammarCompiler(lambda: tokenizer_json, 1024, [0], isolate=False)
    try:
        assert unchecked.compile_blocking(GOOD) is not None
        assert unchecked._checker is None
    finally:
        unchecked.shutdown()


def test_a_tokenizer_llguidance_cannot_read_is_one_warning_and_a_clear_error(caplog):
    """A word-level vocabulary with a WordPiece decoder (as some random-weight checkpoints get):
    the server logs one line saying why, no traceback, and a structured request gets the reason."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 64)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    compiler = GrammarCompiler(lambda: tok.to_str(), 64, [0], isolate=False)
    try:
        with caplog.at_level("WARNING", logger="vt.structured"):
            with pytest.raises(GrammarError, match="not available for this model's tokenizer"):
                compiler.compile_blocking(GOOD)
    finally:
        compiler.shutdown()
    (record,) = [r for r in caplog.records if "llguidance cannot read" in r.getMessage()]
    assert record.exc_info is None and "decoder" in record.getMessage()


def test_close_ends_the_child(tokenizer_json: str):
    checker = GrammarChecker(grammar_tokenizer_json(tokenizer_json), 1024, [0])
    checker.check(GOOD)
    pids = checker.pids
    assert len(pids) == 1 and os.waitpid(pids[0], os.WNOHANG) == (0, 0)  # running
    checker.close()
    assert checker.pids == []
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0], 0)  # killed and reaped
