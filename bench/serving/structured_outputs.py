"""Structured outputs under load: output throughput when 0%, 25% and 100% of requests carry a JSON
schema, async scheduling on and off, against freshly started `vt serve` processes.

    python3 -m bench.serving.structured_outputs --model /tmp/tiny --device cpu
    python3 -m bench.serving.structured_outputs --model /tmp/q06 --device cuda --num-prompts 512 \\
        --max-concurrency 128 --output-len 256 --out /tmp/structured

Requests are `vt bench`'s streamed completions (random prompts of exact token lengths, seeded at
temperature 1, ignore_eos). A guided request's schema is an array of at least 10,000 records
(strings, bounded integers and numbers, enums, a nested object), so it runs to max_tokens like
the free ones: every request generates exactly --output-len tokens and the rows differ only in
the grammar work. The table gives output throughput, TPOT of the free and of the guided requests
(the free requests' TPOT at 25% against 0% is what the guided ones cost the others), the
server's mean step time, and async on / off. Writes structured.md and structured.json under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

from vt.bench.client import ConnectionPool, Endpoint, read_metrics, stream_completion
from vt.bench.run import (
    BenchConfig,
    ServerProcess,
    make_prompts,
    pool_from_server,
    request_payload,
    run_async,
    server_info,
)
from vt.bench.stats import RequestRecord, gpu_stats, summarize

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "score": {"type": "number", "minimum": -100, "maximum": 100},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"team": {"type": "string", "maxLength": 16},
                                                   "level": {"type": "integer", "minimum": 1, "maximum": 9}},
                  "required": ["team", "level"], "additionalProperties": False},
    },
    "required": ["name", "id", "status", "owner"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 10000}
SHARES = (0, 25, 100)


def guided(index: int, share: int) -> bool:
    """Spread the guided requests evenly over the load (every 4th at 25%)."""
    return share > 0 and (index * share) // 100 != ((index + 1) * share) // 100


async def run_load(url: str, cfg: BenchConfig, share: int) -> dict:
    ep = Endpoint.from_url(url, None)
    model, _ = await server_info(ep, cfg)
    prompts = make_prompts(await pool_from_server(ep, model), cfg)
    fmt = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}

    def payload(i: int) -> dict:
        body = request_payload(prompts[i], model, cfg)
        if guided(i, share):
            body["response_format"] = fmt
        return body

    # warm-up: compiles the schema (cached from then on) and runs a step of each kind
    for body in (payload(0), {**payload(0), "response_format": fmt}):
        rec = RequestRecord(index=-1, input_tokens=0)
        await stream_completion(ep, {**body, "max_tokens": 4}, rec, time.perf_counter())
        if not rec.success:
            raise RuntimeError(f"warm-up request failed: {rec.error}")
    before = await read_metrics(ep)
    sem = asyncio.Semaphore(cfg.max_concurrency or len(prompts))
    records = [RequestRecord(index=p.index, input_tokens=len(p.token_ids)) for p in prompts]
    pool = ConnectionPool(ep)

    async def one(i: int) -> None:
        async with sem:
            await stream_completion(ep, payload(i), records[i], t0, pool)

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        await pool.close()
    duration = max(r.end for r in records)
    after = await read_metrics(ep)
    summary = summarize(records, duration, None, gpu_stats(before, after, duration))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")

    def tpot_ms(kind: bool) -> float | None:
        values = [r.tpot for r in records if guided(r.index, share) == kind and r.tpot is not None]
        return 1000 * statistics.mean(values) if values else None

    steps = after.get("vt:steps_total", 0) - before.get("vt:steps_total", 0)
    step_s = after.get("vt:step_time_seconds_total", 0) - before.get("vt:step_time_seconds_total", 0)
    return {"share": share, "requests": len(records),
            "guided": sum(guided(i, share) for i in range(len(records))), "duration_s": duration,
            "output_tokens": sum(r.output_tokens for r in records),
            "output_throughput": summary.output_throughput, "tpot_free_ms": tpot_ms(False),
            "tpot_guided_ms": tpot_ms(True), "ttft_mean_ms": summary.ttft.mean_ms,
            "mean_step_ms": 1000 * step_s / steps if steps else None}


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def median_rows(runs: list[dict]) -> list[dict]:
    """One row per (share, async): the median of each figure over repeats, and the throughput range."""
    keys = ("output_throughput", "tpot_free_ms", "tpot_guided_ms", "ttft_mean_ms", "mean_step_ms")
    rows = []
    for share, on in dict.fromkeys((r["share"], r["async"]) for r in runs):
        same = [r for r in runs if (r["share"], r["async"]) == (share, on)]
        row = {"share": share, "async": on, "repeats": len(same)}
        for k in keys:
            values = [r[k] for r in same if r[k] is not None]
            row[k] = statistics.median(values) if values else None
        row["throughput_range"] = (min(r["output_throughput"] for r in same),
                                   max(r["output_throughput"] for r in same))
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    by = {(r["share"], r["async"]): r for r in rows}
    lines = ["| JSON-schema share | async | output tok/s (median) | range | on/off | TPOT free ms | "
             "TPOT guided ms | TTFT mean ms | mean step ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        other = by.get((r["share"], not r["async"]))
        ratio = (r["output_throughput"] / other["output_throughput"]) if r["async"] and other else None
        lo, hi = r["throughput_range"]
        lines.append(f"| {r['share']}% | {'on' if r['async'] else 'off'} | "
                     f"{_fmt(r['output_throughput'], 0)} | {lo:.0f}-{hi:.0f} | {_fmt(ratio, 2)} | "
                     f"{_fmt(r['tpot_free_ms'], 2)} | {_fmt(r['tpot_guided_ms'], 2)} | "
                     f"{_fmt(r['ttft_mean_ms'])} | {_fmt(r['mean_step_ms'], 2)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint folder")
    p.add_argument("--device", default="auto", help="vt serve --device")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--shares", default=",".join(map(str, SHARES)), help="JSON-schema shares in percent")
    p.add_argument("--repeats", type=int, default=1, help="runs of each row (the table gives medians)")
    p.add_argument("--server-args", default="", help="more vt serve flags, e.g. '--max-model-len 2048'")
    p.add_argument("--emulate-step-ms", type=float, default=None,
                   help="serve on bench/serving/emulated_device.py: the CPU build with a device step of this "
                        "many ms that does no arithmetic (the host's share alone; --device cpu)")
    p.add_argument("--emulate-token-us", type=float, default=0.0,
                   help="with --emulate-step-ms: device time added per token of a step")
    p.add_argument("--out", default=None, help="folder for structured.md and structured.json")
    p.add_argument("--arms", default="both", choices=["both", "on", "off"],
                   help="async scheduling on and off (default), or one of them")
    args = p.parse_args(argv)
    cfg = BenchConfig(
        base_url=None, model_dir=args.model, model_name=None, api_key=None, serve_flags=(),
        server_timeout=600, num_prompts=args.num_prompts, input_len=args.input_len,
        output_len=args.output_len, range_ratio=0.0,
        seed=0, ignore_eos=True, temperature=1.0, priority=0, priority_mix=(), request_rate=float("inf"),
        max_concurrency=args.max_concurrency, goodput_slo_ms=None, compare_async=True, repeats=1,
        json_path=None, plot_path=None, progress=False)
    flags = ("--device", args.device, "--max-num-seqs", str(max(args.max_concurrency, 1)),
             *shlex.split(args.server_args))
    launcher: tuple[str, ...] = ()
    if args.emulate_step_ms is not None:
        launcher = (sys.executable, "-m", "bench.serving.emulated_device",
                    "--step-ms", str(args.emulate_step_ms), "--token-us", str(args.emulate_token_us))
    runs = []
    shares = [int(x) for x in args.shares.split(",")]
    for repeat in range(args.repeats):  # interleaved, so drifts of a shared machine hit every row alike
        for share in shares:
            for on in {"both": (True, False), "on": (True,), "off": (False,)}[args.arms]:
                arm = "--async-scheduling" if on else "--no-async-scheduling"
                with ServerProcess(args.model, (*flags, arm), cfg.server_timeout, launcher) as srv:
                    run = run_async(run_load(srv.url, cfg, share))
                run.update({"async": on, "repeat": repeat})
                runs.append(run)
                print(f"share {share}% async {'on' if on else 'off'} (repeat {repeat + 1}): "
                      f"{run['output_throughput']:.0f} output tok/s", file=sys.stderr)
    rows = median_rows(runs)
    device = args.device if args.emulate_step_ms is None else (
        f"emulated ({args.emulate_step_ms} ms a step + {args.emulate_token_us} us a token)")
    text = (f"{args.num_prompts} requests, {args.input_len} in / {args.output_len} out, concurrency "
            f"{args.max_concurrency}, device {device}, {args.repeats} run(s) a row\n\n{table(rows)}\n")
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "structured.md").write_text(text)
        (out / "structured.json").write_text(json.dumps({"args": vars(args), "rows": rows, "runs": runs},
                                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
