"""`vt bench`'s command line: vt's own flags and `vllm bench serve`'s, parsed into a BenchConfig.

A vLLM benchmark command line runs unchanged where vt can do what it asks: the flags keep vLLM's
names and meanings (`--dataset-name random --random-input-len 32 --request-rate 8 --burstiness
0.5 --save-result ...`). Where vt had a name of its own for the same thing, both are accepted
(`--input-len` / `--random-input-len`, `--no-progress` / `--disable-tqdm`, `--model-name` /
`--served-model-name`). What vt cannot do (another dataset, an embeddings backend, https) is
refused with a message that names what it can.

Where vt's command line differs from vLLM's: with no --base-url, --host or --port it starts a
`vt serve` of its own (on --model, or the demo model) instead of assuming a server on
127.0.0.1:8000; against a running server, --model is sent where the server serves that name and
otherwise the served model is (with a note), where vLLM would get a 404; it sends temperature 0
unless told otherwise (vLLM leaves sampling to the server), so runs can be compared token for
token; --num-prompts defaults to 100 and --random-input-len to 128 (vLLM: 1000 and 1024); the
latency sections default to all four figures at P90 and P99 (vLLM: ttft,tpot,itl at P99);
--ignore-eos can be turned off for random prompts (--no-ignore-eos), which vLLM always forces on.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from vt.bench.config import (
    CHAT_BACKENDS,
    COMPLETIONS_BACKENDS,
    DATASETS,
    DEFAULT_ENDPOINTS,
    DEFAULT_METRIC_PERCENTILES,
    DEFAULT_PERCENTILE_METRICS,
    OTHER_VLLM_BACKENDS,
    OTHER_VLLM_DATASETS,
    BenchConfig,
)
from vt.bench.datasets import check_random_lengths
from vt.bench.stats import LATENCY_METRICS, SLO_KEYS
from vt.bench.tokens import tokenizer_folder

DEFAULT_INPUT_LEN = 128      # vLLM's --random-input-len defaults to 1024; vt's to a CPU-sized 128
DEFAULT_OUTPUT_LEN = 128     # as vLLM's --random-output-len
VLLM_DEFAULT_HOST, VLLM_DEFAULT_PORT = "127.0.0.1", 8000
# vLLM's --percentile-metrics names that vt does not measure (client-side queueing)
UNMEASURED_METRICS = ("client_queue_time", "e2el_including_client_queue")
T = TypeVar("T", int, float)


# ---------------------------------------------------------------- value checks


def _checked(convert: Callable[[str], T], ok: Callable[[T], bool], expected: str,
             hint: str = "") -> Callable[[str], T]:
    """An argparse type: `value` converted (int or float), then held to ok(); errors say what was
    expected and what came (an int as read, anything else as written)."""
    kind = "an integer" if convert is int else "a number"

    def check(value: str) -> T:
        try:
            v = convert(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {value!r}{hint}") from None
        if not ok(v):
            got = v if convert is int else repr(value)
            raise argparse.ArgumentTypeError(f"must be {expected}, got {got}")
        return v

    return check


_rate = _checked(float, lambda r: not math.isnan(r) and r > 0, "positive or 'inf'",
                 hint=" (use a positive rate or 'inf')")
_positive_int = _checked(int, lambda n: n >= 1, "at least 1")
_non_negative_int = _checked(int, lambda n: n >= 0, "0 or more")
_ratio = _checked(float, lambda r: 0.0 <= r < 1.0, "in [0, 1)")
_temperature = _checked(float, lambda t: 0.0 <= t <= 2.0, "in [0, 2]")
_top_p = _checked(float, lambda p: 0.0 < p <= 1.0, "in (0, 1]")
_top_k = _checked(int, lambda k: k >= -1, "-1 (off), 0 (off) or a positive count")
_burstiness = _checked(float, lambda b: not math.isnan(b) and b > 0, "positive (1 = Poisson arrivals)")


def _port(value: str) -> int:
    n = _positive_int(value)
    if n > 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (1 to 65535), got {n}")
    return n


def _backend(value: str) -> str:
    if value in COMPLETIONS_BACKENDS + CHAT_BACKENDS:
        return value
    served = "openai and vllm (/v1/completions) or openai-chat (/v1/chat/completions)"
    if value in OTHER_VLLM_BACKENDS:
        raise argparse.ArgumentTypeError(f"vLLM's {value!r} backend is not served: vt bench measures text "
                                         f"generation, with backend {served}")
    raise argparse.ArgumentTypeError(f"unknown backend {value!r}; vt bench serves {served}")


def _dataset(value: str) -> str:
    if value in DATASETS:
        return value
    served = "random (random token prompts) and sharegpt (a ShareGPT JSON file, --dataset-path)"
    if value in OTHER_VLLM_DATASETS:
        raise argparse.ArgumentTypeError(f"vLLM's {value!r} dataset is not served; vt bench serves {served}")
    raise argparse.ArgumentTypeError(f"unknown dataset {value!r}; vt bench serves {served}")


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


def parse_percentile_metrics(text: str) -> tuple[str, ...]:
    """vLLM's --percentile-metrics: 'ttft,tpot,itl' -> ('ttft', 'tpot', 'itl')."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise ValueError("--percentile-metrics: give one or more of " + ", ".join(LATENCY_METRICS))
    for name in names:
        if name in UNMEASURED_METRICS:
            raise ValueError(f"--percentile-metrics: {name} (client-side queueing) is not measured by vt "
                             f"bench; choose from {', '.join(LATENCY_METRICS)}")
        if name not in LATENCY_METRICS:
            raise ValueError(f"--percentile-metrics: unknown metric {name!r}; choose from "
                             f"{', '.join(LATENCY_METRICS)}")
    return tuple(dict.fromkeys(names))


def parse_metric_percentiles(text: str) -> tuple[float, ...]:
    """vLLM's --metric-percentiles: '25,50,99.9' -> (25.0, 50.0, 99.9)."""
    out: list[float] = []
    for item in (t.strip() for t in text.split(",")):
        try:
            q = float(item)
        except ValueError:
            raise ValueError(f"--metric-percentiles: {item!r} is not a number (give e.g. 50,90,99)") from None
        if not 0.0 <= q <= 100.0:
            raise ValueError(f"--metric-percentiles: {item} is not a percentile in [0, 100]")
        out.append(q)
    return tuple(dict.fromkeys(out))


def parse_metadata(items: list[str]) -> dict[str, str]:
    """vLLM's --metadata KEY=VALUE pairs, saved in the result file."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata expects KEY=VALUE pairs, got {item!r}")
        out[key.strip()] = value.strip()
    return out


# ---------------------------------------------------------------- the parser


def _target_flags(p: argparse.ArgumentParser) -> None:
    """Where the server is, or how to start one."""
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default=None,
                   help="a running server, e.g. http://127.0.0.1:8000 (a path after the port prefixes every "
                        "route, as in vLLM)")
    t.add_argument("--host", default=None,
                   help=f"a running server's host, as vLLM's (default {VLLM_DEFAULT_HOST} with --port)")
    t.add_argument("--port", type=_port, default=None,
                   help=f"a running server's port, as vLLM's (default {VLLM_DEFAULT_PORT} with --host)")
    t.add_argument("--endpoint", default=None,
                   help="API route (default /v1/completions, /v1/chat/completions for --backend openai-chat)")
    t.add_argument("--backend", type=_backend, default="openai",
                   help="openai or vllm: /v1/completions; openai-chat: /v1/chat/completions (default openai)")
    t.add_argument("--model", default=None,
                   help="without a running server: the checkpoint to start `vt serve` on; with one: the "
                        "model name to send, as in vLLM (its tokenizer is read here where the checkpoint is "
                        "found locally, else the server tokenizes)")
    t.add_argument("--served-model-name", "--model-name", dest="model_name", default=None,
                   help="model name to send (default: --model where the server serves it, else the "
                        "served one)")
    t.add_argument("--tokenizer", default=None,
                   help="a folder with tokenizer.json, or a Hugging Face id in the local cache "
                        "(default: --model's)")
    t.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM's command lines; vt reads tokenizer.json and runs no model code")
    t.add_argument("--api-key", default=None, help="bearer token (default: VT_API_KEY, then OPENAI_API_KEY)")
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


def _dataset_flags(p: argparse.ArgumentParser) -> None:
    """What the requests are: prompts, lengths, sampling, priorities."""
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset-name", type=_dataset, default="random",
                   help="random (default) or sharegpt; vLLM's other datasets are refused")
    d.add_argument("--dataset-path", default=None,
                   help="the ShareGPT JSON file (with --dataset-name sharegpt)")
    d.add_argument("--num-prompts", type=_positive_int, default=100)
    d.add_argument("--random-input-len", "--input-len", dest="input_len", type=_positive_int,
                   default=DEFAULT_INPUT_LEN, help=f"prompt tokens per request (default {DEFAULT_INPUT_LEN})")
    d.add_argument("--random-output-len", type=_positive_int, default=None,
                   help=f"max_tokens per random request (default {DEFAULT_OUTPUT_LEN})")
    d.add_argument("--output-len", type=_positive_int, default=None,
                   help="max_tokens per request of any dataset: sets --random-output-len and "
                        "--sharegpt-output-len, as vLLM's")
    d.add_argument("--random-range-ratio", "--range-ratio", dest="range_ratio", type=_ratio, default=0.0,
                   help="lengths uniform over the integers in [floor(len*(1-r)), ceil(len*(1+r))] "
                        "(default 0: exact)")
    d.add_argument("--random-prefix-len", dest="prefix_len", type=_non_negative_int, default=0,
                   help="tokens of one random prefix put before every random prompt (default 0)")
    d.add_argument("--sharegpt-output-len", type=_positive_int, default=None,
                   help="max_tokens of every ShareGPT request (default: the reply's token count)")
    d.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths, priorities and arrivals")
    d.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate exactly the output length (default: on for random, off for sharegpt, as "
                        "vLLM's)")
    d.add_argument("--temperature", type=_temperature, default=0.0,
                   help="0 = greedy (the default); above 0 each request gets sampling seed --seed + its "
                        "index")
    d.add_argument("--top-p", type=_top_p, default=None, help="sent when given")
    d.add_argument("--top-k", type=_top_k, default=None, help="sent when given")
    d.add_argument("--priority", type=int, default=None,
                   help="priority of requests not given one by --priority-mix (default: 1 with "
                        "--priority-mix, else 0, which a server with --scheduling-policy fcfs accepts)")
    d.add_argument("--priority-mix", nargs="+", default=[], metavar="P:SHARE",
                   help="send SHARE of the requests with priority P, e.g. `0:0.2` sends 20%% at priority 0 "
                        "and the rest at --priority; several pairs allowed, shares add up to at most 1; "
                        "lower priority runs first under --scheduling-policy priority")


def _load_flags(p: argparse.ArgumentParser) -> None:
    """How the requests arrive: rate, burstiness, concurrency, SLOs, A/B arms."""
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=_rate, default=math.inf,
                      help="mean requests per second (default inf: all at once)")
    load.add_argument("--burstiness", type=_burstiness, default=1.0,
                      help="shape of the gamma-distributed gaps between arrivals: 1 = Poisson (default), "
                           "below 1 burstier, above 1 more even; inf = evenly spaced")
    load.add_argument("--max-concurrency", type=_positive_int, default=None,
                      help="requests in flight at most")
    load.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                      help="SLOs in ms (ttft, tpot, e2el): requests meeting all of them count as goodput")
    load.add_argument("--compare-async", action="store_true",
                      help="run twice on fresh servers, --async-scheduling and --no-async-scheduling, and "
                           "print them side by side (needs --model or the demo model, not --base-url)")
    load.add_argument("--repeats", type=_positive_int, default=1,
                      help="with --compare-async: runs per arm, order alternated")


def _output_flags(p: argparse.ArgumentParser) -> None:
    """What is printed and saved."""
    out = p.add_argument_group("output")
    out.add_argument("--percentile-metrics", default=None,
                     help="comma-separated figures to print percentiles of: ttft, tpot, itl, e2el "
                          "(default all four)")
    out.add_argument("--metric-percentiles", default=None,
                     help="comma-separated percentiles to print, e.g. 50,90,99 (default 90,99)")
    out.add_argument("--save-result", action="store_true",
                     help="write vLLM's result JSON (completed, request_throughput, mean_ttft_ms, ...) to "
                          "--result-dir/--result-filename")
    out.add_argument("--save-detailed", action="store_true",
                     help="with --save-result: add per-request lists (input_lens, ttfts, itls, ...)")
    out.add_argument("--result-dir", default=None, help="folder of the result file (default: here)")
    out.add_argument("--result-filename", default=None,
                     help="result file name (default {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json)")
    out.add_argument("--label", default=None, help="label of the result (default: --backend)")
    out.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                     help="pairs saved in the result file")
    out.add_argument("--json", default=None, metavar="FILE", help="save every figure and request record")
    out.add_argument("--plot", default=None, metavar="FILE.png",
                     help="save latency CDFs and throughput over time")
    out.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                     help="no progress on stderr (a redrawn bar on a terminal, else a line per tenth)")


def build_bench_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vt bench",
        description="Serving benchmark, with vllm bench serve's flags: random token-id prompts or a ShareGPT "
                    "file as streaming completions or chat completions, against a vt server started here "
                    "(--model, default: the built-in demo model) or already running (--base-url, or "
                    "--host/--port).")
    for add in (_target_flags, _dataset_flags, _load_flags, _output_flags):
        add(p)
    return p

# ---------------------------------------------------------------- to a config


def _target_url(args: argparse.Namespace) -> str | None:
    """--base-url, else http://HOST:PORT where either was given (vLLM's defaults fill the other)."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        parts = urlsplit(url)
        if parts.scheme == "https":
            raise ValueError(f"--base-url {args.base_url}: vt bench speaks plain HTTP; https is not "
                             "supported")
        try:
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {args.base_url!r}") from None
        if parts.scheme != "http" or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"--base-url must look like http://HOST:PORT, got {args.base_url!r}")
        return url
    if args.host is None and args.port is None:
        return None
    host = (args.host or VLLM_DEFAULT_HOST).strip("[]")
    if not host:
        raise ValueError("--host: give a host name or address")
    return f"http://{f'[{host}]' if ':' in host else host}:{args.port or VLLM_DEFAULT_PORT}"


def _endpoint(args: argparse.Namespace) -> str:
    backend = args.backend
    endpoint = args.endpoint or DEFAULT_ENDPOINTS[backend]
    if not endpoint.startswith("/"):
        raise ValueError(f"--endpoint must be a path starting with '/', got {endpoint!r}")
    if backend in CHAT_BACKENDS and not endpoint.endswith("chat/completions"):
        raise ValueError(f"--backend {backend} posts chat completions: --endpoint must end with "
                         f"chat/completions, got {endpoint!r}")
    if backend in COMPLETIONS_BACKENDS and (not endpoint.endswith("completions")
                                            or endpoint.endswith("chat/completions")):
        raise ValueError(f"--backend {backend} posts completions: --endpoint must end with /completions "
                         f"(not chat/completions; use --backend openai-chat for that), got {endpoint!r}")
    return endpoint


def _checkpoint(model: str) -> str:
    from vt.model.locate import resolve_model

    try:  # a folder, or a Hugging Face id in the local cache, as `vt serve` takes it
        resolve_model(model)
    except FileNotFoundError as e:
        raise ValueError(str(e)) from None
    return model


def _local_checkpoint(model: str) -> str | None:
    from vt.model.locate import resolve_model

    try:
        return str(resolve_model(model))
    except (FileNotFoundError, OSError):
        return None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    url = _target_url(args)
    if args.compare_async and url:
        raise ValueError("--compare-async starts its own servers; give --model (or nothing), not --base-url "
                         "or --host/--port")
    if args.compare_async and args.save_result:
        raise ValueError("--save-result writes one run's result; with --compare-async use --json FILE")
    if args.server_timeout <= 0:
        raise ValueError("--server-timeout must be positive")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ValueError(f"--plot writes a PNG; give a FILE.png, got {args.plot!r}")
    endpoint = _endpoint(args)
    goodput = parse_goodput(args.goodput) or None
    mix = tuple(parse_priority_mix(args.priority_mix))
    metrics = (parse_percentile_metrics(args.percentile_metrics) if args.percentile_metrics is not None
               else DEFAULT_PERCENTILE_METRICS)
    percentiles = (parse_metric_percentiles(args.metric_percentiles) if args.metric_percentiles is not None
                   else DEFAULT_METRIC_PERCENTILES)
    metadata = parse_metadata(args.metadata)

    # the dataset, checked as vLLM checks it
    if args.dataset_name == "random" and args.dataset_path is not None:
        raise ValueError(f"--dataset-path {args.dataset_path} is for --dataset-name sharegpt; the random "
                         "dataset takes no file")
    if args.dataset_name == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT JSON file)")
        if not Path(args.dataset_path).is_file():
            raise ValueError(f"--dataset-path {args.dataset_path}: no such file")
    output_len = args.output_len or args.random_output_len or DEFAULT_OUTPUT_LEN
    sharegpt_output_len = args.output_len or args.sharegpt_output_len
    if args.dataset_name == "random":
        check_random_lengths(args.input_len, args.range_ratio, args.prefix_len)
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else args.dataset_name == "random"

    # the target: a server started here from a checkpoint, or a running one
    model_dir, model_hint = None, None
    if url is None:
        if args.model is not None:
            model_dir = _checkpoint(args.model)
        else:
            from vt.model.make_model import default_model_dir

            model_dir = str(default_model_dir())
    elif args.model is not None:
        model_hint = args.model  # vLLM's meaning: the model's name on that server
        model_dir = _local_checkpoint(args.model)
    tokenizer = None
    if args.tokenizer is not None:
        try:
            tokenizer = str(tokenizer_folder(args.tokenizer))
        except FileNotFoundError as e:
            raise ValueError(f"--tokenizer: {e}") from None
    try:
        extra = shlex.split(args.server_args)
    except ValueError as e:
        raise ValueError(f"--server-args: {e}") from None
    flags: list[str] = []
    for name in ("device", "max_num_seqs", "max_num_batched_tokens", "scheduling_policy"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    api_key = args.api_key or os.environ.get("VT_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    return BenchConfig(
        base_url=url, model_dir=model_dir, model_name=args.model_name, api_key=api_key,
        serve_flags=tuple(flags + extra), server_timeout=args.server_timeout,
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=output_len,
        range_ratio=args.range_ratio, seed=args.seed, ignore_eos=ignore_eos,
        temperature=args.temperature,
        priority=args.priority if args.priority is not None else (1 if mix else 0),
        priority_mix=mix, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, goodput_slo_ms=goodput,
        compare_async=args.compare_async, repeats=args.repeats, json_path=args.json, plot_path=args.plot,
        progress=not args.no_progress, backend=args.backend, endpoint=endpoint, model_hint=model_hint,
        tokenizer=tokenizer, dataset_name=args.dataset_name, dataset_path=args.dataset_path,
        prefix_len=args.prefix_len, sharegpt_output_len=sharegpt_output_len, burstiness=args.burstiness,
        top_p=args.top_p, top_k=args.top_k, percentile_metrics=metrics, metric_percentiles=percentiles,
        save_result=args.save_result, save_detailed=args.save_detailed, result_dir=args.result_dir,
        result_filename=args.result_filename, label=args.label, metadata=metadata,
    )
