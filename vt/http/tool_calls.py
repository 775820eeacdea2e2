"""Tool calling: `tools`, `tool_choice` and `parallel_tool_calls` -> a ToolPlan, and model text ->
OpenAI `tool_calls`, whole or as streamed deltas.

- `none`: the template still sees the tools; the output is plain content.
- `auto` (needs `--enable-auto-tool-choice --tool-call-parser hermes`): the model writes Qwen3's
  (Hermes') `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the text before the
  first call is the content, each call becomes a tool call. A call that is not JSON leaves the
  whole text as content, as vLLM does.
- `required` and a named function are enforced by a grammar, so they always parse: required
  makes the output a JSON array of `{"name": <one of the tools>, "parameters": {...}}` (at most
  one element when parallel_tool_calls is false), a named choice makes it the function's
  arguments object. This is vLLM's encoding.

Arguments are the model's JSON text as written, in the streamed deltas and in whole messages
alike (one scanner reads both), so a client that concatenates the deltas gets the same string.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from vt.http.json_scan import ObjectScanner
from vt.http.protocol import ProtocolError
from vt.http.structured_fields import json_text
from vt.structured.compiler import close_objects
from vt.structured.spec import GrammarSpec

PARSERS = ("hermes",)
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: str                                   # none | auto | required | named
    names: tuple[str, ...] = ()
    named: str | None = None                    # the function a named choice forces
    parallel: bool = True
    grammar: GrammarSpec | None = None          # required / named: the output's grammar

    def stream(self) -> ToolCallStream | None:
        if self.mode == "none":
            return None
        kind = {"auto": "hermes", "required": "array", "named": "named"}[self.mode]
        return ToolCallStream(kind, self.named, self.parallel)


def _check_tools(tools: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    """The function definitions of `tools`; ProtocolError naming `tools` for a malformed one."""
    out = []
    for i, tool in enumerate(tools):
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise ProtocolError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ProtocolError(f"tools[{i}].function.name must be a non-empty string", "tools")
        params = function.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ProtocolError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise ProtocolError(f"tools[{i}].function.strict must be a boolean", "tools")
        out.append(function)
    names = [function["name"] for function in out]
    if len(set(names)) != len(names):
        raise ProtocolError("tools must have distinct function names", "tools")
    return out


_NOT_OBJECT_ONLY = ("type", "anyOf", "oneOf", "allOf", "not", "$ref", "enum", "const")
_DEFS = ("$defs", "definitions")


def _parameters(function: dict[str, Any]) -> Any:
    """A function's arguments schema. Arguments are always a JSON object (OpenAI's), so no
    parameters (or `{}`) is the empty object, and a schema that says nothing of the type is an
    object schema: left alone, a grammar would also allow `true` or `[1]` as the arguments."""
    params = function.get("parameters")
    if not params:
        return _NO_PARAMETERS
    if not any(k in params for k in _NOT_OBJECT_ONLY):
        params = {**params, "type": "object"}
    return close_objects(params) if function.get("strict") else params


def _required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The array of calls that tool_choice required makes the output. Each function's `$defs`
    (and older `definitions`) move to the array's root, where their `#/$defs/...` references
    resolve once the schema is nested (pydantic writes them for every nested model or enum)."""
    defs: dict[str, dict[str, Any]] = {}
    calls = []
    for function in functions:
        params = _parameters(function)
        if any(k in params for k in _DEFS):
            params = dict(params)
            for key in _DEFS:
                for name, sub in (params.pop(key, None) or {}).items():
                    if defs.setdefault(key, {}).setdefault(name, sub) != sub:
                        raise ProtocolError(f"tools define {key}/{name} differently; tool_choice 'required' "
                                            f"needs one definition of each name", "tools")
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [function["name"]]},
                                     "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_plan(body: dict[str, Any], tools: tuple[dict[str, Any], ...] | None,
                    auto_tool_choice: bool) -> ToolPlan:
    """tools (already read with the template controls), tool_choice and parallel_tool_calls.
    auto_tool_choice: the server runs a tool-call parser (--enable-auto-tool-choice)."""
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ProtocolError(f"'parallel_tool_calls' must be a boolean, got {parallel!r}",
                            "parallel_tool_calls")
    parallel = parallel is not False
    functions = _check_tools(tools or ())
    names = tuple(function["name"] for function in functions)
    choice = body.get("tool_choice")
    if choice is None:  # vLLM's default: auto with tools (a 400 where the server parses none)
        choice = "auto" if functions else "none"
    if choice == "none":
        return ToolPlan("none", names, parallel=parallel)
    if choice == "auto":
        if not functions:
            return ToolPlan("none", parallel=parallel)
        if not auto_tool_choice:
            raise ProtocolError("tool_choice 'auto' (the default when tools are given) needs a server "
                                "started with --enable-auto-tool-choice --tool-call-parser hermes; "
                                "tool_choice 'none' gives the template the tools without parsing calls",
                                "tool_choice")
        return ToolPlan("auto", names, parallel=parallel)
    if not functions:
        raise ProtocolError("tool_choice other than 'none' or 'auto' needs 'tools'", "tool_choice")
    if choice == "required":
        spec = GrammarSpec("json", json_text(_required_schema(functions, parallel), "tools"))
        return ToolPlan("required", names, parallel=parallel, grammar=spec)
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ProtocolError("tool_choice must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if name not in names:
            raise ProtocolError(f"tool_choice names the function {name!r}, which is not in tools",
                                "tool_choice")
        target = functions[names.index(name)]
        spec = GrammarSpec("json", json_text(_parameters(target), "tools"))
        return ToolPlan("named", names, named=name, parallel=parallel, grammar=spec)
    raise ProtocolError(f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r}",
                        "tool_choice")


@dataclass
class ToolCall:
    index: int
    id: str
    name: str | None = None
    scan: ObjectScanner | None = None   # the call's JSON object (None: the text is the arguments)
    arguments: str = ""                 # the arguments text sent so far
    announced: bool = False             # its first delta (id, type, name) was sent
    complete: bool = False

    def current_arguments(self, args_key: str) -> str:
        """The arguments text so far: always a prefix of the final one."""
        if self.scan is None:
            return self.arguments
        got = self.scan.raw(args_key)
        if got is None:
            return "{}" if self.complete else ""
        raw, whole = got
        if raw.startswith('"'):  # arguments written as a JSON string: its text, once whole
            return orjson.loads(raw) if whole else ""
        return raw

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _holdback(text: str, tag: str) -> int:
    """Length of the longest end of text that could begin tag (held back until it can tell)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _hermes_call(scan: ObjectScanner) -> tuple[str, str] | None:
    """(name, arguments) of a closed `<tool_call>` object, or None if it is not a call: no
    string name, or arguments that are not a JSON object. Arguments are the model's text as
    written ("parameters" is read where "arguments" is missing, "{}" where both are)."""
    name = scan.string("name")
    if name is None:
        return None
    got = scan.raw("arguments") or scan.raw("parameters")
    args = "{}" if got is None else got[0]
    try:
        if args.startswith('"'):  # arguments written as a JSON string of the object
            args = orjson.loads(args)
        if not isinstance(orjson.loads(args), dict):
            return None
    except (orjson.JSONDecodeError, TypeError):
        return None
    return name, args


class ToolCallStream:
    """Content text in -> (content delta, tool-call deltas) out, for one choice.

    kind hermes: <tool_call>{...}</tool_call> blocks after free text; array: a JSON array of
    {"name", "parameters"} objects; named: the whole text is one call's arguments.

    What the deltas add up to is the whole message (`parse` is the stream run on the whole
    text), and text that was meant as a call but is not one is content, never dropped. (hermes
    keeps vLLM's rule for text around calls: content is what comes before the first call.)
    - hermes (auto): a call is sent whole, once its object has closed and holds a string name
      and an arguments object. The model's text is not grammar-bound here, so a call could turn
      out not to be one at any character; sending it only once it is known keeps every sent call
      valid and lets a failed one fall back to content. A text that is not a call leaves it and
      all that follows as content, as vLLM does.
    - array (required) and named: the grammar guarantees the syntax, so arguments stream as
      they are written. Only max_tokens can cut them: the calls so far keep their partial
      arguments (finish_reason "length"), and an output cut before any call had its name is
      content.
    """

    def __init__(self, kind: str, named: str | None = None, parallel: bool = True) -> None:
        self.kind = kind
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.failed = False          # a call was not one: the text is content from there on
        self._args_key = "parameters" if kind == "array" else "arguments"
        self._pending = ""           # hermes: text not yet classified (a tag may be starting)
        self._scan: ObjectScanner | None = None  # hermes: the open call's object
        self._state = "text" if kind == "hermes" else "between"
        self._raw: list[str] = []    # array / named: the text so far, content if no call comes
        if kind == "named":
            self.calls.append(ToolCall(0, _call_id(), named))
            self._state = "args"

    # ---- streaming ----------------------------------------------------------------------------
    def push(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.failed:
            return text, []
        if self.kind == "hermes":
            content = self._hermes(text)
            return content, self._whole_calls()
        self._raw.append(text)
        if self.kind == "named":
            return "", self._named(text)
        content = self._array(text)
        return content, self._deltas()

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the output: what was held back, and the last deltas."""
        if self.failed:
            return "", []
        if self.kind == "hermes":
            content, self._pending = self._pending, ""
            if self._state == "call":  # cut inside a call: it never was one
                return CALL_START + (self._scan.text if self._scan else "") + content, []
            return (content if self._state == "text" else ""), []
        deltas = self._deltas() if self.kind == "array" else []
        if not any(c.announced for c in self.calls):
            raw = "".join(self._raw)
            return (raw if raw.strip() else ""), deltas
        return "", deltas

    def _named(self, text: str) -> list[dict[str, Any]]:
        call = self.calls[0]
        if not call.arguments:
            text = text.lstrip()
            if not text:  # nothing written yet (or only reasoning so far): nothing to announce
                return []
        call.arguments += text
        if not call.announced:
            call.announced = True
            return [{"index": 0, "id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": text}}]
        return [{"index": 0, "function": {"arguments": text}}]

    def _hermes(self, text: str) -> str:
        out = []
        rest = self._pending + text
        self._pending = ""
        while rest:
            if self._state == "text" or self._state == "between":
                i = rest.find(CALL_START)
                if i < 0:
                    keep = _holdback(rest, CALL_START)
                    if self._state == "text":
                        out.append(rest[: len(rest) - keep])
                    self._pending = rest[len(rest) - keep:]
                    break
                if self._state == "text":
                    out.append(rest[:i])
                rest = rest[i + len(CALL_START):]
                if not self.parallel and self.calls:
                    self._state = "skip"
                    continue
                self._scan = ObjectScanner()
                self._state = "call"
            elif self._state == "call":
                scan = self._scan
                assert scan is not None
                rest = rest[scan.feed(rest):]
                if not scan.closed and not scan.invalid:
                    break
                call = None if scan.invalid else _hermes_call(scan)
                if call is None:  # not a call after all: it and all that follows is content
                    self.failed = True
                    out.append(CALL_START + scan.text + rest)
                    break
                name, args = call
                self.calls.append(ToolCall(len(self.calls), _call_id(), name, arguments=args,
                                           announced=False, complete=True))
                self._state = "close"
            else:  # close / skip: text up to </tool_call> is dropped
                i = rest.find(CALL_END)
                if i < 0:
                    self._pending = rest[len(rest) - _holdback(rest, CALL_END):]
                    break
                rest = rest[i + len(CALL_END):]
                self._state = "between"
        return "".join(out)

    def _whole_calls(self) -> list[dict[str, Any]]:
        """hermes: the calls completed since the last push, each as one whole delta."""
        out = []
        for call in self.calls:
            if not call.announced:
                call.announced = True
                out.append({"index": call.index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments}})
        return out

    def _array(self, text: str) -> str:
        rest = text
        while rest and not self.failed:
            if self._state == "call":
                rest = self._feed_call(rest)
                continue
            c, rest = rest[0], rest[1:]
            if c == "{" and self._state == "between":
                self.calls.append(ToolCall(len(self.calls), _call_id(), scan=ObjectScanner()))
                self._state = "call"
                rest = "{" + rest
            elif c not in " \t\r\n[],":
                self.failed = True
                return c + rest  # the grammar allows no such text: from here on it is content
        return ""

    def _feed_call(self, text: str) -> str:
        """Feed the open call's object; returns the text after it once it closed."""
        call = self.calls[-1]
        scan = call.scan
        assert scan is not None
        used = scan.feed(text)
        if scan.invalid:
            self.failed = True
            return text[used:]
        if call.name is None:
            call.name = scan.string("name")
        if scan.closed:
            call.complete = True
            self._state = "between"
            return text[used:]
        return ""

    def _deltas(self) -> list[dict[str, Any]]:
        out = []
        for call in self.calls:
            if call.name is None:
                continue
            args = call.current_arguments(self._args_key)
            if call.announced and args == call.arguments:
                continue
            new = args[len(call.arguments):]
            call.arguments = args
            if not call.announced:
                call.announced = True
                out.append({"index": call.index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": new}})
            elif new:
                out.append({"index": call.index, "function": {"arguments": new}})
        return out

    # ---- whole outputs ------------------------------------------------------------------------
    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """A whole output -> (content, tool calls): what the streamed deltas add up to."""
        content, _ = self.push(text)
        more, _ = self.finish()
        return (content + more) or None, [c.message() for c in self.calls if c.announced]


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"
