"""Tiny random Hugging Face checkpoints, made with transformers itself, for parity tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

_ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

TINY: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.1,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def make_hf_model(arch: str = "qwen3", seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A random fp32 model in eval mode. Norm weights and biases are randomized too (transformers
    starts them at 1 and 0), so that q/k norms and biases visibly change the logits."""
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {tuple(_ARCHS)}")
    config_name, model_name = _ARCHS[arch]
    kwargs = dict(TINY) | overrides
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def make_hf_checkpoint(path: str | Path, arch: str = "qwen3", dtype: str = "float32", seed: int = 0,
                       max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Save a tiny random checkpoint (config.json + safetensors) under `path`; returns the folder.
    `max_shard_size` (e.g. "40KB") writes a sharded checkpoint with an index.json."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = make_hf_model(arch, seed, **overrides)
    model = model.to(getattr(torch, dtype))
    kwargs: dict[str, Any] = {}
    if max_shard_size is not None:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def load_hf_model(path: str | Path) -> torch.nn.Module:
    """The saved checkpoint back in transformers, fp32 on CPU: the logits oracle."""
    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
    return model.eval()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of one unpadded sequence."""
    out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    return out.logits[0].float()
