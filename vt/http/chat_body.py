"""A /v1/chat/completions body read once into one record: the route works from it alone.

Every field the body carries is checked here, in one pass (a 400 naming the field); what depends
on the server (the served model's names, the model's sampling defaults, the engine's limits) is
checked by the route afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vt.http.chat_options import ChatTemplateOptions, parse_template_options
from vt.http.chat_output import chat_constraint
from vt.http.protocol import ChatRequest, get_bool, parse_chat_request
from vt.http.structured_fields import StructuredField, parse_structured_fields
from vt.http.tool_calls import ToolPlan, parse_tool_plan


def fields_given(body: dict[str, Any]) -> frozenset[str]:
    """The fields a body sets (a null counts as unset, as OpenAI's clients send it)."""
    return frozenset(name for name, value in body.items() if value is not None)


@dataclass(frozen=True)
class ChatBody:
    request: ChatRequest                # messages, sampling, streaming, logprobs
    template: ChatTemplateOptions       # how the messages render into the prompt
    tools: ToolPlan                     # tool_choice over the tools, and the grammar it implies
    constraint: StructuredField | None  # the grammar the output follows: a structured output or the tools'
    echo: bool                          # the reply repeats the final message's content when it continues it
    include_reasoning: bool             # vLLM's include_reasoning: false drops the reasoning text
    max_tokens_param: str               # "max_completion_tokens" or "max_tokens", as the client named it
    given: frozenset[str]               # the fields set: the model's sampling defaults fill the others
    response_role: str = "assistant"    # --response-role: the reply's role after a generation prompt

    @property
    def max_tokens_given(self) -> bool:
        return self.max_tokens_param in self.given

    @property
    def reply_role(self) -> str:
        """vLLM's reply role: --response-role's after a generation prompt, else the final message's."""
        if self.template.add_generation_prompt:
            return self.response_role
        return self.request.messages[-1]["role"]

    @property
    def echoed(self) -> str:
        """What the reply starts with: with echo, the final message's content when the reply
        continues it (same role), else nothing."""
        last = self.request.messages[-1]
        return last["content"] if self.echo and last["role"] == self.reply_role else ""


def parse_chat_body(body: dict[str, Any], auto_tool_choice: bool,
                    response_role: str = "assistant") -> ChatBody:
    """auto_tool_choice: the server parses tool calls (--enable-auto-tool-choice); response_role:
    the role of a reply that a generation prompt opens (--response-role)."""
    request = parse_chat_request(body)
    template = parse_template_options(body)
    tools = parse_tool_plan(body, template.tools, auto_tool_choice)
    constraint = chat_constraint(parse_structured_fields(body), tools)
    given = fields_given(body)
    return ChatBody(
        request=request, template=template, tools=tools, constraint=constraint,
        echo=get_bool(body, "echo", False), include_reasoning=get_bool(body, "include_reasoning", True),
        max_tokens_param="max_completion_tokens" if "max_completion_tokens" in given else "max_tokens",
        given=given, response_role=response_role)
