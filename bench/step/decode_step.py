"""Decode-step time of the real runner path (staging, graphs, sampling) against the HBM floor.

    python3 -m bench.step.decode_step --preset 0.6b --batches 1,32,128,256 --context 512
    python3 -m bench.step.decode_step --preset 0.6b --batches 64,256 --prefill 128   # mixed steps

With --prefill P every timed step also admits a new request and computes its P-token prompt
beside the decodes (the previous one is released), as a serving step with arrivals does; such
steps run as per-layer graphs ("graph" mode) or eagerly ("eager").

Weights are random bf16 drawn from one pool (timing does not depend on values), so no checkpoint
is written. The floor is (weight bytes + KV bytes read) / bandwidth (4.25 TB/s measured copy rate).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1024, tie_word_embeddings=True),
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
}
BANDWIDTH = 4.25e12
MATMUL_RATE = 790e12  # bf16 GEMM rate measured on the H200 (8192^3, random data)
STEPS_MAX = 200


def write_config(folder: Path, preset: str) -> None:
    cfg = dict(PRESETS[preset], architectures=["Qwen3ForCausalLM"], model_type="qwen3",
               max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu",
               attention_bias=False, torch_dtype="bfloat16", eos_token_id=2, bos_token_id=1)
    (folder / "config.json").write_text(json.dumps(cfg))


class RandomWeights(Mapping):
    """Every tensor a slice of one random bf16 pool (std ~0.02), made on access."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int = 0) -> None:
        self.shapes = shapes
        rng = np.random.default_rng(seed)
        self.pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def __getitem__(self, name: str) -> np.ndarray:
        shape = self.shapes[name]
        n = int(np.prod(shape))
        reps = -(-n // self.pool.size)
        flat = np.tile(self.pool, reps)[:n] if reps > 1 else self.pool[:n]
        if "norm" in name:
            return np.ones(shape, ml_dtypes.bfloat16)
        return flat.reshape(shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def random_runner(preset: str, device: str, max_model_len: int, **engine: object):
    """A ModelRunner of the preset's shape with random weights instead of a checkpoint;
    `engine` holds the EngineConfig fields that size it."""
    import vt.runner.runner as runner_mod
    from vt.config import EngineConfig, ModelConfig
    from vt.kernels import get_backend
    from vt.model.loader import expected_shapes

    folder = Path(tempfile.mkdtemp())
    write_config(folder, preset)
    mc = ModelConfig.from_dir(folder)
    weights = RandomWeights(dict(expected_shapes(mc)))
    ec = EngineConfig(model=str(folder), device=device, max_model_len=max_model_len, **engine)
    original = runner_mod.load_weights
    runner_mod.load_weights = lambda *_: weights
    try:
        runner = runner_mod.ModelRunner(mc, ec, get_backend(device), max_model_len)
    finally:
        runner_mod.load_weights = original
    return runner, mc


def build_runner(preset: str, max_seqs: int, context: int, enforce_eager: bool, device: str = "cuda",
                 prefill: int = 0, max_model_len: int = 0, **engine: object):
    """`engine`: further EngineConfig fields (quantization, kv_cache_dtype). max_model_len: the
    engine's (at least what the steps need); a server's is larger than its contexts, and the decode
    graphs size their attention's key splits for it."""
    blocks = max_seqs * blocks_per_seq(context) + 16 + -(-prefill // 16)
    max_seqs += prefill > 0
    # the longest sequence is a decode's context or the new prompt, whichever is longer
    max_len = max(max_model_len, 16 * max(blocks_per_seq(context), -(-prefill // 16)))
    return random_runner(preset, device, max_len, max_num_seqs=max_seqs,
                         max_num_batched_tokens=max(2048, max_seqs + prefill), num_gpu_blocks=blocks,
                         enforce_eager=enforce_eager, **engine)


def blocks_per_seq(context: int, steps: int = STEPS_MAX) -> int:
    return -(-(context + steps + 2) // 16)


def decode_batches(batch: int, context: int, steps: int, prefill: int = 0):
    """First a step that admits every row (eager), then `steps` decode-only steps (graphable),
    each with a new prefill of `prefill` tokens beside the decodes when prefill > 0."""
    from vt.sampling_params import SamplingParams
    from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq

    nb = blocks_per_seq(context)
    if steps > STEPS_MAX:
        raise ValueError(f"at most {STEPS_MAX} steps")
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0)
    tables = [tuple(range(b * nb, (b + 1) * nb)) for b in range(batch)]
    first = ScheduledBatch(tuple(
        ScheduledSeq(f"r{b}", context - 1, 1, (5,), False, tables[b], True, 0,
                     NewRequestData((5,) * 4, (), params)) for b in range(batch)), (), batch)
    yield first
    spare = tuple(range(batch * nb, batch * nb + -(-prefill // 16)))
    prompt = tuple(range(7, 7 + prefill))
    for i in range(steps):
        seqs = tuple(ScheduledSeq(f"r{b}", context + i, 1, (), True, tables[b], True, i + 1, None)
                     for b in range(batch))
        released: tuple[str, ...] = ()
        if prefill:
            seqs += (ScheduledSeq(f"p{i}", 0, prefill, prompt, False, spare, True, 0,
                                  NewRequestData(prompt, (), params)),)
            released = (f"p{i - 1}",) if i else ()
        yield ScheduledBatch(seqs, released, batch + prefill)


def floor_seconds(mc, batch: int, context: int, fp8: bool = False, kv8: bool = False,
                  bandwidth: float = BANDWIDTH) -> float:
    """(weight bytes + KV bytes read) / bandwidth. fp8: the layers' projections are one byte an
    element (embeddings, norms and lm_head stay bf16); kv8: the KV cache is."""
    return (weight_bytes(mc, fp8) + kv_bytes(mc, batch, context, kv8)) / bandwidth


def weight_bytes(mc, fp8: bool = False) -> int:
    from vt.model.loader import expected_shapes

    def size(name: str, shape: tuple[int, ...]) -> int:
        projection = fp8 and len(shape) == 2 and "embed" not in name and "lm_head" not in name
        return int(np.prod(shape)) * (1 if projection else 2)

    return sum(size(n, s) for n, s in dict(expected_shapes(mc)).items())


def kv_bytes(mc, batch: int, context: int, kv8: bool = False) -> int:
    return batch * context * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * (1 if kv8 else 2)


def roofline_seconds(mc, batch: int, context: int, fp8: bool = False, kv8: bool = False,
                     bandwidth: float = BANDWIDTH) -> float:
    """The floor with arithmetic counted too: the weight GEMMs take the longer of reading their
    weights and doing their FLOPs at the matmul rate (at batch 256 on 8B shapes the FLOPs win;
    fp8 counts the bf16 rate twice), then the KV read. Embedding rows are gathered, not multiplied."""
    from vt.model.loader import expected_shapes

    shapes = dict(expected_shapes(mc))
    matmul = sum(int(np.prod(s)) for n, s in shapes.items() if len(s) == 2 and "embed" not in n)
    if mc.tie_word_embeddings:
        matmul += mc.vocab_size * mc.hidden_size
    rate = MATMUL_RATE * (2 if fp8 else 1)
    return (max(weight_bytes(mc, fp8) / bandwidth, 2 * matmul * batch / rate)
            + kv_bytes(mc, batch, context, kv8) / bandwidth)


def time_decode(runner, batch: int, context: int, steps: int, pipelined: bool, prefill: int = 0) -> float:
    gen = decode_batches(batch, context, steps, prefill)
    eos = lambda _rid: ()  # noqa: E731
    runner.execute(next(gen), eos).result()
    warm = 5
    handles = []
    t0 = 0.0
    for i, b in enumerate(gen):
        if i == warm:
            while handles:
                handles.pop(0).result()
            t0 = time.perf_counter()
        handles.append(runner.execute(b, eos))
        if len(handles) >= (2 if pipelined else 1):
            handles.pop(0).result()
    while handles:
        handles.pop(0).result()
    for b in range(batch):
        runner.release(f"r{b}")
    runner.release(f"p{steps - 1}")
    return (time.perf_counter() - t0) / (steps - warm)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="0.6b", choices=list(PRESETS))
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--modes", default="graph,eager")
    ap.add_argument("--device", default="cuda", choices=["cuda", "numpy"])
    ap.add_argument("--prefill", type=int, default=0, help="prompt tokens of a new request in every step")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine's, as a server runs it (e.g. 16384; default: what the steps need)")
    ap.add_argument("--bandwidth", type=float, default=BANDWIDTH / 1e12,
                    help="TB/s the floors assume (default: the H200's measured copy rate)")
    args = ap.parse_args()
    fp8, kv8 = args.quantization == "fp8", args.kv_cache_dtype != "auto"
    bw = args.bandwidth * 1e12
    batches = [int(x) for x in args.batches.split(",")]
    rows = []
    for mode in args.modes.split(","):
        t_build = time.perf_counter()
        runner, mc = build_runner(args.preset, max(batches), args.context, mode == "eager", args.device,
                                  args.prefill, args.max_model_len, quantization=args.quantization,
                                  kv_cache_dtype=args.kv_cache_dtype)
        print(f"{mode}: runner built in {time.perf_counter() - t_build:.1f} s "
              f"({len(runner.graphs)} decode graphs, {len(runner.layer_graphs)} per-layer graph sets)",
              flush=True)
        for b in batches:
            floor = floor_seconds(mc, b, args.context, fp8, kv8, bw)
            roof = roofline_seconds(mc, b, args.context, fp8, kv8, bw)
            for pipelined in (False, True):
                t = time_decode(runner, b, args.context, args.steps, pipelined, args.prefill)
                row = dict(preset=args.preset, mode=mode, depth=2 if pipelined else 1, batch=b,
                           prefill=args.prefill, routes=dict(runner.routes),
                           context=args.context, step_ms=t * 1e3, floor_ms=floor * 1e3, ratio=t / floor,
                           roofline_ms=roof * 1e3, roofline_ratio=t / roof)
                rows.append(row)
                print(f"| {args.preset} | {mode} | depth {row['depth']} | {b} | {args.context} | "
                      f"{row['step_ms']:.3f} | {row['floor_ms']:.3f} | {row['ratio']:.2f}x | "
                      f"{row['roofline_ms']:.3f} | {t / roof:.2f}x | {dict(runner.routes)} |", flush=True)
                runner.routes.clear()
        del runner
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
