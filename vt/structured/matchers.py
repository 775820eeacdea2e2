"""llguidance's tokenizer and matchers as the server and the grammar checker both build them:
the same limits, the same errors, so the checker's verdict on a grammar is the server's.

This module imports neither the compiler nor the checker; both import it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from vt.structured.grammar_text import grammar_text
from vt.structured.spec import GrammarError, GrammarSpec, error_line

# llguidance's executor for a step's masks: its threads work while the event loop waits. Half
# the cores up to 8 (at least min(4, cores)): on a 16-core GPU host 8 threads fill 128 masks of a
# 152k vocabulary in 4.4 ms where 4 take 6.8 (bench/RESULTS.md).
_CPUS = os.cpu_count() or 1
MASK_THREADS = max(1, min(8, max(min(4, _CPUS), _CPUS // 2)))
# llguidance's limits, raised where its default refuses what a compile bounded in time and memory
# (the checker's) does in about a second: an Earley row may hold 20,000 items (llguidance: 2,000;
# a Lark rule of 20,000 alternatives compiles in ~0.5 s, and a step still stops at 50,000 items).
# The lexer's fuel stays llguidance's: it already builds a choice of ~150,000 short options, and
# more fuel lets a regex such as `(a){1000000}` take seconds and half a gigabyte per mask.
MAX_ITEMS_IN_ROW = 20_000
# Extra templates of a grammar (one per mask thread) are built only while they take this long
# in all: each costs a full compile, which for a grammar of seconds buys nothing worth it.
EXTRA_TEMPLATES_S = 0.25


def parser_limits() -> Any:
    """The limits every matcher is built with (verbose errors off: they carry the grammar's text
    and the parser's state, which are not the client's to read)."""
    import llguidance

    return llguidance.LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW, verbose_errors=False)


def build_tokenizer(text: str, vocab_size: int, eos: Sequence[int]) -> Any:
    """llguidance's tokenizer of a tokenizer.json text already made grammar-ready
    (grammar_tokenizer_json); its vocab_size may exceed the model's (masks cover every token)."""
    import llguidance

    try:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos) or None)
    except ValueError:
        # More tokens than the model has rows: masks cover them all, cut to the model's.
        return llguidance.LLTokenizer(text, eos_token=list(eos) or None)


def _matcher(tokenizer: Any, grammar: str) -> Any:
    import llguidance

    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())


def new_matchers(spec: GrammarSpec, tokenizer: Any, count: int = 1) -> list[Any]:
    """Up to count matchers of the spec's grammar in their start state, each built on its own
    (they share no lexer state); fewer where one takes long to build (EXTRA_TEMPLATES_S).
    GrammarError for a grammar that does not compile, or whose language is empty (it fails at
    its first mask)."""
    try:
        grammar = grammar_text(spec)
    except RecursionError:
        raise GrammarError("the schema is nested too deep") from None
    start = time.monotonic()
    matcher = _matcher(tokenizer, grammar)  # llguidance lets go of the GIL while it builds
    if matcher.is_error():
        raise GrammarError(error_line(matcher.get_error()))
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise GrammarError("the grammar admits no output at all")
    took = max(time.monotonic() - start, 1e-6)
    extra = min(count - 1, int(EXTRA_TEMPLATES_S / took))
    return [matcher, *(_matcher(tokenizer, grammar) for _ in range(max(extra, 0)))]
