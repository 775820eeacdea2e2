"""The decoder forward, written once over backend ops so it runs on numpy and CUDA alike.

Qwen3 adds per-head q/k RMS norm; Qwen2 (and Llama with attention_bias) adds q/k/v biases.
Only backend ops, .reshape and slicing touch arrays here: no host syncs inside forward.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.config import ModelConfig
from vt.kernels.base import Array, Backend
from vt.model.batch import ForwardBatch


@dataclass
class _Layer:
    input_norm: Array
    qkv: Array          # [(Hq + 2 Hk) D, H]: q, k, v projections stacked along the output dim
    qkv_bias: Array | None
    q_norm: Array | None
    k_norm: Array | None
    o_proj: Array
    post_norm: Array
    gate_up: Array      # [2 I, H]: gate then up
    down: Array


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], ops: Backend) -> None:
        self.cfg = cfg
        self.ops = ops
        self.q_dim = cfg.num_heads * cfg.head_dim
        self.kv_dim = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5

        def w(name: str) -> np.ndarray:
            if name not in weights:
                raise KeyError(f"weights are missing tensor {name!r}")
            return weights[name]

        # Upload tensor by tensor (and merge per layer) so at most one layer's merged copy
        # lives on the host at a time.
        self.embed = ops.upload(w("model.embed_tokens.weight"))
        self.layers: list[_Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv = ops.upload(np.concatenate([w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                                             w(a + "v_proj.weight")], axis=0))
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = ops.upload(np.concatenate([w(a + "q_proj.bias"), w(a + "k_proj.bias"),
                                                      w(a + "v_proj.bias")], axis=0))
            gate_up = ops.upload(np.concatenate([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")],
                                                axis=0))
            self.layers.append(_Layer(
                input_norm=ops.upload(w(p + "input_layernorm.weight")),
                qkv=qkv,
                qkv_bias=qkv_bias,
                q_norm=ops.upload(w(a + "q_norm.weight")) if cfg.qk_norm else None,
                k_norm=ops.upload(w(a + "k_norm.weight")) if cfg.qk_norm else None,
                o_proj=ops.upload(w(a + "o_proj.weight")),
                post_norm=ops.upload(w(p + "post_attention_layernorm.weight")),
                gate_up=gate_up,
                down=ops.upload(w(p + "mlp.down_proj.weight")),
            ))
        self.final_norm = ops.upload(w("model.norm.weight"))
        self.lm_head = self.embed if cfg.tie_word_embeddings else ops.upload(w("lm_head.weight"))
        self.inv_freq = ops.from_host(cfg.inv_freq(), "f32")

    # ---- KV cache --------------------------------------------------------------------------
    def allocate_kv(self, num_blocks: int, block_size: int) -> list[tuple[Array, Array]]:
        """One (k_cache, v_cache) pair per layer, each act[num_blocks, block_size, Hk, D]."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        zeros = self.ops.zeros
        return [(zeros(shape, "act"), zeros(shape, "act")) for _ in range(self.cfg.num_layers)]

    @staticmethod
    def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype_bytes: int) -> int:
        """Bytes one KV block takes across all layers (K and V)."""
        return block_size * cfg.kv_bytes_per_token(dtype_bytes)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch, kv: list[tuple[Array, Array]]) -> Any:
        """Logits f32[B, V] for the rows batch.logits_indices of this ragged step."""
        x, residual = self.hidden(batch, kv)
        return self.head(x, residual, batch.logits_indices)

    def hidden(self, batch: ForwardBatch, kv: list[tuple[Array, Array]],
               attend: Callable[..., Array] | None = None) -> tuple[Array, Array]:
        """The layers: (hidden state, residual) act[T, H] before the final norm. attend, if
        given, stands in for ops.attention (same arguments, returns the output) once per layer:
        the runner's piecewise graphs cut their capture there."""
        cfg, ops = self.cfg, self.ops
        attention = ops.attention if attend is None else attend
        if len(kv) != cfg.num_layers:
            raise ValueError(f"kv has {len(kv)} layers, the model has {cfg.num_layers}")
        t = batch.input_ids.shape[0]
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_end, k_end = self.q_dim, self.q_dim + self.kv_dim
        eps = cfg.rms_norm_eps

        x = ops.embed(batch.input_ids, self.embed)
        residual = None
        # The arena is two alternating regions, one per layer parity: layer l's outputs (hidden
        # state and residual) stay intact while layer l + 1 runs in the other region, and layer
        # l + 2 reuses l's region once l + 1 has consumed them. A step's workspace is then two
        # layers' activations, not all of them, and nothing is copied between layers.
        starts: list[int | None] = [_arena_mark(ops), None]
        for li, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv, strict=True)):
            if starts[0] is not None:
                if starts[li % 2] is None:
                    starts[1] = ops.arena_mark()
                ops.arena_reset(starts[li % 2])
                if residual is None:  # layer 0 makes no residual buffer: take its room anyway,
                    ops.scratch((t, cfg.hidden_size), "act")  # so every layer's footprint is equal
            h, residual = ops.rms_norm(x, layer.input_norm, eps, residual)
            qkv = ops.linear(h, layer.qkv, layer.qkv_bias)
            q = qkv[:, :q_end].reshape(t, hq, d)
            k = qkv[:, q_end:k_end].reshape(t, hk, d)
            v = qkv[:, k_end:].reshape(t, hk, d)
            ops.qk_norm_rope_write_kv(q, k, v, layer.q_norm, layer.k_norm, eps, batch.positions,
                                      self.inv_freq, k_cache, v_cache, batch.slot_mapping)
            o = attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables,
                          self.scale, batch.max_query_len, batch.max_seq_len, decode_seqs=batch.num_decodes)
            x = ops.linear(o.reshape(t, self.q_dim), layer.o_proj, None)
            h, residual = ops.rms_norm(x, layer.post_norm, eps, residual)
            x = ops.linear(ops.silu_mul(ops.linear(h, layer.gate_up, None)), layer.down, None)
            if li % 2 == 0 and starts[1] is not None and ops.arena_mark() > starts[1]:
                raise RuntimeError("a layer's workspace outgrew the first layer's; regions overlap")
        return x, residual

    def head(self, x: Array, residual: Array, logits_indices: Array) -> Any:
        """Final norm and lm_head for rows logits_indices -> logits f32[B, V]."""
        ops = self.ops
        # The final norm is per row, so gather the sampled rows first and normalize only those.
        x_last = ops.gather_rows(x, logits_indices)
        r_last = ops.gather_rows(residual, logits_indices)
        h, _ = ops.rms_norm(x_last, self.final_norm, self.cfg.rms_norm_eps, r_last)
        return ops.logits(h, self.lm_head)


def _arena_mark(ops: Backend) -> int | None:
    """The open arena's offset, or None when the backend has no arena open (numpy, no slot)."""
    try:
        return ops.arena_mark()
    except RuntimeError:
        return None
