"""Prompt attention beside the peer's: vt's prompt tiling and vLLM's FlashAttention-3 on the same
paged cases, the same card and the same minute (time, TFLOP/s, and how far FA3's output is from
vt's).

The cases are bench/kernels/attn_tilings.py's (8B heads: 32 q, 8 kv, head dim 128; causal; a paged
cache of 16-key blocks, shuffled, as vLLM serves it), handed to FA3 through DLPack without a copy.
FA3 runs as vLLM's attention backend calls it: `flash_attn_varlen_func` over the block table with
`fa_version=3`, with and without the scheduler metadata vLLM computes ahead of a step.

Needs vLLM's FA3 extension on PYTHONPATH after this checkout: the peer's vLLM staged on the GPU
machine (../shared/peer/README.md), or only its FA3 module, packed by bench/kernels/fa3_pack.sh (8 MB,
one carry):

    python3 -m bench.kernels.attn_peer [--tiling wgwp --tiling wgs] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import numpy as np

from bench.kernels.attn_tilings import D, PagedCase, case_call, causal_flops, host_f32, paged_case, rel_diff
from vt.kernels.attention_plan import DEFAULT_PREFILL_TILING

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

    from vt.kernels.cuda_ops import CudaBackend

CASES = [("8k alone", [8192], [8192]), ("2k alone", [2048], [2048]), ("2k chunk at 8k", [2048], [8192]),
         ("4 x 1k", [1024] * 4, [1024] * 4),
         ("8000 beside 7 decodes at 4000", [8000] + [1] * 7, [8000] + [4000] * 7),
         # the same batch as a step orders it, decodes first: vt's two launches (decode, prompt)
         ("7 decodes at 4000, then 8000", [1] * 7 + [8000], [4000] * 7 + [8000])]


def time_torch(fn, reps: int = 20) -> float:
    """Mean seconds a call over reps back-to-back calls, CUDA events on torch's stream."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps / 1e3


def fa3_call(c: PagedCase, hq: int = 32, hk: int = 8, metadata: bool = True) -> Callable[[], torch.Tensor]:
    """FA3 over a paged_case as vLLM's attention backend calls it (the scheduler metadata computed
    ahead, as vLLM does for each step, when `metadata`); the call returns its output."""
    import torch
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, get_scheduler_metadata

    q = torch.from_dlpack(c.q).view(torch.bfloat16)
    kc = torch.from_dlpack(c.k_cache).view(torch.bfloat16)
    vc = torch.from_dlpack(c.v_cache).view(torch.bfloat16)
    cu_q, seqused = torch.from_dlpack(c.query_start_loc), torch.from_dlpack(c.seq_lens)
    table = torch.from_dlpack(c.block_table)
    max_q, max_k = max(c.q_lens), max(c.ctx_lens)
    out = torch.empty_like(q)
    meta = get_scheduler_metadata(len(c.q_lens), max_q, max_k, hq, hk, D, seqused, qkv_dtype=torch.bfloat16,
                                  cu_seqlens_q=cu_q, page_size=kc.shape[1], causal=True) if metadata else None

    def call() -> torch.Tensor:
        return flash_attn_varlen_func(q, kc, vc, max_q, cu_q, max_k, seqused_k=seqused, softmax_scale=D**-0.5,
                                      causal=True, block_table=table, out=out, scheduler_metadata=meta,
                                      fa_version=3)

    return call


def measure_case(be: CudaBackend, rng: np.random.Generator, tilings: list[str], q_lens: list[int],
                 ctx_lens: list[int], hq: int = 32) -> list[tuple[str, float, float]]:
    """(engine, seconds a call, relative difference from the first tiling's output) for each of vt's
    tilings, FA3, and FA3 with the scheduler metadata."""
    import cupy

    from bench.kernels.kernel_bench import time_op

    c = paged_case(rng, hq, q_lens, ctx_lens)
    ours = case_call(be, c)
    results: list[tuple[str, float, float]] = []
    mine_f = None
    for tiling in tilings:
        be.use_prefill_tiling(tiling)
        t_ours = time_op(be, ours)
        with be.slot(0):
            mine = ours()
        cupy.cuda.Device().synchronize()
        got = host_f32(mine).reshape(sum(q_lens), hq, D)
        mine_f = got if mine_f is None else mine_f
        results.append((tiling, t_ours, rel_diff(got, mine_f)))
    for name, metadata in (("fa3", False), ("fa3+meta", True)):
        peer = fa3_call(c, hq, metadata=metadata)
        t = time_torch(peer)
        got = peer().float().cpu().numpy()
        results.append((name, t, rel_diff(got, mine_f)))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiling", action="append", help="vt prompt tiling to time (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from vt.kernels.cuda_ops import CudaBackend

    be = CudaBackend(workspace_bytes=1 << 30)
    tilings = args.tiling or [DEFAULT_PREFILL_TILING]
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'case':30s} {'engine':10s} {'us':>9s} {'TFLOP/s':>8s} {'rel diff':>9s}")
    for label, q_lens, ctx_lens in CASES:
        flops = causal_flops(q_lens, ctx_lens, 32)
        for name, t, diff in measure_case(be, rng, tilings, q_lens, ctx_lens):
            rows.append({"case": label, "engine": name, "us": t * 1e6, "tflops": flops / t / 1e12,
                         "rel_diff": diff})
            print(f"{label:30s} {name:10s} {t * 1e6:9.1f} {flops / t / 1e12:8.1f} {diff:9.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
