"""The numpy-backend Transformer against transformers' own fp32 forward on tiny random checkpoints:
ragged prefill, chunked prefill and decode over a paged KV cache with shuffled block ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.hf_models import hf_logits, load_hf_model, make_hf_checkpoint
from vt.config import ModelConfig
from vt.kernels.numpy_ops import NumpyBackend
from vt.model.batch import ForwardBatch
from vt.model.loader import load_weights
from vt.model.transformer import Transformer

PROMPT_LENS = (5, 1, 9, 14)
RTOL = 1e-4


class PagedRunner:
    """Drives Transformer.forward like a runner would: per-sequence block lists drawn from a
    shuffled pool, so block tables are neither contiguous nor ordered."""

    def __init__(self, model: Transformer, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model, self.bs = model, block_size
        self.kv = model.allocate_kv(num_blocks, block_size)
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.blocks: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], all_rows: bool = False) -> list[np.ndarray]:
        """Feed `chunks[seq]` tokens to each sequence; returns logits per sequence (last row, or
        every row of the chunk when all_rows)."""
        ids, pos, slots, qsl, seq_lens, rows = [], [], [], [0], [], []
        for seq, toks in chunks.items():
            start = self.lens.get(seq, 0)
            blocks = self.blocks.setdefault(seq, [])
            end = start + len(toks)
            while len(blocks) * self.bs < end:
                blocks.append(int(self.free.pop()))
            for j, tok in enumerate(toks):
                p = start + j
                ids.append(tok)
                pos.append(p)
                slots.append(blocks[p // self.bs] * self.bs + p % self.bs)
            base = qsl[-1]
            rows.extend(range(base, base + len(toks)) if all_rows else [base + len(toks) - 1])
            qsl.append(base + len(toks))
            seq_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.blocks[s]) for s in chunks)
        # Unused table entries hold garbage ids on purpose: attention must not read past seq_len.
        table = np.full((len(chunks), width + 1), 10**6, dtype=np.int32)
        for b, seq in enumerate(chunks):
            table[b, : len(self.blocks[seq])] = self.blocks[seq]
        i32 = lambda a: np.asarray(a, dtype=np.int32)
        batch = ForwardBatch(i32(ids), i32(pos), i32(slots), i32(qsl), i32(seq_lens), table, i32(rows),
                             max(len(t) for t in chunks.values()), max(seq_lens))
        logits = self.model.forward(batch, self.kv)
        assert logits.dtype == np.float32 and logits.shape == (len(rows), self.model.cfg.vocab_size)
        out, r = [], 0
        for toks in chunks.values():
            n = len(toks) if all_rows else 1
            out.append(logits[r : r + n])
            r += n
        return out


def rel_err(got: np.ndarray, ref: torch.Tensor) -> float:
    ref_np = ref.numpy()
    return float(np.linalg.norm(got - ref_np) / np.linalg.norm(ref_np))


def prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in PROMPT_LENS]


def build(path: Path, arch: str, **overrides) -> tuple[Transformer, torch.nn.Module]:
    ckpt = make_hf_checkpoint(path, arch=arch, **overrides)
    cfg = ModelConfig.from_dir(ckpt)
    return Transformer(cfg, load_weights(ckpt, cfg), NumpyBackend()), load_hf_model(ckpt)


CASES = {
    "qwen3": dict(arch="qwen3"),
    "qwen3-tied-3layers": dict(arch="qwen3", num_hidden_layers=3, tie_word_embeddings=True),
    "llama": dict(arch="llama"),
    "llama3-rope-scaling": dict(
        arch="llama", rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2-bias": dict(arch="qwen2"),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def models(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param), **CASES[request.param])


def test_ragged_prefill_matches_transformers_at_every_position(models):
    model, hf = models
    ps = prompts(model.cfg.vocab_size)
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    got = runner.step(dict(enumerate(ps)), all_rows=True)
    for seq, p in enumerate(ps):
        assert rel_err(got[seq], hf_logits(hf, p)) < RTOL, f"sequence {seq}"


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode_matches_transformers(models, block_size):
    model, hf = models
    ps = prompts(model.cfg.vocab_size, seed=block_size)
    runner = PagedRunner(model, num_blocks=64, block_size=block_size, seed=block_size)
    # Chunk sizes 3 then 5 then the rest: boundaries fall mid-block for both block sizes.
    done = [0] * len(ps)
    last: dict[int, np.ndarray] = {}
    for size in (3, 5, 100):
        chunks = {s: p[done[s] : done[s] + size] for s, p in enumerate(ps) if done[s] < len(p)}
        for s, logits in zip(chunks, runner.step(chunks, all_rows=True), strict=True):
            ref = hf_logits(hf, ps[s][: done[s] + len(chunks[s])])[done[s] :]
            assert rel_err(logits, ref) < RTOL, f"sequence {s} chunk of {size}"
            done[s] += len(chunks[s])
            last[s] = logits[-1]
    seqs = [list(p) for p in ps]
    for step in range(4):
        nxt = {}
        for s, seq in enumerate(seqs):
            ref_last = hf_logits(hf, seq)[-1]
            assert rel_err(last[s], ref_last) < RTOL, f"sequence {s} decode step {step}"
            nxt[s] = int(ref_last.argmax())
            seq.append(nxt[s])
        out = runner.step({s: [t] for s, t in nxt.items()})
        last = {s: o[0] for s, o in enumerate(out)}
    for s, seq in enumerate(seqs):
        assert rel_err(last[s], hf_logits(hf, seq)[-1]) < RTOL


def test_bf16_and_sharded_checkpoints_give_transformers_logits(tmp_path):
    ckpt = make_hf_checkpoint(tmp_path / "bf16", arch="qwen3", dtype="bfloat16", max_shard_size="40KB",
                              seed=5)
    assert (ckpt / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_dir(ckpt)
    assert cfg.dtype == "bfloat16"
    model = Transformer(cfg, load_weights(ckpt, cfg), NumpyBackend())
    hf = load_hf_model(ckpt)  # the same bf16 weights, upcast to fp32
    ps = prompts(cfg.vocab_size)
    got = PagedRunner(model, num_blocks=32, block_size=16).step(dict(enumerate(ps)))
    for seq, p in enumerate(ps):
        assert rel_err(got[seq][0], hf_logits(hf, p)[-1]) < RTOL


def test_padding_slots_do_not_change_other_rows(models):
    model, _ = models
    ps = prompts(model.cfg.vocab_size)[:2]
    ref = PagedRunner(model, 16, 4).step(dict(enumerate(ps)))
    runner = PagedRunner(model, 16, 4)
    # Same step with a trailing padding row (slot -1) that must not be written to the cache.
    ids = ps[0] + ps[1] + [7]
    n0, n1 = len(ps[0]), len(ps[1])
    blocks0, blocks1 = [0, 1], [2, 3, 4]
    slot = lambda blocks, p: blocks[p // 4] * 4 + p % 4
    slots = [slot(blocks0, p) for p in range(n0)] + [slot(blocks1, p) for p in range(n1)]
    table = np.array([blocks0 + [0], blocks1], dtype=np.int32)
    i32 = lambda a: np.asarray(a, dtype=np.int32)
    before = [(k.copy(), v.copy()) for k, v in runner.kv]
    batch = ForwardBatch(i32(ids), i32(list(range(n0)) + list(range(n1)) + [0]), i32(slots + [-1]),
                         i32([0, n0, n0 + n1]), i32([n0, n1]), table, i32([n0 - 1, n0 + n1 - 1]),
                         max(n0, n1), max(n0, n1))
    got = model.forward(batch, runner.kv)
    np.testing.assert_allclose(got, np.concatenate([r for r in ref]), rtol=1e-5, atol=1e-5)
    written = {b * 4 + o for b in blocks0 + blocks1 for o in range(4)}
    for (k, _), (k0, _) in zip(runner.kv, before, strict=True):
        flat, flat0 = k.reshape(-1, *k.shape[2:]), k0.reshape(-1, *k0.shape[2:])
        untouched = [s for s in range(flat.shape[0]) if s not in written]
        np.testing.assert_array_equal(flat[untouched], flat0[untouched])
