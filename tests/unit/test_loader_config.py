"""ModelConfig parsing and checkpoint loading: good checkpoints load, bad ones name the culprit."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from tests.unit.hf_models import make_hf_checkpoint, make_hf_model
from vt.config import ConfigError, ModelConfig
from vt.model.loader import CheckpointError, expected_shapes, load_weights
from vt.model.transformer import Transformer

BASE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 300, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "eos_token_id": [2, 5],
    "bos_token_id": None, "torch_dtype": "bfloat16",
}


def write_config(path: Path, **changes) -> Path:
    raw = dict(BASE) | changes
    for key, value in changes.items():
        if value is ...:
            del raw[key]
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3"), arch="qwen3")


def test_qwen3_config_from_transformers_checkpoint(qwen3_dir):
    cfg = ModelConfig.from_dir(qwen3_dir)
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert cfg.qk_norm and not cfg.attention_bias and not cfg.tie_word_embeddings
    assert cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and cfg.dtype == "float32"
    assert cfg.kv_bytes_per_token(2) == 2 * 2 * 2 * 16 * 2
    assert Transformer.kv_bytes_per_block(cfg, 16, 2) == 16 * cfg.kv_bytes_per_token(2)


def test_config_variants(tmp_path):
    cfg = ModelConfig.from_dir(write_config(tmp_path / "a"))
    assert cfg.rope_theta == 1e6 and cfg.eos_token_ids == (2, 5) and cfg.dtype == "bfloat16"
    cfg = ModelConfig.from_dir(write_config(tmp_path / "b", architectures=["Qwen2ForCausalLM"],
                                            rope_parameters=..., rope_theta=5.0, head_dim=...,
                                            eos_token_id=7))
    assert cfg.attention_bias and not cfg.qk_norm and cfg.rope_theta == 5.0 and cfg.head_dim == 16
    assert cfg.eos_token_ids == (7,)
    cfg = ModelConfig.from_dir(write_config(tmp_path / "c", architectures=["LlamaForCausalLM"],
                                            attention_bias=True, eos_token_id=None, torch_dtype=...,
                                            dtype="float16"))
    assert cfg.attention_bias and cfg.eos_token_ids == () and cfg.dtype == "float16"
    cfg = ModelConfig.from_dir(write_config(tmp_path / "d", architectures=["MistralForCausalLM"],
                                            sliding_window=None, torch_dtype=...))
    assert cfg.architecture == "MistralForCausalLM" and cfg.dtype == "bfloat16"


def test_llama3_rope_scaling_inv_freq(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    cfg = ModelConfig.from_dir(write_config(tmp_path, architectures=["LlamaForCausalLM"],
                                            rope_parameters=scaling | {"rope_theta": 500000.0}))
    assert cfg.rope_scaling["rope_type"] == "llama3"
    plain = 1.0 / 500000.0 ** (np.arange(0, 16, 2) / 16)
    inv = cfg.inv_freq()
    assert inv.dtype == np.float32 and inv.shape == (8,)
    wavelen = 2 * np.pi / plain
    np.testing.assert_allclose(inv[wavelen < 16], plain[wavelen < 16], rtol=1e-6)   # high freq kept
    np.testing.assert_allclose(inv[wavelen > 64], plain[wavelen > 64] / 8, rtol=1e-6)  # low freq slowed
    # The older top-level rope_scaling spelling parses the same way.
    cfg2 = ModelConfig.from_dir(write_config(tmp_path / "old", architectures=["LlamaForCausalLM"],
                                             rope_parameters=..., rope_theta=500000.0,
                                             rope_scaling={"type": "llama3"} | scaling))
    np.testing.assert_array_equal(cfg2.inv_freq(), inv)


@pytest.mark.parametrize("changes,field", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
    ({"hidden_size": ...}, "hidden_size"),
    ({"vocab_size": ...}, "vocab_size"),
    ({"num_hidden_layers": ...}, "num_hidden_layers"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"use_sliding_window": True, "sliding_window": 128}, "sliding_window"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 128}, "sliding_window"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_parameters"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"eos_token_id": "x"}, "eos_token_id"),
    ({"torch_dtype": "int8"}, "torch_dtype"),
])
def test_config_errors_name_the_field(tmp_path, changes, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dir(write_config(tmp_path, **changes))


def test_missing_or_broken_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ConfigError, match="JSON"):
        ModelConfig.from_dir(tmp_path)


def test_qwen_sliding_window_value_unused_is_accepted(tmp_path):
    cfg = ModelConfig.from_dir(write_config(tmp_path, sliding_window=4096, use_sliding_window=False))
    assert cfg.architecture == "Qwen3ForCausalLM"


def hf_state(arch: str = "qwen3", **overrides) -> dict[str, np.ndarray]:
    model = make_hf_model(arch, **overrides)
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def save_checkpoint(path: Path, state: dict[str, np.ndarray], cfg_changes=None) -> ModelConfig:
    write_config(path, **(cfg_changes or {}))
    save_file(state, str(path / "model.safetensors"))
    return ModelConfig.from_dir(path)


def test_load_weights_returns_every_expected_tensor_as_stored(qwen3_dir):
    cfg = ModelConfig.from_dir(qwen3_dir)
    weights = load_weights(qwen3_dir, cfg)
    assert set(weights) == set(expected_shapes(cfg))
    hf = {k: v.detach().numpy() for k, v in make_hf_model("qwen3").state_dict().items()}
    for name, arr in weights.items():
        assert arr.dtype == np.float32
        np.testing.assert_array_equal(arr, hf[name])


def test_missing_tensor_is_named(tmp_path):
    state = hf_state()
    del state["model.layers.1.self_attn.k_norm.weight"]
    cfg = save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_weights(tmp_path, cfg)


def test_misshaped_tensor_names_expected_and_found_shape(tmp_path):
    state = hf_state()
    state["model.layers.0.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
    cfg = save_checkpoint(tmp_path, state)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight.*\(128, 64\).*\(100, 64\)"):
        load_weights(tmp_path, cfg)


def test_untied_checkpoint_without_lm_head_fails_but_tied_with_lm_head_loads(tmp_path):
    state = hf_state()
    lm_head = state.pop("lm_head.weight")
    cfg = save_checkpoint(tmp_path / "untied", state)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_weights(tmp_path / "untied", cfg)
    state["lm_head.weight"] = lm_head
    state["model.rotary_emb.inv_freq"] = np.ones(8, np.float32)  # extra tensors are ignored
    cfg = save_checkpoint(tmp_path / "tied", state, {"tie_word_embeddings": True})
    assert "lm_head.weight" not in load_weights(tmp_path / "tied", cfg)


def test_attention_bias_checkpoint_requires_biases(tmp_path):
    state = hf_state("qwen2")
    cfg = save_checkpoint(tmp_path / "ok", state, {"architectures": ["Qwen2ForCausalLM"]})
    assert load_weights(tmp_path / "ok", cfg)["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    del state["model.layers.0.self_attn.v_proj.bias"]
    cfg = save_checkpoint(tmp_path / "bad", state, {"architectures": ["Qwen2ForCausalLM"]})
    with pytest.raises(CheckpointError, match=r"v_proj\.bias"):
        load_weights(tmp_path / "bad", cfg)


def test_sharded_bf16_checkpoint_loads_as_bfloat16_views(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path, arch="llama", dtype="bfloat16", max_shard_size="30KB", seed=2)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    cfg = ModelConfig.from_dir(ckpt)
    weights = load_weights(ckpt, cfg)
    hf = make_hf_model("llama", seed=2).to(torch.bfloat16).state_dict()
    for name, arr in weights.items():
        assert arr.dtype == np.dtype(ml_dtypes.bfloat16), name
        ref = hf[name].float().numpy()
        np.testing.assert_array_equal(arr.astype(np.float32), ref)


def test_missing_shard_and_no_weights_are_reported(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path / "s", arch="qwen3", max_shard_size="40KB")
    cfg = ModelConfig.from_dir(ckpt)
    shard = sorted(ckpt.glob("model-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_weights(ckpt, cfg)
    empty = write_config(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_weights(empty, cfg)
