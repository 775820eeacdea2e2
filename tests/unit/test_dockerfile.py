"""The Dockerfile must stay in step with the CLI: every flag it passes is one `vt serve` knows,
its ports agree, and it runs as a non-root user."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from vt.launch.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "the Dockerfile ends in a line continuation"
    return out


def final_stage(instr: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (word, _) in enumerate(instr) if word == "FROM")
    return instr[last_from:]


def exec_form(value: str, what: str) -> list[str]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        pytest.fail(f"{what} must use the JSON (exec) form so that appended flags reach vt, got {value!r}")
    assert isinstance(parsed, list) and all(isinstance(x, str) for x in parsed), what
    return parsed


def only(stage: list[tuple[str, str]], word: str) -> str:
    values = [rest for w, rest in stage if w == word]
    assert len(values) == 1, f"expected one {word} in the final stage, found {len(values)}"
    return values[0]


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


@pytest.fixture(scope="module")
def stage() -> list[tuple[str, str]]:
    return final_stage(instructions((ROOT / "Dockerfile").read_text()))


@pytest.fixture(scope="module")
def serve_argv(stage: list[tuple[str, str]]) -> list[str]:
    entry = exec_form(only(stage, "ENTRYPOINT"), "ENTRYPOINT")
    cmd = exec_form(only(stage, "CMD"), "CMD")
    assert entry[:2] == ["vt", "serve"], f"ENTRYPOINT must run `vt serve`, got {entry}"
    return entry[2:] + cmd


def test_every_flag_is_a_vt_serve_flag(serve_argv: list[str]) -> None:
    known = {s for action in serve_parser()._actions for s in action.option_strings}
    flags = [a.split("=", 1)[0] for a in serve_argv if a.startswith("-")]
    assert flags, "the image passes no flags to vt serve"
    unknown = [f for f in flags if f not in known]
    assert not unknown, f"`vt serve` does not know {unknown}"


def test_flags_parse_and_bind_all_interfaces(serve_argv: list[str], stage: list[tuple[str, str]]) -> None:
    try:
        args = serve_parser().parse_args(serve_argv)
    except SystemExit:
        pytest.fail(f"`vt serve {' '.join(serve_argv)}` does not parse")
    assert args.host == "0.0.0.0"
    assert args.model == "/models"
    volumes = only(stage, "VOLUME")
    assert "/models" in (exec_form(volumes, "VOLUME") if volumes.startswith("[") else volumes.split())


def test_ports_agree(serve_argv: list[str], stage: list[tuple[str, str]]) -> None:
    port = serve_parser().parse_args(serve_argv).port
    exposed = {int(p.split("/")[0]) for p in only(stage, "EXPOSE").split()}
    assert exposed == {port}
    health = only(stage, "HEALTHCHECK")
    m = re.search(r"https?://(?:127\.0\.0\.1|localhost):(\d+)/health\b", health)
    assert m, f"HEALTHCHECK does not probe /health on the local port: {health}"
    assert int(m.group(1)) == port
    assert "curl" not in health and "wget" not in health  # neither is in the runtime image
    assert "urllib" in health


def test_runs_as_non_root(stage: list[tuple[str, str]]) -> None:
    users = [rest for word, rest in stage if word == "USER"]
    assert users, "the final stage sets no USER: the server would run as root"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")


def test_cuda12_base_and_extra() -> None:
    instr = instructions((ROOT / "Dockerfile").read_text())
    bases = [rest.split()[0] for word, rest in instr if word == "FROM"]
    assert any(re.match(r"nvidia/cuda:12\.", b) for b in bases), bases
    assert any(word == "RUN" and re.search(r"\[(\S+,)?cuda12(,\S+)?\]", rest) for word, rest in instr)


def test_image_can_publish_kv_events() -> None:
    # deploy/kubernetes/deployment.yaml passes --kv-events-config, which needs the kv-events extra
    instr = instructions((ROOT / "Dockerfile").read_text())
    assert any(word == "RUN" and re.search(r"\[(\S+,)?kv-events(,\S+)?\]", rest) for word, rest in instr)


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")}
    for needed in (".git", "tests", ".whl", "*.whl", "**/__pycache__", ".pytest_cache", "*.json", "*.png"):
        assert needed in patterns, f".dockerignore should exclude {needed}"
    # what the build copies must not be excluded
    for kept in ("vt", "pyproject.toml", "README.md"):
        assert kept not in patterns


def test_parser_joins_continuations() -> None:
    text = "FROM a\n# note\nRUN one \\\n    two\nCMD [\"x\"]\n"
    assert instructions(text) == [("FROM", "a"), ("RUN", "one  two"), ("CMD", '["x"]')]
