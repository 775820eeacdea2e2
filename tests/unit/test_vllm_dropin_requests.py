"""vLLM's request fields and server options on the OpenAI routes, against the scripted fake engine:
return_token_ids, cache_salt, spaces_between_special_tokens, refused extension fields, the
`thinking` message field, text parts, /tokenize's return_token_strs, completions echo,
continuous usage stats, --response-role, --return-tokens-as-token-ids, CORS, several API keys and
the request log line."""

from __future__ import annotations

import logging

import pytest

from tests.unit.test_openai_api import (
    CHAT,
    COMPLETION,
    MODEL,
    CharTokenizer,
    FakeEngine,
    call,
    jbody,
    read_sse,
)
from vt.http.api_options import ApiOptions
from vt.http.cors import CorsPolicy
from vt.http.generation import salt_key
from vt.http.openai_api import OpenAIApp

ENC = CharTokenizer().encode
# FakeEngine's outputs: "Hel", "lo", "", " world", one token each
OUT_IDS = [ord("H"), ord("l"), 65, ord(" ")]


class SaltedEngine(FakeEngine):
    """The fake engine, recording the cache_salt each request brings (None: not passed)."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.salts: list[str | None] = []

    def add_request(self, request_id, prompt_token_ids, params, priority=0, cache_salt=None):
        self.salts.append(cache_salt)
        return super().add_request(request_id, prompt_token_ids, params, priority)


class NamingTokenizer(CharTokenizer):
    """CharTokenizer whose vocabulary entries are spelled <N>, and whose template shows `thinking`."""

    def id_to_token(self, token_id: int) -> str | None:
        return f"<{token_id}>"

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kw) -> str:
        text = "".join(f"<{m['role']}>{m.get('thinking', '')}|{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def make_app(engine: FakeEngine | None = None, api_key=None, **options) -> OpenAIApp:
    return OpenAIApp(engine or SaltedEngine(), MODEL, api_key=api_key, options=ApiOptions(**options))


# --- return_token_ids ----------------------------------------------------------------------------

async def test_completion_return_token_ids_gives_each_choice_its_prompt_and_tokens():
    engine = SaltedEngine()
    body = jbody(await call(make_app(engine), "POST", "/v1/completions",
                            {"prompt": ["ab", "c"], "n": 2, "max_tokens": 4, "return_token_ids": True}))
    choices = body["choices"]
    assert [c["prompt_token_ids"] for c in choices] == [ENC("ab"), ENC("ab"), ENC("c"), ENC("c")]
    assert all(c["token_ids"] == OUT_IDS for c in choices)
    plain = jbody(await call(make_app(engine), "POST", "/v1/completions", COMPLETION))
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


async def test_completion_return_token_ids_streams_the_prompt_first_then_each_delta():
    resp = await call(make_app(), "POST", "/v1/completions",
                      {**COMPLETION, "stream": True, "return_token_ids": True})
    events = await read_sse(resp)
    chunks = [e["choices"][0] for e in events[:-1]]
    assert chunks[0]["prompt_token_ids"] == ENC("hi there")
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == OUT_IDS
    assert events[-1] == "DONE"


async def test_chat_return_token_ids_whole_and_streamed():
    app = make_app()
    body = jbody(await call(app, "POST", "/v1/chat/completions", {**CHAT, "return_token_ids": True}))
    prompt = list(b"<user>hi\n<assistant>")
    assert body["prompt_token_ids"] == prompt
    assert body["choices"][0]["token_ids"] == OUT_IDS
    events = await read_sse(await call(app, "POST", "/v1/chat/completions",
                                       {**CHAT, "stream": True, "n": 2, "return_token_ids": True}))
    chunks = [e for e in events if e != "DONE"]
    role_chunks = [e for e in chunks if "role" in e["choices"][0]["delta"]]
    assert len(role_chunks) == 2 and all(e["prompt_token_ids"] == prompt for e in role_chunks)
    for index in (0, 1):
        deltas = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == index]
        assert [t for d in deltas for t in d.get("token_ids", [])] == OUT_IDS


# --- cache_salt ----------------------------------------------------------------------------------

async def test_cache_salt_reaches_the_engine_as_one_key_per_salt():
    engine = SaltedEngine()
    app = make_app(engine)
    for salt in ("tenant-a", "tenant-a", "tenant-b", None):
        extra = {} if salt is None else {"cache_salt": salt}
        assert (await call(app, "POST", "/v1/completions", {**COMPLETION, **extra})).status == 200
    assert (await call(app, "POST", "/v1/chat/completions", {**CHAT, "cache_salt": "tenant-a"})).status == 200
    a, a_again, b, none, chat_a = engine.salts
    assert a == a_again == chat_a == salt_key("tenant-a") and b == salt_key("tenant-b") != a
    assert none is None
    assert len(salt_key("x" * 100_000)) == len(salt_key("y"))  # a long salt costs the cache no more


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
async def test_a_cache_salt_that_is_not_a_non_empty_string_is_a_400(salt):
    engine = SaltedEngine()
    resp = await call(make_app(engine), "POST", "/v1/completions", {**COMPLETION, "cache_salt": salt})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "cache_salt"
    assert engine.calls == []


# --- spaces_between_special_tokens, refused extension fields --------------------------------------

async def test_spaces_between_special_tokens_reaches_the_sampling_params():
    engine = SaltedEngine()
    app = make_app(engine)
    await call(app, "POST", "/v1/completions", {**COMPLETION, "spaces_between_special_tokens": False})
    await call(app, "POST", "/v1/chat/completions", CHAT)
    assert [c.params.spaces_between_special_tokens for c in engine.calls] == [False, True]
    resp = await call(app, "POST", "/v1/chat/completions", {**CHAT, "spaces_between_special_tokens": "no"})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "spaces_between_special_tokens"


@pytest.mark.parametrize("path, base", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("field, value", [("logits_processors", ["my.Processor"]),
                                          ("vllm_xargs", {"k": 1})])
async def test_logits_processors_and_vllm_xargs_are_a_400_naming_the_field(path, base, field, value):
    engine = SaltedEngine()
    resp = await call(make_app(engine), "POST", path, {**base, field: value})
    assert resp.status == 400
    error = jbody(resp)["error"]
    assert error["param"] == field and field in error["message"]
    assert engine.calls == []


# --- messages: thinking, text parts ---------------------------------------------------------------

async def test_the_assistant_thinking_field_reaches_the_template():
    engine = SaltedEngine(tokenizer=NamingTokenizer())
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "thinking": "hmm"},
                {"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]
    assert (await call(make_app(engine), "POST", "/v1/chat/completions",
                       {"messages": messages})).status == 200
    assert bytes(engine.calls[0].prompt) == b"<user>|q\n<assistant>hmm|a\n<user>|x\ny\n<assistant>"


# --- /tokenize return_token_strs --------------------------------------------------------------------

async def test_tokenize_returns_token_strings_when_asked():
    app = make_app(SaltedEngine(tokenizer=NamingTokenizer()))
    body = jbody(await call(app, "POST", "/tokenize", {"prompt": "ab", "return_token_strs": True}))
    assert body["tokens"] == [1, 97, 98] and body["token_strs"] == ["<1>", "<97>", "<98>"]
    chat = jbody(await call(app, "POST", "/tokenize",
                            {"messages": CHAT["messages"], "return_token_strs": True}))
    assert chat["token_strs"] == [f"<{i}>" for i in chat["tokens"]]
    assert "token_strs" not in jbody(await call(app, "POST", "/tokenize", {"prompt": "ab"}))
    bad = await call(app, "POST", "/tokenize", {"prompt": "ab", "return_token_strs": "yes"})
    assert bad.status == 400 and jbody(bad)["error"]["param"] == "return_token_strs"


# --- completions echo ---------------------------------------------------------------------------

async def test_echo_puts_each_prompt_before_its_choices():
    engine = SaltedEngine()
    body = jbody(await call(make_app(engine), "POST", "/v1/completions",
                            {"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 4, "echo": True}))
    assert [c["text"] for c in body["choices"]] == ["abHello world"] * 2 + ["xyzHello world"] * 2
    assert body["usage"]["completion_tokens"] == 16  # the echoed prompt is not generated
    # token-id prompts echo their text, special tokens kept as vLLM decodes them
    body = jbody(await call(make_app(engine), "POST", "/v1/completions",
                            {"prompt": [[99, 100], [1, 101]], "max_tokens": 4, "echo": True}))
    assert [c["text"] for c in body["choices"]] == ["cdHello world", "\x01eHello world"]
    # a truncated prompt echoes what was kept of it
    body = jbody(await call(make_app(engine), "POST", "/v1/completions",
                            {"prompt": "abcdef", "truncate_prompt_tokens": 3, "echo": True}))
    assert body["choices"][0]["text"] == "defHello world"


async def test_echo_streams_the_prompt_with_each_choices_first_chunk():
    body = {"prompt": "ab", "n": 2, "max_tokens": 4, "echo": True, "stream": True}
    events = await read_sse(await call(make_app(), "POST", "/v1/completions", body))
    for index in (0, 1):
        texts = [e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == index]
        assert texts[0].startswith("ab") and "".join(texts) == "abHello world"


async def test_echo_with_logprobs_is_a_400_that_says_why():
    engine = SaltedEngine()
    resp = await call(make_app(engine), "POST", "/v1/completions",
                      {**COMPLETION, "echo": True, "logprobs": 1})
    assert resp.status == 400
    error = jbody(resp)["error"]
    assert error["param"] == "echo" and "prompt tokens' logprobs" in error["message"]
    assert engine.calls == []


# --- stream_options.continuous_usage_stats ------------------------------------------------------

async def test_continuous_usage_stats_put_usage_in_every_completion_chunk():
    events = await read_sse(await call(make_app(), "POST", "/v1/completions", {
        "prompt": ["ab", "cde"], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    chunks, final = events[:-2], events[-2]
    for index, prompt_len in ((0, 3), (1, 4)):
        usages = [e["usage"] for e in chunks if e["choices"][0]["index"] == index]
        assert [u["completion_tokens"] for u in usages] == [1, 2, 3, 4]
        assert all(u["prompt_tokens"] == prompt_len for u in usages)
        assert all(u["total_tokens"] == prompt_len + u["completion_tokens"] for u in usages)
    assert final["usage"] == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15}


async def test_continuous_usage_stats_put_usage_in_every_chat_chunk():
    events = await read_sse(await call(make_app(), "POST", "/v1/chat/completions", {
        **CHAT, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    prompt_len = len(b"<user>hi\n<assistant>")
    usages = [e["usage"]["completion_tokens"] for e in events[:-2]]
    assert usages == [0, 1, 2, 3, 4]  # the role chunk first
    assert all(e["usage"]["prompt_tokens"] == prompt_len for e in events[:-1])
    # without include_usage there is no usage at all, as in vLLM
    events = await read_sse(await call(make_app(), "POST", "/v1/chat/completions", {
        **CHAT, "stream": True, "stream_options": {"continuous_usage_stats": True}}))
    assert all("usage" not in e for e in events[:-1])


# --- server options: --response-role, --return-tokens-as-token-ids, request log line -----------------

async def test_response_role_names_the_reply_after_a_generation_prompt():
    app = make_app(response_role="bot")
    body = jbody(await call(app, "POST", "/v1/chat/completions", CHAT))
    assert body["choices"][0]["message"]["role"] == "bot"
    events = await read_sse(await call(app, "POST", "/v1/chat/completions", {**CHAT, "stream": True}))
    assert events[0]["choices"][0]["delta"]["role"] == "bot"
    # without a generation prompt the reply continues the final message, whatever the flag says
    body = jbody(await call(app, "POST", "/v1/chat/completions", {**CHAT, "add_generation_prompt": False}))
    assert body["choices"][0]["message"]["role"] == "user"


async def test_return_tokens_as_token_ids_is_the_default_a_request_overrides():
    app = make_app(return_tokens_as_token_ids=True)
    body = jbody(await call(app, "POST", "/v1/completions", {**COMPLETION, "logprobs": 1}))
    assert body["choices"][0]["logprobs"]["tokens"] == [f"token_id:{i}" for i in OUT_IDS]
    body = jbody(await call(app, "POST", "/v1/chat/completions",
                            {**CHAT, "logprobs": True, "return_tokens_as_token_ids": False}))
    assert [c["token"] for c in body["choices"][0]["logprobs"]["content"]] == ["H", "l", "A", " "]


async def test_enable_log_requests_logs_each_request_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="vt.http"):
        await call(make_app(request_log_level=logging.INFO), "POST", "/v1/completions", COMPLETION)
        await call(make_app(), "POST", "/v1/completions", COMPLETION)  # the default: at debug
    lines = [r for r in caplog.records if r.name == "vt.http" and r.getMessage().startswith("request cmpl-")]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO


# --- CORS ---------------------------------------------------------------------------------------------

PREFLIGHT = {"origin": "https://app.example", "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def header(resp, name: str) -> str | None:
    found = [v for k, v in resp.headers if k.lower() == name.lower()]
    return ", ".join(found) if found else None


async def test_preflight_is_answered_before_routing_and_the_api_key():
    app = make_app(api_key="k", cors=CorsPolicy())
    for path in ("/v1/chat/completions", "/no/such/route"):
        resp = await call(app, "OPTIONS", path, headers=PREFLIGHT)
        assert (resp.status, resp.body) == (200, b"OK")
        assert header(resp, "access-control-allow-origin") == "*"
        assert header(resp, "access-control-allow-headers") == "authorization, content-type"
        assert "POST" in header(resp, "access-control-allow-methods")
        assert app.precheck(make_request_head("OPTIONS", path, PREFLIGHT)) is None
    # OPTIONS without the preflight headers is routed as any request
    assert (await call(app, "OPTIONS", "/health")).status == 405


async def test_a_preflight_the_policy_refuses_names_what_is_refused():
    app = make_app(cors=CorsPolicy(allow_origins=("https://ok.example",), allow_methods=("GET",),
                                   allow_headers=("x-token",)))
    resp = await call(app, "OPTIONS", "/v1/completions", headers=PREFLIGHT)
    assert resp.status == 400 and resp.body == b"Disallowed CORS origin, method, headers"
    ok = await call(app, "OPTIONS", "/v1/completions", headers={
        "origin": "https://ok.example", "access-control-request-method": "GET",
        "access-control-request-headers": "X-Token, Content-Type"})
    assert ok.status == 200 and header(ok, "access-control-allow-origin") == "https://ok.example"


async def test_responses_to_a_browser_carry_the_cors_headers_errors_too():
    app = make_app(api_key="k", cors=CorsPolicy())
    resp = await call(app, "GET", "/v1/models", headers={"origin": "https://app.example"})
    assert resp.status == 401 and header(resp, "access-control-allow-origin") == "*"
    named = make_app(cors=CorsPolicy(allow_origins=("https://app.example",), allow_credentials=True))
    resp = await call(named, "GET", "/v1/models", headers={"origin": "https://app.example"})
    assert header(resp, "access-control-allow-origin") == "https://app.example"
    assert header(resp, "access-control-allow-credentials") == "true"
    other = await call(named, "GET", "/v1/models", headers={"origin": "https://evil.example"})
    assert header(other, "access-control-allow-origin") is None
    assert header(await call(make_app(), "GET", "/v1/models", headers={"origin": "https://a.example"}),
                  "access-control-allow-origin") is None  # no policy: no CORS headers


def make_request_head(method: str, path: str, headers: dict[str, str]):
    from tests.unit.test_openai_api import make_request

    return make_request(method, path, headers=headers)


# --- several API keys -----------------------------------------------------------------------------

async def test_any_of_several_api_keys_opens_the_api():
    app = make_app(api_key=["first", "second"])
    for key, status in (("first", 200), ("second", 200), ("third", 401)):
        resp = await call(app, "GET", "/v1/models", headers={"authorization": f"Bearer {key}"})
        assert resp.status == status
