"""Command line: `vt serve | generate | make-model | bench | replicas`; flags mirror vLLM's names."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from vt import __version__
from vt.config import EngineConfig, KVEventsConfig, parse_kv_events_config
from vt.launch.runner_flags import add_runner_flags, runner_from_flags
from vt.launch.vllm_flags import (
    UVICORN_LOG_LEVELS,
    FlagError,
    add_model_flags,
    add_serve_flags,
    api_options,
    check_model_flags,
    sampling_defaults,
    serve_notes,
    tokenizer_dir,
)

log = logging.getLogger("vt.serve")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help shows its default: appended, unless the text already states it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)



def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint folder, or a Hugging Face id found in the local Hugging Face cache "
                        "(default: the built-in tiny demo model)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="cuda (CuPy), cpu (the numpy backend) or auto: cuda where a GPU is found")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="most tokens per sequence, prompt and output (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one step at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens in one step at most")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int,
                   default=None, help="explicit KV cache size in blocks (default: sized from memory)")
    p.add_argument("--kv-cache-memory", type=int, default=None,
                   help="KV cache size in bytes (default: sized from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of GPU memory vt may use; the KV cache takes what the model leaves")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="fcfs: arrival order; priority: the request field `priority`, lower first")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps")
    p.add_argument("--prefill-pacing", action="store_true",
                   help="while requests decode, spread the last waiting prompt over the steps until the "
                        "soonest of them finishes instead of running it in full steps: more throughput "
                        "when prompts come one at a time beside running decodes, at a longer time to "
                        "first token for that prompt (needs chunked prefill)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    p.add_argument("--disable-cascade-attn", action="store_true",
                   help="attend each decode over its whole context even where every running decode "
                        "shares a long cached prefix (by default that prefix is attended once for all)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="schedule step N+1 while step N runs")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting queue bound (503 beyond)")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests that give no seed of their own")
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="write one JSON line per completed step (times, sequences, prompt and decode "
                        "tokens) to FILE, for performance analysis")
    add_model_flags(p)
    add_runner_flags(p)


def _positive(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        parser.error("--max-model-len must be at least 2")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    if args.prefill_pacing and not args.enable_chunked_prefill:
        parser.error("--prefill-pacing spreads prompts over several steps: it needs chunked prefill "
                     "(drop --no-enable-chunked-prefill)")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    runner = runner_from_flags(args)  # a refused flag is named before the model is looked for
    if args.model is None:
        from vt.model.make_model import default_model_dir

        path = default_model_dir()
    else:
        from vt.model.locate import resolve_model

        path = resolve_model(args.model, args.revision)
    tokenizer = None if args.tokenizer is None else str(tokenizer_dir(args.tokenizer))
    return EngineConfig(
        model=str(path), device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        scheduling_policy=args.scheduling_policy, enable_chunked_prefill=args.enable_chunked_prefill,
        prefill_pacing=args.prefill_pacing, enable_prefix_caching=args.enable_prefix_caching,
        disable_cascade_attn=args.disable_cascade_attn, async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager, max_waiting=args.max_waiting, seed=args.seed,
        kv_events_config=_kv_events_config(getattr(args, "kv_events_config", None)),
        tensor_parallel_size=args.tensor_parallel_size, step_trace=args.step_trace,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype, tokenizer=tokenizer,
        runner=runner,
    )


def _kv_events_config(text: str | None) -> KVEventsConfig | None:
    if text is None:
        return None
    return parse_kv_events_config(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vt", description="vt: an OpenAI-compatible LLM server")
    parser.add_argument("--version", action="version", version=f"vt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API", formatter_class=_HelpFormatter)
    s.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="same as --model")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    s.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model's name in the API; more names are accepted as aliases (default: the "
                        "--model argument as given, its last path part also accepted)")
    s.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on the API routes, one of the keys given "
                        "(default: VT_API_KEY, else VLLM_API_KEY, else none)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGTERM before they are aborted")
    s.add_argument("--http-header-timeout", type=float, default=None,
                   help="seconds for a request head to arrive (default 10; VT_HTTP_HEADER_TIMEOUT)")
    s.add_argument("--http-keepalive-timeout", type=float, default=None,
                   help="idle keep-alive seconds (default 30; VT_HTTP_KEEPALIVE_TIMEOUT)")
    s.add_argument("--http-write-timeout", type=float, default=None,
                   help="seconds a client may leave its response unread before the connection is "
                        "closed and its request aborted (default 30; VT_HTTP_WRITE_TIMEOUT)")
    s.add_argument("--max-connections", type=int, default=None,
                   help="open connections beyond which new ones get 503 (default 1024; VT_MAX_CONNECTIONS)")
    s.add_argument("--max-body-bytes", type=int, default=None,
                   help="request body limit, 413 beyond (default 16 MiB; VT_MAX_BODY_BYTES)")
    s.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": true, "
                        "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' "
                        "(needs the kv-events extra)")
    s.add_argument("--enable-server-load-tracking", action="store_true",
                   help="accepted as vLLM's; GET /load is always served")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log detail: info shows the start-up summary and stats lines, debug each request")
    add_serve_flags(s)

    g = sub.add_parser("generate", help="generate text for one prompt", formatter_class=_HelpFormatter)
    _engine_args(g)
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    g.add_argument("--seed-sampling", dest="sample_seed", type=int, default=None,
                   help="per-request sampling seed")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    m = sub.add_parser("make-model", help="write a random-weight checkpoint", formatter_class=_HelpFormatter)
    m.add_argument("dir", help="folder to write")
    m.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"], help="architecture")
    m.add_argument("--preset", default="tiny", choices=["tiny", "tiny128", "0.6b", "8b"],
                   help="size: tiny (CPU tests; tiny128 has every projection dim a multiple of 128, as fp8 "
                        "block checkpoints need), or Qwen3-0.6B / Qwen3-8B shapes")
    m.add_argument("--seed", type=int, default=0, help="weights seed")
    m.add_argument("--quantization", default=None, choices=["fp8-block", "fp8-channel"],
                   help="write the projections as an FP8 checkpoint: fp8-block as Qwen3's FP8 releases "
                        "(128x128 blocks), fp8-channel as llm-compressor's FP8-dynamic (compressed-tensors)")

    b = sub.add_parser("bench", help="serving benchmark (see `vt bench --help`)", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    r = sub.add_parser("replicas", help="N replicas behind the vLLM router (see `vt replicas --help`)",
                       add_help=False)
    r.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench parses its own flags (argparse REMAINDER rejects leading dashes)
        from vt.bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["replicas"]:  # parses its own flags too; those after `--` go to `vt serve`
        from vt.launch.replicas import main as replicas_main

        return replicas_main(argv[1:])
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    args, unknown = parser.parse_known_args(argv)
    command = _subparser(parser, args.command)
    if unknown:  # the command's usage, not the top-level one, so the flag's neighbours show
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return _run(args, command)
    except FlagError as e:
        command.error(str(e))
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"vt: error: {exc}", file=sys.stderr)
        return 1


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _run(args: argparse.Namespace, command: argparse.ArgumentParser) -> int:
    """One command, its flags parsed: FlagError for a flag vt refuses."""
    if args.command == "make-model":
        from vt.model.make_model import make_model

        out = make_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed,
                         quantization=args.quantization)
        print(f"vt: wrote {args.preset} {args.arch} checkpoint to {out}")
        return 0
    if args.command == "serve" and args.model_pos is not None:
        if args.model is not None and args.model != args.model_pos:
            command.error("give the model either as MODEL or as --model, not both")
        args.model = args.model_pos
    if args.command == "serve" and args.model is None and len(args.served_model_name or ()) > 1:
        # `--served-model-name a /models/x` reads the model as a second name: never serve the demo then
        command.error("--served-model-name took several names and no model was given; put MODEL "
                      "before --served-model-name, or use --model")
    if args.command == "serve" and args.model is None and len(args.api_key or ()) > 1:
        command.error("--api-key took several keys and no model was given; put MODEL before --api-key, "
                      "or use --model")
    volume_note = None
    if args.command == "serve" and args.model is None:  # in the image: the mounted checkpoint
        from vt.launch.model_volume import model_from_volume

        args.model, volume_note = model_from_volume()
    _positive(args, command)
    if args.command == "serve":
        # The socket layer would take 99999 modulo 65536 and listen somewhere unexpected.
        if not 0 <= args.port <= 65535:
            command.error(f"--port must be in [0, 65535], got {args.port}")
        if args.shutdown_timeout < 0:
            command.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    notes = check_model_flags(args)
    if args.command == "serve":
        notes += serve_notes(args)
    cfg = _engine_config(args)
    if args.command != "serve":
        return _generate(args, cfg)
    logging.basicConfig(level=args.log_level.upper(), datefmt="%m-%d %H:%M:%S",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.uvicorn_log_level is not None:
        logging.getLogger("vt.access").setLevel(UVICORN_LOG_LEVELS[args.uvicorn_log_level])
    from vt.launch.serve import limits_from_env, run_server

    limits = limits_from_env(header_timeout_s=args.http_header_timeout,
                             keepalive_timeout_s=args.http_keepalive_timeout,
                             write_timeout_s=args.http_write_timeout,
                             max_connections=args.max_connections,
                             max_body_bytes=args.max_body_bytes)
    name, aliases = _model_names(args.served_model_name, args.model, cfg.model)
    defaults, default_notes = sampling_defaults(args.generation_config, cfg.model,
                                                args.override_generation_config)
    options = api_options(args, cfg.model, aliases, defaults)
    for note in notes + default_notes:
        log.info("%s", note)
    if volume_note:  # the demo model served by mistake must not go unnoticed
        log.log(logging.WARNING if args.model is None else logging.INFO, "%s", volume_note)
    return run_server(cfg, args.host, args.port, name, args.api_key, args.shutdown_timeout, limits,
                      options=options, log_stats=not args.disable_log_stats,
                      access_log=not args.disable_uvicorn_access_log)


def _model_names(served: list[str] | None, model_arg: str | None,
                 model_dir: str) -> tuple[str, tuple[str, ...]]:
    """The served name and its aliases: --served-model-name's names, else the --model argument as
    given (vLLM's default) with its last path part as an alias; the demo is named by its folder."""
    if served:
        return served[0], tuple(served[1:])
    if model_arg is None:
        return Path(model_dir).name, ()
    short = Path(model_arg).name
    return model_arg, (short,) if short and short != model_arg else ()


def _generate(args: argparse.Namespace, cfg: EngineConfig) -> int:
    from vt.llm import LLM
    from vt.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sample_seed)
    with LLM(cfg.model, **{k: v for k, v in cfg.__dict__.items() if k != "model"}) as llm:
        out = llm.generate([args.prompt], params)[0]
    if args.json:
        print(json.dumps({"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                          "text": out.text, "finish_reason": out.finish_reason}))
    else:
        print(out.text)
    return 0
