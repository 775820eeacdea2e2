"""The launch side of vLLM's flags, read without starting a server: --override-generation-config
merged as vLLM merges it, the API key from --api-key / VT_API_KEY / VLLM_API_KEY, --tokenizer's
folder, the CORS, response-role and logging flags as they reach the routes' options, and the
no-ops' notes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from vt.http.cors import CorsPolicy
from vt.launch.cli import build_parser
from vt.launch.serve import api_keys
from vt.launch.vllm_flags import FlagError, api_options, check_model_flags, sampling_defaults, tokenizer_dir
from vt.model.make_model import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = make_model(tmp_path_factory.mktemp("launch") / "tiny")
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.7, "top_k": 20}))
    return path


def serve_args(*flags: str):
    return build_parser().parse_args(["serve", "m", *flags])


# --- --override-generation-config ----------------------------------------------------------------

def test_overrides_are_merged_over_the_checkpoints_defaults(model):
    defaults, notes = sampling_defaults("auto", model, {"temperature": 0.2, "max_new_tokens": 64})
    assert dict(defaults.values) == {"temperature": 0.2, "top_k": 20, "max_tokens": 64}
    assert defaults.source == f"{model / 'generation_config.json'} and --override-generation-config"
    assert notes == []


def test_overrides_apply_with_generation_config_vllm_and_a_null_removes_a_default(model):
    defaults, _ = sampling_defaults("vllm", model, {"top_p": 0.9})
    assert dict(defaults.values) == {"top_p": 0.9} and defaults.source == "--override-generation-config"
    defaults, _ = sampling_defaults("auto", model, {"top_k": None})
    assert dict(defaults.values) == {"temperature": 0.7}
    # a value transformers defaults to still counts when the override gives it (vLLM filters only the file)
    defaults, _ = sampling_defaults("auto", model, {"top_k": 50})
    assert defaults.values["top_k"] == 50


def test_keys_vllm_ignores_are_ignored_and_named(model):
    defaults, notes = sampling_defaults("auto", model, {"do_sample": True, "temperature": 0.5})
    assert defaults.values["temperature"] == 0.5 and "do_sample" not in defaults.values
    assert len(notes) == 1 and "do_sample ignored" in notes[0]


def test_a_bad_override_value_is_a_flag_error(model):
    with pytest.raises(FlagError, match="--override-generation-config: temperature must be >= 0"):
        sampling_defaults("auto", model, {"temperature": -1})


# --- API keys ------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, env, keys, source", [
    (None, {}, (), None),
    (None, {"VLLM_API_KEY": "v"}, ("v",), "VLLM_API_KEY"),
    (None, {"VLLM_API_KEY": "v", "VT_API_KEY": "t"}, ("t",), "VT_API_KEY"),
    (["a", "b"], {"VLLM_API_KEY": "v"}, ("a", "b"), "--api-key"),
    (None, {"VLLM_API_KEY": ""}, (), None),
])
def test_the_api_key_comes_from_the_flag_then_vt_then_vllm_variable(flag, env, keys, source):
    assert api_keys(flag, env) == (keys, source)


def test_api_key_takes_several_keys_as_vllm():
    assert serve_args("--api-key", "a", "b").api_key == ["a", "b"]


# --- --tokenizer -----------------------------------------------------------------------------------

def test_tokenizer_names_a_folder_with_a_tokenizer_json(model, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    with pytest.raises(FlagError, match="no tokenizer.json in"):
        tokenizer_dir(str(folder))
    shutil.copy(model / "tokenizer.json", folder)
    assert tokenizer_dir(str(folder)) == folder
    with pytest.raises(FlagError, match="--tokenizer Org/missing"):
        tokenizer_dir("Org/missing")


# --- flags into the routes' options -----------------------------------------------------------------

def test_serve_flags_reach_the_routes_options(model):
    args = serve_args("--response-role", "bot", "--return-tokens-as-token-ids", "--enable-log-requests",
                      "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET", "POST"]',
                      "--allowed-headers", '["x-token"]', "--allow-credentials")
    options = api_options(args, model, ())
    assert (options.response_role, options.return_tokens_as_token_ids) == ("bot", True)
    assert options.request_log_level == logging.INFO and options.log_requests
    assert options.cors == CorsPolicy(("https://a.example",), ("GET", "POST"), ("x-token",), True)


def test_vllm_defaults_allow_any_origin_and_log_requests_at_debug(model):
    options = api_options(serve_args(), model, ())
    assert options.cors == CorsPolicy(("*",), ("*",), ("*",), False)
    assert options.request_log_level == logging.DEBUG and options.response_role == "assistant"
    assert not options.return_tokens_as_token_ids


def test_no_ops_are_accepted_with_a_note_each():
    notes = check_model_flags(serve_args("--swap-space", "4", "--max-seq-len-to-capture", "8192", "-pp", "1",
                                         "-dp", "1", "--load-format", "safetensors"))
    joined = "\n".join(notes)
    for flag in ("--swap-space", "--max-seq-len-to-capture", "--pipeline-parallel-size 1",
                 "--data-parallel-size 1", "--load-format safetensors"):
        assert flag in joined
    assert check_model_flags(serve_args()) == []  # nothing given, nothing noted
