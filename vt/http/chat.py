"""POST /v1/chat/completions: messages rendered by the chat template, n choices, whole or
streamed, with reasoning and tool calls split out of the reply (vt.http.chat_output)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vt.engine.admission import check_params, check_priority
from vt.engine.outputs import RequestOutput
from vt.http.chat_body import ChatBody, parse_chat_body
from vt.http.chat_output import ChatOutputPlan
from vt.http.choices import collect, usage
from vt.http.generation import Generation, Launch
from vt.http.json_response import json_body
from vt.http.logprobs import Logprobs
from vt.http.messages import HttpRequest, Response, StreamResponse
from vt.http.protocol import ChatRequest, ProtocolError, parse_json_object
from vt.http.reasoning import ReasoningParser
from vt.http.route_context import RouteContext
from vt.http.sse import DONE, StreamEvents, TextEvents, error_event, nothing_new, sse_event, stream_response
from vt.http.structured_fields import constrain


class ChatRoute:
    def __init__(self, context: RouteContext, generation: Generation, logprobs: Logprobs,
                 reasoning: ReasoningParser | None) -> None:
        self._context = context
        self._generation = generation
        self._logprobs = logprobs
        self._reasoning = reasoning  # --reasoning-parser

    async def handle(self, http_request: HttpRequest) -> Response | StreamResponse:
        context, generation = self._context, self._generation
        engine = context.engine
        options = context.options
        chat = parse_chat_body(parse_json_object(http_request.body), options.enable_auto_tool_choice,
                               options.response_role)
        request = generation.with_defaults(chat.request, chat.given, "top_logprobs")
        context.check_model(request.model)
        limits = engine.limits
        check_params(request.params, limits)  # before the template and tokenizer run
        check_priority(request.priority, limits)
        rendered = await context.chat_prompt_ids(request.messages, chat.template)
        prompt_ids = generation.truncate(rendered, request)
        if not prompt_ids:
            raise ProtocolError("the messages render to an empty prompt", "messages")
        max_tokens = generation.fit([prompt_ids], request, limits, chat.max_tokens_given, "messages",
                                    chat.max_tokens_param)
        reasoning = self._reasoning
        prompt_closed = reasoning is not None and reasoning.prompt_closed(prompt_ids)
        plan = ChatOutputPlan(reasoning, chat.tools, prompt_closed, chat.include_reasoning)
        params = await constrain(engine, request.params, chat.constraint, plan.grammar_start(),
                                 disconnected=http_request.disconnected)
        request = dataclasses.replace(request, params=params)
        launch = generation.launch("chatcmpl", [prompt_ids], request, max_tokens)
        if request.stream:
            events = self._events(launch, request, prompt_ids, chat, plan)
            return stream_response(engine, launch.streams, events)
        await collect(http_request, launch.streams, launch.choices)
        replies = [plan.reply(chat.reply_role, "".join(c.text), chat.echoed, c.finish_reason)
                   for c in launch.choices]
        choices = [{
            "index": c.index,
            "message": message,
            "logprobs": (self._logprobs.chat(c.logprobs, request.tokens_as_ids, lazy=True)
                         if request.want_logprobs else None),
            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
            **({"token_ids": c.token_ids} if request.return_token_ids else {}),
        } for c, (message, finish_reason) in zip(launch.choices, replies)]
        return json_body({
            "id": launch.response_id, "object": "chat.completion", "created": launch.created,
            "model": context.served_model_name, "choices": choices,
            "usage": usage(len(prompt_ids), launch.choices),
            **({"prompt_token_ids": prompt_ids} if request.return_token_ids else {}),
        })

    def _events(self, launch: Launch, request: ChatRequest, prompt_ids: list[int], chat: ChatBody,
                plan: ChatOutputPlan) -> StreamEvents:
        choices = launch.choices
        num_prompt_tokens = len(prompt_ids)
        want_logprobs, as_ids = request.want_logprobs, request.tokens_as_ids
        head = {"id": launch.response_id, "object": "chat.completion.chunk", "created": launch.created,
                "model": self._context.served_model_name}

        def chunk(choice: dict[str, Any], completion_tokens: int = 0, **top: Any) -> bytes:
            body = {**head, **top, "choices": [choice]}
            if request.continuous_usage:  # each choice's tokens so far, as vLLM counts them
                body["usage"] = usage(num_prompt_tokens, [], completion_tokens)
            elif request.include_usage:
                body["usage"] = None
            return sse_event(body)

        plain_event = TextEvents(lambda index, text: {**head, "choices": [{
            "index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": None,
            "stop_reason": None}], **({"usage": None} if request.include_usage else {})})
        # vLLM's return_token_ids: the prompt's ids with each choice's first chunk
        prompt_top = {"prompt_token_ids": prompt_ids} if request.return_token_ids else {}
        first = [chunk({"index": c.index, "delta": {"role": chat.reply_role, "content": ""},
                        "logprobs": None, "finish_reason": None}, **prompt_top) for c in choices]
        if chat.echoed:
            first += [chunk({"index": c.index, "delta": {"content": chat.echoed}, "logprobs": None,
                             "finish_reason": None}) for c in choices]

        # reasoning and tool calls reshape each delta (chat_output); plain replies skip that
        shapers = [plan.shaper() for _ in choices] if plan.shapes else None
        # Fields that change with every token leave the pre-serialised plain event aside.
        plain = not (want_logprobs or shapers is not None or request.continuous_usage
                     or request.return_token_ids)

        def output(i: int, out: RequestOutput) -> list[bytes]:
            choices[i].update(out)
            if not out.finished and plain and (out.text or out.token_ids):
                return [plain_event(i, out.text)]
            if out.finished and out.finish_reason == "error":
                return [error_event(out), DONE]
            if nothing_new(out):
                return []
            reason = out.finish_reason if out.finished else None
            if shapers is not None:
                delta = shapers[i].delta(out.text, out.finished)
                reason = shapers[i].finish_reason(reason, shapers[i].called)
            else:
                delta = {"content": out.text} if out.text or out.token_ids else {}
            shaped = {
                "index": i, "delta": delta,
                "logprobs": self._logprobs.chat(list(out.logprobs or ()), as_ids) if want_logprobs else None,
                "finish_reason": reason,
                "stop_reason": out.stop_reason if out.finished else None,
            }
            if request.return_token_ids:
                shaped["token_ids"] = list(out.token_ids)
            return [chunk(shaped, choices[i].num_output_tokens)]

        def last() -> list[bytes]:
            if not request.include_usage:
                return [DONE]
            return [sse_event({**head, "choices": [], "usage": usage(num_prompt_tokens, choices)}), DONE]

        return StreamEvents(first, output, last)
