"""The command line a vLLM user brings: `vt`, `vt --version`, every `vt serve` flag documented with
its default, and vLLM's launch flags honoured, accepted or refused with a clear message."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vt import __version__
from vt.launch.cli import _model_names, build_parser
from vt.model.make_model import make_model

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "templates" / "qwen3_like.jinja"


def vt(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "vt", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "100", **(env or {})})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("m") / "tiny")


def test_vt_alone_prints_help_and_version_prints_the_version():
    alone = vt()
    assert alone.returncode == 0 and "usage: vt" in alone.stdout and "serve" in alone.stdout
    version = vt("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"vt {__version__}"


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command", ["serve", "generate", "make-model"])
def test_every_flag_has_help_that_shows_its_default(command):
    help_text = vt(command, "--help").stdout
    # one entry per option: from its "  -x/--flag" line to the next one
    entries = re.split(r"\n  (?=-)", help_text.split("options:", 1)[1])[1:]
    flags = [a for a in _subparser(command)._actions if a.option_strings and a.dest != "help"]
    assert len(entries) == len(flags) + 1  # + -h
    for entry in entries:
        if entry.startswith("-h,"):
            continue
        words = " ".join(entry.split())
        flag = words.split()[0]
        assert re.search(r"\(default[ :]", words), f"{flag}: {words}"
        assert len(re.split(r"\(default[ :]", words)[0].split()) > 2, f"{flag} has no help text"


@pytest.mark.parametrize("args, needle", [
    (("--dtype", "float16"), "vt runs bfloat16 weights; use --dtype auto or bfloat16"),
    (("--dtype", "int4"), "unknown dtype"),
    (("--tensor-parallel-size", "0"), "--tensor-parallel-size must be at least 1"),
    (("-tp", "3"), "--tensor-parallel-size 3 cannot split this model: its 4 attention heads"),
    (("--device", "cuda", "-tp", "2"), "the CUDA backend drives one GPU for now"),
    (("--max-logprobs", "21"), "--max-logprobs must be in [0, 20]"),
    (("--generation-config", "/no/such/folder"), "expected auto, vllm or a folder"),
    (("--chat-template", "/no/such/template.jinja"), "looks like a file path"),
    (("--chat-template", "{% for %}"), "does not compile"),
    (("--reasoning-parser", "deepseek_r1"), "vt has the parsers qwen3"),
    (("--tool-call-parser", "mistral"), "vt has the parsers hermes"),
    (("--enable-auto-tool-choice",), "--enable-auto-tool-choice needs --tool-call-parser"),
    (("--reasoning-parser", "qwen3"), "needs the tokens <think> and </think> in the model's tokenizer"),
    # a KV cache or a step that could never hold one request of --max-model-len
    (("--num-gpu-blocks", "24", "--block-size", "16", "--max-model-len", "1024"),
     "lower --max-model-len to at most 384, or raise --num-gpu-blocks to at least 64"),
    (("--no-enable-chunked-prefill", "--max-num-batched-tokens", "512", "--max-model-len", "1024"),
     "--max-num-batched-tokens 512 is less than --max-model-len 1024"),
    (("--prefill-pacing", "--no-enable-chunked-prefill"),
     "--prefill-pacing spreads prompts over several steps"),
])
def test_launch_flags_vt_cannot_honour_fail_with_a_message(model, args, needle):
    r = vt("serve", str(model), "--device", "cpu", *args)
    assert r.returncode != 0
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_a_model_swallowed_by_served_model_name_is_an_error_not_the_demo(model):
    r = vt("serve", "--served-model-name", "chat", str(model), "--device", "cpu")
    assert r.returncode == 2 and "put MODEL before --served-model-name" in r.stderr


def test_a_hugging_face_id_missing_from_the_cache_says_so(tmp_path):
    r = vt("serve", "Qwen/Qwen3-8B", "--device", "cpu", env={"HF_HUB_CACHE": str(tmp_path)})
    assert r.returncode == 1
    assert "not in the Hugging Face cache" in r.stderr and "never downloads" in r.stderr
    assert str(tmp_path / "models--Qwen--Qwen3-8B") in r.stderr and "Traceback" not in r.stderr


def test_vllm_flags_parse_with_their_defaults():
    args = build_parser().parse_args(["serve", "m"])
    assert (args.dtype, args.tensor_parallel_size, args.trust_remote_code, args.seed) == ("auto", 1, False, 0)
    assert (args.generation_config, args.max_logprobs, args.chat_template) == ("auto", 20, None)
    assert not args.disable_log_stats and not args.disable_log_requests and args.log_level == "info"
    args = build_parser().parse_args(["serve", "--served-model-name", "a", "b", "--", "m"])
    assert args.served_model_name == ["a", "b"]


def test_disable_cascade_attn_reaches_the_engine_config(model):
    from vt.launch.cli import _engine_config

    on = _engine_config(build_parser().parse_args(["serve", str(model)]))
    off = _engine_config(build_parser().parse_args(["serve", str(model), "--disable-cascade-attn"]))
    assert (on.disable_cascade_attn, off.disable_cascade_attn) == (False, True)


@pytest.mark.parametrize("served, model_arg, names", [
    (None, "/models/Qwen3-8B", ("/models/Qwen3-8B", ("Qwen3-8B",))),
    (None, "Qwen/Qwen3-8B", ("Qwen/Qwen3-8B", ("Qwen3-8B",))),
    (None, "tiny", ("tiny", ())),
    (None, None, ("demo-tiny", ())),
    (["chat", "alias"], "/models/Qwen3-8B", ("chat", ("alias",))),
])
def test_served_model_name_defaults_to_the_model_argument(served, model_arg, names):
    assert _model_names(served, model_arg, "/cache/demo-tiny") == names


@pytest.mark.parametrize("args, needle", [
    (("--no-such-flag",), "unrecognized arguments: --no-such-flag"),
    (("--load-format", "pt"), "--load-format pt: vt reads safetensors weights only"),
    (("--load-format", "dummy"), "vt make-model"),
    (("--load-format", "tensorizer"), "--load-format tensorizer: vt reads safetensors weights only"),
    (("--pipeline-parallel-size", "2"), "--pipeline-parallel-size 2: vt serves one replica"),
    (("-dp", "2"), "--data-parallel-size 2: vt serves one replica"),
    (("-pp", "0"), "--pipeline-parallel-size must be at least 1"),
    (("--swap-space", "-1"), "--swap-space must be >= 0"),
    (("--allowed-origins", "*"), "expected a JSON list of strings"),
    (("--override-generation-config", "[1]"), "expected a JSON object"),
    (("--override-generation-config", '{"temperature": -1}'), "temperature must be >= 0"),
    (("--enable-log-requests", "--disable-log-requests"), "contradict each other"),
    (("--tokenizer", "/no/such/tokenizer"), "--tokenizer /no/such/tokenizer"),
    (("--uvicorn-log-level", "loud"), "invalid choice: 'loud'"),
    (("--response-role", ""), "--response-role must not be empty"),
    (("--dtype", "float16"), "vt runs bfloat16 weights"),
])
def test_refused_and_unknown_flags_print_vt_serves_usage_and_the_reason(model, args, needle):
    r = vt("serve", str(model), "--device", "cpu", *args)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("usage: vt serve") and "usage: vt [-h]" not in r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_several_api_keys_before_the_model_are_refused_not_read_as_the_model():
    r = vt("serve", "--api-key", "k1", "/models/x", "--device", "cpu")
    assert r.returncode == 2 and "put MODEL before --api-key" in r.stderr


def test_vllm_frontend_flags_parse_with_vllms_defaults():
    args = build_parser().parse_args(["serve", "m"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers) == (["*"], ["*"], ["*"])
    assert not args.allow_credentials and not args.return_tokens_as_token_ids
    assert args.response_role == "assistant"
    assert (args.load_format, args.tokenizer, args.disable_uvicorn_access_log) == ("auto", None, False)
    args = build_parser().parse_args(["serve", "m", "--allowed-origins", '["https://a.example"]',
                                      "--override-generation-config", '{"top_k": 5}', "-pp", "1", "-dp", "1"])
    assert args.allowed_origins == ["https://a.example"] and args.override_generation_config == {"top_k": 5}
    assert (args.pipeline_parallel_size, args.data_parallel_size) == (1, 1)
