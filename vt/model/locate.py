"""Where a `--model` argument points: a checkpoint folder, or a Hugging Face id found in the local
Hugging Face cache (its hub layout: models--ORG--NAME/refs and snapshots). Nothing is downloaded.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

_HF_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """The hub cache folder as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    XDG_CACHE_HOME/huggingface/hub or ~/.cache/huggingface/hub."""
    env = os.environ if env is None else env
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            return Path(env[var]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    cache = Path(env["XDG_CACHE_HOME"]).expanduser() if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return cache / "huggingface" / "hub"


def _snapshot(repo: Path, revision: str | None) -> Path | None:
    snapshots = repo / "snapshots"
    ref = repo / "refs" / (revision or "main")
    if ref.is_file():
        return snapshots / ref.read_text().strip()
    if revision is not None:
        return snapshots / revision  # a commit hash names its snapshot directly
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime) \
        if snapshots.is_dir() else []
    return found[-1] if found else None  # no refs/main: the newest snapshot


def resolve_model(model: str, revision: str | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The checkpoint folder `model` names: a folder holding config.json, or the cached snapshot of
    a Hugging Face id. Raises FileNotFoundError with what was looked for."""
    path = Path(model).expanduser()
    if path.is_dir() or not _HF_ID.match(model):
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{model!r} is not a checkpoint folder (no config.json in it)")
        return path
    cache = hub_cache_dir(env)
    repo = cache / ("models--" + model.replace("/", "--"))
    snapshot = _snapshot(repo, revision) if repo.is_dir() else None
    if snapshot is None or not snapshot.is_dir():
        what = f"revision {revision!r} of " if revision else ""
        raise FileNotFoundError(
            f"{model!r} is not a local folder, and {what}it is not in the Hugging Face cache ({repo} is "
            f"missing; the cache is HF_HUB_CACHE, or HF_HOME/hub). vt never downloads: fetch it first "
            f"(`hf download {model}`) or give a checkpoint folder")
    if not (snapshot / "config.json").is_file():
        raise FileNotFoundError(f"the cached snapshot of {model!r} ({snapshot}) has no config.json; "
                                "is the download complete?")
    return snapshot
