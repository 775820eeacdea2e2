"""vLLM's runner flags on `vt serve`: --runner, --convert and --task choose what a server runs,
and what vt cannot run is refused naming the flag."""

from __future__ import annotations

import pytest

from vt.launch.cli import build_parser, main
from vt.launch.runner_flags import runner_from_flags
from vt.launch.vllm_flags import FlagError


def runner(*flags: str) -> str:
    args, unknown = build_parser().parse_known_args(["serve", "m", *flags])
    assert not unknown
    return runner_from_flags(args)


@pytest.mark.parametrize("flags,expected", [
    ((), "auto"),
    (("--runner", "pooling"), "pooling"),
    (("--runner", "generate"), "generate"),
    (("--task", "embed"), "pooling"),
    (("--task", "embedding"), "pooling"),
    (("--task", "generate"), "generate"),
    (("--task", "auto"), "auto"),
    (("--convert", "embed"), "pooling"),
    (("--runner", "pooling", "--convert", "embed", "--task", "embed"), "pooling"),
    (("--convert", "none", "--runner", "generate"), "generate"),
])
def test_runner_flags(flags: tuple[str, ...], expected: str) -> None:
    assert runner(*flags) == expected


@pytest.mark.parametrize("flags,match", [
    (("--runner", "draft"), "--runner draft: vt runs no draft"),
    (("--task", "classify"), "--task classify: vt serves no classification models"),
    (("--task", "score"), "--task score: vt serves no scoring"),
    (("--convert", "reward"), "--convert reward: vt serves no reward models"),
    (("--runner", "bogus"), "unknown value; expected one of auto, generate, pooling"),
    (("--runner", "generate", "--task", "embed"), "--runner generate contradicts --task embed"),
    (("--runner", "generate", "--convert", "embed"), "--runner generate contradicts --convert embed"),
    (("--task", "generate", "--convert", "embed"), "--task generate"),
    (("--runner", "pooling", "--convert", "none"), "--convert none with --runner pooling"),
])
def test_what_vt_cannot_run_is_refused(flags: tuple[str, ...], match: str) -> None:
    with pytest.raises(FlagError, match=match):
        runner(*flags)


def test_a_refused_runner_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "/nonexistent-model", "--task", "reward"])
    assert e.value.code == 2
    assert "--task reward: vt serves no reward models" in capsys.readouterr().err
