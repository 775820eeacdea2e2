"""The decoder forward, written once over backend ops so it runs on numpy and CUDA alike.

Qwen3 adds per-head q/k RMS norm; Qwen2 (and Llama with attention_bias) adds q/k/v biases.
Only backend ops, .reshape and slicing touch arrays here: no host syncs inside forward.

The two RMS norms of a layer launch nothing of their own. Each norm's weight is folded into the
projection that reads it (qkv, gate_up) at load, the projection reads the residual stream as it
is, and the op after it (the attention prologue, silu_mul) scales each row by the row's
rsqrt(mean square); that per-row factor commutes with the GEMM. The residual adds happen in the
output projections (o_proj, down) accumulating into the residual stream.

Split over a tensor-parallel group (vt.model.shard), the same code runs on a rank group backend:
heads, KV heads and MLP columns below are one rank's, and the group's linear_residual and logits
do the all-reduce and the all-gather where the split needs them.

With fp8 weights (vt.model.quantization) the norms are not folded: a projection's input is the
norm's output quantized per token (and per 128 columns for block-scaled weights) in the norm's
own kernel (rms_norm_quant), SiLU-mul quantizes what it writes (mlp_act_fp8), and the attention
output is quantized before o_proj; the GEMMs run on fp8 operands with fp32 accumulation. Where
o_proj's product lands in a buffer of its own (CUDA, 17-256 rows), the post-attention norm adds it
to the residual stream as it reads the stream (linear_fp8_residual(defer=True)).

With an fp8 KV cache (--kv-cache-dtype fp8) each layer's cache holds e4m3 codes of k / k_scale
and v / v_scale, per-tensor scales that are the checkpoint's (k_scale / v_scale) or 1.0, as vLLM
applies them: the prologue quantizes as it writes, attention reads code * scale. The scales are
Python floats fixed at load, passed to the ops as arguments (kernel scalars on CUDA, so captured
graphs hold them), never read from device memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.config import ModelConfig
from vt.kernels.base import Array, Backend
from vt.kernels.quantized import Fp8Weight, PendingResidual
from vt.kernels.rank_group import rank_count
from vt.model.batch import ForwardBatch
from vt.model.loader import kv_scale_name
from vt.model.quantization import Fp8Format, QuantizationError, concat_scales
from vt.model.shard import TensorSplit, concat_rows


@dataclass
class _Layer:
    qkv: Array          # [(Hq + 2 Hk) D, H]: q, k, v stacked along the output dim, input norm folded in
    qkv_bias: Array | None
    q_norm: Array | None
    k_norm: Array | None
    o_proj: Array
    gate_up: Array      # [2 I, H]: gate then up, post-attention norm folded in
    down: Array
    # fp8 weights (qkv, o_proj, gate_up, down are then Fp8Weight): the norms stay separate
    input_norm: Array | None = None
    post_norm: Array | None = None


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], ops: Backend,
                 tensor_parallel_size: int = 1, fp8: Fp8Format | None = None, lm_head: bool = True,
                 kv_cache_dtype: str = "auto") -> None:
        """tensor_parallel_size > 1: ops is a rank group of that size (vt.kernels.rank_group) and
        each rank gets its shard of every split tensor (vt.model.shard); dims below are a rank's.
        fp8: the projections' fp8 format (weights as vt.model.loader.load_weights read them).
        lm_head False: the decoder without its head (an embedding model: norm_rows, no logits).
        kv_cache_dtype: "auto" (the cache in act dtype) or "fp8" (e4m3 codes, each layer's
        scales from the checkpoint's k_scale / v_scale tensors, else 1.0)."""
        if kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: expected 'auto' or 'fp8'")
        self.cfg = cfg
        self.kv_cache_dtype = kv_cache_dtype
        # (k_scale, v_scale) per layer; an act cache ignores them, as vLLM ignores a checkpoint's
        # scales without an fp8 cache.
        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * cfg.num_layers
        self.kv_scales_from_checkpoint = False
        if kv_cache_dtype == "fp8":
            self.kv_scales = [(float(weights.get(kv_scale_name(i, "k_scale"), 1.0)),
                               float(weights.get(kv_scale_name(i, "v_scale"), 1.0)))
                              for i in range(cfg.num_layers)]
            self.kv_scales_from_checkpoint = any(kv_scale_name(i, x) in weights for i in range(cfg.num_layers)
                                                 for x in ("k_scale", "v_scale"))
        self.ops = ops
        self.fp8 = fp8
        if fp8 is not None and tensor_parallel_size > 1:
            raise QuantizationError("fp8 weights with --tensor-parallel-size above 1 are not supported yet")
        self.split = split = TensorSplit.of(cfg, tensor_parallel_size)
        if rank_count(ops) != split.size:
            raise ValueError(f"a {split.size}-way split needs a backend of {split.size} ranks, "
                             f"got {rank_count(ops)}")
        self.q_dim = split.heads * cfg.head_dim
        self.kv_dim = split.kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5

        def w(name: str) -> Any:
            if name not in weights:
                raise KeyError(f"weights are missing tensor {name!r}")
            return split.select(name, weights[name])

        # Upload tensor by tensor (and merge per layer) so at most one layer's merged copy
        # lives on the host at a time.
        self.embed = ops.upload(w("model.embed_tokens.weight"))
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            if fp8 is not None:
                self.layers.append(self._fp8_layer(i, w, weights))
                continue
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = ops.upload(concat_rows([w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                                          w(a + "v_proj.weight")]))
            qkv_bias = self._qkv_bias(a, w)
            gate_up = ops.upload(concat_rows([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]))
            ops.fold_norm_weight(qkv, ops.upload(w(p + "input_layernorm.weight")))
            ops.fold_norm_weight(gate_up, ops.upload(w(p + "post_attention_layernorm.weight")))
            self.layers.append(_Layer(
                qkv=ops.gemm_layout(qkv),
                qkv_bias=qkv_bias,
                q_norm=ops.upload(w(a + "q_norm.weight")) if cfg.qk_norm else None,
                k_norm=ops.upload(w(a + "k_norm.weight")) if cfg.qk_norm else None,
                o_proj=ops.gemm_layout(ops.upload(w(a + "o_proj.weight"))),
                gate_up=ops.gemm_layout(gate_up),
                down=ops.gemm_layout(ops.upload(w(p + "mlp.down_proj.weight"))),
            ))
        self.final_norm = ops.upload(w("model.norm.weight"))
        tied = cfg.tie_word_embeddings
        self.lm_head: Array | None = None
        if lm_head:
            self.lm_head = split.lm_head_of(self.embed) if tied else ops.upload(w("lm_head.weight"))
        self.inv_freq = ops.from_host(cfg.inv_freq(), "f32")

    def _qkv_bias(self, attn: str, w: Callable[[str], Any]) -> Array | None:
        """The q, k, v biases stacked as the qkv projection stacks its rows (Qwen2; else None)."""
        if not self.cfg.attention_bias:
            return None
        return self.ops.upload(concat_rows([w(attn + f"{x}_proj.bias") for x in "qkv"]))

    def _fp8_layer(self, i: int, w: Callable[[str], Any], weights: Mapping[str, np.ndarray]) -> _Layer:
        """One layer's projections as fp8 weights (stacked as the bf16 ones are), its norms kept."""
        ops, cfg, fp8 = self.ops, self.cfg, self.fp8
        assert fp8 is not None
        p = f"model.layers.{i}."
        a = p + "self_attn."

        def projection(names: list[str]) -> Fp8Weight:
            if fp8.online:  # quantized per output channel from the checkpoint's own weights
                return ops.quantize_weight(ops.upload(concat_rows([w(n + ".weight") for n in names])))
            q = concat_rows([w(n + ".weight") for n in names])
            scales = [(n, weights[f"{n}.{fp8.scale_name}"], w(n + ".weight").shape[0]) for n in names]
            return ops.upload_fp8(q, concat_scales(fp8, scales))

        return _Layer(
            qkv=projection([a + "q_proj", a + "k_proj", a + "v_proj"]),
            qkv_bias=self._qkv_bias(a, w),
            q_norm=ops.upload(w(a + "q_norm.weight")) if cfg.qk_norm else None,
            k_norm=ops.upload(w(a + "k_norm.weight")) if cfg.qk_norm else None,
            o_proj=projection([a + "o_proj"]),
            gate_up=projection([p + "mlp.gate_proj", p + "mlp.up_proj"]),
            down=projection([p + "mlp.down_proj"]),
            input_norm=ops.upload(w(p + "input_layernorm.weight")),
            post_norm=ops.upload(w(p + "post_attention_layernorm.weight")),
        )

    # ---- KV cache --------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int, block_size: int) -> list[tuple[Array, Array]]:
        """One (k_cache, v_cache) pair per layer, each act[num_blocks, block_size, Hk, D] (Hk: the
        KV heads of one rank), or fp8 codes of that shape with an fp8 KV cache."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        shape = (num_blocks, block_size, self.split.kv_heads, self.cfg.head_dim)
        zeros, dtype = self.ops.zeros, "fp8" if self.kv_cache_dtype == "fp8" else "act"
        return [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(self.cfg.num_layers)]

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int,
                           tensor_parallel_size: int = 1) -> int:
        """Bytes one KV block takes across all layers (K and V), on each rank of the split."""
        kv_heads = TensorSplit.of(cfg, tensor_parallel_size).kv_heads
        return block_size * cfg.kv_bytes_per_token(dtype_bytes) // cfg.num_kv_heads * kv_heads

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: list[tuple[Array, Array]]) -> Any:
        """Logits f32[B, V] for the rows batch.logits_indices of this ragged step."""
        return self.head(self.hidden(batch, kv), batch.logits_indices)

    def hidden(self, batch: ForwardBatch, kv: list[tuple[Array, Array]],
               attend: Callable[..., Array] | None = None) -> Array:
        """The layers: the residual stream act[T, H] before the final norm. attend, if given,
        stands in for ops.attention (same arguments, returns the output) once per layer: the
        runner's piecewise graphs cut their capture there."""
        cfg, ops = self.cfg, self.ops
        attention = ops.attention if attend is None else attend
        if len(kv) != cfg.num_layers:
            raise ValueError(f"kv has {len(kv)} layers, the model has {cfg.num_layers}")
        t = batch.input_ids.shape[0]
        hq, hk, d = self.split.heads, self.split.kv_heads, cfg.head_dim
        q_end, k_end = self.q_dim, self.q_dim + self.kv_dim
        eps = cfg.rms_norm_eps

        # The residual stream is the only thing that crosses layers, updated in place; every
        # layer's other outputs reuse one arena region after it.
        r = ops.embed(batch.input_ids, self.embed)
        start = _arena_mark(ops)
        group = None if self.fp8 is None else self.fp8.activation_group
        pending = None  # fp8: a layer's down_proj product the next layer's input norm adds
        for layer, (k_cache, v_cache), kv_scales in zip(self.layers, kv, self.kv_scales, strict=True):
            if start is not None:
                ops.arena_reset(start)
            if self.fp8 is not None:
                pending = self._fp8_layer_forward(layer, r, batch, k_cache, v_cache, kv_scales, attention,
                                                  group, pending)
                continue
            qkv = ops.linear(r, layer.qkv, None)
            q = qkv[:, :q_end].reshape(t, hq, d)
            k = qkv[:, q_end:k_end].reshape(t, hk, d)
            v = qkv[:, k_end:].reshape(t, hk, d)
            ops.qk_norm_rope_write_kv(q, k, v, layer.q_norm, layer.k_norm, eps, batch.positions,
                                      self.inv_freq, k_cache, v_cache, batch.slot_mapping,
                                      rms_of=r, bias=layer.qkv_bias, kv_scales=kv_scales)
            o = attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                          self.scale, batch.max_query_len, batch.max_seq_len, decode_seqs=batch.num_decodes,
                          follows_kv_write=True, kv_scales=kv_scales, cascade_blocks=batch.cascade_blocks)
            ops.linear_residual(o.reshape(t, self.q_dim), layer.o_proj, r)
            gate_up = ops.linear(r, layer.gate_up, None)
            ops.linear_residual(ops.silu_mul(gate_up, rms_of=r, eps=eps), layer.down, r)
        if pending is not None:
            ops.add_pending(r, pending)
        return r

    def _fp8_layer_forward(self, layer: _Layer, r: Array, batch: ForwardBatch, k_cache: Array, v_cache: Array,
                           kv_scales: tuple[float, float], attention: Callable[..., Array],
                           group: int | None, pending: PendingResidual | None) -> PendingResidual | None:
        """One layer on fp8 weights, the residual stream r updated in place once `pending` (the
        layer before's down_proj product, if it was deferred) is added by the input norm; returns
        this layer's down_proj product where the backend deferred it. The arena is rewound between
        layers, so that product lies in memory a later allocation may reuse: only the next input
        norm's launch may come between (CUDA's rms_norm_quant refuses outputs that overlap it)."""
        cfg, ops = self.cfg, self.ops
        t = batch.input_ids.shape[0]
        hq, hk, d = self.split.heads, self.split.kv_heads, cfg.head_dim
        q_end, k_end = self.q_dim, self.q_dim + self.kv_dim
        eps = cfg.rms_norm_eps
        # qkv may come back as unit-scale sums: the prologue gives them their scales
        qkv, scales = ops.linear_fp8_defer(ops.rms_norm_quant(r, layer.input_norm, eps, group, pending),
                                           layer.qkv)
        q = qkv[:, :q_end].reshape(t, hq, d)
        k = qkv[:, q_end:k_end].reshape(t, hk, d)
        v = qkv[:, k_end:].reshape(t, hk, d)
        ops.qk_norm_rope_write_kv(q, k, v, layer.q_norm, layer.k_norm, eps, batch.positions, self.inv_freq,
                                  k_cache, v_cache, batch.slot_mapping, rms_of=None, bias=layer.qkv_bias,
                                  kv_scales=kv_scales, scales=scales)
        o = attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                      self.scale, batch.max_query_len, batch.max_seq_len, decode_seqs=batch.num_decodes,
                      follows_kv_write=True, kv_scales=kv_scales, cascade_blocks=batch.cascade_blocks)
        # o_proj's product may come back un-added: the post-attention norm adds it (one launch)
        o_q = ops.quantize_fp8(o.reshape(t, self.q_dim), group)
        act = ops.mlp_act_fp8(r, layer.post_norm, eps, group, layer.gate_up,
                              pending=ops.linear_fp8_residual(o_q, layer.o_proj, r, defer=True))
        # and down_proj's too: the next layer's input norm adds it, or add_pending after the last
        return ops.linear_fp8_residual(act, layer.down, r, defer=True)

    def head(self, r: Array, logits_indices: Array) -> Any:
        """Final norm and lm_head for rows logits_indices of the residual stream -> f32[B, V]."""
        if self.lm_head is None:
            raise RuntimeError("this model was loaded without its lm_head (an embedding model): no logits")
        return self.ops.logits(self.norm_rows(r, logits_indices), self.lm_head)

    def norm_rows(self, r: Array, rows: Array) -> Array:
        """The final norm of rows `rows` of the residual stream -> act[B, H]: what the lm_head
        reads, and an embedding model's pooled last-token states."""
        ops = self.ops
        # The final norm is per row, so gather the rows first and normalize only those.
        h, _ = ops.rms_norm(ops.gather_rows(r, rows), self.final_norm, self.cfg.rms_norm_eps, None)
        return h


def _arena_mark(ops: Backend) -> int | None:
    """The open arena's offset, or None when the backend has no arena open (numpy, no slot)."""
    try:
        return ops.arena_mark()
    except RuntimeError:
        return None
