"""Completed requests shown while a run goes: a bar redrawn in place with '\\r' on a terminal, and
otherwise (output piped or sent to a file) a plain line at every tenth, so logs hold no '\\r'."""

from __future__ import annotations

import sys
from typing import TextIO

PLAIN_STEPS = 10  # lines a run writes where the bar cannot be redrawn


def is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


class Progress:
    """Progress of one run on `stream`: redrawn in place when `live`, else a line per tenth."""

    def __init__(self, total: int, label: str, stream: TextIO | None, live: bool, width: int = 30) -> None:
        self.total, self.label, self.stream, self.live, self.width = total, label, stream, live, width
        self.done = 0
        self._shown = -1  # the last tenth written as a plain line
        self._draw()

    @classmethod
    def for_run(cls, total: int, label: str, enabled: bool) -> Progress:
        """On stderr; redrawn only where both stdout and stderr are terminals (either of them in a
        file would otherwise collect every redraw)."""
        live = is_terminal(sys.stdout) and is_terminal(sys.stderr)
        return cls(total, label, sys.stderr if enabled else None, live)

    def _draw(self) -> None:
        if self.stream is None:
            return
        if self.live:
            filled = self.width * self.done // max(self.total, 1)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
        else:
            tenth = PLAIN_STEPS * self.done // max(self.total, 1)
            if tenth == self._shown:
                return
            self._shown = tenth
            self.stream.write(f"{self.label}: {self.done}/{self.total} requests done\n")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        if self.stream is not None and self.live:
            self.stream.write("\n")
            self.stream.flush()
