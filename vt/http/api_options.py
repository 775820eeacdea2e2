"""Server-wide settings of the OpenAI routes, taken from `vt serve` flags."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from vt.http.cors import CorsPolicy
from vt.model.generation_config import SamplingDefaults
from vt.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True)
class ApiOptions:
    model_aliases: tuple[str, ...] = ()       # more names a request may give for the served model
    chat_template: str | None = None          # --chat-template: replaces the model's own
    trust_request_chat_template: bool = False  # a request's own chat_template is refused otherwise
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    max_logprobs: int = MAX_LOGPROBS          # most logprobs / top_logprobs a request may ask for
    log_requests: bool = True                 # a log line per request (--disable-log-requests: none)
    request_log_level: int = logging.DEBUG    # its level: INFO with --enable-log-requests
    reasoning_parser: str | None = None       # --reasoning-parser: qwen3 (<think> -> reasoning_content)
    tool_call_parser: str | None = None       # --tool-call-parser: hermes turns <tool_call> into tool_calls
    enable_auto_tool_choice: bool = False     # --enable-auto-tool-choice: tool_choice auto is served
    response_role: str = "assistant"          # --response-role: a reply's role after a generation prompt
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the requests' default
    cors: CorsPolicy | None = None            # --allowed-origins etc.; None: no CORS headers
