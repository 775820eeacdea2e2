"""Prefill throughput of the real runner step against the bf16 matrix ceiling.

    python3 -m bench.step.prefill --preset 8b --prompt-lens 1024,8192 --tokens 8192
    python3 -m bench.step.prefill --preset 8b --prompt-lens 8192,32768 --chunks 2048,8192

Each row is one step that prefills `tokens // prompt_len` whole prompts from position 0: the
paged KV cache is written, attention is causal over each prompt, logits and a greedy sample are
computed for each sequence's last token only, as in serving. Weights are random bf16 (as in
decode_step.py). tokens/s and TFLOP/s are of the median step waited for on its own; "2 deep" is
the mean step with two in flight, as the engine runs them. FLOPs count the matmuls
(2 * params * tokens), the lm_head on the last tokens and attention's QK^T and PV over the causal
pairs; the ceiling is a bf16 matrix rate.

With --chunks, each prompt is prefilled alone as serving does with chunked prefill: steps of at
most C tokens, each attending to the chunks before it, launched two deep; a row's time is the
whole prompt's (the first token's latency on an idle server) and `seqs` is 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

import vt.runner.runner as runner_mod
from bench.step.decode_step import PRESETS, random_runner
from vt.config import ModelConfig
from vt.sampling_params import SamplingParams
from vt.sched.output import NewRequestData, ScheduledBatch, ScheduledSeq

BLOCK = 16
CEILING_TFLOPS = 790.0  # bf16 matrix rate taken as the H200's ceiling (spec sheet's dense peak: 989)


@dataclass(frozen=True)
class Row:
    preset: str
    prompt_len: int
    chunk: int               # tokens per step (the whole step when not chunked)
    seqs: int
    tokens: int
    ms: float                # one step, waited for
    ms_two_deep: float       # steps launched two deep (host staging hidden)
    tokens_per_s: float
    tflops: float
    of_ceiling: float


def shape_of(prompt_len: int, token_budget: int) -> tuple[int, int]:
    """(sequences, tokens) of a step that packs whole prompts into the budget (at least one)."""
    seqs = max(1, token_budget // prompt_len)
    return seqs, seqs * prompt_len


def prefill_flops(mc: ModelConfig, prompt_len: int, seqs: int) -> float:
    """Matmuls over every token, lm_head over the last ones, attention over causal pairs."""
    h, d = mc.hidden_size, mc.head_dim
    q, kv = mc.num_heads * d, mc.num_kv_heads * d
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * mc.intermediate_size + mc.intermediate_size * h
    tokens = seqs * prompt_len
    pairs = seqs * prompt_len * (prompt_len + 1) // 2
    return (2.0 * per_layer * mc.num_layers * tokens + 2.0 * h * mc.vocab_size * seqs
            + 4.0 * mc.num_heads * d * pairs * mc.num_layers)


def build_prefill_runner(preset: str, max_seqs: int, max_tokens: int, max_len: int,
                         device: str) -> tuple[runner_mod.ModelRunner, ModelConfig]:
    """A ModelRunner sized for the largest step, with random weights instead of a checkpoint."""
    return random_runner(preset, device, -(-max_len // BLOCK) * BLOCK, max_num_seqs=max_seqs,
                         max_num_batched_tokens=max_tokens, block_size=BLOCK,
                         num_gpu_blocks=max(max_tokens, max_len * max_seqs) // BLOCK + max_seqs + 1,
                         enforce_eager=True)


def prefill_batch(prompt_len: int, seqs: int, vocab: int, seed: int = 0) -> ScheduledBatch:
    """One step admitting `seqs` fresh prompts, each computed whole and sampled greedily."""
    rng = np.random.default_rng(seed)
    nb = -(-prompt_len // BLOCK)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for b in range(seqs):
        ids = tuple(int(i) for i in rng.integers(3, vocab, prompt_len))
        blocks = tuple(range(b * nb, (b + 1) * nb))
        out.append(ScheduledSeq(f"p{b}", 0, prompt_len, ids, False, blocks, True, 0,
                                NewRequestData(ids, (), params)))
    return ScheduledBatch(tuple(out), (), seqs * prompt_len)


def chunked_batches(prompt_len: int, chunk: int, vocab: int, seed: int = 0) -> list[ScheduledBatch]:
    """One prompt as consecutive steps of at most `chunk` tokens; the last one samples."""
    rng = np.random.default_rng(seed)
    ids = tuple(int(i) for i in rng.integers(3, vocab, prompt_len))
    blocks = tuple(range(-(-prompt_len // BLOCK)))
    new = NewRequestData(ids, (), SamplingParams(max_tokens=1, temperature=0.0))
    steps = []
    for start in range(0, prompt_len, chunk):
        n = min(chunk, prompt_len - start)
        last = start + n == prompt_len
        seq = ScheduledSeq("p0", start, n, ids[start:start + n], False, blocks, last, 0,
                           new if start == 0 else None)
        steps.append(ScheduledBatch((seq,), (), n))
    return steps


def time_chunked(runner: runner_mod.ModelRunner, steps: list[ScheduledBatch], repeats: int,
                 warmup: int) -> float:
    """Median seconds of a whole chunked prompt, its steps launched two deep."""
    eos = lambda _rid: ()  # noqa: E731
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        handles = []
        for batch in steps:
            handles.append(runner.execute(batch, eos))
            if len(handles) == 2:
                handles.pop(0).result()
        for h in handles:
            h.result()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        runner.release("p0")
    return statistics.median(times)


def time_prefill(runner: runner_mod.ModelRunner, batch: ScheduledBatch, repeats: int,
                 warmup: int) -> tuple[float, float]:
    """Seconds of one step: the median of steps each waited for (result() returns once the
    device has finished it), and the mean of steps launched two deep as the engine runs them,
    where one step's host staging overlaps the previous step's device work."""
    eos = lambda _rid: ()  # noqa: E731
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        runner.execute(batch, eos).result()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    handles = []
    for _ in range(repeats):
        handles.append(runner.execute(batch, eos))
        if len(handles) == 2:
            handles.pop(0).result()
    for h in handles:
        h.result()
    pipelined = (time.perf_counter() - t0) / repeats
    for s in batch.seqs:
        runner.release(s.request_id)
    return statistics.median(times), pipelined


def run(preset: str, prompt_lens: list[int], token_budget: int, device: str, repeats: int,
        warmup: int, ceiling_tflops: float) -> list[Row]:
    shapes = [(L, *shape_of(L, token_budget)) for L in prompt_lens]
    runner, mc = build_prefill_runner(preset, max(s for _, s, _ in shapes), max(t for _, _, t in shapes),
                                      max(prompt_lens), device)
    rows = []
    try:
        for L, seqs, tokens in shapes:
            sec, deep = time_prefill(runner, prefill_batch(L, seqs, mc.vocab_size), repeats, warmup)
            tflops = prefill_flops(mc, L, seqs) / sec / 1e12
            rows.append(Row(preset, L, tokens, seqs, tokens, sec * 1e3, deep * 1e3, tokens / sec, tflops,
                            tflops / ceiling_tflops))
    finally:
        runner.shutdown()
    return rows


def run_chunked(preset: str, prompt_lens: list[int], chunks: list[int], device: str, repeats: int,
                warmup: int, ceiling_tflops: float) -> list[Row]:
    rows = []
    for chunk in chunks:
        runner, mc = build_prefill_runner(preset, 1, chunk, max(prompt_lens), device)
        try:
            for L in prompt_lens:
                sec = time_chunked(runner, chunked_batches(L, chunk, mc.vocab_size), repeats, warmup)
                tflops = prefill_flops(mc, L, 1) / sec / 1e12
                rows.append(Row(preset, L, chunk, 1, L, sec * 1e3, sec * 1e3, L / sec, tflops,
                                tflops / ceiling_tflops))
        finally:
            runner.shutdown()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| preset | prompt len | chunk | seqs | tokens | ms | ms, 2 deep | tokens/s | TFLOP/s "
             "| of ceiling |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = (r.preset, r.prompt_len, r.chunk, r.seqs, r.tokens, f"{r.ms:.2f}", f"{r.ms_two_deep:.2f}",
                 f"{r.tokens_per_s:,.0f}", f"{r.tflops:.3g}", f"{100 * r.of_ceiling:.3g}%")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="0.6b", choices=list(PRESETS))
    ap.add_argument("--prompt-lens", default="1024,8192")
    ap.add_argument("--tokens", type=int, default=8192, help="token budget of one step")
    ap.add_argument("--chunks", default=None,
                    help="comma list of chunk sizes: each prompt alone, in steps of that many tokens")
    ap.add_argument("--device", default="cuda", choices=["cuda", "numpy"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ceiling-tflops", type=float, default=CEILING_TFLOPS)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    lens = [int(x) for x in args.prompt_lens.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")] if args.chunks else []
    if args.repeats < 1 or args.warmup < 0 or args.tokens < 1 or min(lens + chunks) < 1:
        ap.error("--repeats, --tokens, chunks and prompt lengths must be positive, --warmup non-negative")
    if chunks:
        rows = run_chunked(args.preset, lens, chunks, args.device, args.repeats, args.warmup,
                           args.ceiling_tflops)
    else:
        rows = run(args.preset, lens, args.tokens, args.device, args.repeats, args.warmup,
                   args.ceiling_tflops)
    print(table(rows), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))


if __name__ == "__main__":
    main()
