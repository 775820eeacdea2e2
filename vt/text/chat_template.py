"""Chat templates: compiled in a jinja2 sandbox and rendered as transformers' `apply_chat_template`
renders them (tools, extra variables, `continue_final_message`), and `--chat-template` values read
as vLLM reads them (a file, or the template itself).

Rendering only makes text; the caller encodes it (special tokens are in the text already).
"""

from __future__ import annotations

import codecs
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

# Marks the end of the final message so the rendered prompt can be cut there (transformers' way):
# whatever the template writes after the message (end-of-turn tokens) is dropped.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# A message's reasoning travels under several names; templates read one or another.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_JINJA_CHARS = "{}\n"
COMPILED_CACHE_SIZE = 16  # templates kept compiled: the model's, --chat-template's, recent request ones


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or failed while rendering."""


def load_chat_template(value: str) -> str:
    """A `--chat-template` value: the text of the file it names, or else the template itself (with
    backslash escapes such as \\n read as vLLM reads them). A value with no template characters
    that names no readable file is an error rather than a one-line template."""
    path = Path(value)
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ChatTemplateError(f"--chat-template {value!r} looks like a file path, but it cannot be "
                                    f"read: {e}") from None
    return codecs.decode(value.encode("latin-1", "backslashreplace"), "unicode_escape")


def _environment() -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(f"chat template error: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class TemplateCache:
    """Compiled templates by source, least recently used dropped first."""

    def __init__(self, size: int = COMPILED_CACHE_SIZE) -> None:
        self._size = size
        self._env: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def get(self, source: str) -> Any:
        compiled = self._compiled.get(source)
        if compiled is not None:
            self._compiled.move_to_end(source)
            return compiled
        import jinja2

        if self._env is None:
            self._env = _environment()
        try:
            compiled = self._env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self._compiled[source] = compiled
        if len(self._compiled) > self._size:
            self._compiled.popitem(last=False)
        return compiled


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fresh message dicts as transformers hands them to a template: keys whose value is None
    dropped, reasoning under each of its names."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def render_chat(compiled: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                variables: Mapping[str, Any] | None = None) -> str:
    """The prompt text of `messages`. With continue_final_message the prompt ends inside the final
    message, right after its content, so the model continues it."""
    import jinja2

    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        raise ChatTemplateError("messages must be a list of objects")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")
    chat = _template_messages(messages)
    final = ""
    if continue_final_message:
        if not chat or not isinstance(chat[-1].get("content"), str):
            raise ChatTemplateError("continue_final_message needs a final message with text content")
        final = chat[-1]["content"]
        chat[-1]["content"] = final + _CONTINUE_TAG
    context = {**(variables or {}), "messages": chat, "tools": list(tools) if tools is not None else None,
               "documents": None, "add_generation_prompt": add_generation_prompt}
    try:
        text = compiled.render(**context)
    except ChatTemplateError:
        raise
    except (jinja2.TemplateError, TypeError, KeyError, AttributeError, ValueError) as e:
        raise ChatTemplateError(f"chat template failed to render: {e}") from e
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if tag not in text or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the template does not write the final message's "
                                    "content as given, so the prompt cannot end inside it")
        at = text.rindex(tag)
        # a template that strips the message's trailing space strips the tag's too
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
