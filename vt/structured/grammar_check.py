"""Each new grammar is compiled in a child process first: one that crashes the grammar engine
costs its request a 400, not the server.

llguidance builds a grammar by recursion. A JSON schema whose `$ref`s chain about a thousand
definitions deep, or a Lark grammar of a few thousand right-recursive rules, overflows the
compiling thread's stack, and the process dies (SIGSEGV) with every request in it. A body may
be deep enough to need any stack size, so no bound on the stack or the input closes that. So
before the server compiles a grammar, a child process does (in a thread like the server's
compile threads: the same stack) and walks it a few tokens with masks filled as the server
fills them: some of llguidance's run-time limits (an Earley row of more than 2,000 items, a
lexer with too many states) only show once it runs. The server compiles it only once the
child came back with no error; a child that died, or took longer than CHECK_TIMEOUT_S, makes
the spec a GrammarError, and the next check starts a new child.

A check costs a second compile of the grammar (compiles are cached by spec, so once per
distinct grammar) and, the first time, the child's start and its own token trie (about a
second at a 152k vocabulary).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import orjson

from vt.structured.spec import GrammarError, GrammarSpec, matcher_error

log = logging.getLogger("vt.structured")
CHECK_TIMEOUT_S = 60.0
WALK_STEPS = 8          # tokens walked through a new grammar, each after a mask


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


def _check(spec: GrammarSpec, tokenizer: Any, executor: Any) -> str | None:
    """Why the spec is unusable, or None: what the server's compile would say, then the walk."""
    from vt.structured.compiler import new_matchers

    try:
        _walk(new_matchers(spec, tokenizer)[0], executor, -(-tokenizer.vocab_size // 32), WALK_STEPS)
    except GrammarError as e:
        return str(e)
    return None


def _run_check(spec: GrammarSpec, tokenizer: Any, executor: Any, result: list[str | None]) -> None:
    try:
        result[0] = _check(spec, tokenizer, executor)
    except Exception as e:  # anything else the grammar brings is its error too
        result[0] = f"{type(e).__name__}: {e}"


def _child(stdin: Any, stdout: Any) -> None:
    """The child's loop: its first line is the tokenizer (JSON), then each line a spec in, one
    line out with its error (or null), until the parent closes the pipe."""
    import llguidance

    from vt.structured.compiler import MASK_THREADS, build_tokenizer

    init = orjson.loads(stdin.readline())
    tokenizer = build_tokenizer(init["tokenizer"], init["vocab_size"], init["eos"])
    executor = llguidance.LLExecutor(MASK_THREADS)
    stdout.write(b"null\n")  # ready
    stdout.flush()
    for line in stdin:
        spec = GrammarSpec(**orjson.loads(line))
        result: list[str | None] = [None]
        # in a thread like the server's compile threads: the same stack
        worker = threading.Thread(target=_run_check, args=(spec, tokenizer, executor, result),
                                  name="vt-grammar-check")
        worker.start()
        worker.join()
        stdout.write(orjson.dumps(result[0]) + b"\n")
        stdout.flush()


class GrammarChecker:
    """The parent's side: one child at a time, one check at a time (a crash is then the spec's
    that was being checked, never a neighbour's). The child is `python -m` this module, not a
    multiprocessing child, so nothing of the parent's main module runs in it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: list[int],
                 timeout: float = CHECK_TIMEOUT_S) -> None:
        self._init = orjson.dumps({"tokenizer": tokenizer_json, "vocab_size": vocab_size, "eos": list(eos)})
        self._timeout = timeout
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parents[2])  # the child imports this same vt
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        proc = subprocess.Popen([sys.executable, "-m", "vt.structured.grammar_check"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        self._proc = proc
        self._send(self._init)
        self._receive()  # the child's token trie is built: checks are timed from here
        return proc

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def _send(self, data: bytes) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(data + b"\n")
        self._proc.stdin.flush()

    def _receive(self) -> Any:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], self._timeout)
        if not ready:
            self._stop()
            raise GrammarError(f"the grammar took longer than {self._timeout:.0f} s to compile")
        line = proc.stdout.readline()
        if not line:
            raise EOFError
        return orjson.loads(line)

    def check(self, spec: GrammarSpec) -> None:
        """Return if the child compiled and walked spec; GrammarError with the reason if not, or
        if the child died or hung on it."""
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._stop()
                    self._start()
                self._send(orjson.dumps(dataclasses.asdict(spec)))
                error = self._receive()
            except (EOFError, OSError):
                code = self._proc.wait() if self._proc is not None else None
                self._stop()
                log.warning("a grammar crashed its compile check (exit code %s)", code)
                raise GrammarError("the grammar engine crashed compiling this schema or grammar "
                                   "(it is likely nested or chained too deep)") from None
            if error is not None:
                raise GrammarError(error)

    def close(self) -> None:
        with self._lock:
            self._stop()


if __name__ == "__main__":
    _child(sys.stdin.buffer, sys.stdout.buffer)
