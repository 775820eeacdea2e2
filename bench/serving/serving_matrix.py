"""The serving matrix: every workload shape at every concurrency against one `vt serve`, one table.

    python3 -m bench.serving.serving_matrix --model /tmp/q8 --label 8b --out /tmp/matrix8
    python3 -m bench.serving.serving_matrix --model /tmp/q06 --rows targets   # the peer's target rows only

Rows: in/out lengths 128/128, 1024/128, 128/1024, 2048/2048, 8000/64 and a mixed load (1024/256,
lengths spread +-90% as `vt bench --random-range-ratio 0.9`), each at concurrency 1, 16, 64 and
256, plus the target rows measured for the peer (vLLM) with their own prompt counts. Requests
are `vt bench`'s: random prompts of exact token lengths, streamed, ignore_eos, greedy. One server
serves every row (graphs on, async scheduling on); each row is bounded in time, and a row that
does not finish is reported as such, never dropped. Writes matrix.md and matrix.json under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path

from vt.bench.client import BenchError
from vt.bench.run import BenchConfig, ServerProcess, bench_endpoint, pool_from_tokenizer

SHAPES = ((128, 128, 0.0), (1024, 128, 0.0), (128, 1024, 0.0), (2048, 2048, 0.0), (8000, 64, 0.0),
          (1024, 256, 0.9))
CONCURRENCY = (1, 16, 64, 256)
# (in, out, prompts, concurrency) as the peer was measured (the envelope issue's targets table)
TARGETS = ((1024, 128, 500, 256), (8000, 64, 32, 8), (128, 1024, 512, 256), (128, 128, 1024, 256),
           (128, 256, 8, 1))
FIGURES = ("successful_requests", "failed_requests", "duration_s", "output_throughput",
           "total_token_throughput", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms",
           "itl_mean_ms", "mean_step_time_ms", "gpu_idle_fraction")


@dataclasses.dataclass(frozen=True)
class Row:
    input_len: int
    output_len: int
    range_ratio: float
    prompts: int
    concurrency: int
    kind: str  # "matrix" | "target"

    @property
    def name(self) -> str:
        spread = f" +-{self.range_ratio:.0%}" if self.range_ratio else ""
        return f"{self.input_len}/{self.output_len}{spread}"


def prompts_for(input_len: int, output_len: int, concurrency: int) -> int:
    """Two waves of the concurrency for short requests, one for long ones; alone, a few."""
    long = input_len + output_len > 2048 or output_len >= 1024
    if concurrency == 1:
        return 2 if long else 4
    return concurrency if long else 2 * concurrency


def parse_shapes(text: str) -> tuple[tuple[int, int, float], ...]:
    """"128/128,1024/256~0.9" -> ((128, 128, 0.0), (1024, 256, 0.9))."""
    out = []
    for item in text.split(","):
        lens, _, spread = item.partition("~")
        i, _, o = lens.partition("/")
        out.append((int(i), int(o), float(spread or 0)))
    return tuple(out)


def plan_rows(which: str, shapes: tuple = SHAPES, concurrency: tuple = CONCURRENCY,
              targets: tuple | None = None) -> list[Row]:
    """`targets`: (in, out) pairs of TARGETS to keep (default: all of them)."""
    rows = []  # the peer's rows first: a time budget that runs out cuts the matrix's tail
    if which in ("targets", "all"):
        rows += [Row(i, o, 0.0, n, c, "target") for i, o, n, c in TARGETS
                 if targets is None or (i, o) in targets]
    if which in ("matrix", "all"):
        rows += [Row(i, o, r, prompts_for(i, o, c), c, "matrix") for i, o, r in shapes for c in concurrency]
    return rows


def config_for(row: Row, url: str, model_dir: str, prefix_len: int = 0) -> BenchConfig:
    """prefix_len: every prompt starts with the same prefix of this many tokens (`vt bench
    --random-prefix-len`), before its row's input_len tokens."""
    return BenchConfig(
        base_url=url, model_dir=model_dir, model_name=None, api_key=None, serve_flags=(), server_timeout=600,
        num_prompts=row.prompts, input_len=row.input_len, output_len=row.output_len,
        range_ratio=row.range_ratio, seed=0, ignore_eos=True, temperature=0.0, priority=0, priority_mix=(),
        request_rate=float("inf"), max_concurrency=row.concurrency, goodput_slo_ms=None, compare_async=False,
        repeats=1, json_path=None, plot_path=None, progress=False, prefix_len=prefix_len)


async def run_rows(url: str, model_dir: str, pool: list[int], rows: list[Row], row_timeout: float,
                   budget_s: float, prefix_len: int = 0) -> list[dict]:
    results = []
    start = time.monotonic()
    for row in rows:
        entry: dict = {"row": dataclasses.asdict(row), "name": row.name}
        if time.monotonic() - start > budget_s:
            entry["status"] = "skipped (time budget)"
        else:
            try:
                cfg = config_for(row, url, model_dir, prefix_len)
                res = await asyncio.wait_for(bench_endpoint(url, cfg, row.name, pool), row_timeout)
                entry |= figures(res)
            except asyncio.TimeoutError:
                entry["status"] = f"timeout after {row_timeout:.0f} s"
            except BenchError as e:
                entry["status"] = f"error: {e}"
        results.append(entry)
        print(line(entry), flush=True)
    return results


def figures(res: object) -> dict:
    figs = res.summary.figures()
    return {"status": "ok", **{k: figs.get(k) for k in FIGURES}, "errors": res.summary.errors}


async def long_context(url: str, model_dir: str, pool: list[int], length: int,
                       row_timeout: float) -> list[dict]:
    """One prompt of `length` tokens (60 out) alone, then again while 64 short requests decode."""
    alone = Row(length, 60, 0.0, 1, 1, "long")
    beside = Row(128, 512, 0.0, 128, 64, "decodes")
    out = []
    one = config_for(alone, url, model_dir)
    res = await asyncio.wait_for(bench_endpoint(url, one, "long", pool), row_timeout)
    out.append({"row": dataclasses.asdict(alone), "name": f"{alone.name} alone", **figures(res)})

    async def later() -> object:
        await asyncio.sleep(2.0)  # the short requests are decoding by then
        return await bench_endpoint(url, one, "long", pool)

    bg, fg = await asyncio.wait_for(asyncio.gather(
        bench_endpoint(url, config_for(beside, url, model_dir), "decodes", pool), later()), row_timeout)
    out.append({"row": dataclasses.asdict(alone), "name": f"{alone.name} beside decodes", **figures(fg)})
    out.append({"row": dataclasses.asdict(beside), "name": f"{beside.name} around it", **figures(bg)})
    for e in out:
        print(line(e), flush=True)
    return out


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


HEADER = ("| kind | in / out | prompts | conc | ok | failed | out tok/s | total tok/s | TTFT mean ms | "
          "TTFT p99 ms | TPOT mean ms | TPOT p99 ms | step ms | GPU idle |")


def line(e: dict) -> str:
    r = e["row"]
    head = f"| {r['kind']} | {e['name']} | {r['prompts']} | {r['concurrency']} |"
    if e["status"] != "ok":
        return f"{head} {e['status']} |" + " |" * 9
    idle = e.get("gpu_idle_fraction")
    cells = (e["successful_requests"], e["failed_requests"], _f(e["output_throughput"]),
             _f(e["total_token_throughput"]), _f(e["ttft_mean_ms"]), _f(e["ttft_p99_ms"]),
             _f(e["tpot_mean_ms"], 2), _f(e["tpot_p99_ms"], 2), _f(e["mean_step_time_ms"], 2),
             "-" if idle is None else f"{idle:.1%}")
    return head + " " + " | ".join(str(c) for c in cells) + " |"


def table(results: list[dict]) -> str:
    return "\n".join([HEADER, "|" + "---|" * 14] + [line(e) for e in results])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--label", default="", help="name of the model in the table")
    ap.add_argument("--rows", default="all", choices=["matrix", "targets", "all"])
    ap.add_argument("--shapes", default=None, help="matrix shapes, e.g. 128/128,1024/256~0.9 (default: all)")
    ap.add_argument("--concurrency", default=None, help="matrix concurrencies, e.g. 1,16 (default: all)")
    ap.add_argument("--targets", default=None,
                    help="target rows to run, e.g. 1024/128,8000/64 (default: all)")
    ap.add_argument("--server-args", default="--max-num-seqs 256 --max-model-len 16384",
                    help="vt serve flags (besides --device cuda)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--row-timeout", type=float, default=150.0, help="seconds a row may take")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds after which rows are skipped")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prefix-len", type=int, default=0,
                    help="every prompt of the rows starts with one shared prefix of this many tokens")
    ap.add_argument("--long", type=int, default=0,
                    help="also serve one prompt of this many tokens alone and beside 64 decoding requests")
    args = ap.parse_args()
    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    conc = tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else CONCURRENCY
    targets = tuple((i, o) for i, o, _ in parse_shapes(args.targets)) if args.targets else None
    rows = plan_rows(args.rows, shapes, conc, targets)
    flags = ("--device", args.device, *shlex.split(args.server_args))
    t0 = time.monotonic()
    with ServerProcess(args.model, flags, timeout=900) as srv:
        started = time.monotonic() - t0
        print(f"server up in {started:.1f} s: {shlex.join(srv.cmd)}", flush=True)
        print(HEADER, flush=True)
        pool = pool_from_tokenizer(args.model)  # prompt token ids, read once for every row
        results = asyncio.run(run_rows(srv.url, args.model, pool, rows, args.row_timeout, args.budget,
                                       args.prefix_len))
        if args.long:
            results += asyncio.run(long_context(srv.url, args.model, pool, args.long, args.row_timeout))
    args.out.mkdir(parents=True, exist_ok=True)
    title = f"## {args.label or args.model}: `vt serve {shlex.join(flags)}` (start-up {started:.0f} s)"
    (args.out / "matrix.md").write_text(title + "\n\n" + table(results) + "\n")
    (args.out / "matrix.json").write_text(json.dumps({"model": args.model, "label": args.label,
                                                      "flags": list(flags), "rows": results}, indent=1))
    failed = sum((e.get("failed_requests") or 0) for e in results)
    print(f"failed requests in all rows: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
