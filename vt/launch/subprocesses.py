"""Ending child processes the one way every launcher here does: SIGTERM, a grace period, SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM `proc` if it runs, wait up to `timeout` s for it to exit, else SIGKILL it; the exit
    code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
