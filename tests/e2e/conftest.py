"""Fixtures that run the real `vt serve` as a subprocess on a tiny random checkpoint."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vt.launch.subprocesses import terminate

REPO_ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"vt: serving on (http://\S+)")
START_TIMEOUT_S = 120.0


@dataclass
class ServerHandle:
    """A running `vt serve`; `lines` collects its stdout and stderr for failure messages."""

    url: str
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait for a clean exit (kill after `timeout`), return the exit code."""
        return terminate(self.proc, timeout)

    def output(self) -> str:
        return "".join(self.lines)


def _pump(stream, lines: list[str], q: queue.Queue) -> None:
    # reads in a thread so a silent server cannot block the test past its timeout
    for line in stream:
        lines.append(line)
        q.put(line)
    q.put(None)


def start_server(model_dir: str | os.PathLike | None, *extra_args: str,
                 timeout: float = START_TIMEOUT_S) -> ServerHandle:
    """Start `python -m vt serve` on 127.0.0.1 with a free port and wait until it is serving
    (model_dir None: the model comes in extra_args)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    model = [] if model_dir is None else ["--model", str(model_dir)]
    cmd = [sys.executable, "-m", "vt", "serve", *model, "--host", "127.0.0.1",
           "--port", "0", "--device", os.environ.get("VT_TEST_DEVICE", "cpu"), *extra_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=str(REPO_ROOT), env=env)
    lines: list[str] = []
    q: queue.Queue = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines, q), daemon=True).start()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            line = q.get(timeout=max(left, 0.01))
        except queue.Empty:
            line = ""
        if line is None or left <= 0:
            proc.kill()
            proc.wait(10)
            what = "exited" if line is None else f"was not serving after {timeout:.0f} s"
            raise RuntimeError(f"vt serve {what}; output:\n{''.join(lines)}")
        m = READY.search(line)
        if m:
            return ServerHandle(m.group(1), proc, lines)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vt.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny-model") / "tiny-qwen3")


@pytest.fixture(scope="module")
def vt_server(tiny_model_dir: Path):
    handle = start_server(tiny_model_dir)
    yield handle
    handle.stop()
