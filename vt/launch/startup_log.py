"""The start-up summary `vt serve` logs once it is ready: device, model shape and dtype, weight
memory, KV cache capacity and concurrency, captured graphs, sampling defaults, start-up time."""

from __future__ import annotations

import os
from typing import Any

from vt import __version__
from vt.config import ModelConfig
from vt.model.generation_config import SamplingDefaults

GIB = 1024**3


def seconds_since_process_start() -> float | None:
    """How long ago this process started, from the kernel's record (None where /proc has none):
    the interpreter and the imports count, as they do for whoever waits for /health."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        with open("/proc/uptime", "rb") as f:
            uptime = float(f.read().split()[0])
        # the name field may hold spaces: the start time is the 20th field after its closing ')'
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        return max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.1f} MiB"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def num_parameters(mc: ModelConfig) -> int:
    """Parameters of the decoder as the checkpoint stores them (a tied lm_head counted once)."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    layer = h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size + 2 * h
    if mc.attention_bias:
        layer += q + 2 * kv
    if mc.qk_norm:
        layer += 2 * mc.head_dim
    head = 0 if mc.tie_word_embeddings else mc.vocab_size * h
    return mc.vocab_size * h + mc.num_layers * layer + h + head


def projection_parameters(mc: ModelConfig) -> int:
    """Parameters of the layers' projections (q, k, v, o, gate, up, down): what fp8 quantizes."""
    h, q, kv = mc.hidden_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return mc.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * mc.intermediate_size)


def _weights_line(mc: ModelConfig, fp8: Any, dtype_bytes: int) -> str:
    params = num_parameters(mc)
    if fp8 is None:
        return f"weights: {_count(params)} parameters, {_bytes(params * dtype_bytes)}"
    proj = projection_parameters(mc)
    if fp8.online:
        how = "quantized at load (--quantization fp8), a scale per output channel"
    else:
        how = f"as stored ({fp8.method} checkpoint, {'128x128 block' if fp8.block else 'per-channel'} scales)"
    group = "token and 128 columns" if fp8.block else "token"
    return (f"weights: {_count(params)} parameters, {_bytes(proj + (params - proj) * dtype_bytes)}: the "
            f"projections in fp8 e4m3 {how}, activations quantized per {group}; embeddings, norms and "
            "lm_head in bf16")


def _device_name(ops: Any) -> str:
    if ops.name != "cuda":
        return "cpu (numpy backend: float32 compute from the bfloat16 weights)"
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = props["name"]
        return f"cuda ({name.decode() if isinstance(name, bytes) else name})"
    except Exception:  # the name is a nicety; the summary goes on without it
        return "cuda"


def _kv_dtype(kv_cache_dtype: str, runner: Any) -> str:
    """An fp8 KV cache named, with where its scales came from ("" for the model's dtype)."""
    if kv_cache_dtype != "fp8":
        return ""
    source = ("the checkpoint's k_scale / v_scale" if runner.model.kv_scales_from_checkpoint
              else "scales 1.0: the checkpoint has no k_scale / v_scale")
    return f" of fp8 e4m3 ({source})"


def startup_lines(engine: Any, seconds: float, defaults: SamplingDefaults | None = None) -> list[str]:
    """The summary as log lines, read off a started AsyncEngine."""
    from vt.model.transformer import Transformer
    from vt.runner.memory_plan import kv_item_bytes

    mc: ModelConfig = engine.model_config
    runner, cfg = engine.runner, engine.config
    dtype_bytes = 2 if engine.ops.name == "cuda" else 4
    kv_bytes_each = kv_item_bytes(engine.ops.name, cfg.kv_cache_dtype)
    kv_tokens = runner.num_blocks * cfg.block_size
    tp = cfg.tensor_parallel_size  # KV bytes over all ranks (a KV head may live on several)
    kv_bytes = runner.num_blocks * Transformer.kv_bytes_per_block(mc, cfg.block_size, kv_bytes_each, tp) * tp
    ranks = f", {tp} tensor-parallel ranks" if tp > 1 else ""
    if runner.use_graphs:
        graphs = (f"{len(runner.graphs)} decode graphs ({len(runner.graph_sizes)} batch sizes) and "
                  f"{len(runner.layer_graphs)} per-layer prefill graph sets captured")
    else:
        graphs = "none (eager steps: " + ("--enforce-eager" if cfg.enforce_eager else "numpy backend") + ")"
    lines = [
        f"vt {__version__} on {_device_name(engine.ops)}{ranks}",
        f"model {cfg.model}: {mc.architecture}, {mc.num_layers} layers, hidden {mc.hidden_size}, "
        f"{mc.num_heads} heads / {mc.num_kv_heads} KV heads of {mc.head_dim}, vocab {mc.vocab_size}, "
        f"{mc.dtype} checkpoint",
        _weights_line(mc, runner.fp8, dtype_bytes),
        f"KV cache: {runner.num_blocks} blocks of {cfg.block_size} tokens = {kv_tokens} tokens, "
        f"{_bytes(kv_bytes)}{_kv_dtype(cfg.kv_cache_dtype, runner)}; maximum concurrency at "
        f"{engine.max_model_len} tokens per request: {kv_tokens / engine.max_model_len:.2f}x",
        f"scheduling: {cfg.scheduling_policy}, up to {cfg.max_num_seqs} sequences and "
        f"{cfg.max_num_batched_tokens} tokens a step, async scheduling "
        f"{'on' if engine.depth == 2 else 'off'}",
        f"CUDA graphs: {graphs}",
    ]
    if (pooling := getattr(engine, "pooling", None)) is not None:
        lines.append(f"runner: pooling (an embedding model on /v1/embeddings): {pooling.describe()}")
    if defaults is not None and defaults.values:
        lines.append(f"default sampling parameters from {defaults.source}: {defaults.describe()} "
                     "(a request's own values win; --generation-config vllm turns these off)")
    lines.append(f"start-up took {seconds:.1f} s")
    return lines
