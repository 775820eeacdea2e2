"""The same random checkpoint and workload through Hugging Face transformers on the same GPU.

    python3 bench/peer_transformers.py --model /tmp/q06 --batch 128 --input-len 128 --output-len 64

One batched greedy generate() of `batch` prompts with exact lengths (ignore EOS), bf16 on CUDA;
prints output tokens per second, to set beside `vt bench --max-concurrency <batch>`.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    rng = np.random.default_rng(args.seed)
    ids = torch.tensor(rng.integers(3, 999, size=(args.batch, args.input_len)), device="cuda")
    mask = torch.ones_like(ids)
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
              eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], **dict(kw, max_new_tokens=4, min_new_tokens=4))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    new = (out.shape[1] - args.input_len) * args.batch
    print(json.dumps({"peer": "transformers.generate", "batch": args.batch, "input_len": args.input_len,
                      "output_len": args.output_len, "seconds": round(dt, 3),
                      "output_tok_per_s": round(new / dt, 1)}))


if __name__ == "__main__":
    main()
