"""`vt bench`: a serving benchmark like `vllm bench serve`, and the async-scheduling on/off comparison.

It sends random token-id prompts of exact lengths as streaming completions, records every chunk's
arrival time, and prints throughput and latency figures. This module is the command line and the
run: options, the dataset, the load loop, the servers it starts, the printed and saved results;
the HTTP client is vt.bench.client, the figures vt.bench.stats, the plots vt.bench.plot.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import shlex
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import urlsplit

import orjson

from vt.bench.client import (
    BenchError,
    ConnectionPool,
    Endpoint,
    error_text,
    http_json,
    read_metrics,
    stream_completion,
)
from vt.bench.stats import SLO_KEYS, BenchSummary, RequestRecord, gpu_stats, summarize
from vt.launch.subprocesses import terminate

READY = re.compile(r"vt: serving on (http://\S+)")
STOP_TIMEOUT_S = 30.0
SERVER_LOG_LINES = 40        # server output kept to explain a failed start
POOL_TEXT = (
    "The quick brown fox jumps over the lazy dog. A serving benchmark sends many prompts at once, "
    "streams every token back and measures how long each one took. Numbers, like 42 and 3.14, "
    "punctuation; names such as Paris, Tokyo and Lagos; and plain words fill the vocabulary pool."
)



# ---------------------------------------------------------------- command line


def _rate(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r} (use a positive rate or 'inf')") from None
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be positive or 'inf', got {value!r}")
    return rate


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _ratio(value: str) -> float:
    try:
        r = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= r < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value!r}")
    return r


def _temperature(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    if not 0.0 <= t <= 2.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 2], got {value!r}")
    return t


def parse_goodput(items: list[str]) -> dict[str, float]:
    """['ttft:200', 'tpot:50'] -> {'ttft': 200.0, 'tpot': 50.0} (ms)."""
    slo: dict[str, float] = {}
    for item in items:
        key, sep, ms = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"--goodput expects KEY:MS with KEY one of {', '.join(SLO_KEYS)}, got {item!r}")
        try:
            bound = float(ms)
        except ValueError:
            raise ValueError(f"--goodput {key}: {ms!r} is not a number of milliseconds") from None
        if not bound > 0 or math.isinf(bound):
            raise ValueError(f"--goodput {key}: the bound must be a positive number of ms, got {ms!r}")
        slo[key] = bound
    return slo


def parse_priority_mix(items: list[str]) -> list[tuple[int, float]]:
    """['0:0.2', '2:0.1'] -> [(0, 0.2), (2, 0.1)]; shares must sum to at most 1."""
    mix: list[tuple[int, float]] = []
    for item in items:
        prio, sep, share = item.partition(":")
        try:
            p, s = int(prio), float(share)
        except ValueError:
            raise ValueError(f"--priority-mix expects PRIORITY:SHARE like 0:0.2, got {item!r}") from None
        if not sep or not 0.0 < s <= 1.0:
            raise ValueError(f"--priority-mix share must be in (0, 1], got {item!r}")
        mix.append((p, s))
    if sum(s for _, s in mix) > 1.0 + 1e-9:
        raise ValueError("--priority-mix shares add up to more than 1")
    return mix


def build_bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vt bench",
        description="Serving benchmark: random token-id prompts as streaming completions against a vt "
                    "server started here (--model, default: the built-in demo model) or already running "
                    "(--base-url).")
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    t.add_argument("--model", default=None,
                   help="checkpoint: start `vt serve` on it (with --base-url: only its tokenizer is used)")
    t.add_argument("--model-name", default=None, help="model name to send (default: the served one)")
    t.add_argument("--api-key", default=None, help="bearer token (default: VT_API_KEY)")
    t.add_argument("--device", default=None, choices=["auto", "cuda", "cpu"], help="passed to vt serve")
    t.add_argument("--max-num-seqs", type=_positive_int, default=None, help="passed to vt serve")
    t.add_argument("--max-num-batched-tokens", type=_positive_int, default=None, help="passed to vt serve")
    t.add_argument("--scheduling-policy", default=None, choices=["fcfs", "priority"],
                   help="passed to vt serve")
    t.add_argument("--server-args", default="",
                   help="more `vt serve` flags as one string, written with '=' so that its dashes are not "
                        "read as bench flags: --server-args='--enforce-eager --max-model-len 4096'")
    t.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds to wait for the server to start")
    d = p.add_argument_group("dataset")
    d.add_argument("--num-prompts", type=_positive_int, default=100)
    d.add_argument("--input-len", type=_positive_int, default=128, help="prompt tokens per request")
    d.add_argument("--output-len", type=_positive_int, default=128, help="max_tokens per request")
    d.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=_ratio, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (default 0: exact)")
    d.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths, priorities and arrivals")
    d.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the output length (default on)")
    d.add_argument("--temperature", type=_temperature, default=0.0,
                   help="0 = greedy; above 0 each request gets sampling seed --seed + its index")
    d.add_argument("--priority", type=int, default=None,
                   help="priority of requests not given one by --priority-mix (default: 1 with "
                        "--priority-mix, else 0, which a server with --scheduling-policy fcfs accepts)")
    d.add_argument("--priority-mix", nargs="+", default=[], metavar="P:SHARE",
                   help="send SHARE of the requests with priority P, e.g. `0:0.2` sends 20%% at priority 0 "
                        "and the rest at --priority; several pairs allowed, shares add up to at most 1; "
                        "lower priority runs first under --scheduling-policy priority")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="mean requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="requests in flight at most")
    load.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                      help="SLOs in ms (ttft, tpot, e2el): requests meeting all of them count as goodput")
    load.add_argument("--compare-async", action="store_true",
                      help="run twice on fresh servers, --async-scheduling and --no-async-scheduling, and "
                           "print them side by side (needs --model or the demo model, not --base-url)")
    load.add_argument("--repeats", type=_positive_int, default=1,
                      help="with --compare-async: runs per arm, order alternated")
    out = p.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="FILE", help="save every figure and request record")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="save latency CDFs and throughput over time")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


@dataclass(frozen=True)
class BenchConfig:
    """Validated options of one benchmark invocation."""

    base_url: str | None
    model_dir: str | None
    model_name: str | None
    api_key: str | None
    serve_flags: tuple[str, ...]
    server_timeout: float
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    seed: int
    ignore_eos: bool
    temperature: float
    priority: int
    priority_mix: tuple[tuple[int, float], ...]
    request_rate: float
    max_concurrency: int | None
    goodput_slo_ms: dict[str, float] | None
    compare_async: bool
    repeats: int
    json_path: str | None
    plot_path: str | None
    progress: bool


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    if args.compare_async and args.base_url:
        raise ValueError("--compare-async starts its own servers; give --model (or nothing), not --base-url")
    if args.server_timeout <= 0:
        raise ValueError("--server-timeout must be positive")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot writes a PNG; give a FILE.png, got {args.plot!r}")
    goodput = parse_goodput(args.goodput) or None
    mix = tuple(parse_priority_mix(args.priority_mix))
    model_dir = args.model
    if model_dir is None and args.base_url is None:
        from vt.model.make_model import default_model_dir

        model_dir = str(default_model_dir())
    if model_dir is not None:
        from vt.model.locate import resolve_model

        try:  # a folder, or a Hugging Face id in the local cache, as `vt serve` takes it
            resolve_model(model_dir)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    try:
        extra = shlex.split(args.server_args)
    except ValueError as e:
        raise ValueError(f"--server-args: {e}") from None
    flags: list[str] = []
    for name in ("device", "max_num_seqs", "max_num_batched_tokens", "scheduling_policy"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    base_url = args.base_url.rstrip("/") if args.base_url else None
    if base_url is not None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {args.base_url!r}")
    return BenchConfig(
        base_url=base_url, model_dir=model_dir, model_name=args.model_name,
        api_key=args.api_key or os.environ.get("VT_API_KEY") or None,
        serve_flags=tuple(flags + extra), server_timeout=args.server_timeout,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len,
        range_ratio=args.range_ratio, seed=args.seed, ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        priority=args.priority if args.priority is not None else (1 if mix else 0),
        priority_mix=mix, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, goodput_slo_ms=goodput,
        compare_async=args.compare_async, repeats=args.repeats, json_path=args.json, plot_path=args.plot,
        progress=not args.no_progress,
    )


# ---------------------------------------------------------------- dataset


@dataclass(frozen=True)
class Prompt:
    index: int
    token_ids: tuple[int, ...]
    output_len: int
    priority: int


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo = max(1, int(mean * (1 - ratio)))
    hi = max(lo, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _priorities(rng: random.Random, n: int, default: int, mix: tuple[tuple[int, float], ...]) -> list[int]:
    """Exact counts per share (rounded), shuffled, so small runs still get the asked-for mix."""
    out: list[int] = []
    for prio, share in mix:
        out += [prio] * round(share * n)
    out = out[:n] + [default] * max(0, n - len(out))
    rng.shuffle(out)
    return out


def make_prompts(pool: list[int], cfg: BenchConfig) -> list[Prompt]:
    """Random prompts of exact token lengths drawn from `pool` (real ids of the served tokenizer)."""
    if not pool:
        raise BenchError("the tokenizer gave no usable token ids for prompts")
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts
    ins = _lengths(rng, n, cfg.input_len, cfg.range_ratio)
    outs = _lengths(rng, n, cfg.output_len, cfg.range_ratio)
    prios = _priorities(rng, n, cfg.priority, cfg.priority_mix)
    return [Prompt(i, tuple(rng.choices(pool, k=ins[i])), outs[i], prios[i]) for i in range(n)]


def pool_from_tokenizer(model_dir: str) -> list[int]:
    """Every non-special id of the checkpoint's tokenizer."""
    from vt.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    special = set(tok.special_ids) | set(tok.eos_token_ids)
    return [i for i in range(tok.vocab_size) if i not in special]


# ---------------------------------------------------------------- load generator


class Progress:
    """A one-line text bar on stderr, redrawn per completed request."""

    def __init__(self, total: int, label: str, stream: TextIO | None, width: int = 30) -> None:
        self.total, self.label, self.stream, self.width, self.done = total, label, stream, width, 0
        self._draw()

    def _draw(self) -> None:
        if self.stream is None:
            return
        filled = self.width * self.done // max(self.total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}")
        self.stream.flush()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def request_payload(p: Prompt, model: str, cfg: BenchConfig) -> dict:
    body: dict[str, Any] = {
        "model": model, "prompt": list(p.token_ids), "max_tokens": p.output_len, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos, "priority": p.priority,
    }
    if cfg.temperature > 0:
        body["seed"] = cfg.seed + p.index  # same samples for the same prompt in every run
    return body


def arrival_delays(n: int, rate: float, seed: int) -> list[float]:
    """Send offsets (s) of a Poisson process with mean `rate` req/s; all zero for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 1)  # its own stream, so arrivals do not shift with dataset changes
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass
class RunResult:
    """One benchmark run: its records, duration and summary."""

    label: str
    records: list[RequestRecord]
    duration_s: float
    summary: BenchSummary
    server: dict[str, Any] = field(default_factory=dict)


async def server_info(ep: Endpoint, cfg: BenchConfig) -> tuple[str, int | None]:
    try:
        status, body = await http_json(ep, "GET", "/v1/models")
    except OSError as e:
        raise BenchError(f"cannot reach the server at {ep.host}:{ep.port}: {e}") from None
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise BenchError(f"GET /v1/models failed: {error_text(status, body)}")
    first = body["data"][0]
    return cfg.model_name or first["id"], first.get("max_model_len")


async def pool_from_server(ep: Endpoint, model: str) -> list[int]:
    """Distinct ids of a fixed English text as the server's tokenizer encodes it."""
    status, body = await http_json(ep, "POST", "/tokenize",
                                   {"model": model, "prompt": POOL_TEXT, "add_special_tokens": False})
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
        raise BenchError(f"POST /tokenize failed: {error_text(status, body)}")
    return sorted(set(body["tokens"]))


async def run_load(ep: Endpoint, model: str, prompts: list[Prompt], cfg: BenchConfig,
                   label: str) -> RunResult:
    """Warm up with one request, then send every prompt on the arrival schedule and collect records."""
    warm = RequestRecord(index=-1, input_tokens=len(prompts[0].token_ids))
    first = prompts[0]
    test = request_payload(Prompt(-1, first.token_ids, min(2, first.output_len), cfg.priority), model, cfg)
    await stream_completion(ep, test, warm, time.perf_counter())
    if not warm.success:
        raise BenchError(f"the test request failed: {warm.error}")

    before = await read_metrics(ep)
    delays = arrival_delays(len(prompts), cfg.request_rate, cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = Progress(len(prompts), label, sys.stderr if cfg.progress else None)
    records = [RequestRecord(index=p.index, input_tokens=len(p.token_ids), priority=p.priority)
               for p in prompts]

    pool = ConnectionPool(ep)

    async def one(p: Prompt, rec: RequestRecord) -> None:
        if sem is None:
            await stream_completion(ep, request_payload(p, model, cfg), rec, t0, pool)
        else:
            async with sem:
                await stream_completion(ep, request_payload(p, model, cfg), rec, t0, pool)
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
    summary = summarize(records, duration, cfg.goodput_slo_ms, gpu_stats(before, after, duration))
    return RunResult(label, records, duration, summary)


async def bench_endpoint(url: str, cfg: BenchConfig, label: str, pool: list[int] | None) -> RunResult:
    ep = Endpoint.from_url(url, cfg.api_key)
    model, max_len = await server_info(ep, cfg)
    if pool is None:
        pool = await pool_from_server(ep, model)
    prompts = make_prompts(pool, cfg)
    longest = max(len(p.token_ids) + p.output_len for p in prompts)
    if max_len is not None and longest > max_len:
        raise BenchError(f"prompts need {longest} tokens (input + output) but the server's max_model_len "
                         f"is {max_len}; lower --input-len / --output-len")
    result = await run_load(ep, model, prompts, cfg, label)
    result.server = {"url": url, "model": model, "max_model_len": max_len}
    return result


def run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency
        return asyncio.run(coro)
    return uvloop.run(coro)


# ---------------------------------------------------------------- server process


class ServerProcess:
    """`python -m vt serve` on a free loopback port; its output is drained in a thread."""

    def __init__(self, model_dir: str, flags: tuple[str, ...], timeout: float,
                 launcher: tuple[str, ...] = ()) -> None:
        """launcher: the command that stands for `python -m vt` (a benchmark's wrapper of it)."""
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])  # so the child imports this same vt
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.cmd = [*(launcher or (sys.executable, "-m", "vt")), "serve", "--model", model_dir,
                    "--host", "127.0.0.1", "--port", "0", *flags]
        self.lines: deque[str] = deque(maxlen=SERVER_LOG_LINES)
        self._ready = threading.Event()
        self._exited = threading.Event()
        self.url: str | None = None
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, start_new_session=True)
        threading.Thread(target=self._pump, daemon=True).start()
        if not self._wait_ready(timeout):
            self.stop()
            log = "".join(self.lines) or "(no output)\n"
            raise BenchError(f"`{shlex.join(self.cmd)}` did not start serving; its last output:\n{log}")

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._exited.set()

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self._ready.is_set():
            if self._exited.is_set() or time.monotonic() > deadline:
                return False
            self._ready.wait(0.1)
        return True

    def stop(self) -> int | None:
        """SIGTERM; kill if it has not exited within STOP_TIMEOUT_S."""
        return terminate(self.proc, STOP_TIMEOUT_S)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_with_server(cfg: BenchConfig, extra_flags: tuple[str, ...], label: str,
                    pool: list[int] | None) -> RunResult:
    assert cfg.model_dir is not None
    with ServerProcess(cfg.model_dir, cfg.serve_flags + extra_flags, cfg.server_timeout) as srv:
        assert srv.url is not None
        result = run_async(bench_endpoint(srv.url, cfg, label, pool))
    result.server["flags"] = list(cfg.serve_flags + extra_flags)
    return result


# ---------------------------------------------------------------- reporting


def _fmt(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _row(name: str, value: float | None, digits: int = 2) -> str:
    return f"{name:<40} {_fmt(value, digits)}"


LATENCY_SECTIONS = (("ttft", "TTFT", "Time to First Token"),
                    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                    ("itl", "ITL", "Inter-token Latency"), ("e2el", "E2EL", "End-to-end Latency"))


def format_summary(s: BenchSummary, title: str = "Serving Benchmark Result") -> str:
    lines = [f"{' ' + title + ' ':=^50}",
             _row("Successful requests:", s.successful_requests),
             _row("Failed requests:", s.failed_requests),
             _row("Benchmark duration (s):", s.duration_s),
             _row("Total input tokens:", s.total_input_tokens),
             _row("Total generated tokens:", s.total_output_tokens),
             _row("Request throughput (req/s):", s.request_throughput)]
    if s.goodput is not None:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in (s.goodput_slo_ms or {}).items())
        lines.append(_row("Request goodput (req/s):", s.goodput) + f" ({slo})")
    lines += [_row("Output token throughput (tok/s):", s.output_throughput),
              _row("Peak output token throughput (tok/s):", s.peak_output_throughput),
              _row("Peak concurrent requests:", s.peak_concurrent_requests),
              _row("Total token throughput (tok/s):", s.total_token_throughput)]
    if s.gpu is not None:
        lines += [f"{'Server steps':-^50}",
                  _row("Engine steps:", s.gpu.steps),
                  _row("Mean step time (ms):", s.gpu.mean_step_time_ms, 3),
                  _row("GPU idle fraction:", s.gpu.gpu_idle_fraction, 4)]
    for key, short, long in LATENCY_SECTIONS:
        st = getattr(s, key)
        lines.append(f"{long:-^50}")
        lines += [_row(f"Mean {short} (ms):", st.mean_ms), _row(f"Median {short} (ms):", st.median_ms),
                  _row(f"P90 {short} (ms):", st.p90_ms), _row(f"P99 {short} (ms):", st.p99_ms)]
    if s.errors:
        lines.append(f"{'Errors':-^50}")
        lines += [f"{count:>6} x {text}" for text, count in s.errors.items()]
    lines.append("=" * 50)
    return "\n".join(lines)


def mean_figures(runs: list[RunResult]) -> dict[str, float | None]:
    """Each figure averaged over repeats (None if any run lacks it)."""
    per_run = [r.summary.figures() for r in runs]
    out: dict[str, float | None] = {}
    for key in per_run[0]:
        vals = [f[key] for f in per_run]
        out[key] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    return out


def ratios(on: dict[str, float | None], off: dict[str, float | None]) -> dict[str, float | None]:
    return {k: (on[k] / off[k] if on[k] is not None and off.get(k) not in (None, 0) else None) for k in on}


def format_comparison(on: dict[str, float | None], off: dict[str, float | None], identical: bool,
                      mismatched: int, repeats: int) -> str:
    r = ratios(on, off)
    title = " Async scheduling: on vs off " + (f"(mean of {repeats} runs each) " if repeats > 1 else "")
    lines = [f"{title:=^78}", f"{'figure':<34} {'async on':>14} {'async off':>14} {'on/off':>12}"]
    for key in on:
        lines.append(f"{key:<34} {_fmt(on[key], 3):>14} {_fmt(off[key], 3):>14} {_fmt(r[key], 3):>12}")
    verdict = "yes" if identical else f"NO ({mismatched} prompts differ)"
    lines += [f"{'greedy outputs identical:':<34} {verdict}", "=" * 78]
    return "\n".join(lines)


def compare_outputs(a: list[RequestRecord], b: list[RequestRecord]) -> list[int]:
    """Prompt indices whose generated texts differ (or that failed in either run)."""
    by_b = {r.index: r for r in b}
    bad = []
    for ra in a:
        rb = by_b.get(ra.index)
        if rb is None or not (ra.success and rb.success) or ra.text != rb.text:
            bad.append(ra.index)
    return bad


def _run_json(r: RunResult) -> dict:
    return {"label": r.label, "server": r.server, "figures": r.summary.figures(),
            "summary": r.summary.to_dict(),
            "requests": [asdict(rec) for rec in r.records]}


def _write_json(path: str, data: dict) -> None:
    Path(path).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))


def _config_json(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    return d


# ---------------------------------------------------------------- entry points


def run_single(cfg: BenchConfig) -> int:
    pool = pool_from_tokenizer(cfg.model_dir) if cfg.model_dir else None
    if cfg.base_url:
        result = run_async(bench_endpoint(cfg.base_url, cfg, "bench", pool))
    else:
        result = run_with_server(cfg, (), "bench", pool)
    print(format_summary(result.summary))
    if cfg.json_path:
        _write_json(cfg.json_path, {"config": _config_json(cfg), **_run_json(result)})
    if cfg.plot_path:
        from vt.bench.plot import save_plot

        save_plot(cfg.plot_path, {"bench": [result.records]})
    return 0


ARMS = (("async_on", "--async-scheduling"), ("async_off", "--no-async-scheduling"))


def run_compare(cfg: BenchConfig) -> int:
    assert cfg.model_dir is not None
    pool = pool_from_tokenizer(cfg.model_dir)
    runs: dict[str, list[RunResult]] = {name: [] for name, _ in ARMS}
    for rep in range(cfg.repeats):
        order = ARMS if rep % 2 == 0 else ARMS[::-1]  # alternate so drift does not favour one arm
        for name, flag in order:
            label = f"{name} #{rep + 1}" if cfg.repeats > 1 else name
            runs[name].append(run_with_server(cfg, (flag,), label, pool))
    for name, _ in ARMS:
        for r in runs[name]:
            print(format_summary(r.summary, f"Serving Benchmark Result: {r.label}"))
    on, off = mean_figures(runs["async_on"]), mean_figures(runs["async_off"])
    mismatched = compare_outputs(runs["async_on"][0].records, runs["async_off"][0].records)
    print(format_comparison(on, off, not mismatched, len(mismatched), cfg.repeats))
    if cfg.json_path:
        _write_json(cfg.json_path, {
            "config": _config_json(cfg),
            "arms": {name: {"figures": mean_figures(runs[name]), "runs": [_run_json(r) for r in runs[name]]}
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
