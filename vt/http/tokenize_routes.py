"""vLLM's POST /tokenize (a prompt or chat messages -> token ids) and POST /detokenize."""

from __future__ import annotations

from vt.http.chat_options import parse_template_options
from vt.http.json_response import json_body
from vt.http.messages import HttpRequest, Response, StreamResponse
from vt.http.protocol import ProtocolError, get_bool, get_str, parse_json_object, parse_messages
from vt.http.route_context import RouteContext


class TokenizeRoutes:
    def __init__(self, context: RouteContext) -> None:
        self._context = context

    async def tokenize(self, http_request: HttpRequest) -> Response | StreamResponse:
        context = self._context
        body = parse_json_object(http_request.body)
        context.check_model(get_str(body, "model"))
        if body.get("messages") is not None:
            messages = parse_messages(body["messages"])
            ids = await context.chat_prompt_ids(messages, parse_template_options(body))
        elif body.get("prompt") is not None:
            prompt = get_str(body, "prompt")
            add_special = get_bool(body, "add_special_tokens", True)
            ids = await context.prompts.encode(prompt, "prompt", add_special_tokens=add_special)
        else:
            raise ProtocolError("either 'prompt' or 'messages' is required", "prompt")
        out = {"tokens": ids, "count": len(ids), "max_model_len": context.engine.max_model_len}
        if get_bool(body, "return_token_strs", False):  # vLLM's: each id's vocabulary entry
            to_token = context.engine.tokenizer.id_to_token
            out["token_strs"] = await context.prompts.run(lambda: [to_token(i) for i in ids], len(ids))
        return json_body(out)

    async def detokenize(self, http_request: HttpRequest) -> Response | StreamResponse:
        context = self._context
        body = parse_json_object(http_request.body)
        context.check_model(get_str(body, "model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise ProtocolError("'tokens' must be a list of integers", "tokens")
        max_model_len = context.engine.max_model_len
        if len(tokens) > max_model_len:  # no sequence of this model is longer; the work grows with the list
            raise ProtocolError(f"'tokens' has {len(tokens)} ids; this model's maximum context length "
                                f"is {max_model_len} tokens", "tokens")

        def work() -> str:
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                raise ProtocolError("'tokens' must be a list of integers", "tokens")
            context.check_token_ids(tokens, "tokens")
            return context.engine.tokenizer.decode(tokens, skip_special_tokens=False)

        return json_body({"prompt": await context.prompts.run(work, len(tokens))})
