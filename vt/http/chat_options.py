"""vLLM's chat template controls of a request body, read once for /v1/chat/completions and /tokenize.

`add_generation_prompt`, `continue_final_message`, `chat_template`, `tools` and
`chat_template_kwargs` (the template's own variables, e.g. Qwen3's `enable_thinking`) shape the
prompt; `add_special_tokens` how it is encoded. As in vLLM, a control named inside
`chat_template_kwargs` wins over the top-level field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vt.http.protocol import ProtocolError

KWARGS = "chat_template_kwargs"
# controls that chat_template_kwargs may also carry (vLLM merges them into the same call)
_CONTROLS = ("add_generation_prompt", "continue_final_message", "chat_template", "tools")


@dataclass(frozen=True)
class ChatTemplateOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None             # the request's own template (needs the server's trust)
    tools: tuple[dict[str, Any], ...] | None = None
    variables: dict[str, Any] = field(default_factory=dict)   # chat_template_kwargs less the controls


def _read(source: dict[str, Any], name: str, param: str, kind: type, what: str) -> Any:
    value = source.get(name)
    if value is not None and not isinstance(value, kind):
        raise ProtocolError(f"'{name}' must be {what}, got {value!r}", param)
    return value


def parse_template_options(body: dict[str, Any]) -> ChatTemplateOptions:
    kwargs = body.get(KWARGS)
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise ProtocolError(f"'{KWARGS}' must be an object, got {kwargs!r}", KWARGS)
    if "messages" in kwargs:
        raise ProtocolError(f"'{KWARGS}' must not carry 'messages'", KWARGS)
    values: dict[str, Any] = {}
    for name, kind, what in (("add_generation_prompt", bool, "a boolean"),
                             ("continue_final_message", bool, "a boolean"),
                             ("chat_template", str, "a string"), ("tools", list, "a list of objects")):
        source, param = (kwargs, KWARGS) if kwargs.get(name) is not None else (body, name)
        values[name] = _read(source, name, param, kind, what)
    tools = values["tools"]
    if tools is not None and not all(isinstance(t, dict) for t in tools):
        raise ProtocolError("'tools' must be a list of objects", "tools")
    add_generation_prompt = values["add_generation_prompt"] is not False  # default true
    continue_final = bool(values["continue_final_message"])
    if continue_final and add_generation_prompt:
        raise ProtocolError("'continue_final_message' and 'add_generation_prompt' cannot both be true; "
                            "set add_generation_prompt to false to continue the final message",
                            "continue_final_message")
    add_special = _read(body, "add_special_tokens", "add_special_tokens", bool, "a boolean")
    return ChatTemplateOptions(
        add_generation_prompt=add_generation_prompt, continue_final_message=continue_final,
        add_special_tokens=bool(add_special), chat_template=values["chat_template"],
        tools=tuple(tools) if tools is not None else None,
        variables={name: value for name, value in kwargs.items() if name not in _CONTROLS})
