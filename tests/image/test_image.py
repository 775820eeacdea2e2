"""The container image, built from the Dockerfile as it is and run on the CPU (a Debian rootfs stands in
for the CUDA base): a mounted checkpoint is served with extra flags after the image name, through the
`openai` client, as an unprivileged user; the image's healthcheck follows /health; SIGTERM drains an
in-flight stream; with no model named the container serves the mount, says so loudly when it falls back
to the demo model, and refuses a mount it cannot read as one checkpoint.

The image is built once a session (podman's layer cache and the base image carry over between
sessions on one machine). Where podman cannot be had, the tests skip, except under CI."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.image.podman import Container, Podman, Unavailable, ensure_tools
from vt.llm import LLM
from vt.model.make_model import make_model
from vt.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[2]
IMAGE = "localhost/vt-test:latest"
IMAGE_UID = 10001  # the Dockerfile's `vt` user
PROMPT = "The quick brown fox"


@pytest.fixture(scope="session")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Podman]:
    work = tmp_path_factory.mktemp("podman")
    try:
        ensure_tools()
        pm = Podman(work)
        base = pm.ensure_base(work)
        pm.check_runs(base)
    except Unavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the image tests: {exc}")
        pytest.skip(str(exc))
    pm.build(REPO_ROOT, base, IMAGE, work / "build.log")
    pm.create_network()
    yield pm
    pm.remove_network()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random checkpoint, its weights seeded apart from the demo model's."""
    path = make_model(tmp_path_factory.mktemp("ckpt") / "tiny", preset="tiny", seed=7)
    # the image runs as uid 10001: the folder and its files must be readable by others
    for p in (path.parent, path, *path.iterdir()):
        p.chmod(0o755 if p.is_dir() else 0o644)
    return path


@pytest.fixture
def start(podman: Podman) -> Iterator:
    started: list[Container] = []

    def _start(args: list[str], volumes: dict[Path, str] | None = None) -> Container:
        name = f"vt-test-{os.getpid()}-{len(started)}-{os.urandom(3).hex()}"
        c = podman.start(IMAGE, name, args, volumes)
        started.append(c)
        return c

    yield _start
    for c in started:
        print(f"---- {c.name} ----\n{c.logs()}")  # shown when the test fails
        c.remove()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def host_tokens(model: Path, max_tokens: int) -> list[int]:
    """Greedy tokens from the same checkpoint, run here by the repository's code."""
    with LLM(str(model), device="cpu") as llm:
        return llm.generate([PROMPT], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].token_ids


def health_status(url: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_serves_the_mounted_model_with_extra_flags(start, checkpoint: Path) -> None:
    # the reported bug: flags after the image name replaced the model and the demo was served, silently
    c = start(["--max-model-len", "512", "--max-num-seqs", "4"], {checkpoint: "/models"})
    url = c.wait_healthy()
    assert "serving the checkpoint mounted at /models" in c.logs()
    [model] = client(url).models.list().data
    assert model.id == "/models"
    assert model.model_extra["max_model_len"] == 512  # the extra flag took effect
    out = client(url).completions.create(model="/models", prompt=PROMPT, max_tokens=12, temperature=0,
                                         logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    served = [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]
    assert served == host_tokens(checkpoint, 12)
    assert out.usage.completion_tokens == 12
    # the limit came from the flag, not the checkpoint's 2048
    with pytest.raises(openai.BadRequestError):
        client(url).completions.create(model="/models", prompt=PROMPT, max_tokens=600)


def test_model_as_first_argument_and_unprivileged_user(start, checkpoint: Path) -> None:
    c = start(["/models", "--served-model-name", "tiny"], {checkpoint: "/models"})
    url = c.wait_healthy()
    assert [m.id for m in client(url).models.list().data] == ["tiny"]
    chat = client(url).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=5)
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    # the server (PID 1) runs as the image's user, not root
    status = c.podman("exec", c.name, "cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert set(uids) == {str(IMAGE_UID)}, status
    assert c.podman("exec", c.name, "id", "-u").stdout.strip() == str(IMAGE_UID)


def test_healthcheck_and_sigterm_drain(start, checkpoint: Path) -> None:
    c = start(["--shutdown-timeout", "120"], {checkpoint: "/models"})
    url = c.wait_healthy()
    health = c.inspect()["Config"].get("Healthcheck") or {}
    assert health.get("Test", [""])[0] == "CMD", f"the image has no HEALTHCHECK: {health}"
    assert c.podman("healthcheck", "run", c.name, check=False).returncode == 0, c.logs()

    max_tokens = 2000  # seconds of decoding on the CPU: the stream is still running when SIGTERM lands
    stream = client(url).completions.create(model="/models", prompt=PROMPT, max_tokens=max_tokens,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    c.podman("kill", "--signal", "TERM", c.name)
    # draining: /health and the image's healthcheck say unhealthy, new requests are turned away
    assert health_status(url) == 503
    check = c.podman("healthcheck", "run", c.name, check=False)
    assert check.returncode != 0, check.stdout + check.stderr
    with pytest.raises(openai.APIStatusError) as refused:
        client(url).completions.create(model="/models", prompt=PROMPT, max_tokens=2)
    assert refused.value.status_code == 503
    rest = list(chunks)
    assert c.running() or rest, "the stream ended before the checks ran: lengthen it"
    finishes = [ch.choices[0].finish_reason for ch in rest if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["length"]
    assert rest[-1].usage.completion_tokens == max_tokens
    assert c.wait_exit(timeout=60) == 0, c.logs()
    assert "shutting down" in c.logs()


def test_no_model_and_nothing_mounted_serves_the_demo_loudly(start) -> None:
    c = start([])
    url = c.wait_healthy()
    logs = c.logs()
    assert "WARNING" in logs and "DEMO model" in logs, logs
    assert [m.id for m in client(url).models.list().data] == ["demo-tiny"]


def test_a_mount_that_is_not_one_checkpoint_is_refused(start, checkpoint: Path) -> None:
    # the parent folder mounted: the checkpoint sits one level down and must be named
    c = start(["--max-num-seqs", "4"], {checkpoint.parent: "/models"})
    assert c.wait_exit(timeout=60) != 0
    logs = c.logs()
    assert f"/models/{checkpoint.name}" in logs and "Traceback" not in logs, logs


def test_the_image_reports_the_repository_version(podman: Podman) -> None:
    from vt import __version__

    done = podman("run", "--rm", "--network=none", "--entrypoint", "vt", IMAGE, "--version")
    assert done.stdout.strip() == f"vt {__version__}"

