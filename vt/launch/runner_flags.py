"""vLLM's flags that choose what a server runs: `--runner`, `--convert` and the older `--task`.

A server runs one runner. `generate` serves the completion and chat routes; `pooling` serves an
embedding model on /v1/embeddings (vt.model.pooling). `--runner auto` (the default) picks as
vLLM does from the checkpoint: pooling for sentence-transformers files (modules.json with a
Pooling module) or a bare base model (`Qwen3Model`), generate otherwise. `--convert embed` turns
a decoder into an embedding model (last-token pooling, normalized): the pooling runner.
`--task embed` (or `embedding`) is vLLM's deprecated spelling of the same, `--task generate` of
`--runner generate`. What vt does not run (classification, reward and scoring models, draft
runners) is a FlagError naming the flag.
"""

from __future__ import annotations

import argparse

from vt.launch.vllm_flags import FlagError

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")
TASKS = ("auto", "generate", "embed", "embedding")
# vLLM's other values, and why vt refuses them
_REFUSED = {
    "draft": "vt runs no draft (speculative decoding) models",
    "classify": "vt serves no classification models",
    "score": "vt serves no scoring (cross-encoder) models",
    "reward": "vt serves no reward models",
    "transcription": "vt serves no speech-to-text models",
}


def add_runner_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runner", default="auto", metavar="{auto,generate,pooling}",
                   help="generate: the completion and chat routes; pooling: an embedding model on "
                        "/v1/embeddings; auto: pooling for a checkpoint with sentence-transformers "
                        "pooling (modules.json) or a bare base model (e.g. Qwen3Model), else generate")
    p.add_argument("--convert", default="auto", metavar="{auto,none,embed}",
                   help="embed: serve a decoder as an embedding model (last-token pooling, normalized), "
                        "as --runner pooling does; none: as it is")
    p.add_argument("--task", default=None, metavar="{auto,generate,embed}",
                   help="vLLM's older spelling: embed (or embedding) is --runner pooling, generate is "
                        "--runner generate (default: none)")


def _refuse(flag: str, value: str, known: tuple[str, ...]) -> None:
    if value in known:
        return
    why = _REFUSED.get(value, f"unknown value; expected one of {', '.join(known)}")
    raise FlagError(f"{flag} {value}: {why}")


def runner_from_flags(args: argparse.Namespace) -> str:
    """EngineConfig.runner from --runner, --convert and --task: auto, generate or pooling; a
    FlagError where they ask for what vt cannot run or contradict each other."""
    runner, convert, task = args.runner, args.convert, args.task
    _refuse("--runner", runner, RUNNERS)
    _refuse("--convert", convert, CONVERTS)
    if task is not None:
        _refuse("--task", task, TASKS)
    wanted = {"generate": "generate", "embed": "pooling", "embedding": "pooling"}.get(task or "auto")
    if convert == "embed":
        if wanted == "generate":
            raise FlagError("--convert embed makes an embedding model, which --task generate contradicts")
        wanted = "pooling"
    if wanted is not None and runner not in ("auto", wanted):
        given = f"--task {task}" if task not in (None, "auto") else f"--convert {convert}"
        raise FlagError(f"--runner {runner} contradicts {given} (which runs --runner {wanted}); give one")
    runner = wanted or runner
    if convert == "none" and runner == "pooling":
        raise FlagError("--convert none with --runner pooling: vt serves a decoder as an embedding model "
                        "by converting it (--convert embed, the pooling runner's default)")
    return runner
