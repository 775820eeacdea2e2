"""OpenAI request bodies -> validated, typed requests carrying SamplingParams.

Everything here is pure: no engine, no I/O. A bad field raises `ProtocolError` naming the
field as the client spelled it, which the HTTP layer reports as a 400 with `param` set.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, TypedDict

import orjson

from vt.sampling_params import SamplingParams, SamplingParamsError
from vt.text.preview import preview

MAX_COMPLETION_LOGPROBS = 5   # OpenAI's cap for the legacy completions endpoint
MAX_CHAT_TOP_LOGPROBS = 20
MAX_PROMPTS = 1024            # prompts in one completions request (each is n engine requests)


class ProtocolError(ValueError):
    """A request body that does not follow the API; `.param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GenerationRequest:
    """What both generation routes share once the body is parsed."""

    model: str | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    truncate_prompt_tokens: int | None   # keep only the prompt's last k tokens; -1: max-model-len
    tokens_as_ids: bool                  # return_tokens_as_token_ids: logprobs name tokens "token_id:N"
    continuous_usage: bool               # stream_options.continuous_usage_stats: usage in every chunk
    return_token_ids: bool               # vLLM's return_token_ids: the prompt's and each choice's ids
    cache_salt: str | None               # vLLM's cache_salt: prefix-cache hits only under the same salt


@dataclass(frozen=True)
class CompletionRequest(GenerationRequest):
    prompts: tuple[str | tuple[int, ...], ...]   # each text to encode, or token ids as given
    echo: bool                                   # each choice's text starts with its prompt's


@dataclass(frozen=True)
class ChatRequest(GenerationRequest):
    messages: tuple[dict[str, Any], ...]   # {"role", "content": text} and the tool fields given
    want_logprobs: bool


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a JSON body that must be an object; invalid UTF-8 or JSON is a ProtocolError."""
    if not body:
        raise ProtocolError("request body is empty; expected a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        # orjson rejects invalid UTF-8 with the same error type
        raise ProtocolError(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


# --- typed field readers: null means "not given", as OpenAI clients send it ---

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def get_int(body: dict[str, Any], name: str, default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        # JSON integers past 64 bits reach us as floats (rounded): say so, not "not an integer"
        if isinstance(value, float) and (value >= 2**64 or value <= -2**63):
            raise ProtocolError(f"'{name}' is out of range, got {preview(value)}", name)
        raise ProtocolError(f"'{name}' must be an integer, got {preview(value)}", name)
    return value


def get_float(body: dict[str, Any], name: str, default: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(f"'{name}' must be a number, got {preview(value)}", name)
    return float(value)


def get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(f"'{name}' must be a boolean, got {preview(value)}", name)
    return value


def get_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ProtocolError(f"'{name}' must be a string, got {preview(value)}", name)
    return value


def _get_stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ProtocolError("'stop' must be a string or a list of strings", "stop")
    return tuple(value)


def _get_token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    value = body.get(name)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(i) for i in value):
        raise ProtocolError(f"'{name}' must be a list of integers", name)
    return tuple(value)


def _get_logit_bias(body: dict[str, Any]) -> dict[str, Any] | None:
    value = body.get("logit_bias")
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise ProtocolError("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    return value


def _stream_usage(body: dict[str, Any], stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); as in vLLM, usage in every chunk needs both."""
    stream_options = body.get("stream_options")
    if stream_options is None:
        return False, False
    if not isinstance(stream_options, dict):
        raise ProtocolError("'stream_options' must be an object", "stream_options")
    if not stream:
        raise ProtocolError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include = get_bool(stream_options, "include_usage", False)
    continuous = get_bool(stream_options, "continuous_usage_stats", False)
    return include, include and continuous


def _cache_salt(body: dict[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ProtocolError("'cache_salt' must be a non-empty string", "cache_salt")
    return salt


def _sampling_params(body: dict[str, Any], max_tokens: int | None, logprobs: int | None,
                     rename: dict[str, str]) -> SamplingParams:
    """Build SamplingParams; `rename` maps SamplingParams field names back to request field names."""
    try:
        return SamplingParams(
            n=get_int(body, "n", 1),
            max_tokens=max_tokens,
            temperature=get_float(body, "temperature", 1.0),
            top_p=get_float(body, "top_p", 1.0),
            top_k=get_int(body, "top_k", 0),
            min_p=get_float(body, "min_p", 0.0),
            seed=get_int(body, "seed"),
            stop=_get_stop(body),
            stop_token_ids=_get_token_ids(body, "stop_token_ids"),
            ignore_eos=get_bool(body, "ignore_eos", False),
            min_tokens=get_int(body, "min_tokens", 0),
            presence_penalty=get_float(body, "presence_penalty", 0.0),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0),
            repetition_penalty=get_float(body, "repetition_penalty", 1.0),
            logprobs=logprobs,
            skip_special_tokens=get_bool(body, "skip_special_tokens", True),
            include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
            spaces_between_special_tokens=get_bool(body, "spaces_between_special_tokens", True),
            logit_bias=_get_logit_bias(body),
            allowed_token_ids=body.get("allowed_token_ids"),
        )
    except SamplingParamsError as e:
        raise ProtocolError(str(e), rename.get(e.param, e.param)) from None


# Fields that ask for output vt cannot give: ignoring them would hand back something the client
# did not ask for (unbiased tokens, other candidates), so each is a 400. A field counts as asked
# for when it is present and not null, false or empty. Structured outputs and tools are read by
# vt.http.structured_fields and vt.http.tool_calls.
_UNSUPPORTED_BOTH = {
    "prompt_logprobs": "'prompt_logprobs' is not supported",
    "use_beam_search": "beam search is not supported",
    "bad_words": "'bad_words' is not supported",
    "logits_processors": "'logits_processors' is not supported: vt loads no logits processors",
    "vllm_xargs": "'vllm_xargs' is not supported: vt has no custom logits processors to read it",
}
_UNSUPPORTED_COMPLETION = {"suffix": "'suffix' is not supported"}
_UNSUPPORTED_CHAT = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
}


def _asked_for(name: str, value: Any) -> bool:
    if value is None or value is False or value == "" or value == [] or value == {}:
        return False
    return not (name == "function_call" and value == "none")


def _reject_unsupported(body: dict[str, Any], table: dict[str, str]) -> None:
    for name, message in table.items():
        if name in body and _asked_for(name, body[name]):
            raise ProtocolError(message, name)


def _best_of(body: dict[str, Any], n: int) -> None:
    best_of = get_int(body, "best_of")
    if best_of is not None and best_of != n:
        raise ProtocolError(f"'best_of' other than n is not supported (best_of {best_of}, n {n})",
                            "best_of")


def _truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    k = get_int(body, "truncate_prompt_tokens")
    if k is not None and k < 1 and k != -1:
        raise ProtocolError(f"'truncate_prompt_tokens' must be at least 1, or -1 for the maximum "
                            f"context length, got {k}", "truncate_prompt_tokens")
    return k


class _CommonFields(TypedDict):
    model: str | None
    stream: bool
    include_usage: bool
    priority: int
    truncate_prompt_tokens: int | None
    tokens_as_ids: bool
    continuous_usage: bool
    return_token_ids: bool
    cache_salt: str | None


def _common(body: dict[str, Any]) -> _CommonFields:
    """The GenerationRequest fields both routes read the same way."""
    _reject_unsupported(body, _UNSUPPORTED_BOTH)
    stream = get_bool(body, "stream", False)
    include_usage, continuous_usage = _stream_usage(body, stream)
    common = _CommonFields(
        model=get_str(body, "model"), stream=stream, include_usage=include_usage,
        priority=get_int(body, "priority", 0), truncate_prompt_tokens=_truncate_prompt_tokens(body),
        tokens_as_ids=get_bool(body, "return_tokens_as_token_ids", False), continuous_usage=continuous_usage,
        return_token_ids=get_bool(body, "return_token_ids", False), cache_salt=_cache_salt(body))
    get_str(body, "user")  # accepted and ignored, but it must be a string as OpenAI documents
    return common


def _parse_one_prompt(value: Any, max_tokens: int | None) -> str | tuple[int, ...] | None:
    """A string or a list of token ids; None for anything else. A token list of `max_tokens` or
    more ids (None: no bound) is refused before it is read."""
    if isinstance(value, str):
        return value
    if (isinstance(value, list) and value and _is_int(value[0]) and max_tokens is not None
            and len(value) >= max_tokens):
        raise ProtocolError(f"the prompt has {len(value)} tokens; this model's maximum context length "
                            f"is {max_tokens} tokens", "prompt")
    if isinstance(value, list) and value and all(_is_int(i) for i in value):
        if any(i < 0 for i in value):
            raise ProtocolError("'prompt' token ids must be >= 0", "prompt")
        return tuple(value)
    return None


def parse_prompts(value: Any, max_tokens: int | None = None) -> tuple[str | tuple[int, ...], ...]:
    """A completions prompt: a string or a list of token ids, or a batch of them (a list of
    strings or a list of token-id lists)."""
    if isinstance(value, list) and not value:
        raise ProtocolError("'prompt' must not be empty", "prompt")
    if isinstance(value, str) and not value:
        raise ProtocolError("'prompt' must not be empty", "prompt")
    one = _parse_one_prompt(value, max_tokens)
    if one is not None:
        return (one,)
    if isinstance(value, list) and (all(isinstance(p, str) for p in value)
                                    or all(isinstance(p, list) for p in value)):
        if len(value) > MAX_PROMPTS:
            raise ProtocolError(f"'prompt' holds {len(value)} prompts; at most {MAX_PROMPTS} per request",
                                "prompt")
        batch = tuple(_parse_one_prompt(p, max_tokens) for p in value)
        if None not in batch:
            return batch
    raise ProtocolError("'prompt' must be a string, a list of token ids, or a list of strings or of "
                        "token-id lists", "prompt")


def parse_completion_request(body: dict[str, Any],
                             max_prompt_tokens: int | None = None) -> CompletionRequest:
    if "prompt" not in body or body["prompt"] is None:
        raise ProtocolError("'prompt' is required", "prompt")
    common = _common(body)
    # a prompt to be truncated may be longer than the context: the body size bounds it then
    prompts = parse_prompts(body["prompt"], None if common["truncate_prompt_tokens"] else max_prompt_tokens)
    echo = get_bool(body, "echo", False)
    _reject_unsupported(body, _UNSUPPORTED_COMPLETION)
    logprobs = get_int(body, "logprobs")
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise ProtocolError(f"'logprobs' must be in [0, {MAX_COMPLETION_LOGPROBS}], got {logprobs}",
                            "logprobs")
    if echo and logprobs is not None:
        # vLLM answers with the prompt tokens' logprobs too; vt computes no prompt logprobs
        raise ProtocolError("'echo' with 'logprobs' asks for the prompt tokens' logprobs, which vt does "
                            "not compute (as for 'prompt_logprobs'); drop 'logprobs' to echo the prompt, "
                            "or 'echo' to get the generated tokens' logprobs", "echo")
    # the completions endpoint keeps OpenAI's historical default of 16 tokens
    max_tokens = get_int(body, "max_tokens", 16)
    params = _sampling_params(body, max_tokens, logprobs, {})
    _best_of(body, params.n)
    return CompletionRequest(params=params, prompts=prompts, echo=echo, **common)


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
    """Chat messages with text content (list content is its text parts joined by newlines, as
    vLLM joins them) and the tool and reasoning fields templates read; the `developer` role is
    `system`, as OpenAI's newer models name it."""
    if not isinstance(value, list) or not value:
        raise ProtocolError("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ProtocolError(f"messages[{i}] must be an object", "messages")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ProtocolError(f"messages[{i}].role must be a non-empty string", "messages")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ProtocolError(
                        f"messages[{i}].content: only 'text' parts are supported, got {preview(kind)}",
                        "messages")
                text = part.get("text")
                if not isinstance(text, str):
                    raise ProtocolError(f"messages[{i}].content text parts need a string 'text'",
                                        "messages")
                texts.append(text)
            content = "\n".join(texts)  # as vLLM joins text parts for templates that take a string
        elif not isinstance(content, str):
            raise ProtocolError(f"messages[{i}].content must be a string or a list of parts",
                                "messages")
        message = {"role": "system" if role == "developer" else role, "content": content}
        message.update(_message_fields(m, i))
        out.append(message)
    return tuple(out)


# Optional message fields chat templates read (tool turns, earlier reasoning): name -> JSON type
_MESSAGE_FIELDS = {"name": str, "tool_call_id": str, "tool_calls": list, "reasoning_content": str,
                   "reasoning": str, "thinking": str}


def _message_fields(m: dict[str, Any], i: int) -> dict[str, Any]:
    out = {}
    for name, kind in _MESSAGE_FIELDS.items():
        value = m.get(name)
        if value is None:
            continue
        if not isinstance(value, kind) or (kind is list and not all(isinstance(c, dict) for c in value)):
            what = "a list of objects" if kind is list else "a string"
            raise ProtocolError(f"messages[{i}].{name} must be {what}", "messages")
        out[name] = value
    return out


def parse_chat_request(body: dict[str, Any]) -> ChatRequest:
    if body.get("messages") is None:
        raise ProtocolError("'messages' is required", "messages")
    messages = parse_messages(body["messages"])
    common = _common(body)
    _reject_unsupported(body, _UNSUPPORTED_CHAT)
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs")
    if top is not None:
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise ProtocolError(f"'top_logprobs' must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}",
                                "top_logprobs")
        if not want_logprobs and top > 0:
            raise ProtocolError("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = get_int(body, max_name)
    params = _sampling_params(body, max_tokens, (top or 0) if want_logprobs else None,
                              {"max_tokens": max_name, "logprobs": "top_logprobs"})
    _best_of(body, params.n)
    return ChatRequest(params=params, messages=messages, want_logprobs=want_logprobs, **common)


def params_for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of an n-way request: n=1 each, seed shifted so choices differ."""
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return replace(params, n=1, seed=seed)
