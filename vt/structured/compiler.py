"""GrammarCompiler: GrammarSpecs -> llguidance matchers, compiled off the event loop and cached.

Compiling a JSON schema or a grammar takes from microseconds to seconds (the tokenizer's token
trie alone takes ~1 s at a 152k vocabulary, once per process), so it runs on worker threads:
`await compile(spec)` from the HTTP handler, before the request reaches the engine, turns an
invalid schema or grammar into an error the caller reports as a 400. Compiles run side by side
(up to the checker's number of children), each new grammar first in a child process of its own
(GrammarChecker: bounded in time and memory), so a slow one holds up no other. Results (errors
too) are cached by spec in an LRU bounded by count and by the memory the grammars were measured
to take, and identical compiles in flight share one. A compile whose every waiter went away
(the task awaiting compile() was cancelled: its client left) is stopped: its child is killed and
its place freed. A compiled grammar is a matcher in its start state; each request gets a deep
copy (~5 us).

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
import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from vt.structured.grammar_check import (
    CHECK_CHILDREN,
    CheckCancelled,
    CheckResult,
    CheckTicket,
    GrammarChecker,
)
from vt.structured.grammar_text import close_objects, grammar_text
from vt.structured.grammar_vocab import grammar_tokenizer_json
from vt.structured.guide import Guide
from vt.structured.matchers import MASK_THREADS, build_tokenizer, new_matchers
from vt.structured.spec import GrammarError, GrammarSpec, GrammarUnavailableError, StructuredOutput

__all__ = ["CACHE_BYTES", "CACHE_SIZE", "COMPILE_THREADS", "MASK_THREADS", "CompiledGrammar",
           "GrammarCompiler", "GrammarError", "build_tokenizer", "close_objects", "grammar_text",
           "new_matchers"]

log = logging.getLogger("vt.structured")
CACHE_SIZE = 512          # compiled grammars (and compile errors) kept
CACHE_BYTES = 2 << 30     # ... and the memory they were measured to take (the checker's peak, per template)
KEEP_RECENT = 16          # the latest grammars stay whatever they weigh: their requests are about to start
COMPILE_THREADS = CHECK_CHILDREN  # compiles at once: one checker child each


class CompiledGrammar:
    """A grammar's matchers in their start state, one per shard (independently built, so they
    share no lexer state); `new_matcher(shard)` copies one for a request."""

    __slots__ = ("_templates",)

    def __init__(self, templates: Sequence[Any]) -> None:
        self._templates = tuple(templates)

    def new_matcher(self, shard: int = 0) -> Any:
        return self._templates[shard % len(self._templates)].deep_copy()


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()


@dataclasses.dataclass(eq=False)
class _Compile:
    """One spec's compile: its result, how many wait for it, and the ticket that stops its check."""

    spec: GrammarSpec
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    ticket: CheckTicket = dataclasses.field(default_factory=CheckTicket)
    waiters: int = 0
    weight: int = 0  # bytes the compiled grammar was measured to take (0 until it is compiled)


class GrammarCompiler:
    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = CACHE_SIZE, isolate: bool = True, cache_bytes: int = CACHE_BYTES) -> None:
        """isolate: compile each new grammar in a child process first (GrammarChecker)."""
        self._tokenizer_json = tokenizer_json
        self._isolate = isolate
        self._checker: GrammarChecker | None = None  # made with the tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._cache: OrderedDict[GrammarSpec, _Compile] = OrderedDict()
        self._weight = 0  # of the compiled grammars in the cache
        self._cond = threading.Condition()  # guards everything above and below; never held while compiling
        self._queue: collections.deque[_Compile] = collections.deque()
        self._workers = 0
        self._generation = 0  # shutdown() moves it on: workers of an earlier one leave
        self._tokenizer: concurrent.futures.Future | None = None
        self._mask_executor: Any = None
        self._next_shard = 0  # the shard the next request's guide is dealt to
        self._mask_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._wide: np.ndarray | None = None  # masks of a tokenizer larger than the model's vocabulary

    @property
    def checker(self) -> GrammarChecker | None:
        """The child processes new grammars are checked in (made with the tokenizer's trie)."""
        return self._checker

    @property
    def mask_words(self) -> int:
        """int32 words of one token bitmask."""
        return -(-self._vocab_size // 32)

    # ---- compiling ----------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Start building the tokenizer's token trie, so the first request that needs it does not
        wait for it (it is built once, ~1 s at a 152k vocabulary)."""
        self._tokenizer_future()

    def _tokenizer_future(self) -> concurrent.futures.Future:
        with self._cond:
            if self._tokenizer is None:
                self._tokenizer = concurrent.futures.Future()
                # not a daemon: an exit waits for the build (about a second) rather than tearing
                # the interpreter down under llguidance's code
                threading.Thread(target=self._build_tokenizer, args=(self._tokenizer,),
                                 name="vt-grammar-vocab").start()
            return self._tokenizer

    def _build_tokenizer(self, fut: concurrent.futures.Future) -> None:
        try:
            text = grammar_tokenizer_json(self._tokenizer_json())
            tokenizer = build_tokenizer(text, self._vocab_size, self._eos)
        except Exception as e:  # the tokenizer's fault, said in one line (no traceback in the server's log)
            log.warning("llguidance cannot read this tokenizer (%s: %s); structured outputs are unavailable",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            fut.set_exception(e)
            return
        self._checker = GrammarChecker(text, self._vocab_size, self._eos) if self._isolate else None
        self._vocab_size = max(self._vocab_size, tokenizer.vocab_size)
        fut.set_result(tokenizer)

    def _join(self, spec: GrammarSpec) -> _Compile:
        """The spec's compile (cached, in flight, or queued now), with one more waiter."""
        with self._cond:
            job = self._cache.get(spec)
            if job is not None:
                self._cache.move_to_end(spec)
            else:
                job = _Compile(spec)
                self._cache[spec] = job
                self._queue.append(job)
                if self._workers < COMPILE_THREADS:
                    self._workers += 1
                    threading.Thread(target=self._work, args=(self._generation,), daemon=True,
                                     name="vt-grammar").start()
                self._cond.notify()
                self._evict()
            job.waiters += 1
            return job

    def _leave(self, job: _Compile, abandon: bool) -> None:
        """A waiter is done with job; abandon: it went away unanswered, so if no one else waits
        the compile stops (its check's child is killed) and is forgotten."""
        with self._cond:
            job.waiters -= 1
            if not abandon or job.waiters > 0 or job.future.done():
                return
            if self._cache.get(job.spec) is job:
                del self._cache[job.spec]
            if job in self._queue:
                self._queue.remove(job)
                job.future.cancel()
                return
        job.ticket.cancel()

    def _evict(self) -> None:
        """Drop the least recently used finished compiles past the count or the memory bound
        (the caller holds the lock)."""
        done = [spec for spec, job in self._cache.items() if job.future.done()]
        excess = len(self._cache) - self._cache_size
        for i, spec in enumerate(done):
            heavy = self._weight > self._cache_bytes and i < len(done) - KEEP_RECENT
            if excess <= 0 and not heavy:
                break
            self._weight -= self._cache.pop(spec).weight
            excess -= 1

    def _work(self, generation: int) -> None:
        """A compile worker: runs queued compiles until shutdown() moves the generation on."""
        while True:
            with self._cond:
                while not self._queue and generation == self._generation:
                    self._cond.wait()
                if generation != self._generation:
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
            try:
                compiled = self._compile(job)
            except BaseException as e:  # the waiters get it, whatever it is
                job.future.set_exception(e)
                with self._cond:
                    if not isinstance(e, GrammarError) and self._cache.get(job.spec) is job:
                        del self._cache[job.spec]  # not the spec's fault: a later request tries again
                continue
            job.future.set_result(compiled)
            with self._cond:
                if self._cache.get(job.spec) is job:
                    self._weight += job.weight
                    self._evict()

    def _compile(self, job: _Compile) -> CompiledGrammar:
        try:
            tokenizer = self._tokenizer_future().result()
        except Exception as e:  # the model's tokenizer, not the request, is at fault: say so
            raise GrammarError(f"structured outputs are not available for this model's tokenizer "
                               f"({type(e).__name__}: {e})") from None
        checked: CheckResult | None = None
        if self._checker is not None:
            try:
                checked = self._checker.check(job.spec, job.ticket)  # a crash there is this spec's 400
            except CheckCancelled:
                raise GrammarUnavailableError("the grammar's compile was stopped (the server is stopping, "
                                              "or no request waits for it)") from None
        if job.ticket.cancelled:
            raise GrammarUnavailableError("the grammar's compile was stopped")
        templates = new_matchers(job.spec, tokenizer, MASK_THREADS)
        job.weight = (checked.peak_bytes if checked is not None else 0) * len(templates)
        return CompiledGrammar(templates)

    async def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar (cached); GrammarError if the spec does not compile.
        GrammarUnavailableError if the compiler is shut down meanwhile. Cancelling the awaiting
        task stops the compile if no other request waits for it: its child process is killed
        and its place goes to the next compile at once."""
        job = self._join(spec)
        answer = asyncio.wrap_future(job.future)
        answer.add_done_callback(_retrieved)  # read even after this waiter left: asyncio warns otherwise
        abandon = True
        try:
            result = await asyncio.shield(answer)
            abandon = False
            return result
        except asyncio.CancelledError:
            raise
        except BaseException:
            abandon = False
            raise
        finally:
            self._leave(job, abandon)

    def compile_blocking(self, spec: GrammarSpec) -> CompiledGrammar:
        """compile() for callers without an event loop to keep free (scripts, tests)."""
        job = self._join(spec)
        try:
            return job.future.result()
        finally:
            self._leave(job, abandon=False)

    def in_flight(self) -> int:
        """Compiles queued or running."""
        with self._cond:
            return sum(not job.future.done() for job in self._cache.values())

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
        with self._cond:
            if self._mask_thread is None:
                self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vt-masks")
            return self._mask_thread.submit(self.fill_masks, guides, out)

    def shutdown(self) -> None:
        """Stop compiling and the mask thread, without waiting for any compile: queued compiles
        and checks under way end with GrammarUnavailableError (their children are killed). What
        was compiled stays cached; a later compile (or fill) starts the threads again."""
        with self._cond:
            self._generation += 1
            self._workers = 0
            stopped = [job for job in self._cache.values() if not job.future.done()]
            for job in stopped:
                del self._cache[job.spec]
            queued = list(self._queue)
            self._queue.clear()
            masks, self._mask_thread = self._mask_thread, None
            if self._tokenizer is not None and not self._tokenizer.done():
                self._tokenizer = None
            checker = self._checker
            self._cond.notify_all()
        for job in queued:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(GrammarUnavailableError("the server is stopping"))
        for job in stopped:
            job.ticket.cancel()
        if checker is not None:
            checker.close()
        if masks is not None:
            masks.shutdown(wait=True)  # a fill writes into a step's buffer: let it end
