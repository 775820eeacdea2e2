"""GrammarCompiler: GrammarSpecs -> llguidance matchers, compiled off the event loop and cached.

Compiling a JSON schema or a grammar takes from microseconds to about a second (the tokenizer's
token trie alone takes ~1 s at a 152k vocabulary, once per process), so it runs in a small
thread pool: `await compile(spec)` from the HTTP handler, before the request reaches the engine,
turns an invalid schema or grammar into an error the caller reports as a 400. Results (errors
too) are cached by spec in a bounded LRU, and identical compiles in flight share one future. A
compiled grammar is a matcher in its start state; each request gets a deep copy (~5 us).

Per step, `fill_masks` computes the allowed-token bitmasks of the step's guided rows into the
runner's pinned buffer with llguidance's own thread pool (it releases the GIL). Matchers copied
from one template share its lexer state, and llguidance's threads take turns on it: measured at a
152k vocabulary, 128 JSON-schema rows copied from one template fill no faster on two threads
than on one. So a compiled grammar keeps one template per mask thread ("shards"), requests are
dealt to the shards in turn, and a step's rows are handed over grouped by shard, so the pool's
contiguous splits give each thread rows of its own template.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import orjson

from vt.structured.grammar_check import GrammarChecker
from vt.structured.grammar_vocab import grammar_tokenizer_json
from vt.structured.guide import Guide
from vt.structured.spec import GrammarError, GrammarSpec, StructuredOutput

log = logging.getLogger("vt.structured")
CACHE_SIZE = 512          # compiled grammars (and compile errors) kept
COMPILE_THREADS = 2
# llguidance's executor for a step's masks: its threads work while the event loop waits. Half
# the cores up to 8 (at least min(4, cores)): on a 16-core GPU host 8 threads fill 128 masks of a
# 152k vocabulary in 4.4 ms where 4 take 6.8 (bench/RESULTS.md).
_CPUS = os.cpu_count() or 1
MASK_THREADS = max(1, min(8, max(min(4, _CPUS), _CPUS // 2)))


# JSON schema keywords whose values are schemas, maps of schemas or lists of schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains",
               "propertyNames", "unevaluatedProperties", "additionalItems")


def close_objects(schema: Any) -> Any:
    """A copy of a JSON schema where every object schema that does not say otherwise gets
    additionalProperties false: OpenAI's `strict` (which requires it) and vLLM's
    disable_additional_properties. Walks only keywords that hold schemas, so a property that
    happens to be named "properties" or "type" is left alone."""
    if isinstance(schema, list):  # "items" in its old tuple form
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(s) for name, s in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(s) for s in out[key]]
    for key in _SCHEMA_ONE:
        if key in out:
            out[key] = close_objects(out[key])
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"])
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of a spec (no validation yet); GrammarError for unreadable input."""
    import llguidance

    from_json = llguidance.LLMatcher.grammar_from_json_schema
    if spec.kind in ("json", "json_object"):
        if spec.kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = orjson.loads(spec.text)
            except orjson.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("a JSON schema must be an object")
            if spec.strict:
                schema = close_objects(schema)
        options = ({"whitespace_flexible": False} if spec.whitespace == ""
                   else {"whitespace_pattern": spec.whitespace})
        try:
            return from_json(schema, overrides=options)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.kind == "choice":
        choices = orjson.loads(spec.text)
        # A Lark alternation of string literals; JSON string escapes are Lark's.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(orjson.dumps(c).decode() for c in choices))
    try:
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise GrammarError(str(e)) from None


def build_tokenizer(text: str, vocab_size: int, eos: Sequence[int]) -> Any:
    """llguidance's tokenizer of a tokenizer.json text already made grammar-ready
    (grammar_tokenizer_json); its vocab_size may exceed the model's (masks cover every token)."""
    import llguidance

    try:
        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=list(eos) or None)
    except ValueError:
        # More tokens than the model has rows: masks cover them all, cut to the model's.
        return llguidance.LLTokenizer(text, eos_token=list(eos) or None)


def new_matchers(spec: GrammarSpec, tokenizer: Any, count: int = 1) -> list[Any]:
    """count matchers of the spec's grammar in its start state, each built on its own (they
    share no lexer state); GrammarError for a grammar that does not compile, or whose language
    is empty (it fails at its first mask)."""
    import llguidance

    try:
        grammar = grammar_text(spec)
    except RecursionError:
        raise GrammarError("the schema is nested too deep") from None
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise GrammarError(error.strip())
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise GrammarError(matcher.get_error().strip())
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        raise GrammarError("the grammar admits no output at all")
    # ~1 ms each, off the loop like the rest of the compile
    return [matcher, *(llguidance.LLMatcher(tokenizer, grammar, log_level=0) for _ in range(count - 1))]


class CompiledGrammar:
    """A grammar's matchers in their start state, one per shard (independently built, so they
    share no lexer state); `new_matcher(shard)` copies one for a request."""

    __slots__ = ("_templates",)

    def __init__(self, templates: Sequence[Any]) -> None:
        self._templates = tuple(templates)

    def new_matcher(self, shard: int = 0) -> Any:
        return self._templates[shard % len(self._templates)].deep_copy()


class GrammarCompiler:
    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE, isolate: bool = True) -> None:
        """isolate: compile each new grammar in a child process first (GrammarChecker)."""
        self._tokenizer_json = tokenizer_json
        self._isolate = isolate
        self._checker: GrammarChecker | None = None  # made with the tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[GrammarSpec, concurrent.futures.Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # made on first use
        self._tokenizer: concurrent.futures.Future | None = None
        self._mask_executor: Any = None
        self._next_shard = 0  # the shard the next request's guide is dealt to
        self._mask_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._wide: np.ndarray | None = None  # masks of a tokenizer larger than the model's vocabulary

    @property
    def mask_words(self) -> int:
        """int32 words of one token bitmask."""
        return -(-self._vocab_size // 32)

    # ---- compiling ----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Start building the tokenizer's token trie in the pool, so the first request that
        needs it does not wait for it (it is built once, ~1 s at a 152k vocabulary)."""
        self._tokenizer_future()

    def _started_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The compile pool, with the tokenizer's job queued before any compile, so that a
        compile waiting for the tokenizer never holds the thread the tokenizer needs (the caller
        holds the lock)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS,
                                                               thread_name_prefix="vt-grammar")
        if self._tokenizer is None:
            self._tokenizer = self._pool.submit(self._build_tokenizer)
        return self._pool

    def _tokenizer_future(self) -> concurrent.futures.Future:
        with self._lock:
            self._started_pool()
            return self._tokenizer

    def _build_tokenizer(self) -> Any:
        text = grammar_tokenizer_json(self._tokenizer_json())
        try:
            tokenizer = build_tokenizer(text, self._vocab_size, self._eos)
        except Exception:
            log.warning("llguidance cannot read this tokenizer; structured outputs are unavailable",
                        exc_info=True)
            raise
        self._checker = GrammarChecker(text, self._vocab_size, self._eos) if self._isolate else None
        self._vocab_size = max(self._vocab_size, tokenizer.vocab_size)
        return tokenizer

    def _future(self, spec: GrammarSpec) -> concurrent.futures.Future:
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._started_pool().submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        try:
            tokenizer = self._tokenizer_future().result()  # queued first: running or done
        except Exception as e:  # the model's tokenizer, not the request, is at fault: say so
            raise GrammarError(f"structured outputs are not available for this model's tokenizer "
                               f"({type(e).__name__}: {e})") from None
        if self._checker is not None:
            self._checker.check(spec)  # in a child process first: a crash there is this spec's 400
        return CompiledGrammar(new_matchers(spec, tokenizer, MASK_THREADS))

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (cached); GrammarError if the spec does not compile."""
        return await asyncio.wrap_future(self._future(spec))

    def compile_blocking(self, spec: GrammarSpec) -> CompiledGrammar:
        """compile() for callers without an event loop to keep free (scripts, tests)."""
        return self._future(spec).result()

    def guide(self, structured: StructuredOutput) -> Guide:
        """A new request's matcher state. Compiles in the calling thread's wait if the grammar is
        not compiled yet: the HTTP routes await compile() first, so they always find it."""
        shard, self._next_shard = self._next_shard, (self._next_shard + 1) % MASK_THREADS
        matcher = self.compile_blocking(structured.grammar).new_matcher(shard)
        return Guide(matcher, structured.start_after, shard)

    # ---- per step -----------------------------------------------------------------------------
    def fill_masks(self, guides: Sequence[Guide | None], out: np.ndarray) -> None:
        """out i32[len(guides), mask_words]: row i gets guide i's allowed tokens, or every token
        where guide i is None or not applying yet (its request finished, or it still reasons)."""
        import llguidance
        import llguidance.numpy as llg_np

        by_shard: list[tuple[int, int]] = []
        for i, g in enumerate(guides):
            if g is None or not g.active:
                out[i] = -1
            else:
                by_shard.append((g.shard, i))
        if not by_shard:
            return
        by_shard.sort()
        work = [(guides[i].matcher, i) for _, i in by_shard]
        if self._mask_executor is None:
            self._mask_executor = llguidance.LLExecutor(MASK_THREADS)
        words = self.mask_words
        if words <= out.shape[1]:
            llg_np.fill_next_token_bitmask_par(self._mask_executor, work, out)
            return
        if self._wide is None or self._wide.shape[0] < len(guides):
            self._wide = np.empty((max(len(guides), 64), words), np.int32)
        wide = self._wide[: len(guides)]
        llg_np.fill_next_token_bitmask_par(self._mask_executor, work, wide)
        for _, i in work:
            out[i] = wide[i, : out.shape[1]]

    def fill_masks_async(self, guides: Sequence[Guide | None], out: np.ndarray) -> concurrent.futures.Future:
        """fill_masks() on the mask thread (llguidance releases the GIL while it fills, so the
        caller's thread goes on); the future's result() waits for it or raises its error."""
        with self._lock:
            if self._mask_thread is None:
                self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vt-masks")
            return self._mask_thread.submit(self.fill_masks, guides, out)

    def shutdown(self) -> None:
        """Stop the compile and mask threads; what was compiled stays cached, a later compile (or
        fill) starts them again."""
        with self._lock:
            pool, self._pool = self._pool, None
            masks, self._mask_thread = self._mask_thread, None
            if self._tokenizer is not None and not self._tokenizer.done():
                self._tokenizer = None
            for spec in [k for k, f in self._cache.items() if not f.done()]:
                del self._cache[spec]
            checker = self._checker
        if checker is not None:
            checker.close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if masks is not None:
            masks.shutdown(wait=True)  # a fill writes into a step's buffer: let it end
