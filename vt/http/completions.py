"""POST /v1/completions: prompts (texts or token ids) in, n choices each, whole or streamed."""

from __future__ import annotations

import dataclasses
from typing import Any

from vt.engine.admission import check_params, check_priority
from vt.engine.outputs import RequestOutput
from vt.http.chat_body import fields_given
from vt.http.choices import collect, usage
from vt.http.generation import Generation, Launch
from vt.http.json_response import json_body
from vt.http.logprobs import Logprobs
from vt.http.messages import HttpRequest, Response, StreamResponse
from vt.http.protocol import (
    CompletionRequest,
    get_bool,
    parse_completion_request,
    parse_json_object,
)
from vt.http.route_context import RouteContext
from vt.http.sse import DONE, StreamEvents, TextEvents, error_event, nothing_new, sse_event, stream_response
from vt.http.structured_fields import constrain, parse_structured_fields


class CompletionRoute:
    def __init__(self, context: RouteContext, generation: Generation, logprobs: Logprobs) -> None:
        self._context = context
        self._generation = generation
        self._logprobs = logprobs

    async def handle(self, http_request: HttpRequest) -> Response | StreamResponse:
        context, generation = self._context, self._generation
        engine = context.engine
        body = parse_json_object(http_request.body)
        request = generation.with_defaults(parse_completion_request(body, engine.max_model_len),
                                           fields_given(body), "logprobs")
        context.check_model(request.model)
        limits = engine.limits
        # before the prompt work, which can be large
        check_params(request.params, limits, num_prompts=len(request.prompts))
        check_priority(request.priority, limits)
        field = parse_structured_fields(body)
        add_special = get_bool(body, "add_special_tokens", True)  # vLLM's field, default as there
        prompts = [generation.truncate(await self._context.prompt_ids(prompt, "prompt", add_special), request)
                   for prompt in request.prompts]
        max_tokens = generation.fit(prompts, request, limits, body.get("max_tokens") is not None, "prompt",
                                    "max_tokens")
        params = await constrain(engine, request.params, field, disconnected=http_request.disconnected)
        request = dataclasses.replace(request, params=params)
        num_prompt_tokens = sum(map(len, prompts))
        echoes = [await self._echo(prompt, ids, request) for prompt, ids in zip(request.prompts, prompts)] \
            if request.echo else None
        launch = generation.launch("cmpl", prompts, request, max_tokens)
        if request.stream:
            return stream_response(engine, launch.streams, self._events(launch, request, prompts, echoes))
        await collect(http_request, launch.streams, launch.choices)
        want_logprobs = request.params.logprobs is not None
        n = request.params.n
        return json_body({
            "id": launch.response_id, "object": "text_completion", "created": launch.created,
            "model": context.served_model_name,
            "choices": [{
                "index": c.index, "text": (echoes[c.index // n] if echoes else "") + "".join(c.text),
                "logprobs": (self._logprobs.completion(c.logprobs, c, request.tokens_as_ids, lazy=True)
                             if want_logprobs else None),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                **({"prompt_token_ids": prompts[c.index // n], "token_ids": c.token_ids}
                   if request.return_token_ids else {}),
            } for c in launch.choices],
            "usage": usage(num_prompt_tokens, launch.choices),
        })

    async def _echo(self, prompt: str | tuple[int, ...], ids: list[int], request: CompletionRequest) -> str:
        """The text echo puts before a prompt's choices: the prompt as sent, or its token ids
        decoded (special tokens kept, as vLLM decodes them), or what truncation kept of it."""
        if isinstance(prompt, str) and request.truncate_prompt_tokens is None:
            return prompt
        tokenizer = self._context.engine.tokenizer
        return await self._context.prompts.run(lambda: tokenizer.decode(ids, skip_special_tokens=False),
                                               len(ids))

    def _events(self, launch: Launch, request: CompletionRequest, prompts: list[list[int]],
                echoes: list[str] | None) -> StreamEvents:
        want_logprobs, as_ids = request.params.logprobs is not None, request.tokens_as_ids
        choices = launch.choices
        n = request.params.n
        num_prompt_tokens = sum(map(len, prompts))
        head = {"id": launch.response_id, "object": "text_completion", "created": launch.created,
                "model": self._context.served_model_name}
        # Each choice's first chunk starts with its prompt (echo) and carries the prompt's ids
        # (return_token_ids), as vLLM streams them.
        started = [False] * len(choices)

        def plain(index: int, text: str) -> dict[str, Any]:
            event = {**head, "choices": [{"index": index, "text": text, "logprobs": None,
                                          "finish_reason": None, "stop_reason": None}]}
            if request.include_usage:
                event["usage"] = None
            return event

        plain_event = TextEvents(plain)
        # Fields that change with every token leave the pre-serialised plain event aside.
        per_token = want_logprobs or request.continuous_usage or request.return_token_ids

        def output(i: int, out: RequestOutput) -> list[bytes]:
            choice = choices[i]
            choice.update(out)
            first = not started[i]
            started[i] = True
            text = echoes[i // n] + out.text if echoes and first else out.text
            if not out.finished and not per_token and (text or out.token_ids):
                return [plain_event(i, text)]
            if out.finished and out.finish_reason == "error":
                return [error_event(out), DONE]
            if not text and nothing_new(out):
                return []
            shaped = {
                "index": i, "text": text,
                "logprobs": (self._logprobs.completion(list(out.logprobs or ()), choice, as_ids)
                             if want_logprobs else None),
                "finish_reason": out.finish_reason if out.finished else None,
                "stop_reason": out.stop_reason if out.finished else None,
            }
            if request.return_token_ids:
                if first:
                    shaped["prompt_token_ids"] = prompts[i // n]
                shaped["token_ids"] = list(out.token_ids)
            chunk = {**head, "choices": [shaped]}
            if request.continuous_usage:  # this choice's prompt and tokens so far, as vLLM counts them
                chunk["usage"] = usage(len(prompts[i // n]), [], choice.num_output_tokens)
            elif request.include_usage:
                chunk["usage"] = None
            return [sse_event(chunk)]

        def last() -> list[bytes]:
            if not request.include_usage:
                return [DONE]
            return [sse_event({**head, "choices": [], "usage": usage(num_prompt_tokens, choices)}), DONE]

        return StreamEvents([], output, last)
