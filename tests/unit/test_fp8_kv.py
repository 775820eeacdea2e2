"""--kv-cache-dtype fp8 on the numpy backend: the flag (and vLLM's fp8_e4m3), the twin's write
and read (e4m3 codes of x / scale, read as code * scale), the checkpoint's k_scale / v_scale,
twice the blocks in the same memory, the start-up summary, logits close to the float cache, and
the engine's promises unchanged with an fp8 cache: depth 2 samples depth 1's tokens, preemption
and prefix-cache hits keep outputs, structured outputs with the decode graph, fp8 weights too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.unit import test_preemption_exact as preemption
from tests.unit import test_structured_engine as structured
from vt.config import EngineConfig, ModelConfig, kv_cache_dtype_of
from vt.kernels.numpy_fp8 import E4M3, quantize_rows_pow2
from vt.kernels.numpy_ops import NumpyBackend
from vt.launch.cli import build_parser
from vt.launch.startup_log import startup_lines
from vt.launch.vllm_flags import FlagError, check_model_flags
from vt.model.batch import ForwardBatch
from vt.model.loader import load_weights
from vt.model.make_model import make_model
from vt.model.transformer import Transformer
from vt.runner.memory_plan import kv_cache_blocks

FP8 = {"kv_cache_dtype": "fp8"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("kv8") / "tiny-qwen3", preset="tiny")


def _with_kv_scales(src: Path, dst: Path, k_scale: float, v_scale: float, attn: bool = False) -> Path:
    """A copy of checkpoint src whose layers carry KV cache scales (under self_attn. or, as
    some exports write them, self_attn.attn.)."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    cfg = ModelConfig.from_dir(dst)
    where = "self_attn.attn." if attn else "self_attn."
    for i in range(cfg.num_layers):
        tensors[f"model.layers.{i}.{where}k_scale"] = np.array(k_scale, np.float32)
        tensors[f"model.layers.{i}.{where}v_scale"] = np.array(v_scale, np.float32)
    save_file(tensors, dst / "model.safetensors")
    return dst


# ---- the flag --------------------------------------------------------------------------------
@pytest.mark.parametrize("value,served", [("auto", "auto"), ("fp8", "fp8"), ("fp8_e4m3", "fp8")])
def test_kv_cache_dtype_flag_takes_vllms_names(value: str, served: str) -> None:
    args = build_parser().parse_args(["serve", "m", "--kv-cache-dtype", value])
    check_model_flags(args)
    assert EngineConfig(model="m", kv_cache_dtype=value).kv_cache_dtype == served
    assert build_parser().parse_args(["serve", "m"]).kv_cache_dtype == "auto"


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8"])
def test_other_kv_cache_dtypes_are_a_clear_error(value: str) -> None:
    args = build_parser().parse_args(["serve", "m", "--kv-cache-dtype", value])
    with pytest.raises(FlagError, match=f"--kv-cache-dtype {value}: .*fp8_e4m3"):
        check_model_flags(args)
    with pytest.raises(ValueError, match="e4m3" if value.startswith("fp8") else "not a KV cache dtype"):
        kv_cache_dtype_of(value)


# ---- the numpy twin --------------------------------------------------------------------------
def test_write_kv_stores_e4m3_codes_of_x_over_scale() -> None:
    ops, rng = NumpyBackend(), np.random.default_rng(0)
    t, hk, d, nb, bs = 5, 2, 16, 4, 4
    k = (rng.standard_normal((t, hk, d)) * 300).astype(np.float32)
    v = rng.standard_normal((t, hk, d)).astype(np.float32)
    k[0, 0, 0], k[0, 0, 1] = 5000.0, -1e6   # past 448 * scale: saturate
    kc, vc = ops.zeros((nb, bs, hk, d), "fp8"), ops.zeros((nb, bs, hk, d), "fp8")
    assert kc.dtype == E4M3
    slots = np.array([3, -1, 0, 9, 15], np.int32)
    ops.write_kv(k, v, kc, vc, slots, kv_scales=(2.0, 0.25))
    flat_k, flat_v = kc.reshape(-1, hk, d), vc.reshape(-1, hk, d)
    for row, slot in enumerate(slots):
        if slot < 0:
            continue
        want_k = np.clip(k[row] / np.float32(2.0), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        want_v = np.clip(v[row] / np.float32(0.25), -448, 448).astype(ml_dtypes.float8_e4m3fn)
        assert (flat_k[slot].view(np.uint8) == want_k.view(np.uint8)).all()
        assert (flat_v[slot].view(np.uint8) == want_v.view(np.uint8)).all()
    assert float(flat_k[3, 0, 0]) == 448.0 and float(flat_k[3, 0, 1]) == -448.0
    untouched = np.setdiff1d(np.arange(nb * bs), slots[slots >= 0])
    assert (flat_k[untouched].view(np.uint8) == 0).all()


def test_attention_reads_code_times_scale() -> None:
    """Attention over an fp8 cache is attention over the float cache code * scale, exactly."""
    ops, rng = NumpyBackend(), np.random.default_rng(1)
    hq, hk, d, nb, bs = 4, 2, 16, 6, 4
    kc = (rng.standard_normal((nb, bs, hk, d)) * 20).astype(E4M3)
    vc = (rng.standard_normal((nb, bs, hk, d)) * 20).astype(E4M3)
    q = rng.standard_normal((5, hq, d)).astype(np.float32)
    qsl, seq_lens = np.array([0, 1, 5], np.int32), np.array([9, 7], np.int32)
    tables = np.array([[4, 0, 2], [1, 5, 3]], np.int32)
    scales = (0.05, 0.5)
    got = ops.attention(q, kc, vc, qsl, seq_lens, tables, d ** -0.5, 4, 9, decode_seqs=1, kv_scales=scales)
    k32 = kc.astype(np.float32) * np.float32(scales[0])
    v32 = vc.astype(np.float32) * np.float32(scales[1])
    want = ops.attention(q, k32, v32, qsl, seq_lens, tables, d ** -0.5, 4, 9, decode_seqs=1)
    assert np.array_equal(got, want)


def test_the_prologue_quantizes_what_it_writes() -> None:
    """qk_norm_rope_write_kv into an fp8 cache writes the codes write_kv would of the same k, v."""
    ops, rng = NumpyBackend(), np.random.default_rng(2)
    t, hq, hk, d = 3, 4, 2, 16
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) for h in (hq, hk, hk))
    qn, kn = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    pos, slots = np.array([0, 1, 2], np.int32), np.array([2, 0, 1], np.int32)
    caches = [ops.zeros((1, 4, hk, d), "fp8") for _ in range(4)]
    k_after = k.copy()
    ops.qk_norm_rope_write_kv(q.copy(), k_after, v, qn, kn, 1e-6, pos, inv_freq, caches[0], caches[1], slots,
                              kv_scales=(0.5, 2.0))
    ops.write_kv(k_after, v, caches[2], caches[3], slots, kv_scales=(0.5, 2.0))
    assert caches[0].view(np.uint8).tolist() == caches[2].view(np.uint8).tolist()
    assert caches[1].view(np.uint8).tolist() == caches[3].view(np.uint8).tolist()


def test_over_an_fp8_cache_the_prologue_leaves_q_as_e4m3_times_a_power_of_two() -> None:
    """Every attention kernel over an fp8 cache reads one query: each q head row rounded to e4m3
    x 2^n (n from the row's amax), which the e4m3 Q K^T prompt kernel takes as exact codes. A
    float cache leaves q unrounded."""
    ops, rng = NumpyBackend(), np.random.default_rng(3)
    t, hq, hk, d = 3, 4, 2, 16
    q, k, v = (rng.standard_normal((t, h, d)).astype(np.float32) * 50 for h in (hq, hk, hk))
    qn, kn = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    inv_freq = (1.0 / 10000 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    pos, slots = np.array([0, 1, 2], np.int32), np.array([2, 0, 1], np.int32)
    q8, qf = q.copy(), q.copy()
    for x, kind in ((q8, "fp8"), (qf, "act")):
        caches = [ops.zeros((1, 4, hk, d), kind) for _ in range(2)]
        ops.qk_norm_rope_write_kv(x, k.copy(), v.copy(), qn, kn, 1e-6, pos, inv_freq, *caches, slots)
    assert np.array_equal(q8, quantize_rows_pow2(qf)) and not np.array_equal(q8, qf)
    n = np.ceil(np.log2(np.abs(q8).max(axis=-1, keepdims=True) / 448))
    codes = q8 / np.exp2(n)
    assert np.array_equal(codes.astype(E4M3).astype(np.float32), codes)  # exact e4m3 values


# ---- scales, logits ----------------------------------------------------------------------------
def _logits(path: Path, kv_cache_dtype: str, prompt: list[int]) -> tuple[np.ndarray, Transformer]:
    cfg = ModelConfig.from_dir(path)
    model = Transformer(cfg, load_weights(path, cfg), NumpyBackend(), kv_cache_dtype=kv_cache_dtype)
    kv = model.allocate_kv(8, 16)
    n = len(prompt)
    fb = ForwardBatch(input_ids=np.array(prompt, np.int32), positions=np.arange(n, dtype=np.int32),
                      slot_mapping=np.arange(n, dtype=np.int32), query_start_loc=np.array([0, n], np.int32),
                      seq_lens=np.array([n], np.int32), block_tables=np.arange(8, dtype=np.int32)[None],
                      logits_indices=np.array([n - 1], np.int32), max_query_len=n, max_seq_len=n)
    return model.forward(fb, kv), model


def test_fp8_kv_logits_stay_close_to_the_float_cache(model_dir: Path) -> None:
    prompt = np.random.default_rng(4).integers(3, 900, size=40).tolist()
    ref, _ = _logits(model_dir, "auto", prompt)
    got, model = _logits(model_dir, "fp8", prompt)
    assert model.kv_scales == [(1.0, 1.0)] * model.cfg.num_layers and not model.kv_scales_from_checkpoint
    # e4m3 keeps 3 mantissa bits (a relative step of 1/8 to 1/16 a value): on this random model
    # (measured 8.8%, 8.3% of it from the cache, the rest from q rounded to e4m3 x 2^n) the
    # logits move by less than 12%, and the greedy token stays.
    rel = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert 0 < rel < 0.12, rel
    assert np.argmax(got) == np.argmax(ref)


@pytest.mark.parametrize("attn", [False, True])
def test_checkpoint_kv_scales_are_applied(model_dir: Path, tmp_path: Path, attn: bool) -> None:
    prompt = np.random.default_rng(5).integers(3, 900, size=24).tolist()
    scaled = _with_kv_scales(model_dir, tmp_path / "scaled", 0.01, 0.02, attn)
    plain, _ = _logits(model_dir, "fp8", prompt)
    got, model = _logits(scaled, "fp8", prompt)
    assert model.kv_scales_from_checkpoint
    assert model.kv_scales[0] == (pytest.approx(0.01), pytest.approx(0.02))
    assert not np.array_equal(got, plain)  # other codes: the scales were used
    ref, bf = _logits(scaled, "auto", prompt)  # a float cache ignores them, as vLLM does
    assert bf.kv_scales[0] == (1.0, 1.0)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 0.12


# ---- capacity and the summary ---------------------------------------------------------------
class _FakeCuda:
    """The part of a CUDA backend KV sizing reads: its name and free memory."""

    name = "cuda"

    def mem_info(self) -> tuple[int, int]:
        return 2 << 30, 2 << 30


def test_fp8_doubles_the_blocks_in_the_same_memory(model_dir: Path) -> None:
    mc = ModelConfig.from_dir(model_dir)
    args = {"model": str(model_dir), "max_num_seqs": 4096, "gpu_memory_utilization": 0.5}
    auto = kv_cache_blocks(_FakeCuda(), EngineConfig(**args), mc, 4096)
    fp8 = kv_cache_blocks(_FakeCuda(), EngineConfig(**args, **FP8), mc, 4096)
    assert fp8 in (2 * auto, 2 * auto + 1)
    budget = {"model": str(model_dir), "kv_cache_memory": 64 << 20, "max_num_seqs": 4096}
    auto = kv_cache_blocks(_FakeCuda(), EngineConfig(**budget), mc, 4096)
    assert kv_cache_blocks(_FakeCuda(), EngineConfig(**budget, **FP8), mc, 4096) == 2 * auto


def test_startup_summary_shows_the_fp8_cache(model_dir: Path) -> None:
    mc = ModelConfig.from_dir(model_dir)
    lines = {}
    for dtype in ("auto", "fp8"):
        cfg = EngineConfig(model=str(model_dir), kv_cache_dtype=dtype)
        blocks = kv_cache_blocks(_FakeCuda(), EngineConfig(model=str(model_dir), kv_cache_memory=64 << 20,
                                                           max_num_seqs=4096, kv_cache_dtype=dtype), mc, 4096)
        runner = SimpleNamespace(num_blocks=blocks, use_graphs=False, fp8=None,
                                 model=SimpleNamespace(kv_scales_from_checkpoint=False))
        engine = SimpleNamespace(model_config=mc, runner=runner, config=cfg, ops=SimpleNamespace(name="cuda"),
                                 max_model_len=4096, depth=2)
        lines[dtype] = next(x for x in startup_lines(engine, 1.0) if x.startswith("KV cache:"))
    assert "fp8 e4m3 (scales 1.0: the checkpoint has no k_scale / v_scale)" in lines["fp8"]
    assert "fp8" not in lines["auto"]
    tokens = {d: int(line.split(" = ")[1].split(" tokens")[0]) for d, line in lines.items()}
    assert tokens["fp8"] == 2 * tokens["auto"]
    assert "64.0 MiB" in lines["fp8"] and "64.0 MiB" in lines["auto"]


# ---- the engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp8_reference(model_dir: Path) -> list[list[int]]:
    outs, engine = asyncio.run(preemption._run(model_dir, False, max_num_seqs=16, async_scheduling=False,
                                               **FP8))
    assert engine.runner.kv[0][0].dtype == E4M3
    assert engine.stats().num_preemptions_total == 0
    return outs


def test_fp8_kv_depth_two_samples_depth_ones_tokens(model_dir: Path, fp8_reference) -> None:
    outs, _ = asyncio.run(preemption._run(model_dir, False, max_num_seqs=16, async_scheduling=True, **FP8))
    assert outs == fp8_reference


@pytest.mark.parametrize("policy,async_scheduling", [("fcfs", True), ("priority", False)])
def test_fp8_kv_preemption_keeps_outputs(model_dir: Path, fp8_reference, policy: str,
                                         async_scheduling: bool) -> None:
    small = {"num_gpu_blocks": 8, "block_size": 16, "max_num_seqs": 8}
    outs, engine = asyncio.run(preemption._run(model_dir, False, scheduling_policy=policy,
                                               async_scheduling=async_scheduling, **small, **FP8))
    assert engine.stats().num_preemptions_total > 0
    preemption._check_idle(engine)
    assert outs == fp8_reference


def test_fp8_kv_prefix_cache_hits_keep_outputs(model_dir: Path, fp8_reference) -> None:
    outs, engine = asyncio.run(preemption._run(model_dir, True, block_size=16, max_num_seqs=3,
                                               scheduling_policy="priority", async_scheduling=True, **FP8))
    assert engine.stats().prefix_cache_hit_tokens_total > 0
    assert outs == fp8_reference


def test_fp8_kv_structured_outputs_with_graphs_at_depth_two(model_dir: Path) -> None:
    small = {"num_gpu_blocks": 40, "block_size": 16, **FP8}
    two, engine2 = asyncio.run(structured._run(model_dir, graphs=True, async_scheduling=True, **small))
    one, _ = asyncio.run(structured._run(model_dir, async_scheduling=False, **small))
    assert [t for t, _, _ in two] == [t for t, _, _ in one]
    assert engine2.runner.deferred_samples > 0 and engine2.runner.kv[0][0].dtype == E4M3
    for (_, _, kind), (_, text, reason) in zip(structured._workload(engine2.tokenizer), two, strict=True):
        if kind is not None:
            assert reason == "stop" and structured.follows(kind, text), (kind, text)


def test_fp8_kv_with_fp8_weights(model_dir: Path) -> None:
    both = {"quantization": "fp8", **FP8}
    one, engine = asyncio.run(preemption._run(model_dir, False, max_num_seqs=16, async_scheduling=False,
                                              **both))
    assert engine.runner.fp8 is not None and engine.runner.kv[0][0].dtype == E4M3
    small = {"num_gpu_blocks": 8, "block_size": 16, "max_num_seqs": 8}
    two, engine = asyncio.run(preemption._run(model_dir, False, async_scheduling=True, **small, **both))
    assert engine.stats().num_preemptions_total > 0
    assert two == one
