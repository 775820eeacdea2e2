"""Where a decode step's device time goes: every kernel of graph-replayed steps, from a CUPTI trace.

    python3 -m bench.step.step_profile --preset 8b --batch 64 --context 512 [--trace out.json]

The runner is bench/step/decode_step.py's (random weights, the real staging, graphs and sampling).
Steps run at depth 1 so that each step's kernels form one window; the report groups kernels by
name and gives, per step, the device busy time, the gaps between consecutive kernels and the
wall time. torch's profiler is only the CUPTI reader here (it records every kernel of the
process, CuPy's and cuBLAS' included); torch itself runs nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from bench.step.decode_step import build_runner, decode_batches, floor_seconds


def kernel_events(trace: dict) -> list[dict]:
    return sorted((e for e in trace["traceEvents"] if e.get("cat") == "kernel"), key=lambda e: e["ts"])


def device_events(trace: dict) -> list[dict]:
    """Kernels, copies and memsets: everything that occupies the device's timeline."""
    cats = ("kernel", "gpu_memcpy", "gpu_memset")
    return sorted((e for e in trace["traceEvents"] if e.get("cat") in cats), key=lambda e: e["ts"])


def timeline(events: list[dict]) -> dict:
    """Span from the first start to the last end, the time no event covers (events of two
    streams may overlap), and the copies' count and summed duration."""
    if not events:
        return dict(span_us=0.0, idle_us=0.0, copies=0, copy_us=0.0)
    covered, end = 0.0, events[0]["ts"]
    for e in events:
        start, stop = max(e["ts"], end), e["ts"] + e["dur"]
        if stop > start:
            covered += stop - start
            end = stop
    span = end - events[0]["ts"]  # `end` is the latest end seen
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    return dict(span_us=span, idle_us=span - covered, copies=len(copies),
                copy_us=sum(e["dur"] for e in copies))


def split_steps(kernels: list[dict], per_step: int) -> list[list[dict]]:
    return [kernels[i: i + per_step] for i in range(0, len(kernels) - per_step + 1, per_step)]


def short_name(name: str) -> str:
    if any(s in name for s in ("gemm", "nvjet", "cutlass", "xmma", "splitK", "Kernel2")):
        return "cublas:" + name[:60]
    return name.split("(")[0][:60]


def summarize(steps: list[list[dict]]) -> dict:
    by_name: dict[str, list[float]] = defaultdict(list)
    busy, gaps, spans = [], [], []
    for ks in steps:
        busy.append(sum(k["dur"] for k in ks))
        gaps.append(sum(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(ks, ks[1:])))
        spans.append(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"])
        per: dict[str, float] = defaultdict(float)
        for k in ks:
            per[short_name(k["name"])] += k["dur"]
        for n, v in per.items():
            by_name[n].append(v)
    count: dict[str, int] = defaultdict(int)
    for k in steps[0]:
        count[short_name(k["name"])] += 1
    rows = sorted(((n, statistics.median(v), count[n]) for n, v in by_name.items()), key=lambda r: -r[1])
    # The gap before each kernel, by the pair (kernel before, kernel after): which boundaries cost.
    pairs: dict[tuple[str, str], list[float]] = defaultdict(list)
    for ks in steps:
        for a, b in zip(ks, ks[1:]):
            gap = max(0.0, b["ts"] - (a["ts"] + a["dur"]))
            pairs[(short_name(a["name"]), short_name(b["name"]))].append(gap)
    n = len(steps)
    gap_rows = sorted(((f"{a[:34]} -> {b[:34]}", sum(v) / n, statistics.median(v), len(v) // n)
                       for (a, b), v in pairs.items()), key=lambda r: -r[1])
    return dict(kernels_per_step=len(steps[0]), busy_us=statistics.median(busy),
                gaps_us=statistics.median(gaps), span_us=statistics.median(spans), rows=rows,
                gap_rows=gap_rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prefill", type=int, default=0,
                    help="prompt tokens of a new request beside the decodes in every step (a mixed step)")
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=0, help="the engine's (decode_step's flag)")
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    runner, mc = build_runner(args.preset, args.batch, args.context, False, prefill=args.prefill,
                              max_model_len=args.max_model_len,
                              quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    eos = lambda _rid: ()  # noqa: E731
    # warm-up, one, then two runs
    gen = decode_batches(args.batch, args.context, 2 * args.steps + 6, args.prefill)
    runner.execute(next(gen), eos).result()
    for _ in range(4):
        runner.execute(next(gen), eos).result()
    # one profiled step alone, to count its kernels
    with profile(activities=[ProfilerActivity.CUDA]) as p1:
        runner.execute(next(gen), eos).result()
    path = Path(args.trace or "/tmp/step_one.json")
    p1.export_chrome_trace(str(path))
    per_step = len(kernel_events(json.loads(path.read_text())))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            runner.execute(next(gen), eos).result()
    prof.export_chrome_trace(str(path))
    kernels = kernel_events(json.loads(path.read_text()))
    s = summarize(split_steps(kernels, per_step))
    floor = floor_seconds(mc, args.batch, args.context, args.quantization == "fp8",
                          args.kv_cache_dtype != "auto") * 1e6
    print(f"{args.preset} batch {args.batch} context {args.context} prefill {args.prefill}: "
          f"{s['kernels_per_step']} kernels per step, "
          f"busy {s['busy_us']:.0f} us + gaps {s['gaps_us']:.0f} us = span {s['span_us']:.0f} us; "
          f"floor {floor:.0f} us ({s['span_us'] / floor:.2f}x, busy alone {s['busy_us'] / floor:.2f}x)")
    print(f"{'kernel':64s} {'us/step':>9s} {'count':>6s} {'share':>6s}")
    for name, us, n in s["rows"]:
        print(f"{name:64s} {us:9.1f} {n:6d} {us / s['busy_us']:6.1%}")
    print(f"{'gap before a kernel, by boundary':72s} {'us/step':>8s} {'median':>7s} {'count':>6s}")
    for name, us, med, n in s["gap_rows"][:10]:
        print(f"{name:72s} {us:8.1f} {med:7.2f} {n:6d}")
    # Depth 2, as serving runs: what the device timeline holds per step besides the kernels.
    handles = []
    with profile(activities=[ProfilerActivity.CUDA]) as p2:
        for _ in range(args.steps):
            handles.append(runner.execute(next(gen), eos))
            if len(handles) == 2:
                handles.pop(0).result()
        while handles:
            handles.pop(0).result()
    p2.export_chrome_trace(str(path))
    tl = timeline(device_events(json.loads(path.read_text())))
    n = args.steps
    print(f"depth 2: {tl['span_us'] / n:.0f} us per step on the device timeline, of which "
          f"{tl['idle_us'] / n:.0f} us idle; {tl['copies'] / n:.1f} copies per step "
          f"taking {tl['copy_us'] / n:.1f} us")


if __name__ == "__main__":
    main()
