"""Structured outputs, tool calls and reasoning at the API: request fields -> grammar specs,
tool_choice -> a plan, model text -> reasoning_content, content and tool_calls (whole or as
streamed deltas), against the scripted fake engine of test_openai_api."""

from __future__ import annotations

import json
import random

import orjson
import pytest

from tests.unit.test_openai_api import CHAT, COMPLETION, CharTokenizer, FakeEngine, call, jbody, read_sse
from vt.http.api_options import ApiOptions
from vt.http.openai_api import OpenAIApp
from vt.http.protocol import ProtocolError
from vt.http.reasoning import ReasoningParser, ReasoningStream
from vt.http.structured_fields import parse_structured_fields
from vt.http.tool_calls import ToolCallStream, parse_tool_plan
from vt.structured.compiler import close_objects
from vt.structured.spec import DEFAULT_JSON_WHITESPACE, GrammarSpec, StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = orjson.dumps(SCHEMA).decode()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "ping"}}]


# --- request fields -> grammar specs ------------------------------------------------------------

@pytest.mark.parametrize("fields, spec, param", [
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object"), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     GrammarSpec("json", SCHEMA_TEXT), "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     GrammarSpec("json", SCHEMA_TEXT, strict=True), "response_format"),
    ({"structured_outputs": {"json": SCHEMA_TEXT}}, GrammarSpec("json", SCHEMA_TEXT), "structured_outputs"),
    ({"structured_outputs": {"regex": "[0-9]+", "disable_any_whitespace": True}},
     GrammarSpec("regex", "[0-9]+", whitespace=""), "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec("choice", '["a","b"]'),
     "structured_outputs"),
    ({"structured_outputs": {"grammar": "start: \"x\"", "json": None}},
     GrammarSpec("grammar", "start: \"x\""), "structured_outputs"),
    ({"response_format": {"type": "json_object"}},
     GrammarSpec("json_object", whitespace=DEFAULT_JSON_WHITESPACE), "response_format"),
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " ?"}},
     GrammarSpec("json_object", whitespace=" ?"), "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
     GrammarSpec("json", SCHEMA_TEXT, strict=True), "structured_outputs"),
    ({"guided_json": SCHEMA}, GrammarSpec("json", SCHEMA_TEXT), "guided_json"),
    ({"guided_json": json.dumps(SCHEMA), "guided_whitespace_pattern": "[ ]?"},
     GrammarSpec("json", SCHEMA_TEXT, whitespace="[ ]?"), "guided_json"),
    ({"guided_regex": "a+"}, GrammarSpec("regex", "a+"), "guided_regex"),
    ({"guided_choice": ["x"]}, GrammarSpec("choice", '["x"]'), "guided_choice"),
    ({"guided_grammar": "root ::= \"a\""}, GrammarSpec("grammar", "root ::= \"a\""), "guided_grammar"),
])
def test_every_spelling_gives_its_grammar(fields, spec, param):
    got = parse_structured_fields(fields)
    assert got.spec == spec and got.param == param


@pytest.mark.parametrize("fields", [{}, {"response_format": {"type": "text"}}, {"response_format": None},
                                    {"structured_outputs": None, "guided_json": None}])
def test_no_constraint(fields):
    assert parse_structured_fields(fields) is None


@pytest.mark.parametrize("fields, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format"),
    # no name
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}}, "response_format"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": 1}}, "structured_outputs"),
    ({"guided_json": "{oops"}, "guided_json"),
    ({"guided_json": [1, 2]}, "guided_json"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": "a", "guided_whitespace_pattern": 3}, "guided_whitespace_pattern"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_malformed_or_doubled_constraints_name_the_field(fields, param):
    with pytest.raises(ProtocolError) as e:
        parse_structured_fields(fields)
    assert e.value.param == param


def test_strict_closes_every_object_schema_but_leaves_property_names_alone():
    schema = {"type": "object", "properties": {
        "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "type": {"type": "string"},
        "list": {"type": "array", "items": {"type": "object"}},
        "open": {"type": "object", "additionalProperties": True},
        "either": {"anyOf": [{"type": "object", "properties": {}}, {"type": "null"}]}},
        "$defs": {"d": {"properties": {"y": {}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert props["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in props["type"]
    assert props["list"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in props["either"]["anyOf"][1]
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


# --- the routes carry the grammar to the engine ---------------------------------------------------

def make_app(engine: FakeEngine, **options) -> OpenAIApp:
    return OpenAIApp(engine, "tiny-model", options=ApiOptions(**options))


async def test_completions_compile_then_carry_the_grammar():
    engine = FakeEngine()
    resp = await call(make_app(engine), "POST", "/v1/completions",
                      {**COMPLETION, "n": 2, "guided_regex": "[a-z]+"})
    assert resp.status == 200, resp.body
    spec = GrammarSpec("regex", "[a-z]+")
    assert engine.grammars == [spec]
    assert [c.params.structured for c in engine.calls] == [StructuredOutput(spec)] * 2


async def test_a_grammar_that_does_not_compile_is_a_400_naming_the_field():
    from vt.structured.compiler import GrammarError

    engine = FakeEngine()

    async def refuse(spec):
        raise GrammarError("Invalid type: foo")

    engine.compile_grammar = refuse
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    resp = await call(make_app(engine), "POST", "/v1/chat/completions", {**CHAT, "response_format": bad})
    assert resp.status == 400
    err = jbody(resp)["error"]
    assert err["param"] == "response_format" and "Invalid type: foo" in err["message"]
    assert engine.calls == []


# --- tool_choice -> plan ----------------------------------------------------------------------------

def test_tool_plans():
    tools = tuple(TOOLS)
    with pytest.raises(ProtocolError, match="default when tools are given"):  # auto, as vLLM's
        parse_tool_plan({}, tools, auto_tool_choice=False)
    assert parse_tool_plan({"tool_choice": "none"}, tools, auto_tool_choice=False).mode == "none"
    assert parse_tool_plan({}, tools, auto_tool_choice=True).mode == "auto"
    assert parse_tool_plan({"tool_choice": "auto"}, None, auto_tool_choice=False).mode == "none"
    required = parse_tool_plan({"tool_choice": "required", "parallel_tool_calls": False}, tools, False)
    schema = json.loads(required.grammar.text)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["get_weather"], ["ping"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {
        "type": "object", "properties": {}, "additionalProperties": False}  # no parameters: {}
    choose = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    named = parse_tool_plan(choose, tools, False)
    assert named.mode == "named" and named.named == "get_weather"
    assert json.loads(named.grammar.text) == TOOLS[0]["function"]["parameters"]
    # no parameters or {} is the empty object, a schema silent on the type an object schema
    loose = ({"type": "function", "function": {"name": "now", "parameters": {}}},
             {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {}}}}})
    for name, want in (("now", {"type": "object", "properties": {}, "additionalProperties": False}),
                       ("f", {"properties": {"a": {}}, "type": "object"})):
        choice = {"tool_choice": {"type": "function", "function": {"name": name}}}
        plan = parse_tool_plan(choice, loose, False)
        assert json.loads(plan.grammar.text) == want
    strict = ({"type": "function", "function": {**TOOLS[0]["function"], "strict": True}},)
    named = parse_tool_plan(choose, strict, False)
    assert json.loads(named.grammar.text)["additionalProperties"] is False


@pytest.mark.parametrize("body, tools, param", [
    ({"tool_choice": "auto"}, TOOLS, "tool_choice"),                # no parser on this server
    ({"tool_choice": "required"}, None, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, TOOLS, "tool_choice"),
    ({"tool_choice": {"function": "get_weather"}}, TOOLS, "tool_choice"),
    ({"tool_choice": "sometimes"}, TOOLS, "tool_choice"),
    ({"parallel_tool_calls": "no"}, TOOLS, "parallel_tool_calls"),
    ({}, [{"type": "retrieval"}], "tools"),
    ({}, [{"type": "function", "function": {"name": ""}}], "tools"),
    ({}, [{"type": "function", "function": {"name": "f", "parameters": "x"}}], "tools"),
    ({}, [{"type": "function", "function": {"name": "f"}}] * 2, "tools"),
])
def test_bad_tool_fields_name_the_field(body, tools, param):
    with pytest.raises(ProtocolError) as e:
        parse_tool_plan(body, tuple(tools) if tools else None, auto_tool_choice=False)
    assert e.value.param == param


def test_required_moves_each_tools_defs_to_the_root():
    """pydantic's nested models and enums come as $defs with #/$defs/... references, which only
    resolve at the schema's root; a name defined twice differently is a 400 naming tools."""
    color = {"enum": ["red", "blue"], "type": "string"}

    def tool(name, defs):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"c": {"$ref": "#/$defs/Color"}}, "required": ["c"],
            "$defs": defs}}}

    plan = parse_tool_plan({"tool_choice": "required"}, (tool("paint", {"Color": color}),
                                                         tool("dye", {"Color": color})), False)
    schema = json.loads(plan.grammar.text)
    assert schema["$defs"] == {"Color": color}
    assert all("$defs" not in c["properties"]["parameters"] for c in schema["items"]["anyOf"])
    with pytest.raises(ProtocolError) as e:
        parse_tool_plan({"tool_choice": "required"}, (tool("paint", {"Color": color}),
                                                      tool("dye", {"Color": {"enum": ["x"]}})), False)
    assert e.value.param == "tools"


# --- model text -> tool calls -------------------------------------------------------------------

def _streamed(stream: ToolCallStream, text: str, cuts: list[int]) -> tuple[str, dict[int, dict]]:
    """Feed text in pieces; (content, {index: {"id", "name", "arguments"}}) as a client adds them up."""
    content, calls = [], {}
    bounds = [0, *cuts, len(text)]
    pieces = [stream.push(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [stream.finish()]
    for c, deltas in pieces:
        content.append(c)
        for d in deltas:
            entry = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert entry["id"] is None, "a call's id and name come once"
                entry["id"], entry["name"] = d["id"], d["function"]["name"]
            entry["arguments"] += d["function"]["arguments"]
    return "".join(content), calls


HERMES = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris", '
          '"days": [1, 2]}}\n</tool_call>\n'
          '<tool_call>{"arguments": "{\\"q\\": 1}", "name": "ping"}</tool_call>')


@pytest.mark.parametrize("kind, text, content, calls", [
    ("hermes", HERMES, "Let me look.",
     [("get_weather", '{"city": "Pa\\"ris", "days": [1, 2]}'), ("ping", '{"q": 1}')]),
    ("hermes", "no calls here, <tool but not a tag", "no calls here, <tool but not a tag", []),
    ("array", ' [ {"name": "ping", "parameters": {}},\n{"name": "get_weather", "parameters": {"city": "x"}}]',
     None, [("ping", "{}"), ("get_weather", '{"city": "x"}')]),
    ("named", '  {"city": "Lyon"}', None, [("get_weather", '{"city": "Lyon"}')]),
    # text that names the tag, or a call that is not one: all of it is content, streamed or not
    ("hermes", "use <tool_call> tags", "use <tool_call> tags", []),
    ("hermes", 'Hi <tool_call>{"name": "search", "arguments": {"query": }}</tool_call>',
     'Hi <tool_call>{"name": "search", "arguments": {"query": }}</tool_call>', []),
    ("hermes", '<tool_call>[{"name": "ping"}]</tool_call>', '<tool_call>[{"name": "ping"}]</tool_call>', []),
    ("hermes", '<tool_call>{"arguments": {"q": 1}}</tool_call> more',
     '<tool_call>{"arguments": {"q": 1}}</tool_call> more', []),
    ("hermes", '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
     '<tool_call>{"name": 7, "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>',
     '<tool_call>{"name": "ping", "arguments": [1]}</tool_call>', []),
    # a first call stands; the failed second one and what follows are content
    ("hermes", '<tool_call>{"name": "ping", "arguments": {}}</tool_call><tool_call>oops',
     "<tool_call>oops", [("ping", "{}")]),
    # "parameters" for "arguments", and no arguments at all
    ("hermes", '<tool_call>{"name": "ping", "parameters": {"a": 1}}</tool_call>', None,
     [("ping", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", "{}")]),
    # cut by max_tokens: inside a hermes call, it is content; a required array keeps the calls
    # so far, partial arguments included, and is content if no call had its name yet
    ("hermes", 'ok <tool_call>{"name": "ping", "argu', 'ok <tool_call>{"name": "ping", "argu', []),
    ("array", '[{"name": "get_weather", "parameters": {"ci', None, [("get_weather", '{"ci')]),
    ("array", '[{"name": "get_wea', '[{"name": "get_wea', []),
    ("named", "  ", None, []),
])
def test_streamed_tool_calls_add_up_to_the_whole_message(kind, text, content, calls):
    whole_content, whole = ToolCallStream(kind, "get_weather").parse(text)
    assert whole_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole] == calls
    rng = random.Random(kind)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(6, len(text) - 1)))
        got_content, got = _streamed(ToolCallStream(kind, "get_weather"), text, cuts)
        assert got_content == (content or "")
        assert [(c["name"], c["arguments"]) for c in got.values()] == calls
        assert all(c["id"].startswith("chatcmpl-tool-") for c in got.values())


def test_a_call_that_is_not_json_leaves_the_text_as_content():
    text = "Sure.<tool_call>get_weather(city=Paris)</tool_call>"
    assert ToolCallStream("hermes").parse(text) == (text, [])
    unclosed = 'Sure.<tool_call>{"name": "ping", "arguments": {'
    assert ToolCallStream("hermes").parse(unclosed) == (unclosed, [])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    _, calls = ToolCallStream("hermes", parallel=False).parse(text)
    assert [c["function"]["name"] for c in calls] == ["a"]


# --- reasoning ------------------------------------------------------------------------------------

class ThinkTokenizer(CharTokenizer):
    ids = {"<think>": 250, "</think>": 251, "<|im_start|>": 252}

    def token_to_id(self, token: str) -> int | None:
        return self.ids.get(token, super().token_to_id(token))


@pytest.mark.parametrize("text, closed, reasoning, content", [
    ("<think>\nstep one\n</think>\n\nThe answer.", False, "\nstep one\n", "\n\nThe answer."),
    ("step one</think>answer", False, "step one", "answer"),        # <think> came with the prompt
    ("still thinking when cut", False, "still thinking when cut", None),
    ("<think>x</think>", False, "x", None),
    ("The answer.", True, None, "The answer."),                     # the prompt closed the thinking
])
def test_reasoning_splits_whole_and_streamed_alike(text, closed, reasoning, content):
    assert ReasoningStream(not closed).split(text) == (reasoning, content)
    rng = random.Random(text)
    for _ in range(30):
        stream, r, c = ReasoningStream(not closed), [], []
        cuts = sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
        for a, b in zip([0, *cuts], [*cuts, len(text)]):
            dr, dc = stream.push(text[a:b])
            r.append(dr)
            c.append(dc)
        dr, dc = stream.finish()
        assert "".join(r) + dr == (reasoning or "") and "".join(c) + dc == (content or "")


def test_the_prompt_closes_the_thinking_only_in_its_last_turn():
    p = ReasoningParser(ThinkTokenizer())
    assert p.prompt_closed([5, 252, 7, 250, 9, 251, 9])              # enable_thinking false
    assert not p.prompt_closed([5, 252, 7])                          # thinking on: the model opens it
    assert not p.prompt_closed([250, 9, 251, 252, 7])                # an earlier turn's reasoning
    assert not p.prompt_closed([252, 7, 250])                        # a template that opens it
    with pytest.raises(ValueError, match="<think>"):
        ReasoningParser(CharTokenizer())


# --- chat replies -----------------------------------------------------------------------------------

def _chat_engine(*pieces: str) -> FakeEngine:
    return FakeEngine(pieces=pieces, finish="stop", tokenizer=ThinkTokenizer())


async def test_chat_reply_with_reasoning_and_a_tool_call():
    pieces = ("<think>", "weather?", "</think>", "\n\nChecking.", "<tool_call>", '{"name": "get_weather", ',
              '"arguments": {"city": "Oslo"}}', "</tool_call>")
    body = {**CHAT, "tools": TOOLS}
    app = make_app(_chat_engine(*pieces), reasoning_parser="qwen3", tool_call_parser="hermes",
                   enable_auto_tool_choice=True)
    resp = await call(app, "POST", "/v1/chat/completions", body)
    assert resp.status == 200, resp.body
    choice = jbody(resp)["choices"][0]
    msg = choice["message"]
    # the reasoning under both of vLLM's names for it
    assert msg["reasoning"] == msg["reasoning_content"] == "weather?" and msg["content"] == "\n\nChecking."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')]
    assert choice["finish_reason"] == "tool_calls"

    events = await read_sse(await call(app, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0] for e in events if e != "DONE" and e.get("choices")]
    joined = {k: "".join(d["delta"].get(k) or "" for d in deltas) for k in ("reasoning", "reasoning_content",
                                                                                "content")}
    assert joined == {"reasoning": "weather?", "reasoning_content": "weather?", "content": "\n\nChecking."}
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["type"] == "function"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_include_reasoning_false_leaves_the_reasoning_out():
    app = make_app(_chat_engine("<think>", "hmm", "</think>", "Hi."), reasoning_parser="qwen3")
    body = {**CHAT, "include_reasoning": False}
    msg = jbody(await call(app, "POST", "/v1/chat/completions", body))["choices"][0]["message"]
    assert msg["content"] == "Hi." and msg["reasoning"] is None and msg["reasoning_content"] is None
    events = await read_sse(await call(app, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e != "DONE" and e.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == "Hi."
    assert not any("reasoning" in d or "reasoning_content" in d for d in deltas)
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "include_reasoning": "no"})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "include_reasoning"


async def test_a_named_call_starts_only_once_the_reasoning_has_ended():
    """While the model thinks, no call is announced; cut short there, the reply has no call."""
    body = {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    app = make_app(_chat_engine("<think>", "which city", " is it"), reasoning_parser="qwen3")
    events = await read_sse(await call(app, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e != "DONE" and e.get("choices")]
    assert not any(d.get("tool_calls") for d in deltas)
    msg = jbody(await call(app, "POST", "/v1/chat/completions", body))["choices"][0]["message"]
    assert msg["reasoning"] == "which city is it" and "tool_calls" not in msg and msg["content"] is None
    app = make_app(_chat_engine("<think>", "Rome", "</think>", '{"city": "Rome"}'), reasoning_parser="qwen3")
    events = await read_sse(await call(app, "POST", "/v1/chat/completions", {**body, "stream": True}))
    deltas = [e["choices"][0]["delta"] for e in events if e != "DONE" and e.get("choices")]
    first = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    assert all(not d.get("reasoning") for d in deltas[first:])
    args = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", []))
    assert args == '{"city": "Rome"}'


async def test_named_tool_choice_reply_is_the_call():
    engine = _chat_engine('{"city":', ' "Rome"}')
    body = {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    resp = await call(make_app(engine), "POST", "/v1/chat/completions", body)
    choice = jbody(resp)["choices"][0]
    assert choice["message"]["content"] is None and choice["finish_reason"] == "stop"
    call_fn = choice["message"]["tool_calls"][0]["function"]
    assert call_fn == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    assert engine.calls[0].params.structured.grammar.kind == "json"
    conflict = {**body, "response_format": {"type": "json_object"}}
    resp = await call(make_app(_chat_engine("x")), "POST", "/v1/chat/completions", conflict)
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "response_format"


async def test_the_grammar_waits_for_the_end_of_thinking_unless_the_prompt_ended_it():
    engine = _chat_engine("{}")
    app = make_app(engine, reasoning_parser="qwen3")
    body = {**CHAT, "response_format": {"type": "json_object"}}
    await call(app, "POST", "/v1/chat/completions", body)
    assert engine.calls[-1].params.structured.start_after == 251
    closed = {**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
              "response_format": {"type": "json_object"}}
    engine.tokenizer.apply_chat_template = lambda messages, **kw: [252, 7, 250, 251]  # noqa: ARG005
    await call(app, "POST", "/v1/chat/completions", closed)
    assert engine.calls[-1].params.structured.start_after is None
