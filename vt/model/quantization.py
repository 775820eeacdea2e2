"""FP8 weights: the formats vt serves, read from config.json and `--quantization`, and each
projection's fp8 tensors as the checkpoint stores them.

Served (e4m3 weights, activations quantized per token at run time, GEMMs on the fp8 tensor cores):
- `--quantization fp8` on a bf16/f16/f32 checkpoint: each projection quantized at load with a scale
  per output channel (what vLLM's flag does with one scale per tensor; a scale per channel is as
  fast on cuBLASLt's kernels and loses less);
- "fp8" checkpoints (Qwen3 and DeepSeek FP8 releases): `quant_method: fp8`, `fmt: e4m3`,
  `activation_scheme: dynamic`, with `weight_block_size: [128, 128]` (a `weight_scale_inv` per
  128x128 block; activations then get a scale per token and 128 columns) or without it (one
  `weight_scale` per tensor);
- compressed-tensors "float-quantized" checkpoints (llm-compressor FP8-dynamic): 8-bit float
  weights with a `weight_scale` per channel or per tensor, dynamic input activations.
Embeddings, norms and lm_head stay bf16 (as those checkpoints keep them). Anything else
fp8-flavoured is refused at start-up, naming what is supported.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCK = 128
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SUPPORTED = ("served: --quantization fp8 on a bf16 checkpoint; 'fp8' checkpoints (fmt e4m3, "
             "activation_scheme dynamic, weight_block_size [128, 128] or per-tensor scales); "
             "compressed-tensors 'float-quantized' checkpoints with 8-bit float weights (channel or "
             "tensor scales) and dynamic activations")


class QuantizationError(ValueError):
    """A quantization setting vt cannot serve; the message names it and what is supported."""


@dataclass(frozen=True)
class Fp8Format:
    """How a model's projections are fp8. online: quantized from the checkpoint's bf16 weights at
    load (per channel); otherwise read as stored, `scale_name` beside each weight, per 128x128
    block (block) or per channel (a per-tensor scale counts as one per channel)."""

    online: bool
    block: bool
    scale_name: str = ""      # "weight_scale_inv" (fp8 blocks) | "weight_scale"
    method: str = "fp8"       # the checkpoint's quant_method, or "fp8" for --quantization fp8

    @property
    def activation_group(self) -> int | None:
        return BLOCK if self.block else None


def require_fp8_device(fp8: Fp8Format, unsupported: str) -> None:
    """Refuse fp8 weights where the backend cannot run their GEMMs (`unsupported`: its reason, or
    ''), naming what to do instead. An fp8 KV cache needs no fp8 tensor cores and is not refused."""
    if unsupported:
        what = "--quantization fp8" if fp8.online else "this FP8 checkpoint"
        raise QuantizationError(f"{what} needs fp8 tensor cores: {unsupported}; serve a bf16 checkpoint "
                                f"without --quantization (an fp8 KV cache, --kv-cache-dtype fp8, needs none)")


ONLINE = Fp8Format(online=True, block=False)


def checkpoint_format(qc: Mapping[str, Any] | None) -> Fp8Format | None:
    """The fp8 format config.json's quantization_config `qc` declares (None: not quantized)."""
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise QuantizationError(f"config field 'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "fp8":
        return _fp8_format(qc)
    if method == "compressed-tensors":
        return _compressed_tensors_format(qc)
    raise QuantizationError(f"quantization_config.quant_method {method!r} is not supported; {SUPPORTED}")


def _fp8_format(qc: Mapping[str, Any]) -> Fp8Format:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationError(f"quantization_config.fmt {fmt!r} is not supported (only e4m3); {SUPPORTED}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise QuantizationError(f"quantization_config.activation_scheme {scheme!r} is not supported (only "
                                f"dynamic); {SUPPORTED}")
    block = qc.get("weight_block_size")
    if block is None:
        return Fp8Format(online=False, block=False, scale_name="weight_scale")
    if list(block) != [BLOCK, BLOCK]:
        raise QuantizationError(f"quantization_config.weight_block_size {block!r} is not supported (only "
                                f"[128, 128]); {SUPPORTED}")
    return Fp8Format(online=False, block=True, scale_name="weight_scale_inv")


def _compressed_tensors_format(qc: Mapping[str, Any]) -> Fp8Format:
    fmt = qc.get("format")
    if fmt != "float-quantized":
        raise QuantizationError(f"compressed-tensors format {fmt!r} is not supported (only float-quantized); "
                                f"{SUPPORTED}")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping) or len(groups) != 1:
        raise QuantizationError(f"compressed-tensors checkpoints with {len(groups)} config groups are not "
                                f"supported (only one, for every Linear); {SUPPORTED}")
    group = next(iter(groups.values()))
    weights, inputs = group.get("weights") or {}, group.get("input_activations")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or not weights.get("symmetric", True):
        raise QuantizationError(f"compressed-tensors weights {dict(weights)!r} are not supported (only 8-bit "
                                f"float, symmetric); {SUPPORTED}")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise QuantizationError(f"compressed-tensors weight strategy {weights.get('strategy')!r} is not "
                                f"supported (channel or tensor); {SUPPORTED}")
    float8 = inputs is not None and (inputs.get("type"), inputs.get("num_bits")) == ("float", 8)
    if not float8 or not inputs.get("dynamic"):
        raise QuantizationError(f"compressed-tensors input activations {inputs!r} are not supported (only "
                                f"dynamic 8-bit float); {SUPPORTED}")
    ignored = set(qc.get("ignore") or ())
    if ignored - {"lm_head"}:
        raise QuantizationError(f"compressed-tensors 'ignore' {sorted(ignored)!r}: only lm_head may stay "
                                f"unquantized; {SUPPORTED}")
    return Fp8Format(online=False, block=False, scale_name="weight_scale", method="compressed-tensors")


def resolve(checkpoint: Fp8Format | None, flag: str | None) -> Fp8Format | None:
    """The format a server runs: the checkpoint's, or --quantization fp8 on an unquantized one."""
    if flag is None:
        return checkpoint
    if flag not in ("fp8", "compressed-tensors"):
        raise QuantizationError(f"--quantization {flag!r} is not supported; {SUPPORTED}")
    if checkpoint is not None:
        if flag not in ("fp8", checkpoint.method):
            raise QuantizationError(f"--quantization {flag} does not match the checkpoint's quant_method "
                                    f"{checkpoint.method!r}")
        return checkpoint
    if flag != "fp8":
        raise QuantizationError(f"--quantization {flag} needs a {flag} checkpoint; this one is not quantized")
    return ONLINE


def scale_shape(fmt: Fp8Format, n: int, k: int) -> tuple[int, ...] | None:
    """The scale tensor a stored projection of shape [n, k] carries (None: either per-channel
    [n, 1] or per-tensor, read by stored_scale)."""
    if fmt.block:
        return (-(-n // BLOCK), -(-k // BLOCK))
    return None


def stored_scale(fmt: Fp8Format, name: str, scale: np.ndarray, n: int, k: int) -> np.ndarray:
    """A stored weight scale as vt keeps it: f32[n] per channel (a per-tensor scale repeated) or
    f32[ceil(n/128), ceil(k/128)] per block."""
    scale = np.asarray(scale, dtype=np.float32)
    if fmt.block:
        want = scale_shape(fmt, n, k)
        if scale.shape != want:
            raise QuantizationError(f"tensor {name!r}: expected block scales of shape {want}, "
                                    f"found {scale.shape}")
        return scale
    if scale.size == 1:
        return np.full(n, scale.reshape(()), dtype=np.float32)
    if scale.shape in ((n,), (n, 1)):
        return scale.reshape(n)
    raise QuantizationError(f"tensor {name!r}: expected a per-tensor or per-channel scale ([{n}, 1]), "
                            f"found shape {scale.shape}")


def concat_scales(fmt: Fp8Format, parts: list[tuple[str, np.ndarray, int]]) -> np.ndarray:
    """The scales of projections stacked along the output dim (q, k, v; gate, up): per-channel
    scales concatenate; block scales do where every part but the last fills whole 128-row blocks."""
    if fmt.block:
        for name, _, n in parts[:-1]:
            if n % BLOCK:
                raise QuantizationError(f"{name!r} has {n} rows, not a multiple of {BLOCK}: its 128x128 "
                                        "weight blocks cannot be stacked with the next projection's")
    return np.concatenate([s for _, s, _ in parts], axis=0)
