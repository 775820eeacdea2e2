"""Which kernels a CUDA backend launches: tests that check a path was taken record them."""

from __future__ import annotations

from typing import Any


def record_launches(cb: Any, monkeypatch: Any) -> list[str]:
    """The names of the kernels `cb` launches through `_launch` from now on, in order (the
    recording ends with the test, as monkeypatch undoes it)."""
    launched: list[str] = []
    launch = cb._launch

    def recording_launch(name: str, *args: Any, **kwargs: Any) -> None:
        launched.append(name)
        launch(name, *args, **kwargs)

    monkeypatch.setattr(cb, "_launch", recording_launch)
    return launched
