"""What the completions and chat routes share: the model's sampling defaults, the fit of prompt
and output in the context, prompt truncation, and starting the engine requests of one call."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import Container
from dataclasses import dataclass
from typing import TypeVar

from vt.engine.admission import AdmissionLimits, fit_context
from vt.engine.outputs import EngineDeadError, PromptTooLongError, QueueFullError, RequestStream
from vt.http.choices import Choice
from vt.http.errors import HttpError
from vt.http.protocol import GenerationRequest, ProtocolError, params_for_choice
from vt.http.route_context import RouteContext
from vt.sampling_params import SamplingParams, SamplingParamsError

log = logging.getLogger("vt.http")
RequestT = TypeVar("RequestT", bound=GenerationRequest)


def engine_error(error: Exception) -> HttpError | None:
    """add_request's errors as HTTP errors (None: not the request's fault, a 500)."""
    if isinstance(error, PromptTooLongError):
        return HttpError(400, str(error))
    if isinstance(error, QueueFullError):
        return HttpError(503, str(error) or "the waiting queue is full; retry later", type="server_busy",
                         headers=[("retry-after", "1")])
    if isinstance(error, EngineDeadError):
        return HttpError(503, str(error) or "the engine has stopped", type="service_unavailable")
    if isinstance(error, ValueError):
        return HttpError(400, str(error), param=getattr(error, "param", None))
    return None


def salt_key(cache_salt: str) -> str:
    """The engine's key for a request's cache_salt: a digest of fixed size, so a long salt costs
    no more than a short one each time the prefix cache hashes a first block."""
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Launch:
    """The engine requests of one API call: choice k is streams[k]."""

    response_id: str
    created: int
    streams: list[RequestStream]
    choices: list[Choice]


class Generation:
    def __init__(self, context: RouteContext) -> None:
        self._context = context

    def with_defaults(self, request: RequestT, given: Container[str], logprobs_param: str) -> RequestT:
        """The parsed request with the model's sampling defaults (for the fields not `given`) and
        the server's logprobs cap."""
        options = self._context.options
        try:
            params = options.sampling_defaults.apply(request.params, given.__contains__)
        except SamplingParamsError as e:
            raise ProtocolError(f"{e} (with the model's generation_config.json defaults)", e.param) from None
        cap = options.max_logprobs
        if params.logprobs is not None and params.logprobs > cap:
            raise ProtocolError(f"'{logprobs_param}' asks for {params.logprobs} logprobs; this server "
                                f"returns at most {cap} (--max-logprobs)", logprobs_param)
        # --return-tokens-as-token-ids is the default a request's own field overrides, as in vLLM
        as_ids = request.tokens_as_ids if "return_tokens_as_token_ids" in given \
            else options.return_tokens_as_token_ids
        return dataclasses.replace(request, params=params, tokens_as_ids=as_ids)

    @staticmethod
    def fit(prompts: list[list[int]], request: GenerationRequest, limits: AdmissionLimits,
            max_tokens_given: bool, prompt_param: str, max_tokens_param: str) -> list[int | None]:
        """Each prompt's max_tokens, checked against the context and the KV cache (a 400 naming
        the prompt or the max_tokens field); before the engine sees the request."""
        return [fit_context(len(p), request.params, limits, max_tokens_given=max_tokens_given,
                            prompt_param=prompt_param, max_tokens_param=max_tokens_param).max_tokens
                for p in prompts]

    def truncate(self, ids: list[int], request: GenerationRequest) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the maximum context)."""
        k = request.truncate_prompt_tokens
        if k is None:
            return ids
        max_model_len = self._context.engine.max_model_len
        if k > max_model_len:
            raise ProtocolError(f"'truncate_prompt_tokens' ({k}) is greater than this model's maximum "
                                f"context length ({max_model_len})", "truncate_prompt_tokens")
        return ids[-(max_model_len if k == -1 else k):]

    def launch(self, prefix: str, prompts: list[list[int]], request: GenerationRequest,
               max_tokens: list[int | None]) -> Launch:
        """Start the engine requests of one API call, n per prompt, choice index prompt * n + sample
        as OpenAI and vLLM number them, with each prompt's max_tokens from fit()."""
        response_id = f"{prefix}-{uuid.uuid4().hex}"
        count = len(prompts) * request.params.n
        request_ids = [response_id] if count == 1 else [f"{response_id}-{i}" for i in range(count)]
        streams = self._start(request_ids, prompts, request, max_tokens)
        options = self._context.options
        if options.log_requests and log.isEnabledFor(options.request_log_level):
            log.log(options.request_log_level, "request %s: prompt tokens %s, priority %d, %s", response_id,
                    [len(p) for p in prompts], request.priority, request.params)
        choices = [Choice(i, request_id) for i, request_id in enumerate(request_ids)]
        return Launch(response_id, int(time.time()), streams, choices)

    def _start(self, request_ids: list[str], prompts: list[list[int]], request: GenerationRequest,
               max_tokens: list[int | None]) -> list[RequestStream]:
        """Add the n engine requests of each prompt (choice k: prompt k // n, sample k % n); on any
        failure abort the ones already added. (A draining server refuses new requests before
        their handler starts: one that started before the drain comes here to finish.)"""
        engine = self._context.engine
        streams: list[RequestStream] = []
        asked, priority = request.params, request.priority
        n = asked.n
        per_prompt: list[SamplingParams] = [
            asked if m == asked.max_tokens else dataclasses.replace(asked, max_tokens=m) for m in max_tokens]
        # Passed only when given, so an engine client that knows no salt still serves the rest.
        salted = {} if request.cache_salt is None else {"cache_salt": salt_key(request.cache_salt)}
        try:
            for k, request_id in enumerate(request_ids):
                params = params_for_choice(per_prompt[k // n], k % n)
                streams.append(engine.add_request(request_id, prompts[k // n], params, priority=priority,
                                                  **salted))
        except Exception as e:
            for request_id in request_ids[:len(streams)]:
                engine.abort(request_id)
            mapped = engine_error(e)
            if mapped is None:
                raise
            raise mapped from None
        return streams
