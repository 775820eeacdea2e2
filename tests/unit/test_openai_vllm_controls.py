"""vLLM's request controls on the OpenAI routes, against the scripted fake engine: batch prompts,
generation defaults, the logprobs cap, model aliases, the developer role, chat template controls,
echo, and the ids /detokenize takes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

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
from vt.http.openai_api import OpenAIApp
from vt.model.generation_config import SamplingDefaults

ENC = CharTokenizer().encode


def make_app(engine: FakeEngine, **options) -> OpenAIApp:
    return OpenAIApp(engine, MODEL, options=ApiOptions(**options))


# --- several prompts in one completions request ---------------------------------------------

@pytest.mark.parametrize("prompt, encoded", [
    (["ab", "cde"], [ENC("ab"), ENC("cde")]),
    ([[5, 6], [7]], [[5, 6], [7]]),
])
async def test_batch_prompts_number_choices_prompt_by_prompt(prompt, encoded):
    engine = FakeEngine()
    resp = await call(make_app(engine), "POST", "/v1/completions",
                      {"prompt": prompt, "n": 2, "seed": 5, "max_tokens": 4})
    assert resp.status == 200, resp.body
    body = jbody(resp)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert all(c["text"] == "Hello world" for c in body["choices"])
    # choice k is sample k % n of prompt k // n, as OpenAI and vLLM number them
    assert [c.prompt for c in engine.calls] == [encoded[0], encoded[0], encoded[1], encoded[1]]
    assert [c.params.seed for c in engine.calls] == [5, 6, 5, 6]
    prompt_tokens = sum(map(len, encoded))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16}


async def test_batch_prompts_stream_every_choice_with_its_index():
    engine = FakeEngine()
    resp = await call(make_app(engine), "POST", "/v1/completions", {
        "prompt": ["ab", "c", "de"], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    events = await read_sse(resp)
    assert events[-1] == "DONE"
    texts: dict[int, str] = {}
    for e in events[:-2]:
        [choice] = e["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "Hello world", 1: "Hello world", 2: "Hello world"}
    assert events[-2]["usage"]["prompt_tokens"] == len(ENC("ab")) + len(ENC("c")) + len(ENC("de"))


async def test_completions_take_add_special_tokens():
    engine = FakeEngine()
    app = make_app(engine)
    for add_special, want in ((True, ENC("ab")), (False, ENC("ab", add_special_tokens=False))):
        body = {"prompt": ["ab"], "add_special_tokens": add_special}
        assert (await call(app, "POST", "/v1/completions", body)).status == 200
        assert engine.calls[-1].prompt == want
    assert ENC("ab")[0] == 1 and ENC("ab", add_special_tokens=False)[0] != 1


async def test_a_batch_that_the_engine_refuses_midway_adds_nothing():
    engine = FakeEngine()

    def refuse_third(request_id, prompt_token_ids, params, priority=0):
        if len(engine.calls) == 2:
            raise ValueError("no room")
        return FakeEngine.add_request(engine, request_id, prompt_token_ids, params, priority)

    engine.add_request = refuse_third
    resp = await call(make_app(engine), "POST", "/v1/completions", {"prompt": ["a", "b", "c"]})
    assert resp.status == 400
    assert sorted(engine.aborted) == sorted(c.request_id for c in engine.calls)


# --- generation_config.json defaults -----------------------------------------------------------

DEFAULTS = SamplingDefaults({"temperature": 0.25, "top_k": 7, "repetition_penalty": 1.1, "max_tokens": 5})


async def test_model_defaults_fill_only_what_the_request_leaves_unset():
    engine = FakeEngine()
    app = make_app(engine, sampling_defaults=DEFAULTS)
    assert (await call(app, "POST", "/v1/completions", {"prompt": "hi", "top_k": 0})).status == 200
    params = engine.calls[-1].params
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.25, 0, 1.1)
    assert params.max_tokens == 5  # the endpoint's 16, capped by max_new_tokens as vLLM does
    body = {**CHAT, "temperature": 1.0, "max_completion_tokens": 3}
    assert (await call(app, "POST", "/v1/chat/completions", body)).status == 200
    params = engine.calls[-1].params
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 7, 3)


async def test_without_defaults_vt_s_own_apply():
    engine = FakeEngine()
    assert (await call(make_app(engine), "POST", "/v1/chat/completions", CHAT)).status == 200
    params = engine.calls[-1].params
    assert (params.temperature, params.top_k, params.max_tokens) == (1.0, 0, None)


# --- server-wide settings ------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {**COMPLETION, "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
])
async def test_max_logprobs_caps_what_a_request_may_ask(path, body, param):
    engine = FakeEngine()
    resp = await call(make_app(engine, max_logprobs=2), "POST", path, body)
    assert resp.status == 400 and jbody(resp)["error"]["param"] == param
    assert "--max-logprobs" in jbody(resp)["error"]["message"]
    assert engine.calls == []


async def test_model_aliases_are_accepted_and_responses_name_the_served_model():
    app = make_app(FakeEngine(), model_aliases=("tiny",))
    resp = await call(app, "POST", "/v1/completions", {**COMPLETION, "model": "tiny"})
    assert resp.status == 200 and jbody(resp)["model"] == MODEL
    assert (await call(app, "POST", "/v1/completions", {**COMPLETION, "model": "other"})).status == 404


# --- chat template controls ---------------------------------------------------------------------

async def test_developer_role_is_system():
    engine = FakeEngine()
    resp = await call(make_app(engine), "POST", "/v1/chat/completions", {"messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    assert resp.status == 200
    assert engine.calls[0].prompt == list(b"<system>be brief\n<user>hi\n<assistant>")


@pytest.mark.parametrize("extra, param", [
    ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"add_generation_prompt": "no"}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": 0}, "add_generation_prompt"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"tools": [1], "tool_choice": "none"}, "tools"),
    ({"add_special_tokens": "yes"}, "add_special_tokens"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": "f()"}]}, "messages"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_bad_template_controls_are_400(path, extra, param):
    engine = FakeEngine()
    resp = await call(make_app(engine), "POST", path, {**CHAT, **extra})
    assert resp.status == 400, resp.body
    assert jbody(resp)["error"]["param"] == param
    assert engine.calls == []


async def test_a_request_template_runs_only_on_a_trusting_server():
    body = {**CHAT, "chat_template": "{{ messages }}"}
    refused = await call(make_app(FakeEngine()), "POST", "/v1/chat/completions", body)
    assert "--trust-request-chat-template" in jbody(refused)["error"]["message"]
    app = make_app(FakeEngine(), trust_request_chat_template=True)
    assert (await call(app, "POST", "/v1/chat/completions", body)).status == 200


async def test_tokenize_and_chat_render_the_same_prompt():
    engine = FakeEngine()
    app = make_app(engine)
    for controls in ({}, {"add_generation_prompt": False}, {"add_special_tokens": True},
                     {"chat_template_kwargs": {"add_generation_prompt": False}}):
        body = {**CHAT, **controls}
        assert (await call(app, "POST", "/v1/chat/completions", body)).status == 200
        tokens = jbody(await call(app, "POST", "/tokenize", body))["tokens"]
        assert tokens == engine.calls[-1].prompt
    assert [len(c.prompt) for c in engine.calls] == [len(b"<user>hi\n<assistant>"), len(b"<user>hi\n"),
                                                      len(b"<user>hi\n<assistant>") + 1, len(b"<user>hi\n")]


CONTINUE = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sa"}],
            "add_generation_prompt": False, "continue_final_message": True}


async def test_echo_prepends_the_continued_message():
    app = make_app(FakeEngine())
    body = jbody(await call(app, "POST", "/v1/chat/completions", {**CONTINUE, "echo": True}))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "SaHello world"}
    plain = jbody(await call(app, "POST", "/v1/chat/completions", CONTINUE))
    assert plain["choices"][0]["message"]["content"] == "Hello world"
    # without a generation prompt the reply takes the final message's role (vLLM's rule)
    user_last = {**CHAT, "add_generation_prompt": False, "echo": True}
    body = jbody(await call(app, "POST", "/v1/chat/completions", user_last))
    assert body["choices"][0]["message"] == {"role": "user", "content": "hiHello world"}


async def test_echo_streams_the_continued_message_after_the_role():
    resp = await call(make_app(FakeEngine()), "POST", "/v1/chat/completions",
                      {**CONTINUE, "echo": True, "stream": True, "n": 2})
    events = await read_sse(resp)
    deltas = [e["choices"][0]["delta"] for e in events[:4]]
    assert deltas == [{"role": "assistant", "content": ""}] * 2 + [{"content": "Sa"}] * 2
    for index in (0, 1):
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                       if e["choices"][0]["index"] == index)
        assert text == "SaHello world"


# --- /detokenize takes every id the model can produce -------------------------------------------

class WideVocabTokenizer(CharTokenizer):
    """Decodes ids past its 256 bytes to nothing, as `tokenizers` does."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return super().decode([i for i in ids if i < 256], skip_special_tokens)


async def test_detokenize_takes_ids_up_to_the_model_vocabulary():
    engine = FakeEngine(tokenizer=WideVocabTokenizer())
    engine.model_config = SimpleNamespace(vocab_size=300)
    app = make_app(engine)
    assert (await call(app, "POST", "/detokenize", {"tokens": [72, 299]})).status == 200
    resp = await call(app, "POST", "/detokenize", {"tokens": [300]})
    assert resp.status == 400 and jbody(resp)["error"]["param"] == "tokens"


# --- request log lines ------------------------------------------------------------------------------

@pytest.mark.parametrize("log_requests", [True, False])
async def test_requests_are_logged_at_debug_unless_disabled(caplog, log_requests):
    caplog.set_level(logging.DEBUG, logger="vt.http")
    app = make_app(FakeEngine(), log_requests=log_requests)
    resp = await call(app, "POST", "/v1/completions", COMPLETION)
    lines = [r for r in caplog.records if r.getMessage().startswith("request cmpl-")]
    assert len(lines) == int(log_requests)
    if log_requests:
        assert lines[0].levelno == logging.DEBUG and jbody(resp)["id"] in lines[0].getMessage()
        assert "prompt tokens [9]" in lines[0].getMessage()
