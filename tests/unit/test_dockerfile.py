"""The Dockerfile must stay in step with the CLI: every flag it passes is one `vt serve` knows,
its ports agree, it runs as a non-root user, and what follows the image name in `docker run` is
appended to `vt serve` without losing the mounted model. tests/image builds and runs it for real."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from vt import __version__
from vt.launch.cli import build_parser, main
from vt.launch.model_volume import ENV as VOLUME_ENV
from vt.launch.model_volume import model_from_volume

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


def env_values(stage: list[tuple[str, str]]) -> dict[str, str]:
    """The final stage's ENV settings (KEY=VALUE form)."""
    values: dict[str, str] = {}
    for word, rest in stage:
        if word == "ENV":
            values.update(item.split("=", 1) for item in shlex.split(rest))
    return values


@pytest.fixture(scope="module")
def serve_argv(stage: list[tuple[str, str]]) -> list[str]:
    entry = exec_form(only(stage, "ENTRYPOINT"), "ENTRYPOINT")
    assert entry[:2] == ["vt", "serve"], f"ENTRYPOINT must run `vt serve`, got {entry}"
    # a CMD would be replaced by the first word after the image name: flags there once dropped
    # `--model /models` and the demo model was served instead of the mounted one
    assert not [w for w, _ in stage if w == "CMD"], "the model comes after the image name, not from CMD"
    return entry[2:]


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
    assert args.model is None and args.model_pos is None  # the model comes after the image name
    volumes = only(stage, "VOLUME")
    volumes = exec_form(volumes, "VOLUME") if volumes.startswith("[") else volumes.split()
    assert env_values(stage).get(VOLUME_ENV) in volumes, f"{VOLUME_ENV} must name the model volume"


@pytest.fixture(scope="module")
def volume(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model volume holding a checkpoint at its top, and a second one in a subfolder."""
    from vt.model.make_model import make_model

    root = tmp_path_factory.mktemp("models")
    make_model(root, preset="tiny", seed=1)
    make_model(root / "b", preset="tiny", seed=2)
    return root


@pytest.mark.parametrize("after_image, model, name", [
    (["--max-num-seqs", "128"], "", "VOLUME"),              # flags only: the mounted checkpoint
    (["VOLUME/b", "--max-num-seqs", "128"], "b", "VOLUME/b"),   # the model first, as with vLLM's image
    (["--model", "VOLUME/b", "--max-num-seqs", "128"], "b", "VOLUME/b"),
    (["--max-num-seqs", "128", "VOLUME/b", "--served-model-name", "x"], "b", "x"),
])
def test_what_follows_the_image_name(serve_argv: list[str], volume: Path, monkeypatch: pytest.MonkeyPatch,
                                     after_image: list[str], model: str, name: str) -> None:
    """`docker run IMAGE ARGS...` runs ENTRYPOINT + ARGS: what vt serve would serve, and as what."""
    import vt.launch.serve

    served: dict = {}

    def fake_run_server(cfg, host, port, served_model_name, *args, **kwargs) -> int:
        served.update(model=cfg.model, name=served_model_name, host=host, seqs=cfg.max_num_seqs)
        return 0

    monkeypatch.setattr(vt.launch.serve, "run_server", fake_run_server)
    monkeypatch.setenv(VOLUME_ENV, str(volume))
    argv = [a.replace("VOLUME", str(volume)) for a in after_image]
    assert main(["serve", *serve_argv, *argv, "--device", "cpu"]) == 0
    assert Path(served["model"]) == volume / model
    assert served["name"] == name.replace("VOLUME", str(volume))
    assert served["seqs"] == 128 and served["host"] == "0.0.0.0"


def test_volume_with_a_checkpoint_is_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv(VOLUME_ENV, str(tmp_path))
    model, note = model_from_volume()
    assert model == str(tmp_path) and note and str(tmp_path) in note


@pytest.mark.parametrize("content", [[], ["lost+found/"], [".cache/"]])
def test_empty_volume_falls_back_to_the_demo_with_a_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            content: list[str]) -> None:
    for name in content:
        (tmp_path / name).mkdir()
    monkeypatch.setenv(VOLUME_ENV, str(tmp_path))
    model, note = model_from_volume()
    assert model is None and "DEMO" in note and str(tmp_path) in note


def test_no_volume_outside_the_image(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VOLUME_ENV, raising=False)
    assert model_from_volume() == (None, None)


@pytest.mark.parametrize("layout, named", [
    (["a/config.json", "b/config.json"], ["a", "b"]),   # a folder of checkpoints: name one
    (["notes.txt"], []),
])
def test_volume_holding_something_else_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str], layout: list[str],
                                                  named: list[str]) -> None:
    for rel in layout:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    monkeypatch.setenv(VOLUME_ENV, str(tmp_path))
    assert main(["serve", "--max-num-seqs", "128", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vt: error: ") and "Traceback" not in err
    assert "config.json" in err and "--model" in err
    for name in named:
        assert str(tmp_path / name) in err


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
    # the base is a build argument (CI builds on a Debian rootfs); the CUDA 12 runtime is its default
    args = dict(rest.split("=", 1) for word, rest in instr if word == "ARG" and "=" in rest)
    bases = [rest.split()[0] for word, rest in instr if word == "FROM"]
    bases = [args.get(b[2:-1], b) if b.startswith("${") else b for b in bases]
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


def test_readme_wheel_is_the_one_pip_wheel_builds() -> None:
    # vt-serve is not on the package index: the README's install line names the wheel a clone builds
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'vt-serve" not in readme
    assert f"vt_serve-{__version__}-py3-none-any.whl" in readme
