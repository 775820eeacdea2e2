"""Safetensors checkpoint -> host arrays, memory-mapped so nothing is copied until upload.

A .safetensors file is an 8-byte little-endian header length, a JSON header mapping tensor names
to {dtype, shape, data_offsets}, then raw bytes. We parse the header ourselves and np.memmap the
data, so bf16 comes back as ml_dtypes.bfloat16 views of the file without a host copy.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from vt.config import ModelConfig
from vt.model.quantization import PROJECTIONS, Fp8Format, QuantizationError, stored_scale

_DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
_WEIGHT_DTYPES = ("BF16", "F16", "F32")


class CheckpointError(ValueError):
    """A checkpoint's tensors do not match its config; the message names the tensor."""


def expected_shapes(cfg: ModelConfig, lm_head: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward reads, with its shape, for this config (lm_head False: the
    decoder alone, as an embedding model reads it)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (q, h)
        out[p + "self_attn.k_proj.weight"] = (kv, h)
        out[p + "self_attn.v_proj.weight"] = (kv, h)
        out[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.attention_bias:
            out[p + "self_attn.q_proj.bias"] = (q,)
            out[p + "self_attn.k_proj.bias"] = (kv,)
            out[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        out[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    out["model.norm.weight"] = (h,)
    if lm_head and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def _decoder_names(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A bare base model's tensors (saved as Qwen3Model: `layers.0...`, `norm.weight`) under the
    names the decoder inside a *ForCausalLM has (`model.layers.0...`)."""
    if "model.embed_tokens.weight" in tensors or "embed_tokens.weight" not in tensors:
        return tensors
    return {name if name.startswith("lm_head.") else f"model.{name}": t for name, t in tensors.items()}


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one .safetensors file as read-only memory-mapped arrays."""
    file = Path(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{file}: too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors header: {e}") from e
    data_start = 8 + header_len
    size = file.stat().st_size - data_start
    if size == 0:
        return {}
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=data_start, shape=(size,))
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise CheckpointError(f"tensor {name!r} in {file.name}: unsupported dtype {info['dtype']!r}")
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dt.itemsize or end > size:
            raise CheckpointError(f"tensor {name!r} in {file.name}: data_offsets do not match its shape")
        out[name] = raw[begin:end].view(dt).reshape(shape)
    return out


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise CheckpointError(f"{index} names missing shard(s) {missing}")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return found
    raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def _is_stored_fp8(name: str, fp8: Fp8Format | None) -> bool:
    """Whether checkpoint tensor `name` is an fp8 projection weight in this format."""
    return fp8 is not None and not fp8.online and any(name.endswith(f".{p}.weight") for p in PROJECTIONS)


# Where checkpoints keep a layer's KV cache scales (vLLM reads these names): the attention's own
# k_scale / v_scale, under attn. too, compressed-tensors' k_proj / v_proj output_scale, and the
# older single kv_scale for both.
_KV_SCALE_NAMES = {
    "k_scale": ("self_attn.k_scale", "self_attn.attn.k_scale", "self_attn.k_proj.output_scale",
                "self_attn.kv_scale"),
    "v_scale": ("self_attn.v_scale", "self_attn.attn.v_scale", "self_attn.v_proj.output_scale",
                "self_attn.kv_scale"),
}


def kv_scale_name(layer: int, which: str) -> str:
    """The name load_weights gives a layer's KV cache scale (which: "k_scale" | "v_scale")."""
    return f"model.layers.{layer}.self_attn.{which}"


def _kv_scales(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The checkpoint's per-tensor KV cache scales as float32 scalars under kv_scale_name, for the
    layers that carry them (an fp8 KV cache stores x / scale; none: scale 1.0)."""
    out: dict[str, np.ndarray] = {}
    for i in range(cfg.num_layers):
        for which, names in _KV_SCALE_NAMES.items():
            name = next((f"model.layers.{i}.{n}" for n in names if f"model.layers.{i}.{n}" in tensors), None)
            if name is None:
                continue
            t = np.asarray(tensors[name], dtype=np.float32)
            if t.size != 1 or not np.isfinite(t).all() or float(t.reshape(())) <= 0:
                raise CheckpointError(f"tensor {name!r}: a KV cache scale is one positive number, found "
                                      f"shape {t.shape}")
            out[kv_scale_name(i, which)] = t.reshape(())
    return out


def load_weights(model_dir: str | Path, cfg: ModelConfig,
                 fp8: Fp8Format | None = None, lm_head: bool = True) -> dict[str, np.ndarray]:
    """Every tensor the forward needs, checked against the config, as memory-mapped host arrays
    (bfloat16 as ml_dtypes.bfloat16, float16 and float32 as stored). With a stored fp8 format the
    projection weights are e4m3 and each comes with its scale (`<projection>.<scale_name>`, read
    as vt.model.quantization.stored_scale gives it: f32 per channel or per 128x128 block).
    Tensors saved without the `model.` prefix (a bare base model, as Qwen3Model saves them) are
    read under it; lm_head False (an embedding model): no lm_head is read. A layer's KV cache
    scales, where the checkpoint has them, come as float32 scalars under kv_scale_name."""
    model_dir = Path(model_dir)
    tensors: dict[str, np.ndarray] = {}
    for file in _checkpoint_files(model_dir):
        tensors.update(read_safetensors(file))
    tensors = _decoder_names(tensors)
    out: dict[str, np.ndarray] = {}
    for name, shape in expected_shapes(cfg, lm_head).items():
        t = tensors.get(name)
        if t is None:
            hint = (" (a checkpoint without an lm_head is an embedding model: serve it with --runner pooling)"
                    if name == "lm_head.weight" else "")
            raise CheckpointError(f"checkpoint is missing tensor {name!r} (expected shape {shape}){hint}")
        if t.shape != shape:
            raise CheckpointError(f"tensor {name!r}: expected shape {shape}, found {t.shape}")
        if _is_stored_fp8(name, fp8):
            assert fp8 is not None
            if t.dtype != _DTYPES["F8_E4M3"]:
                raise CheckpointError(f"tensor {name!r}: the checkpoint's quantization_config makes it fp8 "
                                      f"(e4m3), found {t.dtype}")
            scale_name = name[: -len("weight")] + fp8.scale_name
            scale = tensors.get(scale_name)
            if scale is None:
                raise CheckpointError(f"checkpoint is missing tensor {scale_name!r} (the scales of {name!r})")
            try:
                out[scale_name] = stored_scale(fp8, scale_name, np.asarray(scale), *shape)
            except QuantizationError as e:
                raise CheckpointError(str(e)) from None
        elif t.dtype not in (_DTYPES[d] for d in _WEIGHT_DTYPES):
            raise CheckpointError(f"tensor {name!r}: expected a bf16/f16/f32 tensor, found {t.dtype}")
        out[name] = t
    out.update(_kv_scales(tensors, cfg))
    return out
