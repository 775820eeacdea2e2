"""`vt make-model`: write a random-weight HF-format checkpoint with a tokenizer trained on the spot
and grown to the vocabulary size, so every id the model can sample has text.

Weights are bf16 drawn from per-chunk seeded generators (seed, tensor index, chunk index), so the
result is deterministic for a seed whatever the thread count, and big presets generate in parallel.

Standard deviations: matrices 0.02 and embeddings 0.02 for the real-size presets. For `tiny` the
matrices use 0.125 and the embedding 0.25: with hidden 64, the 0.02 init gives near-uniform logits
(greedy decoding then hinges on rounding ties) and layers that barely change the residual stream;
these values give logits a spread of a few units that depends on the context.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from vt.kernels.numpy_fp8 import BLOCK, E4M3_MAX, to_e4m3

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3's markup tokens, added (not special: they decode into the text) by make_model(qwen3_tokens=True)
# for what parses them: reasoning (<think>) and tool calls (<tool_call>).
QWEN3_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
REPLACEMENT_CHAR = "\ufffd"
CHUNK_ELEMS = 1 << 23          # elements drawn per generator; bounds memory per worker
DEFAULT_SHARD_BYTES = 2 << 30  # shards at most about this size (a tensor is never split)
# The demo folder's format: bumped when make_model's output changes, so a cached demo is remade.
DEMO_FORMAT = 2
DEMO_STAMP = "vt-demo-format"

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{- raise_exception('unknown role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class Preset:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int | None          # None: the trained tokenizer's size rounded up to a multiple of 64
    max_pos: int
    tied: bool
    rope_theta: float
    matrix_std: float
    embed_std: float
    tokenizer_vocab: int       # tokens trained on the corpus; the tokenizer then grows to `vocab`


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 128, 2, 4, 2, 16, None, 2048, True, 1e6, 0.125, 0.25, 1000),
    # every projection dim a multiple of 128: fp8 checkpoints with 128x128 weight blocks
    "tiny128": Preset(128, 256, 2, 4, 2, 64, None, 2048, True, 1e6, 0.1, 0.25, 1000),
    "0.6b": Preset(1024, 3072, 28, 16, 8, 128, 151936, 40960, True, 1e6, 0.02, 0.02, 1000),
    "8b": Preset(4096, 12288, 36, 32, 8, 128, 151936, 40960, False, 1e6, 0.02, 0.02, 1000),
}
ARCHS = ("qwen3", "llama")
QUANTIZATIONS = ("fp8-block", "fp8-channel")


# ---- tokenizer ----------------------------------------------------------------------------

_EN = (
    "the quick brown fox jumps over lazy dog hello world model token stream server request "
    "response batch cache block attention layer weight value key query prompt output input "
    "a an and or not is are was were be been have has had do does did will would can could "
    "should may might must shall of in on at by for with about against between into through "
    "during before after above below to from up down out off again further then once here there "
    "when where why how all any both each few more most other some such no nor only own same so "
    "than too very just now time year people way day man woman child thing world life hand part "
    "place case week company system program question work government number night point home "
    "water room mother area money story fact month lot right study book eye job word business "
    "issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others "
    "level office door health person art war history party result change morning reason research "
    "girl guy moment air teacher force education"
).split()
_ACCENTED = (
    "café naïve über señor français garçon déjà vu résumé piñata crème brûlée façade jalapeño "
    "smörgåsbord Zürich São Paulo München Ærø fjörður Łódź Kraków İstanbul straße"
).split()
_CJK = (
    "你好 世界 中文 模型 服务器 请求 日本語 東京 こんにちは ありがとう カタカナ 한국어 안녕하세요 "
    "감사합니다 北京 上海 漢字 学习 机器 人工智能"
).split()
_EMOJI = "😀 🚀 🎉 👍 🔥 ❤️ 🌍 🤖 🍕 ✨ 🐍 🧠 👩‍💻 🇯🇵".split()
_PUNCT = (".", ",", "!", "?", ";", ":", " -", " (ok)", " \"quoted\"", " 42", " 3.14", " 2024")


def training_corpus(lines: int = 3000) -> list[str]:
    """A fixed multilingual corpus: English with accented, CJK and emoji words mixed in."""
    rng = np.random.default_rng(1234)
    pools = (_EN, _ACCENTED, _CJK, _EMOJI)
    weights = np.array([0.7, 0.12, 0.12, 0.06])
    out = []
    for _ in range(lines):
        n = int(rng.integers(4, 16))
        kinds = rng.choice(4, size=n, p=weights)
        words = [pools[k][int(rng.integers(len(pools[k])))] for k in kinds]
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        out.append(" ".join(words) + _PUNCT[int(rng.integers(len(_PUNCT)))])
    return out


def train_tokenizer(vocab_size: int = 1000, added: tuple[str, ...] = ()):
    """A byte-level BPE with the ChatML special tokens at ids 0, 1, 2 and then `added` as added
    tokens that are not special (they stay in decoded text, as Qwen3's <think> does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS + added),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    if not added:
        return tok
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        if entry["content"] in added:
            entry["special"] = False
    return Tokenizer.from_str(json.dumps(data))


def _word_kind(text: str) -> tuple[bool, str] | None:
    """(leading space, kind) of a token that can sit in one byte-level pre-token: letters, digits
    or other symbols, optionally after one space; None for anything else."""
    lead = text.startswith(" ")
    body = text[1:] if lead else text
    if not body or REPLACEMENT_CHAR in body:
        return None
    kinds = {"L" if c.isalpha() else "N" if c.isnumeric() else "S" if c.isspace() else "P" for c in body}
    if len(kinds) != 1 or "S" in kinds:
        return None
    return lead, kinds.pop()


def grow_tokenizer(tok, size: int, seed: int = 0):
    """The trained tokenizer grown to exactly `size` tokens, so that every id the model can sample
    has text. Each new token joins two trained tokens whose joined text is one pre-token that the
    trained merges split into exactly those two: appended as the lowest-priority merges, they turn
    that text into the new token, so every new id decodes to non-empty text and encodes back to
    itself. No training: a 151,936-token vocabulary takes a few seconds."""
    from tokenizers import Tokenizer

    need = size - tok.get_vocab_size()
    if need < 0:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens, more than {size}")
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["id"] for t in data["added_tokens"]}
    ids = sorted(set(vocab.values()) - special)
    kinds = dict(zip(ids, map(_word_kind, tok.decode_batch([[i] for i in ids], skip_special_tokens=False))))
    # a word piece (letters, digits or symbols, maybe after a space) then a piece of the same kind
    pairs = np.array([(a, b) for a, ka in kinds.items() if ka for b, kb in kinds.items()
                      if kb and not kb[0] and kb[1] == ka[1]], dtype=np.int64).reshape(-1, 2)
    pairs = pairs[np.random.default_rng(seed).permutation(len(pairs))]
    inv = {i: s for s, i in vocab.items()}
    merges: list[list[str]] = []
    chunk = max(2 * need, 1024)
    for start in range(0, len(pairs), chunk):
        batch = pairs[start:start + chunk].tolist()
        texts = tok.decode_batch(batch, skip_special_tokens=False)
        for pair, enc in zip(batch, tok.encode_batch(texts, add_special_tokens=False)):
            # one pre-token segmented as the pair: the text is then unique to the pair, new to the
            # vocabulary, and no merge but the new one applies to it
            if len(merges) < need and enc.ids == pair and enc.word_ids == [0, 0]:
                merges.append([inv[pair[0]], inv[pair[1]]])
        if len(merges) == need:
            break
    if len(merges) < need:
        raise ValueError(f"cannot grow the tokenizer to {size} tokens from its {len(ids)} trained ones")
    for a, b in merges:
        vocab[a + b] = len(vocab)
    data["model"]["merges"] += merges
    return Tokenizer.from_str(json.dumps(data))


# ---- config -------------------------------------------------------------------------------

def hf_config(arch: str, p: Preset, vocab: int, bos_id: int, eos_id: int) -> dict:
    common = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate,
        "max_position_embeddings": p.max_pos,
        "num_attention_heads": p.heads,
        "num_hidden_layers": p.layers,
        "num_key_value_heads": p.kv_heads,
        "rope_scaling": None,
        "tie_word_embeddings": p.tied,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab,
    }
    if arch == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common,
                "max_window_layers": p.layers, "rms_norm_eps": 1e-6, "rope_theta": p.rope_theta,
                "sliding_window": None, "use_sliding_window": False}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common,
            "mlp_bias": False, "pretraining_tp": 1, "rms_norm_eps": 1e-5, "rope_theta": p.rope_theta}


def quantization_config(quantization: str) -> dict:
    """config.json's quantization_config as the published FP8 checkpoints write it: Qwen3's FP8
    releases (fp8-block) and llm-compressor's FP8-dynamic (fp8-channel, compressed-tensors)."""
    if quantization == "fp8-block":
        return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                "weight_block_size": [128, 128]}
    scheme = {"actorder": None, "block_structure": None, "group_size": None, "num_bits": 8,
              "observer_kwargs": {}, "symmetric": True, "type": "float"}
    return {
        "config_groups": {"group_0": {
            "input_activations": {**scheme, "dynamic": True, "observer": None, "strategy": "token"},
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {**scheme, "dynamic": False, "observer": "minmax", "strategy": "channel"},
        }},
        "format": "float-quantized",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


# ---- weights ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    std: float | None  # None: ones (norm weights)

    @property
    def nbytes(self) -> int:
        return 2 * int(np.prod(self.shape))


def tensor_specs(arch: str, p: Preset, vocab: int) -> list[TensorSpec]:
    h, d, ms = p.hidden, p.head_dim, p.matrix_std
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, h), p.embed_std)]
    for i in range(p.layers):
        pre = f"model.layers.{i}."
        specs += [
            TensorSpec(pre + "input_layernorm.weight", (h,), None),
            TensorSpec(pre + "self_attn.q_proj.weight", (p.heads * d, h), ms),
            TensorSpec(pre + "self_attn.k_proj.weight", (p.kv_heads * d, h), ms),
            TensorSpec(pre + "self_attn.v_proj.weight", (p.kv_heads * d, h), ms),
            TensorSpec(pre + "self_attn.o_proj.weight", (h, p.heads * d), ms),
        ]
        if arch == "qwen3":
            specs += [TensorSpec(pre + "self_attn.q_norm.weight", (d,), None),
                      TensorSpec(pre + "self_attn.k_norm.weight", (d,), None)]
        specs += [
            TensorSpec(pre + "post_attention_layernorm.weight", (h,), None),
            TensorSpec(pre + "mlp.gate_proj.weight", (p.intermediate, h), ms),
            TensorSpec(pre + "mlp.up_proj.weight", (p.intermediate, h), ms),
            TensorSpec(pre + "mlp.down_proj.weight", (h, p.intermediate), ms),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), None))
    if not p.tied:
        specs.append(TensorSpec("lm_head.weight", (vocab, h), p.embed_std))
    return specs


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (plain integer ops: fast and GIL-free)."""
    bits = x.view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _fill_chunk(out_bits: np.ndarray, seed: int, index: int, chunk: int, start: int, std: float) -> None:
    rng = np.random.default_rng([seed, index, chunk])
    part = out_bits[start:start + CHUNK_ELEMS]
    x = rng.standard_normal(part.shape[0], dtype=np.float32)
    x *= np.float32(std)
    part[:] = _to_bf16_bits(x)


def _generate_shard(specs: list[tuple[int, TensorSpec]], seed: int, pool: ThreadPoolExecutor) -> dict:
    tensors, futures = {}, []
    for index, spec in specs:
        n = int(np.prod(spec.shape))
        if spec.std is None:
            bits = np.full(n, 0x3F80, dtype=np.uint16)  # bf16 1.0
        else:
            bits = np.empty(n, dtype=np.uint16)
            for c, start in enumerate(range(0, n, CHUNK_ELEMS)):
                futures.append(pool.submit(_fill_chunk, bits, seed, index, c, start, spec.std))
        tensors[spec.name] = bits.view(ml_dtypes.bfloat16).reshape(spec.shape)
    for f in futures:
        f.result()
    return tensors


_PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                "up_proj.weight", "down_proj.weight")


def _quantize_shard(tensors: dict, quantization: str) -> dict:
    """A shard's projection weights as e4m3 with bf16 scales named as the published checkpoints
    name them (weight_scale_inv per 128x128 block; weight_scale [N, 1] per channel); each weight is
    quantized against its scale as stored (bf16), so the file dequantizes to the closest values."""
    out = {}
    for name, t in tensors.items():
        if not name.endswith(_PROJECTIONS):
            out[name] = t
            continue
        w = t.astype(np.float32)
        n, k = w.shape
        if quantization == "fp8-block":
            nb, kb = -(-n // BLOCK), -(-k // BLOCK)
            padded = np.zeros((nb * BLOCK, kb * BLOCK), np.float32)
            padded[:n, :k] = np.abs(w)
            amax = padded.reshape(nb, BLOCK, kb, BLOCK).max(axis=(1, 3))
            scale = (np.maximum(amax, 1e-12) / E4M3_MAX).astype(ml_dtypes.bfloat16)
            per = np.repeat(np.repeat(scale.astype(np.float32), BLOCK, 0), BLOCK, 1)[:n, :k]
            out[name] = to_e4m3(w / per)
            out[name[: -len("weight")] + "weight_scale_inv"] = scale
        else:
            amax = np.abs(w).max(axis=1, keepdims=True)
            scale = (np.maximum(amax, 1e-12) / E4M3_MAX).astype(ml_dtypes.bfloat16)
            out[name] = to_e4m3(w / scale.astype(np.float32))
            out[name[: -len("weight")] + "weight_scale"] = scale
    return out


def _save(tensors: dict, path: Path, meta: dict) -> None:
    """safetensors creates its file 0600; a checkpoint is read by others too (a container's user)."""
    save_file(tensors, str(path), metadata=meta)
    path.chmod(0o644)


def _write_weights(out: Path, specs: list[TensorSpec], seed: int, max_shard_bytes: int,
                   quantization: str | None = None) -> None:
    shards: list[list[tuple[int, TensorSpec]]] = [[]]
    size = 0
    for i, spec in enumerate(specs):
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((i, spec))
        size += spec.nbytes
    meta = {"format": "pt"}

    def shard_tensors(shard: list[tuple[int, TensorSpec]], pool: ThreadPoolExecutor) -> dict:
        tensors = _generate_shard(shard, seed, pool)
        return tensors if quantization is None else _quantize_shard(tensors, quantization)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        if len(shards) == 1:
            _save(shard_tensors(shards[0], pool), out / "model.safetensors", meta)
            return
        weight_map = {}
        for k, shard in enumerate(shards):
            fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = shard_tensors(shard, pool)
            _save(tensors, out / fname, meta)
            weight_map.update({name: fname for name in tensors})
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# ---- entry points -------------------------------------------------------------------------

def make_model(out_dir: str | os.PathLike, arch: str = "qwen3", preset: str = "tiny", seed: int = 0,
               max_shard_bytes: int = DEFAULT_SHARD_BYTES, qwen3_tokens: bool = False,
               quantization: str | None = None) -> Path:
    """Write a random checkpoint (config, safetensors, tokenizer, generation config) to out_dir;
    qwen3_tokens adds Qwen3's <think> and <tool_call> markup tokens to the tokenizer;
    quantization (fp8-block | fp8-channel) writes the projections as an FP8 checkpoint of that
    format (the same random weights, quantized)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(p.tokenizer_vocab, QWEN3_TOKENS if qwen3_tokens else ())
    vocab = p.vocab if p.vocab is not None else -(-tok.get_vocab_size() // 64) * 64
    tok = grow_tokenizer(tok, vocab, seed)  # every row of the vocabulary has a token
    tok.save(str(out / "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")

    config = hf_config(arch, p, vocab, eot, im_end)
    if quantization is not None:
        config["quantization_config"] = quantization_config(quantization)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": eot, "eos_token_id": [im_end, eot], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": p.max_pos,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    _write_weights(out, tensor_specs(arch, p, vocab), seed, max_shard_bytes, quantization)
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("VT_CACHE_DIR") or Path.home() / ".cache" / "vt")


def _is_current_demo(folder: Path) -> bool:
    stamp = folder / DEMO_STAMP
    return stamp.is_file() and stamp.read_text().strip() == str(DEMO_FORMAT)


def default_model_dir() -> Path:
    """The demo tiny model in the cache folder, made once (atomically: temp dir, then rename) and
    made again when an older vt wrote it (its format stamp differs)."""
    target = cache_dir() / "demo-tiny"
    if _is_current_demo(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-tiny-", dir=target.parent))
    stale = None
    try:
        # config.json is written before the weights; rename only after everything is on disk
        make_model(tmp, arch="qwen3", preset="tiny", seed=0)
        (tmp / DEMO_STAMP).write_text(f"{DEMO_FORMAT}\n")
        if target.exists() and not _is_current_demo(target):
            stale = Path(tempfile.mkdtemp(prefix=".demo-stale-", dir=target.parent))
            os.rename(target, stale / "old")
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_current_demo(target):  # not a concurrent maker that won the race
                raise
    finally:
        for leftover in (tmp, stale):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return target
