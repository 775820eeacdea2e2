"""The same random checkpoint and workload through Hugging Face transformers on the same GPU.

    python3 -m bench.serving.peer_transformers --model /tmp/q06 --batch 128 --input-len 128 --output-len 64

`batch` prompts of exact length, greedy, exactly `output-len` new tokens each (EOS ignored), bf16 on
CUDA, in one or both of transformers' paths:
  generate        one batched generate() call (static batch, dynamic cache)
  generate_batch  its continuous-batching engine (paged KV cache, scheduler thread)
Prints output tokens per second per mode, to set beside `vt bench --max-concurrency <batch>`.
A mode that fails is reported with its reason; the other still runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import transformers

MODES = ("generate", "generate_batch")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Timing(NamedTuple):
    seconds: float               # generation time: first request in to last token out
    lengths: list[int]           # new tokens of every sequence
    call_seconds: float | None   # whole call, where it adds start/stop costs


def run_generate(model: Any, prompts: np.ndarray, output_len: int, device: str) -> Timing:
    """One batched generate() after a small warm-up call."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], **dict(kw, max_new_tokens=4, min_new_tokens=4))
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        sync(device)
        dt = time.perf_counter() - t0
    # No EOS, so no row is padded: every row's new length is the tensor's.
    return Timing(dt, [out.shape[1] - prompts.shape[1]] * prompts.shape[0], None)


def run_generate_batch(model: Any, prompts: np.ndarray, output_len: int, device: str) -> Timing:
    """The second of two identical generate_batch() calls (the first sizes the cache and captures
    graphs). Its generation time comes from the requests' own stamps (created, finished): the
    call also starts and joins the scheduler thread and runs gc.collect() on exit."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    # eos -1: transformers reads a missing eos from the model config, and negative ids never match.
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig()
    if device == "cpu":
        # Its memory-based cache sizing is slow on CPU; give it what the workload needs.
        page = getattr(cb, "page_size", None) or cb.block_size  # renamed page_size after 5.17
        per_seq = -(-(prompts.shape[1] + output_len) // page)
        cb = ContinuousBatchingConfig(num_blocks=prompts.shape[0] * per_seq + 4,
                                      max_batch_tokens=max(256, prompts.shape[1] * min(8, prompts.shape[0])))
    inputs = [[int(t) for t in row] for row in prompts]
    if device == "cuda":
        torch.cuda.empty_cache()  # its cache takes a share of the memory free now
    kw = dict(inputs=inputs, generation_config=gen, continuous_batching_config=cb, persistent_manager=True)
    try:
        model.generate_batch(**kw)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate_batch(**kw)
        call = time.perf_counter() - t0
    finally:
        model.destroy_cached_continuous_batching_manager()
    errors = [r.error for r in out.values() if r.error is not None]
    if errors or len(out) != len(inputs):
        raise RuntimeError(f"{len(inputs) - len(out)} requests missing, errors: {errors[:1]}")
    span = max(r.lifespan[1] for r in out.values()) - min(r.created_time for r in out.values())
    return Timing(span, [len(r.generated_tokens) for r in out.values()], call)


def measure(name: str, fn: Callable[..., Timing], output_len: int, *args: Any) -> dict:
    """One mode's figures; a failure becomes {"ok": False, "error": one line}."""
    try:
        t = fn(*args)
    except Exception as e:  # report it, keep the other mode
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        print(f"transformers.{name}: failed: {reason}", flush=True)
        return {"ok": False, "error": reason}
    tokens = sum(t.lengths)
    exact = all(n == output_len for n in t.lengths)
    res = {"ok": True, "seconds": round(t.seconds, 3), "output_tokens": tokens,
           "output_tok_per_s": round(tokens / t.seconds, 1), "exact_lengths": exact,
           "min_len": min(t.lengths), "max_len": max(t.lengths)}
    line = (f"transformers.{name}: {res['output_tok_per_s']} output tok/s "
            f"({tokens} tokens in {t.seconds:.3f} s")
    if t.call_seconds is not None:
        res["call_seconds"] = round(t.call_seconds, 3)
        res["output_tok_per_s_call"] = round(tokens / t.call_seconds, 1)
        line += f"; whole call {t.call_seconds:.3f} s, {res['output_tok_per_s_call']} tok/s"
    print(f"{line}; lengths {'exact' if exact else 'NOT exact'})", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mode", default="both", choices=[*MODES, "both"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--attn-implementation", default=None, help="passed to from_pretrained")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32  # CPU bf16 matmuls crawl
    extra = {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, **extra)
    model = model.to(args.device).eval()
    vocab = model.config.vocab_size
    prompts = np.random.default_rng(args.seed).integers(3, min(999, vocab), size=(args.batch, args.input_len))
    runners = {"generate": run_generate, "generate_batch": run_generate_batch}
    modes = MODES if args.mode == "both" else (args.mode,)
    results = {m: measure(m, runners[m], args.output_len, model, prompts, args.output_len, args.device)
               for m in modes}
    summary = {"peer": "transformers", "transformers_version": transformers.__version__,
               "device": args.device, "batch": args.batch, "input_len": args.input_len,
               "output_len": args.output_len, "modes": results}
    print(json.dumps(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=1))
    if not any(r["ok"] for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
