"""Command line: `vt serve | generate | make-model | bench`; flags mirror vLLM's names."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from vt.config import EngineConfig


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint folder (default: the built-in tiny demo model)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int,
                   default=None, help="explicit KV cache size in blocks")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache size in bytes")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting queue bound (503 beyond)")
    p.add_argument("--seed", type=int, default=0)


def _positive(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_waiting"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.max_model_len is not None and args.max_model_len < 2:
        parser.error("--max-model-len must be at least 2")
    if not 0.0 < args.gpu_memory_utilization <= 1.0:
        parser.error("--gpu-memory-utilization must be in (0, 1]")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    model = args.model
    if model is None:
        from vt.model.make_model import default_model_dir

        model = str(default_model_dir())
    path = Path(model)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model!r} is not a checkpoint folder (no config.json in it)")
    return EngineConfig(
        model=str(path), device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        scheduling_policy=args.scheduling_policy, enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching, async_scheduling=args.async_scheduling,
        enforce_eager=args.enforce_eager, max_waiting=args.max_waiting, seed=args.seed,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vt", description="vt: an OpenAI-compatible LLM server")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    s.add_argument("model_pos", nargs="?", default=None, metavar="MODEL", help="same as --model")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or VT_API_KEY)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0)
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
    s.add_argument("--log-level", default="warning")

    g = sub.add_parser("generate", help="generate text for one prompt")
    _engine_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed-sampling", dest="sample_seed", type=int, default=None,
                   help="per-request sampling seed")
    g.add_argument("--json", action="store_true", help="print one JSON object")

    m = sub.add_parser("make-model", help="write a random-weight checkpoint")
    m.add_argument("dir")
    m.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"])
    m.add_argument("--preset", default="tiny", choices=["tiny", "0.6b", "8b"])
    m.add_argument("--seed", type=int, default=0)

    b = sub.add_parser("bench", help="serving benchmark (see `vt bench --help`)", add_help=False)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench parses its own flags (argparse REMAINDER rejects leading dashes)
        from vt.bench import main as bench_main

        return bench_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "make-model":
            from vt.model.make_model import make_model

            out = make_model(args.dir, arch=args.arch, preset=args.preset, seed=args.seed)
            print(f"vt: wrote {args.preset} {args.arch} checkpoint to {out}")
            return 0
        if args.command == "serve" and args.model_pos is not None:
            if args.model is not None and args.model != args.model_pos:
                parser.error("give the model either as MODEL or as --model, not both")
            args.model = args.model_pos
        _positive(args, parser)
        if args.command == "serve":
            # The socket layer would take 99999 modulo 65536 and listen somewhere unexpected.
            if not 0 <= args.port <= 65535:
                parser.error(f"--port must be in [0, 65535], got {args.port}")
            if args.shutdown_timeout < 0:
                parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
        cfg = _engine_config(args)
        if args.command == "serve":
            logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
            from vt.serve import limits_from_env, run_server

            limits = limits_from_env(header_timeout_s=args.http_header_timeout,
                                     keepalive_timeout_s=args.http_keepalive_timeout,
                                     write_timeout_s=args.http_write_timeout,
                                     max_connections=args.max_connections,
                                     max_body_bytes=args.max_body_bytes)
            name = args.served_model_name or Path(cfg.model).name
            return run_server(cfg, args.host, args.port, name, args.api_key, args.shutdown_timeout, limits)
        return _generate(args, cfg)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as exc:
        print(f"vt: error: {exc}", file=sys.stderr)
        return 1


def _generate(args: argparse.Namespace, cfg: EngineConfig) -> int:
    from vt.llm import LLM
    from vt.sampling import SamplingParams

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
