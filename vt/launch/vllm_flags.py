"""The launch flags of a typical vLLM command line that vt honours, accepts or refuses clearly.

A vLLM user's script should start vt unchanged where vt can do what it asks: `--dtype auto` or
`bfloat16`, `--trust-remote-code` (vt runs no model code but its own), `--tensor-parallel-size`,
`--tokenizer`, `--load-format safetensors`, `--generation-config` and its overrides,
`--chat-template`, `--response-role`, CORS, logging switches and `--max-logprobs`. Flags that only
tune vLLM's own machinery (`--swap-space`, `--max-seq-len-to-capture`, ...) are accepted with a
note in the log. What vt cannot do is an error naming the flag (FlagError: `vt serve`'s usage and
the reason), never a silent difference.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from vt.config import kv_cache_dtype_of
from vt.http.api_options import ApiOptions
from vt.http.cors import CorsPolicy
from vt.http.reasoning import PARSERS as REASONING_PARSERS
from vt.http.tool_calls import PARSERS as TOOL_CALL_PARSERS
from vt.model.generation_config import SamplingDefaults, load_sampling_defaults
from vt.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from vt.text.chat_template import TemplateCache, load_chat_template

log = logging.getLogger("vt.serve")

DTYPES_HONOURED = ("auto", "bfloat16")
_DTYPES_REFUSED = ("float16", "half", "float32", "float")
LOAD_FORMATS_HONOURED = ("auto", "safetensors")
# vLLM's other load formats, and why vt cannot serve them
_LOAD_FORMATS_REFUSED = {
    "pt": "vt reads safetensors weights only; convert the .bin files to safetensors",
    "npcache": "vt reads safetensors weights only; convert the .bin files to safetensors",
    "dummy": "vt loads no random weights in place; write a random checkpoint with `vt make-model DIR`",
    "gguf": "vt does not read GGUF files; serve the safetensors checkpoint",
    "bitsandbytes": "vt does not run bitsandbytes quantization; serve a bf16 or FP8 checkpoint",
}
# --override-generation-config keys vLLM reads -> SamplingParams fields (the others it ignores)
_GENERATION_OVERRIDES = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                         "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
UVICORN_LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
                      "info": logging.INFO, "debug": logging.DEBUG, "trace": logging.DEBUG - 5}


class FlagError(ValueError):
    """A launch flag vt refuses: reported with the command's usage, exit status 2."""


def _json_list(text: str) -> list[str]:
    """--allowed-origins and its kin take a JSON list, as vLLM reads them."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"*\"]', got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"temperature\": 0.5}}', "
                                         f"got {text!r}")
    return value


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
    p.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,fp8,fp8_e4m3}",
                   help="the KV cache's element type: auto = the model's (bf16); fp8 (= fp8_e4m3) stores "
                        "e4m3 codes with a per-layer scale (the checkpoint's k_scale / v_scale, else 1.0), "
                        "twice the tokens in the same memory")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="folder (or cached Hugging Face id) of the tokenizer to use: its tokenizer.json, "
                        "tokenizer_config.json and chat template (default: the model's own)")
    p.add_argument("--load-format", default="auto", metavar="{auto,safetensors}",
                   help="how the weights are stored: vt reads safetensors (auto or safetensors; pt, "
                        "npcache, dummy, gguf and the others are refused)")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                   help="accepted as 1 (one pipeline stage); above 1 is refused (default: 1)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None,
                   help="accepted as 1; above 1 is refused: run several `vt serve` behind a router "
                        "(`vt replicas`) (default: 1)")
    p.add_argument("--swap-space", type=float, default=None, metavar="GiB",
                   help="accepted and noted: vt preempts by recomputation and never swaps KV blocks "
                        "to the CPU (default: none)")
    p.add_argument("--max-seq-len-to-capture", type=int, default=None,
                   help="accepted and noted: vt's decode graphs serve every context length "
                        "(default: none)")


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
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log a line per request at info level (its prompt length, priority and sampling "
                        "parameters)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per request (vt.access: client, request line and status)")
    p.add_argument("--uvicorn-log-level", default=None, choices=list(UVICORN_LOG_LEVELS),
                   help="level of the access log (default: --log-level's)")
    p.add_argument("--disable-frontend-multiprocessing", action="store_true",
                   help="accepted: vt serves from one process already")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name each token 'token_id:N' unless a request sets "
                        "return_tokens_as_token_ids itself")
    p.add_argument("--response-role", default="assistant",
                   help="the role of a chat reply that follows a generation prompt")
    p.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                   help="sampling defaults merged over --generation-config's, as vLLM merges them, "
                        "e.g. '{\"temperature\": 0.5}' (keys: temperature, top_p, top_k, min_p, "
                        "repetition_penalty, max_new_tokens)")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: origins allowed to call the API from a browser, a JSON list")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: methods allowed, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], metavar="JSON",
                   help="CORS: request headers allowed, a JSON list")
    p.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (the origin is then named instead of '*')")
    p.add_argument("--reasoning-parser", default=None, metavar="{qwen3}",
                   help="split the model's <think>...</think> into reasoning_content (chat replies and "
                        "their streamed deltas); a structured output's grammar then applies after it")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (the default with tools): the model's tool calls, "
                        "read by --tool-call-parser, become tool_calls")
    p.add_argument("--tool-call-parser", default=None, metavar="{hermes}",
                   help="how the model writes tool calls: hermes is Qwen3's <tool_call>{...}</tool_call>")


def check_model_flags(args: argparse.Namespace) -> list[str]:
    """FlagError for what vt cannot do; notes worth logging for what it accepts."""
    if args.dtype not in DTYPES_HONOURED:
        known = "" if args.dtype in _DTYPES_REFUSED else "unknown dtype; "
        raise FlagError(f"--dtype {args.dtype}: {known}vt runs bfloat16 weights; use --dtype auto or "
                        "bfloat16")
    if args.tensor_parallel_size < 1:
        raise FlagError(f"--tensor-parallel-size must be at least 1, got {args.tensor_parallel_size}")
    try:
        kv_cache_dtype_of(args.kv_cache_dtype)
    except ValueError as e:
        raise FlagError(str(e)) from None
    if args.load_format not in LOAD_FORMATS_HONOURED:
        why = _LOAD_FORMATS_REFUSED.get(args.load_format, "vt reads safetensors weights only")
        raise FlagError(f"--load-format {args.load_format}: {why}; use --load-format auto or safetensors")
    for flag, value, instead in (
            ("--pipeline-parallel-size", args.pipeline_parallel_size,
             "split the model with --tensor-parallel-size instead"),
            ("--data-parallel-size", args.data_parallel_size,
             "run one `vt serve` per replica behind a router (`vt replicas`)")):
        if value is not None and value < 1:
            raise FlagError(f"{flag} must be at least 1, got {value}")
        if value is not None and value > 1:
            raise FlagError(f"{flag} {value}: vt serves one replica of the model in one stage; {instead}")
    if args.swap_space is not None and args.swap_space < 0:
        raise FlagError(f"--swap-space must be >= 0, got {args.swap_space}")
    if args.max_seq_len_to_capture is not None and args.max_seq_len_to_capture < 1:
        raise FlagError(f"--max-seq-len-to-capture must be at least 1, got {args.max_seq_len_to_capture}")
    notes = []
    if args.trust_remote_code:
        notes.append("--trust-remote-code: accepted; vt runs no code from the checkpoint, only its own")
    if args.load_format == "safetensors":
        notes.append("--load-format safetensors: accepted; vt reads safetensors weights")
    for flag, value in (("--pipeline-parallel-size", args.pipeline_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value == 1:
            notes.append(f"{flag} 1: accepted; vt serves one replica in one stage")
    if args.swap_space is not None:
        notes.append("--swap-space: accepted and unused; vt preempts by recomputation (the prefix "
                     "cache keeps it cheap) and never swaps KV blocks to the CPU")
    if args.max_seq_len_to_capture is not None:
        notes.append("--max-seq-len-to-capture: accepted and unused; vt's decode graphs serve every "
                     "context length up to --max-model-len")
    return notes


def tokenizer_dir(name: str, revision: str | None = None) -> Path:
    """The folder --tokenizer names (a folder, or a Hugging Face id in the local cache); FlagError
    when it holds no tokenizer.json, the file vt reads."""
    path = Path(name).expanduser()
    if not path.is_dir():
        from vt.model.locate import resolve_model

        try:
            path = resolve_model(name, revision)
        except FileNotFoundError as e:
            raise FlagError(f"--tokenizer {name}: {e}") from None
    if not (path / "tokenizer.json").is_file():
        raise FlagError(f"--tokenizer {name}: no tokenizer.json in {path} (vt reads Hugging Face fast "
                        "tokenizers)")
    return path


def serve_notes(args: argparse.Namespace) -> list[str]:
    """FlagError for `vt serve` flags that contradict each other; notes for the no-ops."""
    if args.enable_log_requests and args.disable_log_requests:
        raise FlagError("--enable-log-requests and --disable-log-requests contradict each other; give one")
    notes = []
    if args.disable_frontend_multiprocessing:
        notes.append("--disable-frontend-multiprocessing: accepted; vt serves from one process already")
    return notes


def sampling_defaults(setting: str, model_dir: str | Path,
                      override: Mapping[str, Any] | None) -> tuple[SamplingDefaults, list[str]]:
    """--generation-config's defaults with --override-generation-config merged over them, as vLLM
    merges them: the override's values win, a null removes one, keys vLLM does not read are
    ignored (and named in the returned notes)."""
    defaults = load_sampling_defaults(setting, model_dir)
    if not override:
        return defaults, []
    values = dict(defaults.values)
    for theirs, ours in _GENERATION_OVERRIDES.items():
        if theirs in override:
            if override[theirs] is None:
                values.pop(ours, None)
            else:
                values[ours] = override[theirs]
    try:
        SamplingParams(**values)
    except SamplingParamsError as e:
        raise FlagError(f"--override-generation-config: {e}") from None
    source = "--override-generation-config"
    if defaults.source and defaults.values:  # the file is named where it gave a value
        source = f"{defaults.source} and {source}"
    notes = []
    ignored = sorted(k for k in override if k not in _GENERATION_OVERRIDES)
    if ignored:
        notes.append(f"--override-generation-config: {', '.join(ignored)} ignored (vLLM reads only "
                     f"{', '.join(_GENERATION_OVERRIDES)})")
    return SamplingDefaults(values, source), notes


def api_options(args: argparse.Namespace, model_dir: str | Path, aliases: tuple[str, ...],
                defaults: SamplingDefaults | None = None) -> ApiOptions:
    """The OpenAI routes' settings from `vt serve` flags (`defaults`: the sampling defaults, read
    from --generation-config when None); FlagError or ValueError for a bad value."""
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        raise FlagError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}], got {args.max_logprobs}")
    if not args.response_role:
        raise FlagError("--response-role must not be empty")
    template = None
    if args.chat_template is not None:
        template = load_chat_template(args.chat_template)
        TemplateCache().get(template)  # a template that does not compile fails the start, not requests
    for flag, value, known in (("--reasoning-parser", args.reasoning_parser, REASONING_PARSERS),
                               ("--tool-call-parser", args.tool_call_parser, TOOL_CALL_PARSERS)):
        if value is not None and value not in known:
            raise FlagError(f"{flag} {value}: vt has the parsers {', '.join(known)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise FlagError("--enable-auto-tool-choice needs --tool-call-parser (hermes)")
    if defaults is None:
        defaults = load_sampling_defaults(args.generation_config, model_dir)
    return ApiOptions(
        model_aliases=aliases, chat_template=template,
        trust_request_chat_template=args.trust_request_chat_template,
        sampling_defaults=defaults,
        max_logprobs=args.max_logprobs, log_requests=not args.disable_log_requests,
        request_log_level=logging.INFO if args.enable_log_requests else logging.DEBUG,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice, response_role=args.response_role,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        cors=CorsPolicy(allow_origins=tuple(args.allowed_origins), allow_methods=tuple(args.allowed_methods),
                        allow_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials))
