"""CUDA graphs of a step: captured once per slot and size, padded to, replayed.

Decode steps (one token a sequence, no admission, no penalty, ban, bias or logprobs) replay a
decode graph of the smallest captured batch size that holds them, in two parts (the forward to
the logits, then the sampler) so that a guided step's masks go between them. Other steps up to
the largest layer-graph size replay per-layer graphs at a padded token count: each layer's
attention runs uncaptured between them, as its grid depends on the batch. Longer steps run eager.

A capture runs nothing on the device; the graphs of a slot read and write only that slot's
buffers and arena, so each of the backend's slots has its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from vt.kernels.base import Backend
from vt.model.batch import ForwardBatch
from vt.model.transformer import Transformer
from vt.runner.buffers import SlotBuffers
from vt.runner.sampler import StepSampler
from vt.runner.staging import StagedBatch, upload_inputs

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
# Token counts the per-layer graphs of other steps are captured for. Longer steps run eager:
# their GPU time dwarfs the ~7 us a launch costs on the host.
LAYER_GRAPH_SIZES = (16, 32, 64, 96, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 2048)
# Device memory kept free for the captured graphs when the KV cache is sized from what is left.
GRAPH_RESERVE = 512 << 20


def padded_size(sizes: tuple[int, ...], n: int) -> int:
    """The smallest captured size that holds n, or 0 when none does (sizes ascending)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else 0


@dataclass
class LayerGraphs:
    """One padded token count's layers, captured per layer for steps no decode graph serves
    (prefill, mixed, penalties, logprobs): graphs[0] runs up to layer 0's attention and
    graphs[l + 1] from layer l's attention output on, the last one to the hidden state.
    Attention runs uncaptured between them (its grid depends on the batch), reading q and
    writing out in place; the final norm, lm_head and sampler run uncaptured after."""

    size: int
    graphs: list[Any]
    # (q, k_cache, v_cache, out, kv_scales) per layer
    attention: list[tuple[Any, Any, Any, Any, tuple[float, float]]]
    hidden: Any                                 # the residual stream the last graph leaves
    high: int                                   # arena bytes the graphs' buffers take


@dataclass(slots=True)
class DecodeGraph:
    """One padded decode size, captured in two parts: `forward` stages the inputs and runs the
    model to `logits`, `sample` runs the sampler on them. A free step replays both back to back;
    a guided step applies its masks to `logits` between them, possibly only once the previous
    step's tokens are in (the forward already running), so guided rows keep the decode graph.
    On CUDA `logits` is the captured buffer every replay rewrites; on numpy each forward replay
    sets it."""

    forward: Any = None
    sample: Any = None
    logits: Any = None
    high: int = 0  # CUDA: the arena offset past the graphs' buffers (eager work goes above it)


class StepGraphs:
    """Every slot's decode graphs and per-layer graphs, by (slot, size)."""

    def __init__(self, ops: Backend, model: Transformer, kv: Any, slots: list[SlotBuffers],
                 sampler: StepSampler, max_seqs: int, max_tokens: int, max_blocks: int,
                 max_model_len: int, decode: bool = True) -> None:
        """decode False: no decode graphs (an embedding model's steps are prompts only, and it
        has no lm_head for a decode graph's logits)."""
        self.ops, self.model, self.kv, self.slots, self.sampler = ops, model, kv, slots, sampler
        self.max_blocks, self.max_model_len = max_blocks, max_model_len
        self.decode: dict[tuple[int, int], DecodeGraph] = {}
        self.layer: dict[tuple[int, int], LayerGraphs] = {}
        self.decode_sizes = tuple(n for n in GRAPH_SIZES if n <= max_seqs) if decode else ()
        top = {max_tokens} if max_tokens <= LAYER_GRAPH_SIZES[-1] else set()
        self.layer_sizes = tuple(sorted({n for n in LAYER_GRAPH_SIZES if n < max_tokens} | top))
        self.enabled = False  # capture() turns it on

    def route(self, staged: StagedBatch, gemm_sms: int) -> tuple[str, int]:
        """How a staged step runs: ("graph", decode size), ("layer_graphs", token count) or
        ("eager", 0). A step whose GEMMs are held to part of the SMs runs eager, so that every
        GEMM is held."""
        if not self.enabled or gemm_sms:
            return "eager", 0
        # decode_only already excludes admissions, hence rows that need a penalty setup.
        # Guided rows keep the decode graph: their masks go between its forward and sampler parts.
        # A cascade's launches depend on the shared prefix, so its steps take the layer graphs,
        # whose attention runs uncaptured.
        if (staged.decode_only and not staged.cascade_blocks and not staged.any_penalty
                and not staged.any_ban and not staged.num_biased
                and staged.logprobs_k == 0 and (padded := padded_size(self.decode_sizes, staged.num_seqs))):
            return "graph", padded
        if self.layer and (padded := padded_size(self.layer_sizes, staged.num_tokens)):
            return "layer_graphs", padded
        return "eager", 0

    # ---- capture ----------------------------------------------------------------------------
    def capture(self) -> None:
        """Capture every size of every slot and turn replay on. Capturing runs nothing on the
        device, and there is no warm-up run: a step reads and writes last_tokens, so running it
        twice would feed the sampled token back in (kernels and cuBLAS handles exist from
        backend start)."""
        self.enabled = True
        for slot, buf in enumerate(self.slots):
            with self.ops.slot(slot):
                for size in self.decode_sizes:
                    pad_decode(buf, 0, 1, size, self.max_blocks)
                    self.decode[(slot, size)] = self._capture_decode(slot, size)
            # numpy ops return fresh arrays instead of rewriting captured ones, so nothing
            # could run between replayed layer graphs there: those steps stay eager.
            if self.ops.name == "cuda":
                for size in self.layer_sizes:
                    self.layer[(slot, size)] = self._capture_layers(slot, size)

    def _capture_decode(self, slot: int, size: int) -> DecodeGraph:
        buf, graph = self.slots[slot], DecodeGraph()

        def forward() -> None:
            fb = upload_inputs(self.ops, buf, self.sampler.last_tokens, size, size, self.max_blocks, 1,
                               self.max_model_len)
            graph.logits = self.model.forward(fb, self.kv)

        def sample() -> None:
            self.sampler.sample(buf, graph.logits, size, 0, False, False)

        if self.ops.name == "cuda":
            def run(cut: Callable[[], None]) -> None:
                forward()
                cut()
                sample()

            (graph.forward, graph.sample), graph.high = self.ops.capture_layer_graphs(slot, run)
        else:
            graph.forward, graph.sample = self.ops.capture_parts(slot, (forward, sample))
        return graph

    def _capture_layers(self, slot: int, size: int) -> LayerGraphs:
        buf, ops = self.slots[slot], self.ops
        attention: list[tuple[Any, Any, Any, Any, tuple[float, float]]] = []
        hidden: list[Any] = []
        # Only the per-token inputs are read inside the layer graphs; the rest goes to attention.
        fb = ForwardBatch(
            input_ids=buf.input_ids[1][:size], positions=buf.positions[1][:size],
            slot_mapping=buf.slot_mapping[1][:size], query_start_loc=buf.query_start_loc[1][:2],
            seq_lens=buf.seq_lens[1][:1], block_tables=buf.block_tables[1][:1].reshape(1, 1),
            logits_indices=buf.logits_indices[1][:1], max_query_len=size, max_seq_len=self.max_model_len)

        def run(cut: Callable[[], None]) -> None:
            def attend(q: Any, k_cache: Any, v_cache: Any, *_: Any,
                       kv_scales: tuple[float, float] = (1.0, 1.0), **__: Any) -> Any:
                out = ops.scratch(q.shape, "act")
                attention.append((q, k_cache, v_cache, out, kv_scales))
                cut()
                return out
            hidden.append(self.model.hidden(fb, self.kv, attend))

        graphs, high = ops.capture_layer_graphs(slot, run)
        return LayerGraphs(size, graphs, attention, hidden[0], high)

    # ---- replay -----------------------------------------------------------------------------
    def replay_decode_forward(self, slot: int, staged: StagedBatch, padded: int) -> DecodeGraph:
        """Pad the staged decodes to the graph's size and replay its forward part; the graph's
        logits then hold the step's."""
        pad_decode(self.slots[slot], staged.num_seqs, staged.max_blocks, padded, self.max_blocks)
        graph = self.decode[(slot, padded)]
        graph.forward.replay()
        return graph

    def replay_layers(self, slot: int, staged: StagedBatch, padded: int) -> Any:
        """The step's layers replayed (replay_hidden), then the head: the logits of its sequences."""
        hidden, fb = self.replay_hidden(slot, staged, padded)
        return self.model.head(hidden, fb.logits_indices)

    def replay_hidden(self, slot: int, staged: StagedBatch, padded: int) -> tuple[Any, ForwardBatch]:
        """Pad the step's tokens to the layer graphs' size (padding rows write no KV and feed no
        sequence), upload, then replay the graphs with each layer's attention between them;
        returns the residual stream they leave and the step's uploaded inputs."""
        ops, buf, layers = self.ops, self.slots[slot], self.layer[(slot, padded)]
        num_tokens = staged.num_tokens
        pad_tokens(buf, num_tokens, layers.size)
        fb = upload_inputs(ops, buf, self.sampler.last_tokens, layers.size, staged.num_seqs,
                           staged.max_blocks, staged.max_query_len, staged.max_seq_len, staged.num_decodes,
                           staged.cascade_blocks)
        ops.arena_reserve(layers.high)
        layers.graphs[0].replay()
        for (q, k_cache, v_cache, out, kv_scales), graph in zip(layers.attention, layers.graphs[1:],
                                                                strict=True):
            ops.attention(q[:num_tokens], k_cache, v_cache, fb.query_start_loc, fb.seq_lens, fb.block_tables,
                          self.model.scale, staged.max_query_len, staged.max_seq_len, out=out[:num_tokens],
                          decode_seqs=fb.num_decodes, kv_scales=kv_scales, cascade_blocks=fb.cascade_blocks)
            graph.replay()
        return layers.hidden, fb


def pad_tokens(buf: SlotBuffers, num_tokens: int, size: int) -> None:
    """Tokens num_tokens..size-1 become padding: no KV write, no input from the last step."""
    for name, value in (("input_ids", 0), ("src_rows", -1), ("positions", 0), ("slot_mapping", -1)):
        getattr(buf, name)[0][num_tokens:size] = value


def pad_decode(buf: SlotBuffers, num_seqs: int, max_blocks: int, size: int, graph_max_blocks: int) -> None:
    """Rows num_seqs..size-1 become harmless: no KV write, one context token, no sampler row.
    The block table is laid out again at the static stride the graph reads, graph_max_blocks."""
    src = buf.block_tables[0][: num_seqs * max_blocks].reshape(num_seqs, max_blocks).copy()
    full = buf.block_tables[0][: size * graph_max_blocks].reshape(size, graph_max_blocks)
    full.fill(0)
    full[:num_seqs, :max_blocks] = src
    pad_tokens(buf, num_seqs, size)
    buf.seq_lens[0][num_seqs:size] = 1
    buf.query_start_loc[0][num_seqs + 1: size + 1] = np.arange(num_seqs + 1, size + 1, dtype=np.int32)
    buf.logits_indices[0][num_seqs:size] = np.arange(num_seqs, size, dtype=np.int32)
    buf.sample_rows[0][num_seqs:size] = -1
    buf.record_rows[0][num_seqs:size] = -1
    buf.temperature[0][num_seqs:size] = 0.0
    buf.top_k[0][num_seqs:size] = 0
    buf.top_p[0][num_seqs:size] = 1.0
    buf.min_p[0][num_seqs:size] = 0.0
    buf.seeds[0][num_seqs:size] = 0
    buf.offsets[0][num_seqs:size] = 0
