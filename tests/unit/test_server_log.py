"""What `vt serve` logs: the start-up summary read off a real engine, and the stats line every
interval while busy (throughput, queue, KV cache use, prefix-cache hit rate), silent when idle."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from vt.config import EngineConfig, ModelConfig
from vt.engine.engine import AsyncEngine
from vt.engine.stats import EngineStats
from vt.launch.startup_log import num_parameters, projection_parameters, startup_lines
from vt.launch.stats_log import StatsSnapshot, log_stats, stats_line
from vt.model.generation_config import SamplingDefaults
from vt.model.make_model import PRESETS, hf_config, make_model, tensor_specs


@pytest.mark.parametrize("preset, arch", [("tiny", "qwen3"), ("0.6b", "qwen3"), ("8b", "qwen3"),
                                          ("8b", "llama")])
def test_parameter_count_matches_the_checkpoint_tensors(preset, arch):
    p = PRESETS[preset]
    vocab = p.vocab or 1024
    mc = ModelConfig.from_dict(hf_config(arch, p, vocab, 0, 1))
    assert num_parameters(mc) == sum(int(np.prod(s.shape)) for s in tensor_specs(arch, p, vocab))


async def test_startup_summary_of_a_cpu_engine(tmp_path):
    model = make_model(tmp_path / "m")
    engine = AsyncEngine(EngineConfig(model=str(model), device="cpu", max_model_len=512, num_gpu_blocks=100,
                                      max_num_seqs=8))
    try:
        text = "\n".join(startup_lines(engine, 1.5, SamplingDefaults({"temperature": 0.6}, "gen.json")))
    finally:
        await engine.stop()
    assert "on cpu (numpy backend" in text
    assert "Qwen3ForCausalLM, 2 layers, hidden 64, 4 heads / 2 KV heads of 16, vocab 1024" in text
    assert "KV cache: 100 blocks of 16 tokens = 1600 tokens" in text
    assert "maximum concurrency at 512 tokens per request: 3.12x" in text
    assert "CUDA graphs: none (eager steps: numpy backend)" in text
    assert "default sampling parameters from gen.json: temperature=0.6" in text
    assert text.endswith("start-up took 1.5 s")


def snap(t: float, prompt: int = 0, generated: int = 0, hits: int = 0, running: int = 0, waiting: int = 0,
         kv: float = 0.0) -> StatsSnapshot:
    return StatsSnapshot(t, prompt, generated, hits, running, waiting, kv)


def test_stats_line_reports_the_interval():
    line = stats_line(snap(0.0, 100, 50, 10), snap(10.0, 1100, 2050, 510, running=3, waiting=2, kv=0.125))
    assert line == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 200.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 2 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 50.0%")


def test_stats_line_is_silent_when_idle_and_not_when_requests_wait():
    assert stats_line(snap(0.0, 5, 5), snap(10.0, 5, 5)) is None
    assert "Waiting: 1 reqs" in stats_line(snap(0.0), snap(10.0, waiting=1))


async def test_log_stats_logs_while_busy(caplog):
    stats = EngineStats()
    engine = SimpleNamespace(stats=lambda: stats)
    caplog.set_level(logging.INFO, logger="vt.stats")
    task = asyncio.create_task(log_stats(engine, interval=0.01))
    try:
        for _ in range(200):
            await asyncio.sleep(0.01)
            stats.generation_tokens_total += 10
            stats.num_requests_running = 1
            if caplog.records:
                break
    finally:
        task.cancel()
    assert caplog.records and "Avg generation throughput" in caplog.records[0].getMessage()


def test_startup_summary_names_captured_graphs_on_cuda():
    mc = ModelConfig.from_dict(hf_config("qwen3", PRESETS["0.6b"], 151936, 0, 1))
    graphs = {(slot, size): None for slot in (0, 1) for size in (1, 2, 4)}
    runner = SimpleNamespace(num_blocks=1000, use_graphs=True, graphs=graphs, graph_sizes=(1, 2, 4),
                             layer_graphs={(0, 16): None, (1, 16): None}, fp8=None)
    cfg = EngineConfig(model="/models/Qwen3-0.6B", block_size=16)
    engine = SimpleNamespace(model_config=mc, runner=runner, config=cfg, ops=SimpleNamespace(name="cuda"),
                             max_model_len=40960, depth=2)
    text = "\n".join(startup_lines(engine, 30.0))
    assert "on cuda" in text
    assert "weights: 596.05 M parameters, 1.11 GiB" in text
    assert "16000 tokens, 1.71 GiB; maximum concurrency at 40960 tokens per request: 0.39x" in text
    assert "CUDA graphs: 6 decode graphs (3 batch sizes) and 2 per-layer prefill graph sets captured" in text


@pytest.mark.parametrize("checkpoint", [None, "fp8-block"])
async def test_startup_summary_says_how_fp8_weights_are_held(tmp_path, checkpoint):
    model = make_model(tmp_path / "m", preset="tiny128", quantization=checkpoint)
    flag = "fp8" if checkpoint is None else None
    engine = AsyncEngine(EngineConfig(model=str(model), device="cpu", max_model_len=512, num_gpu_blocks=10,
                                      max_num_seqs=8, quantization=flag))
    try:
        text = "\n".join(startup_lines(engine, 1.0))
    finally:
        await engine.stop()
    how = "quantized at load (--quantization fp8), a scale per output channel, activations quantized " \
          "per token;" if checkpoint is None else \
        "as stored (fp8 checkpoint, 128x128 block scales), activations quantized per token and 128 columns;"
    assert "the projections in fp8 e4m3 " + how in text
    mc = engine.model_config
    fp8_bytes = projection_parameters(mc) + 4 * (num_parameters(mc) - projection_parameters(mc))
    assert f"{fp8_bytes / 1024**2:.1f} MiB: the projections" in text


@pytest.mark.parametrize("preset", ["tiny", "8b"])
def test_projection_count_matches_the_checkpoint_projections(preset):
    p = PRESETS[preset]
    vocab = p.vocab or 1024
    mc = ModelConfig.from_dict(hf_config("qwen3", p, vocab, 0, 1))
    specs = tensor_specs("qwen3", p, vocab)
    want = sum(int(np.prod(s.shape)) for s in specs if s.name.endswith("proj.weight"))
    assert projection_parameters(mc) == want
