"""`vt make-model`: checkpoints that transformers loads, deterministic per seed, written atomically."""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoModelForCausalLM

from vt.model import make_model as mm


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    start = time.perf_counter()
    out = mm.make_model(tmp_path_factory.mktemp("mm") / "q", arch="qwen3", preset="tiny", seed=0)
    return out, time.perf_counter() - start


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model


def test_tiny_qwen3_loads_in_transformers_with_our_weights(tiny):
    path, seconds = tiny
    assert seconds < 5
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is True
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    assert cfg["vocab_size"] % 64 == 0 and tok.get_vocab_size() == cfg["vocab_size"]
    model = _load(path)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    weights = load_file(str(path / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"].astype(np.float32)
    np.testing.assert_array_equal(model.model.embed_tokens.weight.detach().numpy(), emb)
    assert 0.2 < emb.std() < 0.3
    np.testing.assert_array_equal(weights["model.norm.weight"].astype(np.float32), 1.0)
    assert "model.layers.0.self_attn.q_norm.weight" in weights
    # logits have a usable spread (greedy decoding is not decided by rounding ties)
    logits = model(torch.tensor([tok.encode("Hello world").ids])).logits[0, -1]
    assert logits.std().item() > 0.5


def test_tiny_tokenizer_and_generation_config(tiny):
    path, _ = tiny
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    text = "Hello café 你好 🚀 鱻"
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in mm.SPECIAL_TOKENS] == [0, 1, 2]
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [2, 0]
    tcfg = json.loads((path / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and tcfg["pad_token"] == "<|endoftext|>"
    assert "add_generation_prompt" in tcfg["chat_template"]


def test_deterministic_per_seed(tiny, tmp_path):
    path, _ = tiny
    same = mm.make_model(tmp_path / "same", preset="tiny", seed=0)
    other = mm.make_model(tmp_path / "other", preset="tiny", seed=1)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _digest(same / name) == _digest(path / name)
    assert _digest(other / "model.safetensors") != _digest(path / "model.safetensors")


def test_llama_sharded_checkpoint_loads(tmp_path):
    path = mm.make_model(tmp_path / "llama", arch="llama", preset="tiny", seed=3, max_shard_bytes=40_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (path / "model.safetensors").exists()
    assert all((path / f).exists() for f in files)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert not any("q_norm" in k for k in index["weight_map"])
    model = _load(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    # sharding does not change the weights: same seed unsharded gives identical tensors
    flat = load_file(str(mm.make_model(tmp_path / "flat", arch="llama", preset="tiny", seed=3)
                         / "model.safetensors"))
    for f in files:
        for k, v in load_file(str(path / f)).items():
            np.testing.assert_array_equal(v.view(np.uint16), flat[k].view(np.uint16))


def test_big_preset_shapes_without_writing():
    p = mm.PRESETS["8b"]
    specs = mm.tensor_specs("qwen3", p, p.vocab)
    total = sum(int(np.prod(s.shape)) for s in specs)
    assert 8.1e9 < total < 8.3e9 and specs[-1].name == "lm_head.weight"
    p06 = mm.PRESETS["0.6b"]
    total06 = sum(int(np.prod(s.shape)) for s in mm.tensor_specs("qwen3", p06, p06.vocab))
    assert 0.55e9 < total06 < 0.65e9


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        mm.make_model(tmp_path / "x", arch="gpt2")
    with pytest.raises(ValueError, match="preset"):
        mm.make_model(tmp_path / "x", preset="70b")


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.00390625, 1.01171875, -2.5, 3.0e-3], np.float32)
    bits = mm._to_bf16_bits(x.copy())
    import ml_dtypes

    np.testing.assert_array_equal(bits, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_default_model_dir_is_made_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VT_CACHE_DIR", str(tmp_path))
    first = mm.default_model_dir()
    assert first == tmp_path / "demo-tiny" and (first / "model.safetensors").exists()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert mm.default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["demo-tiny"]  # no half-written temp dirs left


def _decodes_and_round_trips(tok, trained: int) -> None:
    """Every id decodes to non-empty text; every id past the trained ones encodes back to itself."""
    ids = list(range(tok.get_vocab_size()))
    texts = tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
    assert all(texts), [i for i, t in zip(ids, texts) if not t][:5]
    grown = [e.ids for e in tok.encode_batch(texts[trained:], add_special_tokens=False)]
    assert grown == [[i] for i in ids[trained:]]


def test_every_id_of_the_tiny_vocabulary_has_text(tiny):
    path, _ = tiny
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == json.loads((path / "config.json").read_text())["vocab_size"] == 1024
    _decodes_and_round_trips(tok, mm.PRESETS["tiny"].tokenizer_vocab)
    # ordinary text still encodes and decodes as before
    assert tok.decode(tok.encode("Hello café 你好 🚀").ids) == "Hello café 你好 🚀"


def test_the_big_presets_tokenizer_is_as_large_as_their_vocabulary_and_quick_to_make():
    p = mm.PRESETS["0.6b"]
    assert mm.PRESETS["8b"].vocab == p.vocab == 151936
    start = time.perf_counter()
    tok = mm.grow_tokenizer(mm.train_tokenizer(p.tokenizer_vocab), p.vocab)
    assert time.perf_counter() - start < 30  # seconds, not a BPE training over 151k merges
    assert tok.get_vocab_size() == p.vocab
    _decodes_and_round_trips(tok, p.tokenizer_vocab)


def test_a_demo_model_from_an_older_vt_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("VT_CACHE_DIR", str(tmp_path))
    old = tmp_path / "demo-tiny"
    old.mkdir()
    (old / "config.json").write_text("{}")  # an older demo: no format stamp
    demo = mm.default_model_dir()
    assert demo == old and (demo / "model.safetensors").exists()
    tok = HFTokenizer.from_file(str(demo / "tokenizer.json"))
    assert tok.get_vocab_size() == json.loads((demo / "config.json").read_text())["vocab_size"]
    assert [p.name for p in tmp_path.iterdir()] == ["demo-tiny"]


def test_the_checkpoint_files_are_readable_by_other_users(tmp_path):
    """A checkpoint mounted into the image is read by its unprivileged user."""
    import stat

    out = mm.make_model(tmp_path / "m", preset="tiny", max_shard_bytes=100_000)
    for f in out.iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f.name
