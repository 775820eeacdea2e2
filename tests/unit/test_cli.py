"""The README's CLI commands: make-model, generate --json, and clear errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def vt(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vt", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("m") / "tiny"
    r = vt("make-model", str(out), "--preset", "tiny")
    assert r.returncode == 0, r.stderr
    return out


def test_generate_json_is_greedy_and_reproducible(model: Path) -> None:
    runs = [vt("generate", "--model", str(model), "--prompt", "Hello world", "--max-tokens", "12", "--json",
               "--device", "cpu") for _ in range(2)]
    outs = [json.loads(r.stdout) for r in runs]
    assert outs[0] == outs[1]
    assert set(outs[0]) == {"prompt_token_ids", "token_ids", "text", "finish_reason"}
    assert len(outs[0]["token_ids"]) == 12 and outs[0]["finish_reason"] == "length"


@pytest.mark.parametrize("args, needle", [
    (("serve", "--model", "/nonexistent/model"), "not a checkpoint folder"),
    (("serve", "--max-connections", "0"), "max_connections"),
    (("serve", "--max-num-seqs", "0"), "--max-num-seqs must be at least 1"),
    (("generate", "--prompt", "x", "--max-tokens", "0"), "max_tokens"),
    (("serve", "--scheduling-policy", "lifo"), "invalid choice"),
    (("serve", "--port", "99999"), "--port must be in [0, 65535]"),
    (("serve", "--port", "-1"), "--port must be in [0, 65535]"),
    (("serve", "--shutdown-timeout", "-5"), "--shutdown-timeout must be >= 0"),
])
def test_bad_input_is_a_message_and_nonzero_exit(args: tuple[str, ...], needle: str) -> None:
    r = vt(*args)
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr
