"""The launch flags of a typical vLLM command line that vt honours, accepts or refuses clearly.

A vLLM user's script should start vt unchanged where vt can do what it asks: `--dtype auto` or
`bfloat16`, `--trust-remote-code` (vt runs no model code but its own), `--tensor-parallel-size`,
`--generation-config`, `--chat-template`, logging switches and `--max-logprobs`. What vt cannot do
is an error naming the flag, never a silent difference.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vt.http.api_options import ApiOptions
from vt.http.reasoning import PARSERS as REASONING_PARSERS
from vt.http.tool_calls import PARSERS as TOOL_CALL_PARSERS
from vt.model.generation_config import load_sampling_defaults
from vt.sampling_params import MAX_LOGPROBS
from vt.text.chat_template import TemplateCache, load_chat_template

log = logging.getLogger("vt.serve")

DTYPES_HONOURED = ("auto", "bfloat16")
_DTYPES_REFUSED = ("float16", "half", "float32", "float")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Flags for every command that loads a model."""
    p.add_argument("--dtype", default="auto", metavar="{auto,bfloat16}",
                   help="weight and activation type: vt runs bfloat16 weights (auto or bfloat16; "
                        "float16 and float32 are refused)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM command lines; vt runs no code from the checkpoint")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is split over (attention heads and KV cache, MLP columns, "
                        "vocabulary), all driven by this process; above 1 runs on the numpy backend "
                        "(--device cpu) for now")
    p.add_argument("--revision", default=None,
                   help="the snapshot of a Hugging Face id to serve from the local cache: a branch, tag "
                        "or commit hash (default: main)")
    p.add_argument("--quantization", "-q", default=None, metavar="{fp8,compressed-tensors}",
                   help="fp8 weights (Hopper): fp8 quantizes a bf16 checkpoint's projections at load, one "
                        "scale per output channel; an FP8 checkpoint (quant_method fp8 or "
                        "compressed-tensors) is served as stored without the flag")
    p.add_argument("--kv-cache-dtype", default="auto", metavar="{auto}",
                   help="the KV cache's element type: auto = the model's (bf16)")


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """`vt serve` flags that shape the API and the log, named as vLLM's."""
    p.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="chat template replacing the checkpoint's: a Jinja file, or the template itself")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent in a request (refused with a 400 otherwise)")
    p.add_argument("--generation-config", default="auto", metavar="{auto,vllm,FOLDER}",
                   help="sampling defaults for fields a request leaves unset: auto = the checkpoint's "
                        "generation_config.json, vllm = none (vt's own), or a folder holding that file")
    p.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS,
                   help=f"most logprobs / top_logprobs per token a request may ask for (0-{MAX_LOGPROBS})")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line (throughput, queue, KV cache use) every 10 s while busy")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="no log line per request (they are at debug level: --log-level debug shows them)")
    p.add_argument("--reasoning-parser", default=None, metavar="{qwen3}",
                   help="split the model's <think>...</think> into reasoning_content (chat replies and "
                        "their streamed deltas); a structured output's grammar then applies after it")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default with tools): the model's tool calls, "
                        "read by --tool-call-parser, become tool_calls")
    p.add_argument("--tool-call-parser", default=None, metavar="{hermes}",
                   help="how the model writes tool calls: hermes is Qwen3's <tool_call>{...}</tool_call>")


def check_model_flags(args: argparse.Namespace) -> list[str]:
    """Errors (ValueError) for what vt cannot do; notes worth logging for what it accepts."""
    if args.dtype not in DTYPES_HONOURED:
        known = "" if args.dtype in _DTYPES_REFUSED else "unknown dtype; "
        raise ValueError(f"--dtype {args.dtype}: {known}vt runs bfloat16 weights; use --dtype auto or "
                         "bfloat16")
    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    if args.kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype}: vt keeps the KV cache in the model's "
                         "dtype for now; use --kv-cache-dtype auto")
    notes = []
    if args.trust_remote_code:
        notes.append("--trust-remote-code: accepted; vt runs no code from the checkpoint, only its own")
    return notes


def api_options(args: argparse.Namespace, model_dir: str | Path, aliases: tuple[str, ...]) -> ApiOptions:
    """The OpenAI routes' settings from `vt serve` flags; ValueError for a bad value."""
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {args.max_logprobs}")
    template = None
    if args.chat_template is not None:
        template = load_chat_template(args.chat_template)
        TemplateCache().get(template)  # a template that does not compile fails the start, not requests
    for flag, value, known in (("--reasoning-parser", args.reasoning_parser, REASONING_PARSERS),
                               ("--tool-call-parser", args.tool_call_parser, TOOL_CALL_PARSERS)):
        if value is not None and value not in known:
            raise ValueError(f"{flag} {value}: vt has the parsers {', '.join(known)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    return ApiOptions(
        model_aliases=aliases, chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        sampling_defaults=load_sampling_defaults(args.generation_config, model_dir),
        max_logprobs=args.max_logprobs, log_requests=not args.disable_log_requests,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice)
