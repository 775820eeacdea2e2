"""How a chat reply's text becomes its message: reasoning split off, tool calls parsed out.

A ChatOutputPlan is made once per request from the server's parsers and the request's tool
fields; each choice gets a ChoiceShaper, which turns the text as it streams into OpenAI deltas
(`reasoning`, `content`, `tool_calls`) and a whole text into the final message. Without a
reasoning parser or tools the routes skip all of this and send the text as content.

The reasoning goes out under both names vLLM has used: `reasoning` (vLLM's since it followed
OpenAI's guidance) and `reasoning_content` (DeepSeek's, which vLLM sent before and many clients
still read). `include_reasoning: false` leaves it out; the reply is split all the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vt.http.protocol import ProtocolError
from vt.http.reasoning import ReasoningParser, ReasoningStream
from vt.http.structured_fields import StructuredField
from vt.http.tool_calls import ToolCallStream, ToolPlan


@dataclass(frozen=True)
class ChatOutputPlan:
    reasoning: ReasoningParser | None
    tools: ToolPlan
    prompt_closed: bool = False        # the prompt already ended the thinking
    include_reasoning: bool = True     # vLLM's include_reasoning: false drops the reasoning text

    @property
    def shapes(self) -> bool:
        return self.reasoning is not None or self.tools.mode != "none"

    def grammar_start(self) -> int | None:
        """The token after which a grammar applies: the end of the thinking, unless the prompt
        already ended it (None: from the first token)."""
        if self.reasoning is None or self.prompt_closed:
            return None
        return self.reasoning.end_id

    def shaper(self) -> ChoiceShaper:
        return ChoiceShaper(self)

    def reply(self, role: str, text: str, echoed: str,
              finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's (message, finish_reason)."""
        if not self.shapes:
            return {"role": role, "content": echoed + text}, finish_reason
        shaper = self.shaper()
        message = shaper.message(role, text, echoed)
        return message, shaper.finish_reason(finish_reason, "tool_calls" in message)


def chat_constraint(field: StructuredField | None, tools: ToolPlan) -> StructuredField | None:
    """The grammar of a chat request: its structured-output field, or the one tool_choice
    required / named implies; both at once is a 400."""
    if tools.grammar is None:
        return field
    if field is not None:
        raise ProtocolError(f"'{field.param}' cannot be combined with tool_choice "
                            f"'{tools.mode if tools.mode != 'named' else tools.named}'", field.param)
    return StructuredField(tools.grammar, "tools")  # a grammar that fails to build is the tools' fault


def _merge_calls(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call index: a call's pieces within one chunk joined."""
    merged: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        call = merged.get(delta["index"])
        if call is None:
            merged[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            function = call["function"]
            function["arguments"] = function.get("arguments", "") + delta["function"]["arguments"]
    return list(merged.values())


class ChoiceShaper:
    def __init__(self, plan: ChatOutputPlan) -> None:
        self._plan = plan
        self._reasoning: ReasoningStream | None = (
            plan.reasoning.stream(plan.prompt_closed) if plan.reasoning is not None else None)
        self._tools: ToolCallStream | None = plan.tools.stream()

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The streamed delta of one output's text (the last one flushes what was held back)."""
        reasoning, content = self._reasoning.push(text) if self._reasoning is not None else ("", text)
        if finished and self._reasoning is not None:
            held_reasoning, held_content = self._reasoning.finish()
            reasoning, content = reasoning + held_reasoning, content + held_content
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            content, calls = self._tools.push(content)
            if finished:
                c, more = self._tools.finish()
                content, calls = content + c, calls + more
        delta: dict[str, Any] = {}
        if reasoning and self._plan.include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = _merge_calls(calls)
        return delta

    def message(self, role: str, text: str, echoed: str = "") -> dict[str, Any]:
        """The whole reply as a chat message."""
        plan = self._plan
        reasoning, content = None, text
        if plan.reasoning is not None:
            reasoning, content = plan.reasoning.stream(plan.prompt_closed).split(text)
        calls: list[dict[str, Any]] = []
        stream = plan.tools.stream()
        if stream is not None:
            content, calls = stream.parse(content or "")
        if echoed:
            content = echoed + (content or "")
        message: dict[str, Any] = {"role": role, "content": content}
        if plan.reasoning is not None:
            shown = reasoning if plan.include_reasoning else None
            message["reasoning"] = message["reasoning_content"] = shown
        if calls:
            message["tool_calls"] = calls
        return message

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's: tool_calls when the model called tools (auto or required) and stopped by
        itself; a named choice keeps stop, as OpenAI's forced calls do."""
        if reason == "stop" and called and self._plan.tools.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    @property
    def called(self) -> bool:
        """Whether the streamed output has started a tool call."""
        return self._tools is not None and any(c.announced for c in self._tools.calls)
