"""Tiny random Qwen3-Embedding-style checkpoints, written with transformers itself, and their oracle.

A Qwen3-Embedding checkpoint is the Qwen3 decoder without its lm_head (saved as `Qwen3Model`:
tensors without the `model.` prefix), a tokenizer that appends <|endoftext|>, and
sentence-transformers files: modules.json naming a Transformer, a Pooling module whose
1_Pooling/config.json sets pooling_mode_lasttoken, and a Normalize module. The oracle is
transformers' own forward of that base model: the hidden state of each input's last non-padded
token in a right-padded batch, L2-normalized, as the model card's last_token_pool computes it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.numpy import load_file, save_file

from tests.unit.hf_models import make_hf_model

MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]
POOLING_MODES = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                 "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
                 "pooling_mode_lasttoken")


def write_sentence_transformers_files(path: Path, hidden: int, mode: str = "pooling_mode_lasttoken",
                                      normalize: bool = True) -> None:
    modules = MODULES if normalize else MODULES[:2]
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    settings = {"word_embedding_dimension": hidden, **{m: m == mode for m in POOLING_MODES},
                "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(settings, indent=2))


def append_eos(tokenizer_json: Path) -> None:
    """Make the tokenizer append <|endoftext|> to every encoding, as Qwen3-Embedding's does."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = TemplateProcessing(single="$A <|endoftext|>",
                                            pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
                                            special_tokens=[("<|endoftext|>", eos)])
    tok.save(str(tokenizer_json))


def write_embedding_checkpoint(path: str | Path, tokenizer_dir: Path, *, layout: str = "base",
                               sentence_transformers: bool = True, normalize: bool = True,
                               mode: str = "pooling_mode_lasttoken",
                               config_extra: dict[str, Any] | None = None, eos: bool = False, seed: int = 0,
                               **overrides: Any) -> Path:
    """A random Qwen3 embedding checkpoint in `path` with the tokenizer of `tokenizer_dir`.
    layout "base": saved as Qwen3Model (no lm_head, no `model.` prefix); "causal": a
    Qwen3ForCausalLM checkpoint whose lm_head.weight was removed. config_extra goes into
    config.json (is_matryoshka, matryoshka_dimensions); eos makes the tokenizer append EOS."""
    path = Path(path)
    shutil.rmtree(path, ignore_errors=True)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    model = make_hf_model("qwen3", seed, vocab_size=vocab, tie_word_embeddings=False, **overrides)
    if layout == "base":
        model.model.save_pretrained(path)
    elif layout == "causal":
        model.save_pretrained(path)
        file = path / "model.safetensors"
        tensors = load_file(file)
        del tensors["lm_head.weight"]
        save_file(tensors, file, metadata={"format": "pt"})
    else:
        raise ValueError(f"unknown layout {layout!r}")
    if config_extra:
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | config_extra, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    if eos:
        append_eos(path / "tokenizer.json")
    if sentence_transformers:
        write_sentence_transformers_files(path, model.config.hidden_size, mode, normalize)
    return path


@torch.no_grad()
def hf_embeddings(path: Path, prompts: list[list[int]], normalize: bool = True,
                  dimensions: int | None = None) -> list[np.ndarray]:
    """transformers' pooled vectors: the base model's last hidden state at each prompt's last
    non-padded token of one right-padded batch, truncated to `dimensions`, L2-normalized."""
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        mask[i, : len(p)] = 1
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = hidden[torch.arange(len(prompts)), mask.sum(dim=1) - 1]
    if dimensions is not None:
        last = last[:, :dimensions]
    if normalize:
        last = torch.nn.functional.normalize(last, p=2, dim=1)
    return [row.numpy() for row in last]
