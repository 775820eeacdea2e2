"""Random bf16 Qwen3 checkpoints made by transformers itself, with a `vt make-model` tokenizer
beside them (the engine serves text too), for the GPU suites."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def qwen3_checkpoint(root: Path, **config: Any) -> Path:
    """A random Qwen3 of the given config fields (vocab 151,936, head dim 128, rope 1e6 unless
    given), saved in bf16 under root/model with the tiny preset's tokenizer."""
    import torch
    import transformers

    from vt.model.make_model import make_model

    tok = make_model(root / "tok", preset="tiny")
    fields = dict(vocab_size=151936, head_dim=128, rope_theta=1e6, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2) | config
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**fields)).to(torch.bfloat16)
    path = root / "model"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, path / name)
    return path
