"""Which kernels a CUDA backend launches: tests that check a path was taken record them."""

from __future__ import annotations

from typing import Any


def record_launches(cb: Any, monkeypatch: Any) -> list[str]:
    """The names of the kernels `cb` launches (through `_launch`, or `_launch_after` as a
    programmatic dependent) from now on, in order (the recording ends with the test, as
    monkeypatch undoes it)."""
    launched: list[str] = []
    launch, launch_after = cb._launch, cb._launch_after

    def recording_launch(name: str, *args: Any, **kwargs: Any) -> None:
        launched.append(name)
        launch(name, *args, **kwargs)

    def recording_launch_after(name: str, *args: Any, **kwargs: Any) -> None:
        if cb._dependent is not None:  # else _launch_after goes through _launch, recorded there
            launched.append(name)
        launch_after(name, *args, **kwargs)

    monkeypatch.setattr(cb, "_launch", recording_launch)
    monkeypatch.setattr(cb, "_launch_after", recording_launch_after)
    return launched
