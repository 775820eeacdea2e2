"""Chat templates a request brings, rendered in child processes bounded in time and memory.

A template is code. The sandbox keeps it from the server's objects and its bounds keep mistakes
cheap, but a single C-level call (one big join, one `sum` of lists) can still hold the GIL for
seconds or take gigabytes before any Python-level guard looks. So a template the server does not
trust (one sent with a request under --trust-request-chat-template) is compiled and rendered in
a child process: its address space is capped at its size after start plus `max_memory`, a timer
in it stops a template's Python code at `timeout_s`, and the parent kills it if it has not
answered shortly after. The server's own process, its event loop and its other requests never
run the template. A child serves render after render; one that was killed, hit its memory or
its timer is replaced by a fresh one. The cost is a round trip of the messages (JSON) to the
child, a few hundred microseconds; the model's own template stays in process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import orjson

from vt.text.chat_template import ChatTemplateError, TemplateCache, reason, render_chat

RENDER_TIMEOUT_S = 2.0
RENDER_MAX_MEMORY = 512 << 20
RENDER_WORKERS = 2
MAX_RENDERED_CHARS = 1 << 25     # twice what a 16 MiB body can hold: no prompt is longer
_KILL_GRACE_S = 0.5              # past the child's own timer, the parent kills it
_START_TIMEOUT_S = 30.0
_HEADER = struct.Struct(">I")    # each message: its length, then that many bytes of JSON


@dataclasses.dataclass(frozen=True)
class RenderBounds:
    timeout_s: float = RENDER_TIMEOUT_S
    max_memory: int = RENDER_MAX_MEMORY
    max_chars: int = MAX_RENDERED_CHARS


def _dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # an integer past 64 bits, say: the standard library writes it
        return json.dumps(value, default=str).encode()


def _loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def _write_message(stream: Any, value: Any) -> None:
    data = _dumps(value)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


# ---- the child -------------------------------------------------------------------------------

class _Timeout(BaseException):
    """The render's timer struck (a BaseException: no `except Exception` of the template's path
    may swallow it)."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def _vm_size() -> int:
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _render_one(cache: TemplateCache, request: dict[str, Any], bounds: RenderBounds) -> dict[str, Any]:
    """One render's reply: {"text"} or {"error", "retire"} (retire: this child should go)."""
    signal.setitimer(signal.ITIMER_REAL, bounds.timeout_s)
    try:
        text = render_chat(cache.get(request["source"]), request["messages"],
                           add_generation_prompt=request["add_generation_prompt"],
                           continue_final_message=request["continue_final_message"],
                           tools=request["tools"], variables=request["variables"])
    except _Timeout:
        return {"error": f"chat template ran for more than {bounds.timeout_s:g} s", "retire": True}
    except MemoryError:
        return {"error": f"chat template used more than {bounds.max_memory >> 20} MiB", "retire": True}
    except ChatTemplateError as e:
        return {"error": str(e), "retire": False}
    except Exception as e:  # the template's own failure, in whatever form it came
        return {"error": f"chat template failed: {reason(e)}", "retire": False}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if len(text) > bounds.max_chars:
        return {"error": f"chat template made a prompt of {len(text):,} characters, more than any context "
                         f"holds ({bounds.max_chars:,})", "retire": False}
    return {"text": text}


def _child(stdin: Any, stdout: Any) -> None:
    """The child's loop: its first message is its bounds, then each message a render in, one
    reply out, until the parent closes the pipe."""
    bounds = RenderBounds(**_read_message(stdin))
    signal.signal(signal.SIGALRM, _on_alarm)
    cache = TemplateCache()
    cache.get("{{ messages }}")  # Jinja's modules loaded before the address space is capped
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + bounds.max_memory
    if hard == resource.RLIM_INFINITY or limit < hard:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    _write_message(stdout, None)  # ready
    while True:
        request = _read_message(stdin)
        if request is None:
            return
        # An orphaned child still stops: SIGXCPU a few CPU seconds past the render's bound.
        used = resource.getrusage(resource.RUSAGE_SELF)
        _, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
        cpu_limit = int(used.ru_utime + used.ru_stime + bounds.timeout_s) + 3
        if cpu_hard != resource.RLIM_INFINITY:
            cpu_limit = min(cpu_limit, cpu_hard)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_limit, cpu_hard))
        try:
            reply = _render_one(cache, request, bounds)
        except (_Timeout, MemoryError):  # struck between the guards
            reply = {"error": "chat template exceeded its bounds", "retire": True}
        _write_message(stdout, reply)
        if reply.get("retire"):
            return


def _read_message(stream: Any) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    return _loads(stream.read(size))


# ---- the parent ------------------------------------------------------------------------------

class _Worker:
    """A started child: its process and pipes; owned by one render at a time."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        assert proc.stdout is not None
        self._fd = proc.stdout.fileno()

    def send(self, value: Any) -> None:
        _write_message(self.proc.stdin, value)

    def _read_exact(self, size: int, deadline: float) -> bytes:
        parts, left = [], size
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([self._fd], [], [], wait)[0]:
                raise TimeoutError
            chunk = os.read(self._fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def receive(self, deadline: float) -> Any:
        (size,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline))
        return _loads(self._read_exact(size, deadline))

    def stop(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


def _stop_all(workers: list[_Worker]) -> None:
    for w in workers:
        w.stop()


class TemplateProcesses:
    """Renders chat templates in up to `workers` child processes at once (more renders wait for
    one to be free; each render is bounded, so the wait is too)."""

    def __init__(self, workers: int = RENDER_WORKERS, bounds: RenderBounds = RenderBounds()) -> None:
        self.bounds = bounds
        self._workers = max(1, workers)
        self._cond = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy = 0
        # children still idle when this object goes are killed with it
        self._finalizer = weakref.finalize(self, _stop_all, self._idle)

    @property
    def pids(self) -> list[int]:
        """The idle children's process ids (a busy one is its render's)."""
        with self._cond:
            return [w.proc.pid for w in self._idle]

    def _start(self) -> _Worker:
        root = str(Path(__file__).resolve().parents[2])  # the child imports this same vt
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))),
                   MALLOC_ARENA_MAX="2")
        proc = subprocess.Popen([sys.executable, "-m", "vt.text.template_process"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=env, start_new_session=True)
        worker = _Worker(proc)
        try:
            worker.send(dataclasses.asdict(self.bounds))
            worker.receive(time.monotonic() + _START_TIMEOUT_S)
        except (OSError, EOFError, TimeoutError, ValueError):
            worker.stop()
            raise ChatTemplateError("chat template could not be rendered: its renderer did not start "
                                    "(see the server log)") from None
        return worker

    def _take(self) -> _Worker | None:
        with self._cond:
            while self._busy >= self._workers:
                self._cond.wait()
            self._busy += 1
            while self._idle:
                worker = self._idle.pop()
                if worker.proc.poll() is None:
                    return worker
                worker.stop()
            return None

    def _give_back(self, worker: _Worker | None, keep: bool) -> None:
        with self._cond:
            self._busy -= 1
            if worker is not None and keep:
                self._idle.append(worker)
                worker = None
            self._cond.notify()
        if worker is not None:
            worker.stop()

    def render(self, source: str, messages: Any, *, add_generation_prompt: bool,
               continue_final_message: bool = False, tools: Any = None, variables: Any = None,
               param: str = "chat_template") -> str:
        """render_chat(source, ...) in a child; ChatTemplateError (with `param`) for anything the
        template did wrong, ran past its time or its memory."""
        previous = sys.gettrace()
        sys.settrace(None)  # bounded here: a caller's trace-function guard must not strike mid-render
        try:
            return self._render(param, {
                "source": source, "messages": messages, "add_generation_prompt": add_generation_prompt,
                "continue_final_message": continue_final_message, "tools": tools, "variables": variables})
        finally:
            sys.settrace(previous)

    def _render(self, param: str, request: dict[str, Any]) -> str:
        worker = self._take()
        keep = False
        try:
            if worker is None:
                worker = self._start()
            deadline = time.monotonic() + self.bounds.timeout_s + _KILL_GRACE_S
            try:
                worker.send(request)
                reply = worker.receive(deadline)
            except TimeoutError:
                raise ChatTemplateError(f"chat template ran for more than {self.bounds.timeout_s:g} s",
                                        param) from None
            except (OSError, EOFError, ValueError):
                raise ChatTemplateError(f"chat template stopped its renderer (it likely used more than "
                                        f"{self.bounds.max_memory >> 20} MiB)", param) from None
            keep = not reply.get("retire")
            if "text" in reply:
                return reply["text"]
            raise ChatTemplateError(reply.get("error") or "chat template failed", param)
        finally:
            self._give_back(worker, keep)

    def close(self) -> None:
        """Kill the idle children (a busy one goes when its render ends)."""
        with self._cond:
            idle = list(self._idle)
            self._idle.clear()
        _stop_all(idle)


if __name__ == "__main__":
    _child(sys.stdin.buffer, sys.stdout.buffer)
