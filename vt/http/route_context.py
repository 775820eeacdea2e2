"""What every OpenAI route reads (the engine, the served model's names, the server's options, the
prompt preparer, whether the server is draining) and the checks and prompt rendering they share."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vt.http.api_options import ApiOptions
from vt.http.chat_options import ChatTemplateOptions
from vt.http.engine_client import EngineClient
from vt.http.errors import HttpError
from vt.http.prompt_prep import PromptPreparer
from vt.http.protocol import ProtocolError
from vt.text.preview import preview


@dataclass
class RouteContext:
    engine: EngineClient
    served_model_name: str
    options: ApiOptions
    prompts: PromptPreparer
    draining: bool = False  # set by OpenAIApp.begin_drain() on SIGTERM
    model_names: frozenset[str] = field(init=False)  # the served name and its aliases

    def __post_init__(self) -> None:
        self.model_names = frozenset((self.served_model_name, *self.options.model_aliases))

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise HttpError(404, f"the model {preview(model)} does not exist; this server serves "
                                 f"'{self.served_model_name}'", type="not_found_error",
                            param="model", code="model_not_found")

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        # any id the model can produce is valid, also where its vocabulary has rows past the tokenizer
        model_config = getattr(self.engine, "model_config", None)  # optional: see EngineClient
        vocab = max(self.engine.tokenizer.vocab_size, model_config.vocab_size if model_config else 0)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ProtocolError(f"token id {bad[0]} is outside the vocabulary (size {vocab})", param)

    async def prompt_ids(self, prompt: str | Sequence[int], param: str,
                         add_special_tokens: bool = True) -> list[int]:
        """A completion's prompt or an embedding's input, text or token ids, as checked token ids;
        one that comes to no tokens is the request's error, named by `param`."""
        if isinstance(prompt, str):
            ids = await self.prompts.encode(prompt, param, add_special_tokens=add_special_tokens)
        else:
            self.check_token_ids(prompt, param)
            ids = list(prompt)
        if not ids:
            raise ProtocolError(f"the {param} encodes to no tokens", param)
        return ids

    async def chat_prompt_ids(self, messages: Sequence[dict[str, Any]],
                              template: ChatTemplateOptions) -> list[int]:
        """The prompt of a chat: its messages rendered by the chat template, then encoded."""
        if template.chat_template is not None and not self.options.trust_request_chat_template:
            raise ProtocolError("this server does not run chat templates sent in requests; start it with "
                                "--trust-request-chat-template to allow them", "chat_template")
        rendered = await self.prompts.render_chat(
            list(messages), add_generation_prompt=template.add_generation_prompt,
            template_param="messages" if template.chat_template is None else "chat_template",
            continue_final_message=template.continue_final_message,
            tools=list(template.tools) if template.tools is not None else None,
            chat_template=template.chat_template or self.options.chat_template,
            variables=template.variables)
        if isinstance(rendered, str):
            # the template already wrote the special tokens (BOS, role markers)
            return await self.prompts.encode(rendered, "messages",
                                             add_special_tokens=template.add_special_tokens)
        return list(rendered)
