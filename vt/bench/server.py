"""The `vt serve` process a benchmark starts: on a free loopback port, its output drained in a
thread (the last lines kept to explain a failed start), stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from vt.bench.client import BenchError
from vt.launch.subprocesses import terminate

READY = re.compile(r"vt: serving on (http://\S+)")
STOP_TIMEOUT_S = 30.0
SERVER_LOG_LINES = 40        # server output kept to explain a failed start


class ServerProcess:
    """`python -m vt serve` on a free loopback port; its output is drained in a thread."""

    def __init__(self, model_dir: str, flags: tuple[str, ...], timeout: float,
                 launcher: tuple[str, ...] = ()) -> None:
        """launcher: the command that stands for `python -m vt` (a benchmark's wrapper of it)."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this same vt
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.cmd = [*(launcher or (sys.executable, "-m", "vt")), "serve", "--model", model_dir,
                    "--host", "127.0.0.1", "--port", "0", *flags]
        self.lines: deque[str] = deque(maxlen=SERVER_LOG_LINES)
        self._ready = threading.Event()
        self._exited = threading.Event()
        self.url: str | None = None
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._wait_ready(timeout):
            self.stop()
            log = "".join(self.lines) or "(no output)\n"
            raise BenchError(f"`{shlex.join(self.cmd)}` did not start serving; its last output:\n{log}")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._exited.set()

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._ready.is_set():
            if self._exited.is_set() or time.monotonic() > deadline:
                return False
            self._ready.wait(0.1)
        return True

    def stop(self) -> int | None:
        """SIGTERM; kill if it has not exited within STOP_TIMEOUT_S."""
        return terminate(self.proc, STOP_TIMEOUT_S)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
