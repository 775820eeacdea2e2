"""A --model argument resolves to a checkpoint folder or a snapshot in the local Hugging Face cache,
never the network; when absent, the error says where it looked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vt.model.locate import hub_cache_dir, resolve_model


def cached(hub: Path, repo_id: str, commit: str, ref: str | None = "main") -> Path:
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def test_hub_cache_dir_follows_huggingface_hub_variables(tmp_path):
    assert hub_cache_dir({"HF_HUB_CACHE": str(tmp_path / "c")}) == tmp_path / "c"
    assert hub_cache_dir({"HF_HOME": str(tmp_path / "h")}) == tmp_path / "h" / "hub"
    assert hub_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "huggingface" / "hub"
    assert hub_cache_dir({}) == Path.home() / ".cache" / "huggingface" / "hub"


def test_a_hugging_face_id_resolves_to_its_cached_snapshot(tmp_path):
    env = {"HF_HOME": str(tmp_path)}
    main = cached(tmp_path / "hub", "Qwen/Qwen3-8B", "abc123")
    cached(tmp_path / "hub", "Qwen/Qwen3-8B", "def456", ref="v2")
    assert resolve_model("Qwen/Qwen3-8B", env=env) == main
    assert resolve_model("Qwen/Qwen3-8B", revision="v2", env=env).name == "def456"
    assert resolve_model("Qwen/Qwen3-8B", revision="abc123", env=env) == main


def test_without_refs_the_newest_snapshot_is_served(tmp_path):
    old = cached(tmp_path, "org/m", "old", ref=None)
    new = cached(tmp_path, "org/m", "new", ref=None)
    os.utime(old, (1, 1))
    assert resolve_model("org/m", env={"HF_HUB_CACHE": str(tmp_path)}) == new


def test_a_local_folder_wins_over_the_cache(tmp_path, monkeypatch):
    local = tmp_path / "org" / "m"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/m", env={"HF_HUB_CACHE": str(tmp_path / "hub")}) == Path("org/m")


@pytest.mark.parametrize("model, needle", [
    ("Qwen/Qwen3-8B", "not in the Hugging Face cache"),
    ("/no/such/folder", "not a checkpoint folder"),
    ("./relative/folder", "not a checkpoint folder"),
])
def test_absent_models_name_what_was_looked_for(tmp_path, model, needle):
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(model, env={"HF_HUB_CACHE": str(tmp_path)})
    message = str(info.value)
    assert needle in message
    if "cache" in needle:
        assert str(tmp_path / "models--Qwen--Qwen3-8B") in message and "never downloads" in message


def test_an_incomplete_snapshot_is_reported(tmp_path):
    snap = cached(tmp_path, "org/m", "abc")
    (snap / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model("org/m", env={"HF_HUB_CACHE": str(tmp_path)})
