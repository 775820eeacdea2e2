"""--generation-config: the checkpoint's generation_config.json sampling values, as vLLM reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vt.model.generation_config import SamplingDefaults, load_sampling_defaults
from vt.sampling_params import SamplingParams

QWEN3 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
         "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}


def write(folder: Path, data: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(data))
    return folder


def test_auto_reads_the_model_folder(tmp_path):
    d = load_sampling_defaults("auto", write(tmp_path, {**QWEN3, "min_p": 0.05, "max_new_tokens": 100}))
    assert dict(d.values) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                              "max_tokens": 100}
    assert d.source == str(tmp_path / "generation_config.json")


def test_values_equal_to_transformers_defaults_set_nothing(tmp_path):
    d = load_sampling_defaults("auto", write(tmp_path, {"temperature": 1.0, "top_k": 50, "top_p": 1.0,
                                                        "repetition_penalty": 1.0, "do_sample": True}))
    assert not d.values


def test_vllm_ignores_the_file_and_auto_without_a_file_is_empty(tmp_path):
    assert not load_sampling_defaults("vllm", write(tmp_path / "m", QWEN3)).values
    assert not load_sampling_defaults("auto", tmp_path / "empty").values


def test_a_folder_setting_reads_that_folder(tmp_path):
    other = write(tmp_path / "other", {"temperature": 0.3})
    d = load_sampling_defaults(str(other), write(tmp_path / "m", QWEN3))
    assert dict(d.values) == {"temperature": 0.3}


@pytest.mark.parametrize("setting, data, needle", [
    ("missing-folder", None, "expected auto, vllm or a folder"),
    ("auto", {"temperature": -1}, "temperature must be >= 0"),
    ("auto", {"top_p": 2}, "top_p must be in (0, 1]"),
    ("auto", [1, 2], "JSON object"),
    ("auto", "{not json", "cannot be read as JSON"),
])
def test_bad_settings_and_files_are_clear_errors(tmp_path, setting, data, needle):
    if data is not None:
        (tmp_path / "generation_config.json").write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(ValueError) as info:
        load_sampling_defaults(str(tmp_path / setting) if setting != "auto" else "auto", tmp_path)
    assert needle in str(info.value)


def test_apply_fills_unset_fields_and_caps_max_tokens():
    d = SamplingDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 10})
    given = {"top_k"}
    out = d.apply(SamplingParams(temperature=1.0, top_k=3, max_tokens=50), given.__contains__)
    assert (out.temperature, out.top_k, out.max_tokens) == (0.6, 3, 10)
    out = d.apply(SamplingParams(max_tokens=None), lambda name: False)
    assert out.max_tokens == 10
    assert d.apply(SamplingParams(max_tokens=4), lambda name: True).max_tokens == 4
