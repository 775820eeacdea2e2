"""Each new grammar is compiled in a child process first: one that crashes the grammar engine,
runs too long or needs too much memory costs its request a 400, not the server.

llguidance builds a grammar by recursion. A JSON schema whose `$ref`s chain about a thousand
definitions deep, or a Lark grammar of a few thousand right-recursive rules, overflows the
compiling thread's stack, and the process dies (SIGSEGV) with every request in it. A body may
be deep enough to need any stack size, so no bound on the stack or the input closes that. So
before the server compiles a grammar, a child process does (in a thread like the server's
compile threads: the same stack) and walks it a few tokens with masks filled as the server
fills them: some of llguidance's run-time limits (an Earley row over its item limit, a lexer
with too many states) only show once it runs. The server compiles it only once the child came
back with no error.

Checks run side by side, each in a child of its own (up to `children` at once; a child is kept
for the next check), so a grammar that takes its time holds up no other. Each is bounded:
`timeout` seconds (past it the child is killed), `max_memory` bytes of growth (the child's
address space is capped, so the compile fails instead of taking the host's memory), and a CPU
limit that ends a child whose parent is gone. A check can be cancelled from another thread
(`CheckTicket.cancel`: its child is killed at once and its place freed), and close() kills every
child without waiting for any check.

A check costs a second compile of the grammar (compiles are cached by spec, so once per
distinct grammar) and, for each child, its start and its own token trie (about a second at a
152k vocabulary).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import orjson

from vt.structured.matchers import MASK_THREADS, build_tokenizer, new_matchers
from vt.structured.spec import GrammarError, GrammarSpec, GrammarUnavailableError, error_line, matcher_error

log = logging.getLogger("vt.structured")
CHECK_TIMEOUT_S = 30.0
CHECK_MAX_MEMORY = 1 << 30           # address space a check may add to its child's
CHECK_CHILDREN = max(2, min(4, (os.cpu_count() or 1) // 2))
START_TIMEOUT_S = 120.0              # a child's start: its token trie (~1 s at 152k tokens)
WALK_STEPS = 8                       # tokens walked through a new grammar, each after a mask
_CPU_GRACE_S = 5                     # CPU seconds past the timeout before an orphaned check is killed


class CheckCancelled(Exception):
    """The check was cancelled, or the checker closed, before it had an answer."""


@dataclasses.dataclass(frozen=True)
class CheckResult:
    """A grammar the child compiled and walked: what it cost there."""

    seconds: float
    peak_bytes: int  # the child's resident growth while it compiled (about the grammar's size)


class CheckTicket:
    """One check's handle, for another thread to cancel it: cancel() kills its child at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._proc: subprocess.Popen | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            proc = self._proc
        if proc is not None:
            _kill(proc)

    def _attach(self, proc: subprocess.Popen | None) -> bool:
        """Let cancel() kill proc from now on (None: from now on nothing); False if cancelled."""
        with self._lock:
            self._proc = proc
            return not self._cancelled


def _kill(proc: subprocess.Popen) -> None:
    try:
        proc.kill()
    except OSError:
        pass


# ---- the child -------------------------------------------------------------------------------

def _walk(matcher: Any, executor: Any, mask_words: int, steps: int) -> None:
    """Take `steps` tokens through a matcher, each the lowest one its mask allows, the masks
    filled by llguidance's executor as the server fills them."""
    import llguidance.numpy as llg_np
    import numpy as np

    mask = np.zeros((1, mask_words), np.int32)
    for _ in range(steps):
        if matcher.is_stopped():
            return
        llg_np.fill_next_token_bitmask_par(executor, [(matcher, 0)], mask)
        if matcher.is_error():
            raise GrammarError(matcher_error(matcher))
        words = np.flatnonzero(mask[0])
        if not len(words):
            raise GrammarError("the grammar admits no further token")
        w = int(words[0])
        bits = int(mask[0, w]) & 0xFFFFFFFF
        if not matcher.consume_token(w * 32 + (bits & -bits).bit_length() - 1) or matcher.is_error():
            raise GrammarError(matcher_error(matcher))


def _status_kib(field: str) -> int:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(field.encode() + b":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _reset_peak() -> None:
    try:  # Linux: "5" resets VmHWM, so each check's peak is its own
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _run_check(spec: GrammarSpec, tokenizer: Any, executor: Any, max_memory: int,
               out: dict[str, Any]) -> None:
    """What the server's compile would say of spec, then the walk; into out["error"]."""
    try:
        _walk(new_matchers(spec, tokenizer)[0], executor, -(-tokenizer.vocab_size // 32), WALK_STEPS)
    except GrammarError as e:
        out["error"] = str(e)
    except MemoryError:
        out["error"] = f"the grammar needs more than {max_memory >> 20} MiB to compile"
    except Exception as e:  # anything else the grammar brings is its error too
        out["error"] = error_line(f"{type(e).__name__}: {e}")


def _child(stdin: Any, stdout: Any) -> None:
    """The child's loop: its first line is the tokenizer and the bounds (JSON), then each line a
    spec in, one line out ({"error": ..., "peak": bytes}), until the parent closes the pipe."""
    import llguidance
    import llguidance.numpy  # noqa: F401  (loaded, with numpy's BLAS, before the address space is capped)

    init = orjson.loads(stdin.readline())
    tokenizer = build_tokenizer(init["tokenizer"], init["vocab_size"], init["eos"])
    executor = llguidance.LLExecutor(MASK_THREADS)
    max_memory = int(init["max_memory"])
    del init
    # From here on the address space may grow by max_memory: a compile past it fails here.
    limit = _status_kib("VmSize") * 1024 + max_memory
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard == resource.RLIM_INFINITY or limit < hard:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    stdout.write(b"null\n")  # ready
    stdout.flush()
    for line in stdin:
        try:
            request = orjson.loads(line)
        except (MemoryError, orjson.JSONDecodeError):  # the spec alone is past the bound (orjson says so)
            too_big = f"the grammar needs more than {max_memory >> 20} MiB to compile"
            stdout.write(orjson.dumps({"error": too_big, "peak": 0}) + b"\n")
            stdout.flush()
            continue
        spec = GrammarSpec(**request["spec"])
        # An orphaned child (its parent killed) still stops: SIGXCPU past the check's CPU bound.
        used = resource.getrusage(resource.RUSAGE_SELF)
        cpu_limit = int(used.ru_utime + used.ru_stime + request["timeout"] + _CPU_GRACE_S) + 1
        _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
        if cpu_hard != resource.RLIM_INFINITY:
            cpu_limit = min(cpu_limit, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_hard))
        _reset_peak()
        before = _status_kib("VmRSS")
        out: dict[str, Any] = {"error": None}
        # in a thread like the server's compile threads: the same stack
        worker = threading.Thread(target=_run_check, args=(spec, tokenizer, executor, max_memory, out),
                                  name="vt-grammar-check")
        worker.start()
        worker.join()
        out["peak"] = max(0, _status_kib("VmHWM") - before) * 1024
        stdout.write(orjson.dumps(out) + b"\n")
        stdout.flush()


# ---- the parent ------------------------------------------------------------------------------

class _Child:
    """A started child process and its pipes; owned by one check at a time."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def send(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data + b"\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float) -> Any:
        """The child's next line, read as JSON; TimeoutError past timeout, EOFError if it died."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0.0))
        if not ready:
            raise TimeoutError
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError
        return orjson.loads(line)

    def stop(self) -> int | None:
        """Kill it (if it still runs), reap it, close its pipes; its exit code."""
        _kill(self.proc)
        try:
            code = self.proc.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass
        return code


class GrammarChecker:
    """The parent's side: up to `children` checks at once, each in its own child process (a
    crash is then the spec's that was being checked, never a neighbour's). A child is `python
    -m` this module, not a multiprocessing child, so nothing of the parent's main module runs in
    it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int], timeout: float = CHECK_TIMEOUT_S,
                 children: int = CHECK_CHILDREN, max_memory: int = CHECK_MAX_MEMORY) -> None:
        self._init = orjson.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": list(eos),
                                   "max_memory": max_memory})
        self._timeout = timeout
        self._max_memory = max_memory
        self._children = max(1, children)
        self._cond = threading.Condition()
        self._idle: list[_Child] = []
        self._running: set[subprocess.Popen] = set()  # every child not yet stopped, idle or busy
        self._busy = 0
        self._generation = 0  # close() moves it on: checks begun before then are cancelled

    @property
    def max_checks(self) -> int:
        """How many checks run at once (more wait for a place)."""
        return self._children

    @property
    def busy(self) -> int:
        """Checks under way (each holding a place, and a child once started)."""
        with self._cond:
            return self._busy

    @property
    def pids(self) -> list[int]:
        """The process ids of the children now running (idle or checking)."""
        with self._cond:
            return [p.pid for p in self._running]

    def _take(self, ticket: CheckTicket, generation: int) -> _Child | None:
        """A place to check in: an idle child, or None to start one; CheckCancelled while waiting."""
        with self._cond:
            while self._busy >= self._children:
                if ticket.cancelled or generation != self._generation:
                    raise CheckCancelled
                self._cond.wait(0.05)
            if ticket.cancelled or generation != self._generation:
                raise CheckCancelled
            self._busy += 1
            while self._idle:
                child = self._idle.pop()
                if child.proc.poll() is None:
                    return child
                self._running.discard(child.proc)
                child.stop()  # died while idle (reaped already: quick)
            return None

    def _give_back(self, child: _Child | None, keep: bool, generation: int) -> None:
        with self._cond:
            self._busy -= 1
            if child is not None:
                if keep and generation == self._generation and child.proc.poll() is None:
                    self._idle.append(child)
                    child = None
                else:
                    self._running.discard(child.proc)
            self._cond.notify()
        if child is not None:
            child.stop()

    def _start(self, ticket: CheckTicket, generation: int) -> _Child:
        root = str(Path(__file__).resolve().parents[2])  # the child imports this same vt
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
                   # one malloc arena and one BLAS thread: the address-space cap then measures the
                   # grammar, not per-thread reservations (a second arena reserves 64 MiB when a
                   # check's thread first allocates, which a 64 MiB cap then refuses at random)
                   MALLOC_ARENA_MAX="1", OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-m", "vt.structured.grammar_check"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        child = _Child(proc)
        with self._cond:
            self._running.add(proc)
        try:
            if not ticket._attach(proc) or generation != self._generation:
                raise CheckCancelled
            child.send(self._init)
            child.receive(START_TIMEOUT_S)  # the child's token trie is built: checks are timed from here
            return child
        except (OSError, EOFError, TimeoutError, ValueError, CheckCancelled):
            child.stop()
            with self._cond:
                self._running.discard(proc)
            if ticket.cancelled or generation != self._generation:
                raise CheckCancelled from None
            log.warning("the grammar checker's child did not start (exit code %s)", proc.returncode)
            raise GrammarUnavailableError("the grammar checker could not start (see the log)") from None

    def check(self, spec: GrammarSpec, ticket: CheckTicket | None = None) -> CheckResult:
        """What compiling and walking spec cost in a child; GrammarError with the reason if it
        failed, or if the child died, ran past the timeout or past its memory. CheckCancelled if
        the ticket was cancelled or the checker closed meanwhile; GrammarUnavailableError if no
        child could start (the server's fault, not the spec's)."""
        ticket = ticket or CheckTicket()
        with self._cond:
            generation = self._generation
        child = self._take(ticket, generation)
        keep = False
        try:
            if child is None:
                child = self._start(ticket, generation)
            elif not ticket._attach(child.proc):
                raise CheckCancelled
            start = time.monotonic()
            try:
                child.send(orjson.dumps({"spec": dataclasses.asdict(spec), "timeout": self._timeout}))
                reply = child.receive(self._timeout)
            except TimeoutError:
                raise GrammarError(f"the grammar took longer than {self._timeout:g} s to compile") from None
            except (EOFError, OSError, ValueError):
                if ticket.cancelled or generation != self._generation:
                    raise CheckCancelled from None
                raise GrammarError(self._death(child)) from None
            keep = True
            if reply.get("error") is not None:
                raise GrammarError(reply["error"])
            return CheckResult(time.monotonic() - start, int(reply.get("peak") or 0))
        finally:
            ticket._attach(None)
            # a cancel that came after the answer may have killed the child: do not keep it
            self._give_back(child, keep and not ticket.cancelled, generation)

    def _death(self, child: _Child) -> str:
        """Why a child died mid-check, for its grammar's error."""
        code = child.stop()
        log.warning("a grammar crashed its compile check (exit code %s)", code)
        if code in (-signal.SIGKILL, -signal.SIGXCPU):
            return f"the grammar took longer than {self._timeout:g} s to compile"
        return ("the grammar engine crashed compiling this schema or grammar (it is likely nested or "
                f"chained too deep, or needs more than {self._max_memory >> 20} MiB)")

    def close(self) -> None:
        """Kill every child now, idle or checking; checks under way end with CheckCancelled. A
        later check starts new children."""
        with self._cond:
            self._generation += 1
            idle, self._idle = self._idle, []
            busy = [p for p in self._running if all(p is not c.proc for c in idle)]
            self._running.difference_update(busy)
            self._running.difference_update(c.proc for c in idle)
            self._cond.notify_all()
        for proc in busy:
            _kill(proc)  # its check's thread sees the pipe close, reaps it and closes its pipes
        for child in idle:
            child.stop()


if __name__ == "__main__":
    _child(sys.stdin.buffer, sys.stdout.buffer)
