"""Structured outputs, tool calls and reasoning through the real `vt serve` (official openai client).

The checkpoint is the tiny random model with Qwen3's <think> and <tool_call> tokens and a
Qwen3-shaped chat template; sampling is seeded at temperature 1, so only the grammar keeps the
output in shape. Acceptance: 200 JSON-schema replies all validate; regex and choice likewise;
named and required tool choices always give calls with valid arguments; async scheduling on and
off give the same tokens over a batch of guided and free requests.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.e2e.conftest import REPO_ROOT, start_server
from tests.e2e.test_reliability import wait_idle
from vt.model.make_model import make_model
from vt.structured.matchers import MAX_ITEMS_IN_ROW

TEMPLATE = str(REPO_ROOT / "tests" / "templates" / "qwen3_like.jinja")
FLAGS = ("--chat-template", TEMPLATE, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", "--max-num-seqs", "64")
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 16}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
PARAMS = {"get_weather": WEATHER, "search": SEARCH}
REGEX = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"
CHOICES = ["positive", "negative", "neutral"]
MESSAGES = [{"role": "user", "content": "Describe a person."}]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("guided") / "q3", qwen3_tokens=True)


@pytest.fixture(scope="module")
def server(model):
    handle = start_server(model, *FLAGS)
    yield handle
    assert handle.stop() == 0


def _gather(server, make) -> list:
    """Run make(client)'s coroutines together on one client (and one event loop)."""
    async def go() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return list(await asyncio.gather(*make(client)))
    return asyncio.run(go())


def test_200_json_schema_replies_all_validate(server, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}

    def requests(client):
        return [client.chat.completions.create(
            model=str(model), messages=MESSAGES, response_format=fmt, temperature=1.0, seed=seed,
            max_tokens=600, extra_body=NO_THINKING) for seed in range(200)]

    replies = _gather(server, requests)
    for r in replies:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.message.tool_calls is None
    assert len({r.choices[0].message.content for r in replies}) > 150  # seeds really differ
    wait_idle(server)


def test_regex_and_choice_replies_follow_them(server, model):
    def requests(extra: dict):
        return lambda client: [client.completions.create(
            model=str(model), prompt="Answer:", temperature=1.0, seed=seed, max_tokens=100, extra_body=extra)
            for seed in range(50)]

    regex = [r.choices[0] for r in _gather(server, requests({"structured_outputs": {"regex": REGEX}}))]
    choice = [r.choices[0] for r in _gather(server, requests({"guided_choice": CHOICES}))]
    assert all(re.fullmatch(REGEX, c.text) and c.finish_reason == "stop" for c in regex), regex
    assert all(c.text in CHOICES for c in choice)
    assert len({c.text for c in choice}) > 1


def test_named_and_required_tool_choices_always_give_valid_calls(server, model):
    def requests(tool_choice, count: int, parallel: bool = False, max_tokens: int = 400):
        return lambda client: [client.chat.completions.create(
            model=str(model), messages=MESSAGES, tools=TOOLS, tool_choice=tool_choice, temperature=1.0,
            seed=seed, max_tokens=max_tokens, parallel_tool_calls=parallel, extra_body=NO_THINKING)
            for seed in range(count)]

    named = {"type": "function", "function": {"name": "get_weather"}}
    for r in _gather(server, requests(named, 50)):
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    names = set()
    for r in _gather(server, requests("required", 30)):  # parallel_tool_calls false: one call
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        names.add(call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    assert names == set(PARAMS)
    # parallel: as many calls as the model writes (the array may also run past max_tokens)
    finished = [r.choices[0] for r in _gather(server, requests("required", 10, True, 1500))
                if r.choices[0].finish_reason == "tool_calls"]
    assert max(len(c.message.tool_calls) for c in finished) > 1
    for choice in finished:
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_grammars_may_hold_the_text_of_qwen3_markup_tokens(server, model):
    """<think> and <tool_call> are added tokens that are text: a grammar allowing that text
    may get them sampled, and the reply is the text (it was a 500 when the grammar engine read
    them as special tokens)."""
    markup = ["<think>yes", "<tool_call>no</tool_call>", "</think>"]
    # one choice: the grammar forces the text, as the tokenizer would write it (the tokens)
    replies = _gather(server, lambda client: [client.completions.create(
        model=str(model), prompt="Answer:", temperature=1.0, seed=1, max_tokens=20,
        extra_body={"guided_choice": [m]}) for m in markup])
    assert [r.choices[0].text for r in replies] == markup
    replies = _gather(server, lambda client: [client.completions.create(
        model=str(model), prompt="Answer:", temperature=1.0, seed=seed, max_tokens=20,
        extra_body={"guided_choice": [*markup, "plain"]}) for seed in range(20)])
    assert all(r.choices[0].text in [*markup, "plain"] for r in replies)
    schema = {"type": "object", "properties": {"t": {"enum": ["</think>", "</tool_call>"]}},
              "required": ["t"], "additionalProperties": False}
    replies = _gather(server, lambda client: [client.completions.create(
        model=str(model), prompt="Answer:", temperature=1.0, seed=seed, max_tokens=40,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
        for seed in range(10)])
    for r in replies:
        assert r.choices[0].finish_reason == "stop", (r.choices[0].text, r.choices[0].finish_reason)
        jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_required_calls_of_tools_with_defs_and_no_parameters(server, model):
    """pydantic-made tools ($defs at each parameters' root) under required, and a tool whose
    parameters are {}: every call parses, and its arguments are an object."""
    color = {"enum": ["red", "blue"], "type": "string"}
    paint = {"type": "object", "properties": {"color": {"$ref": "#/$defs/Color"}}, "required": ["color"],
             "additionalProperties": False, "$defs": {"Color": color}}
    tools = [{"type": "function", "function": {"name": "paint", "parameters": paint}},
             {"type": "function", "function": {"name": "now", "parameters": {}}}]
    replies = _gather(server, lambda client: [client.chat.completions.create(
        model=str(model), messages=MESSAGES, tools=tools, tool_choice="required", temperature=1.0, seed=seed,
        max_tokens=200, parallel_tool_calls=False, extra_body=NO_THINKING) for seed in range(20)])
    names = set()
    for r in replies:
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        names.add(call.function.name)
        if call.function.name == "paint":
            assert args["color"] in ("red", "blue")
        else:
            assert args == {}
    assert names == {"paint", "now"}


def test_streamed_tool_calls_add_up_to_the_reply(server, model):
    # one call: a random model may go on adding parallel calls past any max_tokens (it did on
    # CUDA), and then neither reply ends in tool_calls
    kw = dict(model=str(model), messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=1.0,
              seed=7, max_tokens=400, parallel_tool_calls=False, extra_body=NO_THINKING)

    async def both(client):
        whole = await client.chat.completions.create(**kw)
        calls: dict[int, dict] = {}
        reason = None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            for d in delta.tool_calls or ():
                c = calls.setdefault(d.index, {"id": d.id, "name": None, "arguments": ""})
                c["name"] = c["name"] or d.function.name
                c["arguments"] += d.function.arguments or ""
            reason = chunk.choices[0].finish_reason or reason
        return whole.choices[0], calls, reason

    ((whole, calls, reason),) = _gather(server, lambda client: [both(client)])
    assert reason == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    assert all(c["id"] for c in calls.values())


def test_reasoning_is_split_off_and_the_grammar_starts_after_it(server, model):
    """Thinking on: the model writes reasoning until it samples </think>, then the choice
    grammar holds; a reply that never closes its thinking is all reasoning."""
    async def one(client, seed: int, stream: bool):
        kw = dict(model=str(model), messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=300,
                  extra_body={"guided_choice": CHOICES, "ignore_eos": True})
        if not stream:
            c = (await client.chat.completions.create(**kw)).choices[0]
            return c.message.model_extra.get("reasoning_content"), c.message.content, c.finish_reason
        reasoning, content, reason = [], [], None
        async for chunk in await client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta
            reasoning.append(delta.model_extra.get("reasoning_content") or "")
            content.append(delta.content or "")
            reason = chunk.choices[0].finish_reason or reason
        return "".join(reasoning), "".join(content) or None, reason

    whole = _gather(server, lambda client: [one(client, s, False) for s in range(60)])
    streamed = _gather(server, lambda client: [one(client, s, True) for s in range(60)])
    closed = [c for _, c, reason in whole if reason == "stop"]
    assert len(closed) >= 3, len(closed)  # about one reply in five samples </think> in 300 tokens
    assert all(c in CHOICES for c in closed)
    for (reasoning, content, reason), again in zip(whole, streamed):
        assert again == (reasoning, content, reason)
        assert "</think>" not in reasoning
        if reason == "length":  # cut short: still thinking, or inside a choice
            assert content is None or any(choice.startswith(content) for choice in CHOICES)
    (off,) = _gather(server, lambda client: [client.chat.completions.create(
        model=str(model), messages=MESSAGES, seed=1, max_tokens=20, extra_body=NO_THINKING)])
    off = off.choices[0]
    assert off.message.model_extra.get("reasoning_content") is None and off.message.content


# $refs chained 3,000 definitions deep, and 4,000 right-recursive Lark rules: each overflows the
# grammar engine's stack while it compiles
REF_CHAIN = {"$defs": {**{f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}}
                          for i in range(3000)}, "d3000": {"type": "integer"}}, "$ref": "#/$defs/d0"}
WIDE_RULE = "start: " + " | ".join(f'"c{i}"' for i in range(MAX_ITEMS_IN_ROW + 1))
RULE_CHAIN = "start: r0\n" + "\n".join(f'r{i}: "a{i}" r{i + 1} | "b"' for i in range(4000)) + '\nr4000: "z"'


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    # grammars that crash the grammar engine (a stack overflow) or break its run-time limits
    ({"guided_json": REF_CHAIN}, "guided_json"),
    ({"guided_grammar": RULE_CHAIN}, "guided_grammar"),
    # an Earley row past its item limit (a choice is one lexeme: 20,000 options compile)
    ({"guided_grammar": WIDE_RULE}, "guided_grammar"),
    ({"guided_regex": "(a){1000000}"}, "guided_regex"),
    ({"guided_json": functools.reduce(lambda inner, _: {"type": "object", "properties": {"a": inner}},
                                      range(300), {"type": "integer"})}, "guided_json"),
])
def test_bad_grammars_are_400_naming_the_field(server, model, extra, param):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=str(model), messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == param
    # the server lives on and serves the same grammar kind
    ok = client.completions.create(model=str(model), prompt="Answer:", max_tokens=20,
                                   extra_body={"guided_choice": CHOICES})
    assert ok.choices[0].text in CHOICES


def _equivalence_load() -> list[dict]:
    """32 completions: guided by a schema, a regex or a choice, or free; seeded at temperature 1."""
    out = []
    for i in range(32):
        body = {"prompt": f"Request {i}:", "temperature": 1.0, "seed": 500 + i, "logprobs": 0,
                "max_tokens": 40, "stream": bool(i % 2)}
        kind = i % 4
        if kind == 1:
            fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
            body.update(response_format=fmt, max_tokens=600)
        elif kind == 2:
            body.update(guided_regex=REGEX)
        elif kind == 3:
            body.update(structured_outputs={"choice": CHOICES})
        out.append(body)
    return out


def _tokens(server, model: str, bodies: list[dict]) -> list[list[str]]:
    async def one(client, body: dict) -> list[str]:
        extra = {k: body[k] for k in ("response_format", "guided_regex", "structured_outputs") if k in body}
        kw = dict(model=model, prompt=body["prompt"], temperature=1.0, seed=body["seed"], logprobs=0,
                  max_tokens=body["max_tokens"], extra_body=extra)
        if not body["stream"]:
            return (await client.completions.create(**kw)).choices[0].logprobs.tokens
        tokens: list[str] = []
        async for chunk in await client.completions.create(stream=True, **kw):
            if chunk.choices and chunk.choices[0].logprobs:
                tokens.extend(chunk.choices[0].logprobs.tokens)
        return tokens

    return _gather(server, lambda client: [one(client, b) for b in bodies])


def test_async_on_and_off_give_the_same_tokens_over_guided_and_free_requests(model, server):
    bodies = _equivalence_load()
    on = _tokens(server, str(model), bodies)
    off_server = start_server(model, *FLAGS, "--no-async-scheduling")
    try:
        off = _tokens(off_server, str(model), bodies)
    finally:
        assert off_server.stop() == 0
    assert on == off
    guided = ["".join(t) for t, b in zip(on, bodies) if "guided_regex" in b]
    assert all(re.fullmatch(REGEX, text) for text in guided)
