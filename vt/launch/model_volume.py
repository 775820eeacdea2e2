"""The model `vt serve` serves when none is named, inside the image: the checkpoint mounted at the
folder VT_MODEL_VOLUME names (/models in the Dockerfile), else the demo model, said loudly."""

from __future__ import annotations

import os
from pathlib import Path

ENV = "VT_MODEL_VOLUME"
# a fresh ext4 volume (a PersistentVolume, a disk) holds lost+found: that is still an empty volume
_NOT_CONTENT = {"lost+found"}


def model_from_volume() -> tuple[str | None, str | None]:
    """(model, note): the volume's folder when it holds a checkpoint (config.json); None (the demo
    model) and a warning to log when the volume is empty or missing; (None, None) outside the image.
    ValueError when the volume holds something else, so that a mounted model is never passed over."""
    volume = os.environ.get(ENV)
    if not volume:
        return None, None
    path = Path(volume)
    if (path / "config.json").is_file():
        return volume, f"no model named: serving the checkpoint mounted at {volume}"
    entries = sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.name not in _NOT_CONTENT) \
        if path.is_dir() else []
    if not entries:
        return None, (f"no model named and nothing mounted at {volume}: serving the built-in DEMO model "
                      "(random weights, its answers are noise). Mount a checkpoint folder at "
                      f"{volume} (-v /path/to/checkpoint:{volume}) or name one as the first argument")
    found = [str(p) for p in entries if (p / "config.json").is_file()]
    hint = f"name one of {', '.join(found)}" if found else "name the checkpoint folder"
    raise ValueError(f"no model named and {volume} holds no config.json at its top; {hint} as the first "
                     f"argument (e.g. `{found[0] if found else volume + '/<folder>'} --max-num-seqs 128`) "
                     "or with --model")
