"""EngineConfig (every engine flag) and ModelConfig (parsed from a checkpoint's config.json)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

# ---------------------------------------------------------------------------------------------
# KV-cache events (--kv-events-config), published by vt.sched.kv_publisher.

@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"           # null | zmq
    endpoint: str = "tcp://*:5557"    # bound if it has '*', '::', ipc:// or inproc://, else connected
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000        # batches kept for replay
    hwm: int = 100_000                # the PUB socket's send high-water mark
    max_queue_size: int = 100_000     # batches waiting for the publisher thread
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """--kv-events-config: a JSON object of KVEventsConfig fields. Raises ValueError naming the
    field at fault."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config must be a JSON object: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    for key, value in raw.items():
        if key not in known:
            raise ValueError(f"--kv-events-config: unknown field {key!r} (known: {', '.join(known)})")
        if key == "enable_kv_cache_events":
            ok = isinstance(value, bool)
        elif key in ("buffer_steps", "hwm", "max_queue_size"):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        elif key == "replay_endpoint":
            ok = value is None or (isinstance(value, str) and value != "")
        else:
            ok = isinstance(value, str) and (value != "" or key == "topic")
        if not ok:
            raise ValueError(f"--kv-events-config: {key!r} has an invalid value {value!r}")
    cfg = KVEventsConfig(**raw)
    if cfg.publisher not in ("null", "zmq"):
        raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
    if cfg.enable_kv_cache_events and cfg.publisher == "null" and "publisher" not in raw:
        cfg = KVEventsConfig(**{**raw, "publisher": "zmq"})  # as vLLM: enabling picks zmq
    return cfg


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "auto"                  # auto | cuda | cpu
    max_model_len: int | None = None      # None: the checkpoint's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks: int | None = None     # explicit KV block count (overrides memory sizing)
    kv_cache_memory: int | None = None    # bytes for the KV cache
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "fcfs"       # fcfs | priority
    enable_chunked_prefill: bool = True
    prefill_pacing: bool = False          # spread the last prompt in line over the decodes' steps
    enable_prefix_caching: bool = True
    # decodes sharing a long cached prefix attend to it once for all of them (cascade_plan.py)
    disable_cascade_attn: bool = False
    async_scheduling: bool = True
    enforce_eager: bool = False
    max_waiting: int = 1024               # bounded waiting queue; beyond it requests get 503
    seed: int = 0
    kv_events_config: KVEventsConfig | None = None  # --kv-events-config: publish KV cache events
    tensor_parallel_size: int = 1         # ranks the weights, heads and KV cache are split over
    step_trace: str | None = None         # --step-trace: a JSON line per completed step to this file
    # An experiment (env VT_SPLIT_DECODE_SMS when None): a mixed step's decodes run as a step of
    # their own beside its prompt rows, the decodes' GEMMs on this many SMs, the prompt rows' on
    # the rest; 0: one mixed step.
    split_decode_sms: int | None = None
    quantization: str | None = None       # --quantization: fp8 weights (vt.model.quantization)
    kv_cache_dtype: str = "auto"          # --kv-cache-dtype: auto (the model's dtype) | fp8 (e4m3)
    tokenizer: str | None = None          # --tokenizer: the tokenizer's folder (None: the model's)
    runner: str = "auto"                  # --runner: generate | pooling (embeddings) | auto: by checkpoint

    def __post_init__(self) -> None:
        # fp8_e4m3 is vLLM's other name for fp8; the engine speaks of one.
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_of(self.kv_cache_dtype))


# --kv-cache-dtype values served, under vLLM's names: the model's dtype, or e4m3 codes with a
# per-tensor scale per layer (vLLM's fp8 KV cache).
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8"}


def kv_cache_dtype_of(name: str) -> str:
    """"auto" or "fp8" for a --kv-cache-dtype value; ValueError naming the ones served otherwise."""
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        why = ("vt's fp8 KV cache is e4m3" if name.startswith("fp8") else "not a KV cache dtype vt knows")
        raise ValueError(f"--kv-cache-dtype {name}: {why}; use one of {', '.join(KV_CACHE_DTYPES)}") from None


# ---------------------------------------------------------------------------------------------
# ModelConfig: the subset of a Hugging Face config.json that the decoder forward needs.

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM")
# Bare base models, saved without their lm_head (embedding checkpoints): the same decoder.
BASE_MODEL_ARCHITECTURES = {"Qwen3Model": "Qwen3ForCausalLM", "Qwen2Model": "Qwen2ForCausalLM",
                            "LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM"}
_MODEL_TYPE_TO_ARCH = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}
_DTYPES = ("bfloat16", "float16", "float32")


class ConfigError(ValueError):
    """A checkpoint's config.json is not one vt can serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None for plain rope; {"rope_type": "llama3", ...} otherwise
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # config.json's quantization_config as written (vt.model.quantization reads it), or None
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"config field 'num_key_value_heads' ({self.num_kv_heads}) must divide "
                              f"'num_attention_heads' ({self.num_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"config field 'head_dim' must be even for rope, got {self.head_dim}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"config field 'torch_dtype' must be one of {_DTYPES}, got {self.dtype!r}")

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Parse `path`/config.json."""
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"config.json in {path} is not valid JSON: {e}") from e
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse an already loaded config.json mapping."""
        arch = _architecture(raw)

        def need(name: str) -> Any:
            if raw.get(name) is None:
                raise ConfigError(f"config.json is missing required field {name!r}")
            return raw[name]

        hidden_act = raw.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ConfigError(f"config field 'hidden_act' must be 'silu', got {hidden_act!r}")
        if raw.get("mlp_bias"):
            raise ConfigError("config field 'mlp_bias' = true is not supported")
        _reject_sliding_window(raw, arch)

        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % heads:
                raise ConfigError("config field 'head_dim' is absent and 'hidden_size' is not a multiple "
                                  "of 'num_attention_heads'")
            head_dim = hidden // heads
        rope_theta, rope_scaling = _rope(raw)
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
        eos = raw.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = tuple(eos)
        else:
            raise ConfigError(f"config field 'eos_token_id' must be an int or list of ints, got {eos!r}")
        # Qwen2 always has q/k/v biases; the others say so in `attention_bias`.
        attention_bias = True if arch == "Qwen2ForCausalLM" else bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(need("max_position_embeddings")),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            dtype=str(dtype),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            quantization_config=raw.get("quantization_config"),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token takes across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def inv_freq(self) -> np.ndarray:
        """Rope inverse frequencies f32[head_dim // 2], with llama3 scaling when configured."""
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float64) / self.head_dim
        inv = 1.0 / (self.rope_theta ** exponents)
        if self.rope_scaling is not None:
            inv = _llama3_scale(inv, self.rope_scaling)
        return inv.astype(np.float32)


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs:
        if not isinstance(archs, list):
            raise ConfigError(f"config field 'architectures' must be a list, got {archs!r}")
        for a in archs:
            if a in SUPPORTED_ARCHITECTURES:
                return a
            if a in BASE_MODEL_ARCHITECTURES:
                return BASE_MODEL_ARCHITECTURES[a]
        raise ConfigError(f"config field 'architectures' = {archs!r}: supported are "
                          f"{SUPPORTED_ARCHITECTURES + tuple(BASE_MODEL_ARCHITECTURES)}")
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ConfigError(f"config field 'architectures' is missing and 'model_type' = {model_type!r} is not one "
                      f"of {tuple(_MODEL_TYPE_TO_ARCH)}")


def _reject_sliding_window(raw: dict[str, Any], arch: str) -> None:
    window = raw.get("sliding_window")
    if window is None:
        return
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # Qwen configs carry a window value but only apply it when use_sliding_window is set.
        in_use = bool(raw.get("use_sliding_window", False))
    else:
        in_use = int(window) < int(raw.get("max_position_embeddings") or 0)
    if in_use:
        raise ConfigError(f"config field 'sliding_window' = {window} is in use; sliding-window attention "
                          "is not supported")


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 nests rope_theta and the scaling type in `rope_parameters`; older files keep
    # `rope_theta` at the top level and the scaling in `rope_scaling`.
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"config field 'rope_parameters' must be an object, got {params!r}")
    scaling = raw.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ConfigError(f"config field 'rope_scaling' must be an object or null, got {scaling!r}")
    theta = raw.get("rope_theta")
    if theta is None and params is not None:
        theta = params.get("rope_theta")
    theta = 10000.0 if theta is None else float(theta)
    source, field = (scaling, "rope_scaling") if scaling is not None else (params, "rope_parameters")
    if source is None:
        return theta, None
    kind = source.get("rope_type", source.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise ConfigError(f"config field '{field}' has rope type {kind!r}; supported: default, llama3")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    for key in keys:
        if source.get(key) is None:
            raise ConfigError(f"config field '{field}' (llama3) is missing {key!r}")
    out = {"rope_type": "llama3"} | {key: float(source[key]) for key in keys}
    return theta, out


def _llama3_scale(inv: np.ndarray, s: dict[str, Any]) -> np.ndarray:
    """Llama 3.1 frequency-dependent rope scaling: long wavelengths slowed by `factor`,
    short ones kept, a smooth blend in between."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = np.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, blended, out)
