"""Host time of a step's structured-output masks: `GrammarCompiler.fill_masks` at a 151,936-token
vocabulary, guides dealt to per-thread template shards (as served) against every guide copied
from one template (as before sharding).

    python3 -m bench.step.mask_fill --rows 32,128 --threads 1,2,4

Each guide follows bench/serving/structured_outputs.py's JSON schema; a step fills every row's mask, then
each guide takes a random allowed token, so rows drift apart as in serving. The figure is the
mean over --steps steps of the wall time of one fill (and the process CPU time beside it: CPU
above wall means the threads ran at once). The tokenizer is grown to the vocabulary as random
benchmark checkpoints have it.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np

import vt.structured.compiler as compiler_module
from bench.serving.structured_outputs import SCHEMA
from vt.model.make_model import grow_tokenizer, train_tokenizer
from vt.structured.compiler import GrammarCompiler
from vt.structured.spec import GrammarSpec, StructuredOutput

VOCAB = 151_936


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(text: str, rows: int, threads: int, sharded: bool, steps: int) -> tuple[float, float]:
    """(wall ms, CPU ms) of one step's fill, averaged over the steps."""
    compiler_module.MASK_THREADS = threads  # read when the compiler builds templates and its pool
    compiler = GrammarCompiler(lambda: text, VOCAB, [1])
    structured = StructuredOutput(GrammarSpec("json", json.dumps(SCHEMA)))
    guides = [compiler.guide(structured) for _ in range(rows)]
    if not sharded:
        grammar = compiler.compile_blocking(structured.grammar)
        for g in guides:
            g.shard, g.matcher = 0, grammar.new_matcher(0)
    masks = np.zeros((rows, compiler.mask_words), np.int32)
    rng = np.random.default_rng(0)
    wall = cpu = 0.0
    for _ in range(steps):
        c0, t0 = _cpu(), time.perf_counter()
        compiler.fill_masks(guides, masks)
        wall += time.perf_counter() - t0
        cpu += _cpu() - c0
        bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :VOCAB]
        for g, allowed in zip(guides, bits):
            g.advance(int(rng.choice(np.flatnonzero(allowed))))
    compiler.shutdown()
    return wall / steps * 1e3, cpu / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="32,128", help="guided rows per step, comma-separated")
    ap.add_argument("--threads", default="1,2,4", help="mask threads, comma-separated")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    text = grow_tokenizer(train_tokenizer(), VOCAB).to_str()
    print("| rows | threads | one template ms (CPU ms) | sharded ms (CPU ms) | speed-up |")
    print("|---|---|---|---|---|")
    for rows in map(int, args.rows.split(",")):
        for threads in map(int, args.threads.split(",")):
            one = measure(text, rows, threads, False, args.steps)
            shard = measure(text, rows, threads, True, args.steps)
            print(f"| {rows} | {threads} | {one[0]:.2f} ({one[1]:.2f}) | {shard[0]:.2f} ({shard[1]:.2f}) "
                  f"| {one[0] / shard[0]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
