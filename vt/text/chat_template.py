"""Chat templates: compiled in a bounded jinja2 sandbox (template_sandbox.py) and rendered as
transformers' `apply_chat_template` renders them (tools, extra variables, `continue_final_message`),
and `--chat-template` values read as vLLM reads them (a file, or the template itself).

Whatever a template does wrong (a syntax error, `{{ 1/0 }}`, a loop past the sandbox's range, a
value past its bounds, `raise_exception`) is a ChatTemplateError: a one-line reason, never a
traceback. Rendering only makes text; the caller encodes it (special tokens are in the text
already).
"""

from __future__ import annotations

import codecs
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from vt.text.template_sandbox import new_environment

# Marks the end of the final message so the rendered prompt can be cut there (transformers' way):
# whatever the template writes after the message (end-of-turn tokens) is dropped.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# A message's reasoning travels under several names; templates read one or another.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_JINJA_CHARS = "{}\n"
COMPILED_CACHE_SIZE = 16  # templates kept compiled: the model's, --chat-template's, recent request ones
CHECK_TIMEOUT_S = 2.0     # a template's check at start-up (check_template)
MAX_REASON_CHARS = 300
# The conversations a template is checked with: any chat template renders them.
_HELLO = {"role": "user", "content": "Hello"}
CHECK_CONVERSATIONS = (([_HELLO], True), ([_HELLO, {"role": "assistant", "content": "Hi"}], False))
T = TypeVar("T")


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or failed while rendering; `param` names
    the request field at fault ("chat_template" for a request's own template)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


def reason(e: BaseException) -> str:
    """What went wrong, on one line: the exception's message (its type where it has none)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else type(e).__name__
    if isinstance(e, (ArithmeticError, LookupError, TypeError, AttributeError, RecursionError)):
        text = f"{type(e).__name__}: {text}"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


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


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template error: {message}")


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
        if self._env is None:
            self._env = new_environment(_raise_exception)
        try:
            compiled = self._env.from_string(source)
        except Exception as e:  # a syntax error, or Python refusing what Jinja generated from it
            raise ChatTemplateError(f"chat template does not compile: {reason(e)}") from None
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


def check_controls(messages: Any, add_generation_prompt: bool, continue_final_message: bool) -> None:
    """ChatTemplateError for messages and controls no template can render, whatever it is."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) for m in messages):
        raise ChatTemplateError("messages must be a list of objects")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true")


def render_chat(compiled: Any, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
                variables: Mapping[str, Any] | None = None) -> str:
    """The prompt text of `messages`. With continue_final_message the prompt ends inside the final
    message, right after its content, so the model continues it."""
    check_controls(messages, add_generation_prompt, continue_final_message)
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
    except (ChatTemplateError, MemoryError):
        raise  # a MemoryError is the caller's to report: it bounds the memory
    except Exception as e:  # whatever the template's code raised is the template's error
        raise ChatTemplateError(f"chat template failed to render: {reason(e)}") from None
    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if tag not in text or final.strip() not in text:
            raise ChatTemplateError("continue_final_message: the template does not write the final message's "
                                    "content as given, so the prompt cannot end inside it")
        at = text.rindex(tag)
        # a template that strips the message's trailing space strips the tag's too
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text


def _with_deadline(fn: Callable[[], T], timeout_s: float) -> T:
    """fn() stopped with a ChatTemplateError once it has run for timeout_s (checked at each Python
    call and line: a template's loops are Python code)."""
    deadline = time.monotonic() + timeout_s

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"chat template ran for more than {timeout_s:g} s")
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(previous)


def check_template(compiled: Any, variables: Mapping[str, Any] | None = None,
                   timeout_s: float = CHECK_TIMEOUT_S) -> str | None:
    """Why a template cannot render a plain conversation (a user turn; a user and an assistant
    turn), or None: a model's or --chat-template's template is checked so at start-up, where a
    broken one is reported instead of failing every chat request unexplained."""
    try:
        for messages, prompt in CHECK_CONVERSATIONS:
            _with_deadline(lambda m=messages, p=prompt: render_chat(compiled, m, add_generation_prompt=p,
                                                                    variables=variables), timeout_s)
    except ChatTemplateError as e:
        return str(e)
    except Exception as e:  # a bound hit outside the template's own frames
        return f"chat template failed to render: {reason(e)}"
    return None
