"""A closed-loop serving load run through vt's real Scheduler against a step-cost model: what a
scheduling policy does to a row's throughput and TTFT, predicted on a machine without the GPU.

    python3 -m bench.serving.schedule_sim --rows 8000/64x32c8,1024/128x500c256 [--pacing] [--budget 2048]

Each row is in/out tokens, prompts and concurrency, as vt bench runs it (every client sends its
next request when its last one finishes; outputs run to their length). Steps run one at a time
(depth 1): the scheduler builds a step, the model prices it, its sampled tokens come back.

The cost model (`StepCost`) is a step's device time from what the step carries: a fixed part,
the decodes' attention (KV bytes read), the GEMMs (the weights' read time or the rows' compute,
whichever is longer, over the rows padded to the captured layer graph sizes) and the prompt rows'
causal attention (FLOPs at a marginal rate). Its defaults are fitted to the 8B steps measured
on an H100 (bench/RESULTS.md, the step traces of the target rows): a 2,048-token prompt step
beside 6 decodes at 8k keys 65.7 ms, the same with 1,280 padded tokens 35-49 ms, a decode-only
step of 7 rows at 8k keys 9.6 ms, the 1024/128 steady-state step 60.4 ms and its drain steps 13.4
ms; it reproduces each within ~3%. It is a model: a policy it favours still has to be served
on the device before it becomes a default.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from dataclasses import dataclass

from vt.runner.runner import LAYER_GRAPH_SIZES, padded_size
from vt.sampling_params import SamplingParams
from vt.sched.output import ScheduledBatch
from vt.sched.request import Request, RequestStatus
from vt.sched.scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True)
class StepCost:
    """Device seconds of one step (8B shapes, H100 fit by default)."""

    fixed_s: float = 2.6e-3            # lm_head, sampler, launches, per-layer fixed costs
    weights_s: float = 4.5e-3          # the GEMMs' weight read: a step's GEMM floor
    token_s: float = 22.4e-6           # GEMMs and element kernels per padded token
    kv_bytes_per_key: int = 147_456    # 36 layers x 8 kv heads x 128 dims x (K, V) x bf16
    kv_bytes_per_s: float = 3.1e12     # decode attention's streaming rate
    attn_flop_per_pair: float = 589_824  # 36 layers x 32 heads x 128 dims x 4 (QK and PV)
    attn_flop_per_s: float = 330e12    # the prompt rows' attention, marginal rate
    layer_graph_sizes: tuple[int, ...] = LAYER_GRAPH_SIZES  # steps up to the largest are padded to one

    def padded(self, tokens: int) -> int:
        return padded_size(self.layer_graph_sizes, tokens) or tokens

    def seconds(self, batch: ScheduledBatch) -> float:
        keys = pairs = 0
        for s in batch.seqs:
            if s.num_tokens == 1:
                keys += s.start_pos + 1
            else:  # causal: token j of the chunk sees start_pos + j + 1 keys
                pairs += s.num_tokens * s.start_pos + s.num_tokens * (s.num_tokens + 1) // 2
        gemm = max(self.weights_s, self.token_s * self.padded(batch.num_tokens))
        return (self.fixed_s + gemm + keys * self.kv_bytes_per_key / self.kv_bytes_per_s
                + pairs * self.attn_flop_per_pair / self.attn_flop_per_s)


@dataclass
class RowResult:
    row: str
    seconds: float
    out_tok_s: float
    mean_ttft_ms: float
    steps: int
    decode_only_steps: int


def run_row(prompt_len: int, output_len: int, prompts: int, concurrency: int, sched_cfg: SchedulerConfig,
            cost: StepCost) -> RowResult:
    sched = Scheduler(sched_cfg)
    now, sent = 0.0, 0
    arrivals: list[tuple[float, int]] = []
    arrived_at: dict[str, float] = {}
    first_token: dict[str, float] = {}
    done = steps = decode_only = 0

    def send(t: float) -> None:
        nonlocal sent
        heapq.heappush(arrivals, (t, sent))
        sent += 1

    for _ in range(min(concurrency, prompts)):
        send(0.0)
    while done < prompts:
        while arrivals and arrivals[0][0] <= now:
            t, n = heapq.heappop(arrivals)
            rid = f"r{n}"
            # distinct prompts: no prefix-cache hits between requests
            ids = [(n * 7919 + i) % 100_000 + 1 for i in range(prompt_len)]
            sched.add(Request(rid, ids, SamplingParams(max_tokens=output_len), arrival=t, seq=n,
                              max_tokens=output_len))
            arrived_at[rid] = t
        batch = sched.schedule()
        if batch.empty:
            now = arrivals[0][0]
            continue
        steps += 1
        decode_only += all(s.num_tokens == 1 for s in batch.seqs)
        now += cost.seconds(batch)
        for s in batch.seqs:
            if not s.sample:
                continue
            req = sched.append_token(s.request_id, 1)
            first_token.setdefault(s.request_id, now)
            if req is not None and len(req.output_token_ids) >= output_len:
                sched.finish(s.request_id, RequestStatus.FINISHED_LENGTH)
                done += 1
                if sent < prompts:
                    send(now)
    ttft = sum(first_token[r] - arrived_at[r] for r in arrived_at) / len(arrived_at)
    return RowResult(f"{prompt_len}/{output_len} x{prompts} c={concurrency}", now,
                     prompts * output_len / now, ttft * 1e3, steps, decode_only)


def parse_row(text: str) -> tuple[int, int, int, int]:
    """'8000/64x32c8' -> (8000, 64, 32, 8)."""
    io, rest = text.split("x")
    n, c = rest.split("c")
    i, o = io.split("/")
    return int(i), int(o), int(n), int(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8000/64x32c8,1024/128x500c256,128/128x1024c256,2048/2048x64c16")
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--pacing", action="store_true", help="the scheduler's prefill pacing on")
    base = StepCost()
    ap.add_argument("--fixed-ms", type=float, default=base.fixed_s * 1e3, help="a step's fixed cost")
    ap.add_argument("--weights-ms", type=float, default=base.weights_s * 1e3, help="the GEMMs' weight read")
    ap.add_argument("--token-us", type=float, default=base.token_s * 1e6,
                    help="GEMMs and element kernels a token")
    ap.add_argument("--kv-bytes-per-key", type=int, default=base.kv_bytes_per_key,
                    help="KV bytes a decode reads per key (half with an fp8 cache)")
    ap.add_argument("--attn-tflops", type=float, default=base.attn_flop_per_s / 1e12,
                    help="the prompt rows' attention rate")
    args = ap.parse_args(argv)
    cost = StepCost(fixed_s=args.fixed_ms * 1e-3, weights_s=args.weights_ms * 1e-3,
                    token_s=args.token_us * 1e-6, kv_bytes_per_key=args.kv_bytes_per_key,
                    attn_flop_per_s=args.attn_tflops * 1e12)
    graph_sizes = tuple(n for n in LAYER_GRAPH_SIZES if n <= args.budget)
    print("| row | pacing | seconds | out tok/s | mean TTFT ms | steps | decode-only |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for text in args.rows.split(","):
        i, o, n, c = parse_row(text)
        for pacing in ((False, True) if args.pacing else (False,)):
            cfg = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.budget,
                                  block_size=16, num_blocks=(i + o) * min(c, args.max_num_seqs) // 16 + 64,
                                  prefill_pacing=pacing, step_sizes=graph_sizes)
            r = run_row(i, o, n, c, cfg, cost)
            print(f"| {r.row} | {'on' if pacing else 'off'} | {r.seconds:.2f} | {r.out_tok_s:,.1f} | "
                  f"{r.mean_ttft_ms:,.0f} | {r.steps} | {r.decode_only_steps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
