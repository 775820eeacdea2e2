"""`vt bench`: a serving benchmark like `vllm bench serve`, and the async-scheduling on/off comparison.

It sends a dataset (random token-id prompts of exact lengths, or a ShareGPT file) as streaming
completions or chat completions at a request rate with a concurrency cap, records every chunk's
arrival time, and prints throughput and latency figures. This module is the run: the load loop,
the target (a server started here or a running one) and the entry point. The command line is
vt.bench.options (vt.bench.config its record), the datasets vt.bench.datasets, arrival times
vt.bench.arrivals, the HTTP client vt.bench.client, the figures vt.bench.stats, the printed and
saved results vt.bench.report and vt.bench.results, the plots vt.bench.plot.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace

from vt.bench.arrivals import arrival_delays
from vt.bench.client import (
    BenchError,
    ConnectionPool,
    Endpoint,
    error_text,
    http_json,
    read_metrics,
    stream_completion,
)
from vt.bench.config import BenchConfig
from vt.bench.datasets import Prompt, load_sharegpt, make_prompts, sample_sharegpt, with_text
from vt.bench.options import build_bench_parser, config_from_args
from vt.bench.payload import request_payload
from vt.bench.progress import Progress
from vt.bench.report import compare_outputs, format_comparison, format_summary, mean_figures, ratios
from vt.bench.results import RunResult, config_json, run_json, save_vllm_result, write_json
from vt.bench.server import ServerProcess
from vt.bench.stats import RequestRecord, gpu_stats, summarize
from vt.bench.tokens import LocalTokens, ServerTokens, TextTokens, pool_from_server, pool_from_tokenizer

# the names the scripts under bench/ import from here
__all__ = ["BenchConfig", "Prompt", "RunResult", "ServerProcess", "bench_endpoint", "make_prompts", "main",
           "pool_from_server", "pool_from_tokenizer", "request_payload", "run_async", "server_info"]


# ---------------------------------------------------------------- the target


async def server_info(ep: Endpoint, cfg: BenchConfig) -> tuple[str, int | None]:
    """The model name to send and the server's max_model_len: --served-model-name, else --model
    where the server lists it (vLLM sends --model), else the first model it serves."""
    try:
        status, body = await http_json(ep, "GET", "/v1/models")
    except OSError as e:
        raise BenchError(f"cannot reach the server at {ep.host}:{ep.port}: {e}") from None
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise BenchError(f"GET {ep.prefix}/v1/models failed: {error_text(status, body)}")
    models = {m.get("id"): m for m in body["data"] if isinstance(m, dict)}
    first = body["data"][0]
    if cfg.model_name:
        name = cfg.model_name
    elif cfg.model_hint in models:
        name = cfg.model_hint
    else:
        name = first["id"]
        if cfg.model_hint and cfg.model_dir is None:
            print(f"vt bench: the server does not serve {cfg.model_hint!r}; sending its model {name!r}",
                  file=sys.stderr)
    max_len = models.get(name, first).get("max_model_len")
    return name, max_len


def text_tokens(ep: Endpoint, model: str, cfg: BenchConfig) -> TextTokens:
    """A tokenizer on this side where one is found, else the server's."""
    return LocalTokens(cfg.tokenizer_dir) if cfg.tokenizer_dir else ServerTokens(ep, model)


async def dataset_prompts(ep: Endpoint, model: str, cfg: BenchConfig, pool: list[int] | None) -> list[Prompt]:
    """The run's prompts; random ones are written out as text where a chat message needs it."""
    if cfg.dataset_name == "sharegpt":
        assert cfg.dataset_path is not None
        return await sample_sharegpt(load_sharegpt(cfg.dataset_path, cfg.seed), cfg,
                                     text_tokens(ep, model, cfg).encode)
    if pool is None:
        pool = (pool_from_tokenizer(cfg.tokenizer_dir) if cfg.tokenizer_dir
                else await pool_from_server(ep, model))
    prompts = make_prompts(pool, cfg)
    if cfg.chat:
        prompts = with_text(prompts, await text_tokens(ep, model, cfg).decode([p.token_ids for p in prompts]))
    return prompts


# ---------------------------------------------------------------- load generator


async def run_load(ep: Endpoint, model: str, prompts: list[Prompt], cfg: BenchConfig,
                   label: str) -> RunResult:
    """Check the route with one short request, then send every prompt on the arrival schedule and
    collect records."""
    async def send(p: Prompt, rec: RequestRecord, t0: float, pool: ConnectionPool | None) -> None:
        await stream_completion(ep, request_payload(p, model, cfg), rec, t0, pool, path=cfg.endpoint,
                                chat=cfg.chat)

    first = prompts[0]
    warm = RequestRecord(index=-1, input_tokens=len(first.token_ids))
    await send(replace(first, index=-1, output_len=min(2, first.output_len), priority=cfg.priority),
               warm, time.perf_counter(), None)
    if not warm.success:
        raise BenchError(f"the test request failed: {warm.error}")

    before = await read_metrics(ep)
    delays = arrival_delays(len(prompts), cfg.request_rate, cfg.seed, cfg.burstiness)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = Progress.for_run(len(prompts), label, cfg.progress)
    records = [RequestRecord(index=p.index, input_tokens=len(p.token_ids), priority=p.priority)
               for p in prompts]
    pool = ConnectionPool(ep)

    async def one(p: Prompt, rec: RequestRecord) -> None:
        if sem is None:
            await send(p, rec, t0, pool)
        else:
            async with sem:
                await send(p, rec, t0, pool)
        bar.advance()

    t0 = time.perf_counter()
    tasks = []
    for p, rec, delay in zip(prompts, records, delays):
        wait = delay - (time.perf_counter() - t0)
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(p, rec)))
    try:
        await asyncio.gather(*tasks)
    finally:
        await pool.close()
    duration = max(max(r.end for r in records), 1e-9)
    bar.close()
    after = await read_metrics(ep)
    summary = summarize(records, duration, cfg.goodput_slo_ms, gpu_stats(before, after, duration),
                        cfg.metric_percentiles)
    return RunResult(label, records, duration, summary)


async def bench_endpoint(url: str, cfg: BenchConfig, label: str, pool: list[int] | None) -> RunResult:
    """One run against the server at `url`; `pool`: the ids random prompts are drawn from (None:
    read from the tokenizer, or the server's)."""
    ep = Endpoint.from_url(url, cfg.api_key)
    model, max_len = await server_info(ep, cfg)
    prompts = await dataset_prompts(ep, model, cfg, pool)
    longest = max(len(p.token_ids) + p.output_len for p in prompts)
    if not cfg.chat and max_len is not None and longest > max_len:  # a chat template adds tokens unseen here
        what = ("lower --input-len / --output-len" if cfg.dataset_name == "random"
                else "lower --sharegpt-output-len")
        raise BenchError(f"prompts need {longest} tokens (input + output) but the server's max_model_len "
                         f"is {max_len}; {what}")
    result = await run_load(ep, model, prompts, cfg, label)
    result.server = {"url": url, "model": model, "max_model_len": max_len}
    return result


def run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_with_server(cfg: BenchConfig, extra_flags: tuple[str, ...], label: str,
                    pool: list[int] | None) -> RunResult:
    assert cfg.model_dir is not None
    with ServerProcess(cfg.model_dir, cfg.serve_flags + extra_flags, cfg.server_timeout) as srv:
        assert srv.url is not None
        result = run_async(bench_endpoint(srv.url, cfg, label, pool))
    result.server["flags"] = list(cfg.serve_flags + extra_flags)
    return result


# ---------------------------------------------------------------- entry points


def _local_pool(cfg: BenchConfig) -> list[int] | None:
    if cfg.tokenizer_dir and cfg.dataset_name == "random":
        return pool_from_tokenizer(cfg.tokenizer_dir)
    return None


def _summary_text(r: RunResult, cfg: BenchConfig, title: str = "Serving Benchmark Result") -> str:
    return format_summary(r.summary, title, metrics=cfg.percentile_metrics,
                          percentiles=cfg.metric_percentiles, max_concurrency=cfg.max_concurrency,
                          request_rate=cfg.request_rate)


def run_single(cfg: BenchConfig) -> int:
    pool = _local_pool(cfg)
    if cfg.base_url:
        result = run_async(bench_endpoint(cfg.base_url, cfg, "bench", pool))
    else:
        result = run_with_server(cfg, (), "bench", pool)
    print(_summary_text(result, cfg))
    if cfg.json_path:
        write_json(cfg.json_path, {"config": config_json(cfg), **run_json(result)})
    if cfg.save_result:
        print(f"vt bench: result saved to {save_vllm_result(result, cfg)}", file=sys.stderr)
    if cfg.plot_path:
        from vt.bench.plot import save_plot

        save_plot(cfg.plot_path, {"bench": [result.records]})
    return 0


ARMS = (("async_on", "--async-scheduling"), ("async_off", "--no-async-scheduling"))


def run_compare(cfg: BenchConfig) -> int:
    assert cfg.model_dir is not None
    pool = _local_pool(cfg)
    runs: dict[str, list[RunResult]] = {name: [] for name, _ in ARMS}
    for rep in range(cfg.repeats):
        order = ARMS if rep % 2 == 0 else ARMS[::-1]  # alternate so drift does not favour one arm
        for name, flag in order:
            label = f"{name} #{rep + 1}" if cfg.repeats > 1 else name
            runs[name].append(run_with_server(cfg, (flag,), label, pool))
    for name, _ in ARMS:
        for r in runs[name]:
            print(_summary_text(r, cfg, f"Serving Benchmark Result: {r.label}"))
    figures = {name: mean_figures([r.summary for r in runs[name]]) for name, _ in ARMS}
    on, off = figures["async_on"], figures["async_off"]
    mismatched = compare_outputs(runs["async_on"][0].records, runs["async_off"][0].records)
    print(format_comparison(on, off, not mismatched, len(mismatched), cfg.repeats))
    if cfg.json_path:
        write_json(cfg.json_path, {
            "config": config_json(cfg),
            "arms": {name: {"figures": figures[name], "runs": [run_json(r) for r in runs[name]]}
                     for name, _ in ARMS},
            "ratio_on_off": ratios(on, off),
            "outputs_identical": not mismatched,
            "mismatched_prompts": mismatched,
        })
    if cfg.plot_path:
        from vt.bench.plot import save_plot

        save_plot(cfg.plot_path, {name: [r.records for r in runs[name]] for name, _ in ARMS})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_bench_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse already printed usage and the message
        return e.code if isinstance(e.code, int) else 2
    if args.plot:
        from vt.bench.plot import MISSING_MATPLOTLIB, plotting_available

        if not plotting_available():  # now, not after a run that cannot be plotted
            print(f"vt bench: error: {MISSING_MATPLOTLIB}", file=sys.stderr)
            return 2
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"vt bench: error: {e}", file=sys.stderr)
        return 2
    try:
        return run_compare(cfg) if cfg.compare_async else run_single(cfg)
    except KeyboardInterrupt:
        return 130
    except (BenchError, OSError, ValueError) as e:
        print(f"vt bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
